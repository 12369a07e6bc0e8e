"""cost: time of every node on every device type, forward and backward (roofline + overhead + host).

    GPU time = max(flops / achievable FLOP/s, bytes / achievable bandwidth) + kernel overhead

Achievable = peak × efficiency (``DeviceType.achievable_flops`` / ``achievable_bandwidth_bps``; a
calibration file replaces the efficiencies with measured ones). The FLOP/s peak is the one of the
node's dtype (or the ``dtype`` the user compiles for). Backward: the analysis gives backward FLOPs
(a matmul's backward is two matmuls); a memory-bound op's backward is about two memory passes.

On a GPU the host issues work asynchronously: each op costs the host ``host_op_s`` (Python, the
dispatcher, the launch; ``host_backward_op_s`` for autograd's backward of it; less for a view; a
fused group's call ``host_fused_op_s`` / ``host_fused_backward_op_s``), and the GPU runs what was
queued. A node's time is what it adds to the end of that
queue (``_queue``): a large GEMM hides the host cost of the small ops around it, a run of small ops
costs their host time. On a CPU the op runs where it is issued: roofline + overhead, one after the
other. Under autocast (``autocast=True``, mixed precision on a GPU) an op autocast runs in the
lower precision (``LOWER_PRECISION_OPS``) also pays the casts of its fp32 inputs (6 bytes per
element, and their gradients back), and a bf16/fp16 GEMM whose inner or output dimension is not a
multiple of 8 runs at ``UNALIGNED_TENSOR_CORE_SHARE`` of the aligned rate (tensor cores need
16-byte rows; GPT-2's vocabulary of 50257 is the classic case). Getitems launch nothing and cost
nothing.
"""

from __future__ import annotations

import math
import operator
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
# A view's host cost against a small op's, forward and backward (an H200's host: 8 vs 14 us, 14 vs 50 us).
VIEW_HOST_SHARE = (0.5, 0.25)
# Share of the aligned bf16/fp16 GEMM rate left when a row is not 16 bytes aligned. Measured on an
# H200: GPT-2's head (N = 50257) ran its three GEMMs at 95-146 TFLOP/s against 658 aligned.
UNALIGNED_TENSOR_CORE_SHARE = 0.2
_TENSOR_CORE_KEYS = ("bf16", "fp16")
CAST_BYTES = 6  # an fp32 -> bf16/fp16 cast reads 4 bytes and writes 2 per element (its gradient too)
# Ops torch.autocast runs in the lower precision on a GPU (its lower_precision_fp list, as graphs name them).
LOWER_PRECISION_OPS = frozenset({
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "matmul", "linear", "einsum", "addmv", "addr", "prelu",
    "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "scaled_dot_product_attention",
})  # fmt: skip
# GEMMs and where their first matrix is in args: K is its last dim, N the output's.
_GEMM_MATRIX_ARG = {"mm": 0, "bmm": 0, "matmul": 0, "linear": 0, "addmm": 1, "addbmm": 1, "baddbmm": 1}
_NO_LAUNCH = (operator.getitem, getattr)
_COMPUTE = ("call_function", "call_method", "call_module")  # the node ops that run something


def cost(
    gm: torch.fx.GraphModule,
    *,
    device_types: Sequence[DeviceType],
    dtype: object | None = None,
    training: bool = True,
    autocast: bool = False,
) -> torch.fx.GraphModule:
    """Annotate ``fwd_s`` / ``bwd_s`` per device type on every compute node (``autocast``: the stages
    run under torch.autocast at ``dtype``, fp32 weights cast on the fly)."""
    rates = {t.name: _Rates(t) for t in device_types}
    nodes = [n for n in gm.graph.nodes if n.op in _COMPUTE]
    parts, unaligned = [], []
    for node in nodes:
        record = info(node)
        _require_concrete(node, record)
        times, slow = _node_parts(node, record, rates, dtype, training, autocast, float)
        parts.append(times)
        unaligned.append(slow)
    fwd, bwd = _queued(parts, rates)
    for i, node in enumerate(nodes):
        record = annotate(
            node, fwd_s=tuple((t, fwd[t][i]) for t in rates), bwd_s=tuple((t, bwd[t][i]) for t in rates)
        )
        if unaligned[i] and UNALIGNED_NOTE not in record.notes:
            annotate(node, notes=(*record.notes, UNALIGNED_NOTE))
    return gm


UNALIGNED_NOTE = "GEMM off tensor-core alignment"


def cost_notes(
    gm: torch.fx.GraphModule,
    device_types: Sequence[DeviceType],
    *,
    dtype: object | None = None,
    training: bool = True,
    autocast: bool = False,
) -> list[str]:
    """The plan's notes about a costed graph: GEMMs off tensor-core alignment, fusion that does not pay."""
    notes = [
        unaligned_gemm_note(gm),
        fusion_note(gm, device_types, dtype=dtype, training=training, autocast=autocast),
    ]
    return [note for note in notes if note]


def unaligned_gemm_note(gm: torch.fx.GraphModule) -> str | None:
    """One line for the plan naming the bf16/fp16 GEMMs priced off tensor-core alignment, and the
    fix (pad the dimension), or None."""
    found = [(n, _unaligned_dims(n, op_name(n))) for n in gm.graph.nodes if UNALIGNED_NOTE in info(n).notes]
    if not found:
        return None
    named = ", ".join(f"%{node.name} ({' and '.join(map(str, dims))})" for node, dims in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    return (
        f"{len(found)} half-precision GEMM(s) have a dimension that is not a multiple of 8 and are priced "
        f"at {UNALIGNED_TENSOR_CORE_SHARE:.0%} of the tensor-core rate: {named}{more}; padding such a "
        "dimension (a vocabulary, say) to a multiple of 8 makes them about 5x faster"
    )


def _node_parts(node, record, rates, dtype, training: bool, autocast: bool, value) -> tuple[dict, bool]:
    """Per device type, (GPU forward, GPU backward, host forward, host backward) seconds of one node,
    and whether it is a half-precision GEMM off tensor-core alignment; ``value`` turns a (possibly
    symbolic) size into a number."""
    key, floating = _flops_key(record, dtype)
    has_backward = training and floating
    group = node.meta.get(FUSION_META_KEY)
    replays = group is not None and group.backward == "recompute"
    name = op_name(node)
    low = autocast and name in LOWER_PRECISION_OPS
    cast = _cast_elements(node) if low else (0, 0)
    cast = (value(cast[0]) * CAST_BYTES, cast[1])
    slow = key in _TENSOR_CORE_KEYS and bool(_unaligned_dims(node, name))
    numbers = SimpleNamespace(
        fwd_flops=value(record.fwd_flops), bwd_flops=value(record.bwd_flops), bytes=value(record.bytes),
        members=record.members,
    )  # fmt: skip
    kind = _launch_kind(node, record)
    times = {
        t: _times(rate, numbers, key, has_backward, replays, cast=cast, slow=slow, kind=kind)
        for t, rate in rates.items()
    }
    return times, slow


def _queued(parts: list[dict], rates: dict) -> tuple[dict, dict]:
    """Per device type, each node's forward and backward seconds in the queue model (``_queue_both``)."""
    both = {t: _queue_both([p[t] for p in parts]) for t in rates}
    return {t: fwd for t, (fwd, _) in both.items()}, {t: bwd for t, (_, bwd) in both.items()}


def _queue_both(parts: Sequence[tuple[float, float, float, float]]) -> tuple[list[float], list[float]]:
    """Each node's forward and backward seconds (``_queue``): forwards in graph order, backwards in
    reverse. ``parts``: (GPU forward, GPU backward, host forward, host backward) per node."""
    forward = _queue([p[0] for p in parts], [p[2] for p in parts])
    backward = _queue([p[1] for p in parts][::-1], [p[3] for p in parts][::-1])[::-1]
    return forward, backward


def _queue(gpu: Sequence[float], host: Sequence[float]) -> list[float]:
    """What each op adds to the end of the work when the host issues ops in order (host[i] seconds
    each) and the device runs each (gpu[i] seconds) once issued and once the previous one is done:
    the device's finish time grows by gpu[i] when the host is ahead, by more when it waits for the
    host. With no host time this is ``gpu`` itself (a CPU runs an op where it is issued)."""
    issued = done = 0.0
    added = []
    for g, h in zip(gpu, host):
        issued += h
        end = max(issued, done) + g
        added.append(end - done)
        done = end
    return added


def fusion_note(
    gm: torch.fx.GraphModule,
    device_types: Sequence[DeviceType],
    *,
    dtype: object | None = None,
    training: bool = True,
    autocast: bool = False,
) -> str | None:
    """One line for the plan when, on a GPU type of the cluster, the costed graph's fused groups make a
    microbatch's forward and backward through the whole model slower than their ops would unfused
    (each call's host time outweighing the memory passes it saves), or None. Both ways are priced as
    ``cost`` prices them, the host queue included."""
    nodes = [n for n in gm.graph.nodes if n.op in _COMPUTE]
    fused = sum(1 for n in nodes if info(n).members)
    found = []
    for device in (t for t in device_types if t.vendor != "cpu" and fused):
        rate, as_fused, as_ops = _Rates(device), [], []
        for node in nodes:
            record = info(node)
            times, _ = _node_parts(node, record, {device.name: rate}, dtype, training, autocast, float)
            as_fused.append(times[device.name])
            key, floating = _flops_key(record, dtype)
            members = [_times(rate, m, key, training and floating) for m in record.members]
            as_ops.extend(members or [times[device.name]])
        fused_s, ops_s = (sum(map(sum, _queue_both(way))) for way in (as_fused, as_ops))
        if fused_s > ops_s:
            found.append(f"{device.name} {fused_s * 1e3:.2f} ms fused, {ops_s * 1e3:.2f} ms unfused")
    if not found:
        return None
    return (
        f"the {fused} fused groups make a microbatch slower than their ops would run unfused: each "
        f"call's host time outweighs the memory passes it saves (forward + backward through the model: "
        f"{'; '.join(found)}); HETCC_FUSE=0 compiles without them"
    )


def _flops_key(record, dtype: object | None) -> tuple[str, bool]:
    """(the peak-FLOP/s key a node is priced at, whether its output is floating point): the compile
    dtype when one is given, else the node's own dtype (fp32 for integer nodes)."""
    floating = record.dtype is not None and record.dtype.is_floating_point
    return flops_key(dtype if dtype is not None else (record.dtype if floating else torch.float32)), floating


def op_name(node: torch.fx.Node) -> str:
    """The op a node runs, as torch.autocast's lists name it ("addmm", "linear", ...)."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    if node.op == "call_module":
        return type(node.graph.owning_module.get_submodule(node.target)).__name__.lower()
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def _launch_kind(node: torch.fx.Node, record) -> str | None:
    """ "op" (a kernel), "view" (dispatched, no kernel) or None (Python only: getitem, non-tensors)."""
    if record.shape is None or node.target in _NO_LAUNCH:
        return None
    return "op" if record.fwd_flops or record.bytes or record.members else "view"


def _cast_elements(node: torch.fx.Node) -> tuple[object, int]:
    """(elements, tensors) autocast casts to the lower precision before ``node`` runs: its fp32
    inputs, except those a lower-precision op produced (through views), which are already cast."""
    elements, tensors = 0, 0
    for arg in node.all_input_nodes:
        record = info(arg)
        if record.dtype != torch.float32 or record.shape is None or _low_precision_source(arg):
            continue
        elements += math.prod(record.shape)
        tensors += 1
    return elements, tensors


def _low_precision_source(node: torch.fx.Node) -> bool:
    while node.op == "call_function" and _launch_kind(node, info(node)) == "view" and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node.op in _COMPUTE and op_name(node) in LOWER_PRECISION_OPS


def _unaligned_dims(node: torch.fx.Node, name: str) -> list[str]:
    """``["K=..", "N=.."]``: a GEMM's inner and output dimensions that are not multiples of 8."""
    index = _GEMM_MATRIX_ARG.get(name)
    if index is None or len(node.args) <= index or not isinstance(node.args[index], torch.fx.Node):
        return []
    dims = (("K", info(node.args[index]).shape), ("N", info(node).shape))
    return [f"{k}={shape[-1]}" for k, shape in dims if shape and isinstance(shape[-1], int) and shape[-1] % 8]


def _times(
    rate: _Rates,
    record,
    key: str,
    has_backward: bool,
    replays: bool = False,
    *,
    cast: tuple[float, int] = (0.0, 0),
    slow: bool = False,
    kind: str | None = "op",
) -> tuple[float, float, float, float]:
    """(GPU forward, GPU backward, host forward, host backward) seconds of one node on one device type.

    A fused node runs as one Triton kernel on GPUs. Where Triton does not run (a ``cpu`` device, short
    of the interpreter used for testing), its original ops run instead. A group without a generated
    backward kernel (``replays``: row groups, and every group on a ``cpu``) differentiates its
    original ops, recomputing them first: its backward costs its members' forwards and backwards.
    ``cast``: bytes and tensors autocast casts first (and casts back in backward); ``slow``: a
    bf16/fp16 GEMM off tensor-core alignment. The host terms are zero on a CPU (``_queue``).
    """
    device = rate.type
    on_cpu = device.vendor == "cpu"
    host = _host_s(device, kind) if not on_cpu else (0.0, 0.0)
    share = UNALIGNED_TENSOR_CORE_SHARE if slow else 1.0
    cast_s = cast[0] / device.achievable_bandwidth_bps if cast[1] else 0.0
    cast_host = cast[1] * device.kernel_overhead_s
    if record.members and not on_cpu:  # one call of the fused-group op
        host = (device.host_fused_op_s, device.host_fused_backward_op_s if has_backward else 0.0)
    if record.members and (on_cpu or (replays and has_backward)):
        parts = [_times(rate, member, key, has_backward, kind="op") for member in record.members]
        members_fwd = sum(p[0] for p in parts)
        fwd = members_fwd if on_cpu else rate.time_s(record.fwd_flops, record.bytes, key)
        bwd = sum(p[1] for p in parts) + members_fwd if has_backward else 0.0
        # a replay differentiates the members under torch autograd, after the group op's own wrapper
        replayed = host[1] + sum(p[2] + p[3] for p in parts) if not on_cpu else 0.0
        return fwd, bwd, host[0], replayed
    fwd = rate.time_s(record.fwd_flops, record.bytes, key, share) + cast_s
    if not has_backward:
        return fwd, 0.0, host[0] + cast_host, 0.0
    bwd = rate.time_s(record.bwd_flops, BACKWARD_MEMORY_PASSES * record.bytes, key, share) + cast_s
    return fwd, bwd, host[0] + cast_host, host[1] + cast_host


def _host_s(device: DeviceType, kind: str | None) -> tuple[float, float]:
    if kind is None:
        return 0.0, 0.0
    shares = VIEW_HOST_SHARE if kind == "view" else (1.0, 1.0)
    return device.host_op_s * shares[0], device.host_backward_op_s * shares[1]


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

    def time_s(self, flops: float, nbytes: float, key: str, share: float = 1.0) -> float:
        """Roofline seconds of one kernel (``share`` of the achievable FLOP/s: an unaligned GEMM)."""
        if not flops and not nbytes:
            return 0.0
        compute_s = flops / (self.flops_per_s(key) * share) if flops else 0.0
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
    autocast: bool = False,
):
    """``block_times`` of a symbolic analysis (sizes in sympy dims) at the dims ``subs`` gives, without
    annotating the graph: how the microbatch search prices every microbatch size from one trace."""
    rates = {t.name: _Rates(t) for t in device_types}
    by_name = {n.name: n for n in gm.graph.nodes}
    owner, parts = [], []
    for i, names in enumerate(block_nodes):
        for name in names:
            node = by_name[name]
            if node.op in _COMPUTE:
                owner.append(i)
                times, _ = _node_parts(
                    node, info(node), rates, dtype, training, autocast, lambda v: _at(v, subs)
                )
                parts.append(times)
    per_node = _queued(parts, rates)
    fwd, bwd = ({t: [0.0] * len(block_nodes) for t in rates} for _ in range(2))
    for total, times in zip((fwd, bwd), per_node):
        for t in rates:
            for i, seconds in zip(owner, times[t]):
                total[t][i] += seconds
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
