"""cost: time of every node on every device type, forward and backward (roofline + overhead).

    time = max(flops / achievable FLOP/s, bytes / achievable bandwidth) + kernel overhead

Achievable = peak × efficiency (``DeviceType.achievable_flops`` / ``achievable_bandwidth_bps``; a
calibration file replaces the efficiencies with measured ones). The FLOP/s peak is the one of the
node's dtype (or the ``dtype`` the user compiles for). Backward: the analysis gives backward FLOPs
(a matmul's backward is two matmuls); a memory-bound op's backward is about two memory passes. Nodes
that move no bytes and do no FLOPs (views, getitem) launch no kernel and cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import sympy
import torch
import torch.fx

from hetcc.errors import AnalysisError, ClusterError
from hetcc.hardware.presets import DeviceType, flops_key
from hetcc.ir import annotate, info, is_concrete
from hetcc.kernels import FUSION_META_KEY

BACKWARD_MEMORY_PASSES = 2.0
# When a device type has no peak for a dtype, the nearest format its matrix units run instead.
# bf16 has no fallback but fp32: a card without bf16 units (T4, V100) runs bf16 matmuls no faster.
_DTYPE_FALLBACK = {"bf16": "fp32", "fp16": "fp32", "fp8": "fp16", "tf32": "fp32"}


def cost(
    gm: torch.fx.GraphModule,
    *,
    device_types: Sequence[DeviceType],
    dtype: object | None = None,
    training: bool = True,
) -> torch.fx.GraphModule:
    """Annotate ``fwd_s`` / ``bwd_s`` per device type on every compute node."""
    rates = {t.name: _Rates(t) for t in device_types}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        record = info(node)
        _require_concrete(node, record)
        key, floating = _flops_key(record, dtype)
        has_backward = training and floating
        group = node.meta.get(FUSION_META_KEY)
        replays = group is not None and group.backward == "recompute"
        times = [(name, _times(rate, record, key, has_backward, replays)) for name, rate in rates.items()]
        annotate(node, fwd_s=tuple((n, t[0]) for n, t in times), bwd_s=tuple((n, t[1]) for n, t in times))
    return gm


def _flops_key(record, dtype: object | None) -> tuple[str, bool]:
    """(the peak-FLOP/s key a node is priced at, whether its output is floating point): the compile
    dtype when one is given, else the node's own dtype (fp32 for integer nodes)."""
    floating = record.dtype is not None and record.dtype.is_floating_point
    return flops_key(dtype if dtype is not None else (record.dtype if floating else torch.float32)), floating


def _times(rate: _Rates, record, key: str, has_backward: bool, replays: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one node on one device type.

    A fused node runs as one Triton kernel on GPUs. Where Triton does not run (a ``cpu`` device, short
    of the interpreter used for testing), its original ops run instead. A group without a generated
    backward kernel (``replays``: row groups, and every group on a ``cpu``) differentiates its
    original ops, recomputing them first: its backward costs its members' forwards and backwards.
    """
    if record.members and (rate.type.vendor == "cpu" or (replays and has_backward)):
        parts = [_times(rate, member, key, has_backward) for member in record.members]
        members_fwd = sum(f for f, _ in parts)
        fwd = members_fwd if rate.type.vendor == "cpu" else rate.time_s(record.fwd_flops, record.bytes, key)
        return fwd, (sum(b for _, b in parts) + members_fwd if has_backward else 0.0)
    fwd = rate.time_s(record.fwd_flops, record.bytes, key)
    bwd = rate.time_s(record.bwd_flops, BACKWARD_MEMORY_PASSES * record.bytes, key) if has_backward else 0.0
    return fwd, bwd


class _Rates:
    """Achievable rates of one device type, with dtype fallback resolved once per dtype."""

    def __init__(self, device_type: DeviceType):
        self.type = device_type
        self._flops: dict[str, float] = {}

    def flops_per_s(self, key: str) -> float:
        if key not in self._flops:
            self._flops[key] = self._resolve(key)
        return self._flops[key]

    def _resolve(self, key: str) -> float:
        probe = key
        while probe is not None:
            if probe in self.type.peak_flops:
                return self.type.achievable_flops(probe)
            probe = _DTYPE_FALLBACK.get(probe)
        raise ClusterError(
            f"device type {self.type.name} has no FLOP/s figure for {key} or a fallback format",
            hint="add peak_flops for it in the cluster file (custom_types) or compile with another dtype",
        )

    def time_s(self, flops: float, nbytes: float, key: str) -> float:
        if not flops and not nbytes:
            return 0.0
        compute_s = flops / self.flops_per_s(key) if flops else 0.0
        memory_s = nbytes / self.type.achievable_bandwidth_bps
        return max(compute_s, memory_s) + self.type.kernel_overhead_s


def _require_concrete(node: torch.fx.Node, record) -> None:
    for value in (record.fwd_flops, record.bwd_flops, record.bytes):
        if not is_concrete(value):
            raise AnalysisError(
                f"node %{node.name} has symbolic cost {value}; times need concrete sizes",
                hint="call analysis.evaluate(batch=..., seq=...) before costing, or trace without dynamic_shapes",
            )


def block_times_at(
    gm: torch.fx.GraphModule,
    block_nodes: Sequence[Sequence[str]],
    device_types: Sequence[DeviceType],
    subs: dict,
    *,
    dtype: object | None = None,
    training: bool = True,
):
    """``block_times`` of a symbolic analysis (sizes in sympy dims) at the dims ``subs`` gives, without
    annotating the graph: how the microbatch search prices every microbatch size from one trace."""
    rates = {t.name: _Rates(t) for t in device_types}
    by_name = {n.name: n for n in gm.graph.nodes}
    fwd = {t: [0.0] * len(block_nodes) for t in rates}
    bwd = {t: [0.0] * len(block_nodes) for t in rates}
    for i, names in enumerate(block_nodes):
        for name in names:
            node = by_name[name]
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            record = info(node)
            values = {f: _at(getattr(record, f), subs) for f in ("fwd_flops", "bwd_flops", "bytes")}
            at = SimpleNamespace(**values, members=None)
            key, floating = _flops_key(record, dtype)
            for t, rate in rates.items():
                f, b = _times(rate, at, key, training and floating, False)
                fwd[t][i] += f
                bwd[t][i] += b
    return fwd, bwd


def _at(value, subs: dict) -> float:
    if is_concrete(value):
        return float(value)
    number = sympy.sympify(value).subs(subs)
    if not number.is_number:
        raise AnalysisError(
            f"cost {value} still has free dims {sorted(map(str, number.free_symbols))} at {subs}",
            hint="mark only the batch dimension dynamic for the microbatch search",
        )
    return float(number)


def block_times(gm: torch.fx.GraphModule, block_nodes: Sequence[Sequence[str]], type_names: Sequence[str]):
    """Per device type, forward and backward seconds of each block (sums of its nodes)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    fwd = {t: [0.0] * len(block_nodes) for t in type_names}
    bwd = {t: [0.0] * len(block_nodes) for t in type_names}
    for i, names in enumerate(block_nodes):
        for name in names:
            record = info(by_name[name])
            for t, seconds in record.fwd_s:
                fwd[t][i] += seconds
            for t, seconds in record.bwd_s:
                bwd[t][i] += seconds
    return fwd, bwd
