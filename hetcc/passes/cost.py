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

A calibrated type may carry rates measured by size (``DeviceType.rate_curves``): a GEMM or an
attention call (``_RATE_CLASS``) then runs at its curve's share of peak for its forward FLOPs per call
(small kernels reach far less than large ones), an unaligned GEMM at the unaligned curve where one was
measured (``rates.CURVES``), and the node's notes say so; without curves, the constant rate above.

Fusion is chosen here (the record is ``passes.fuse.FusionChoice``): each group ``passes.fuse`` could make one kernel is priced
both ways in its block's queue on every device type, and fuses on the types where the kernel call wins;
the fuse step, after the partition, fuses it in the stages of those types. The microbatch search prices
a symbolic trace the same way (``block_times_at``), so its figures are the plans'.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.fx

from hetcc import config
from hetcc.errors import AnalysisError, HetccError
from hetcc.hardware.presets import DeviceType, flops_key
from hetcc.ir import annotate, info, is_concrete, number_at
from hetcc.kernels import FUSION_META_KEY
from hetcc.passes.fuse import FusionCandidate, FusionChoice
from hetcc.passes.rates import CURVE_NOTE, UNALIGNED_TENSOR_CORE_SHARE, Rates, Speed

BACKWARD_MEMORY_PASSES = 2.0
# A view's host cost against a small op's, forward and backward (an H200's host: 8 vs 14 us, 14 vs 50 us).
VIEW_HOST_SHARE = (0.5, 0.25)
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
_ATTENTION_OPS = (
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
)  # fmt: skip
# The kernel class whose measured rate curve prices an op (a GEMM off alignment: "gemm_unaligned").
_RATE_CLASS = dict.fromkeys(_GEMM_MATRIX_ARG, "gemm") | dict.fromkeys(_ATTENTION_OPS, "sdpa")
_NO_LAUNCH = (operator.getitem, getattr)
_COMPUTE = ("call_function", "call_method", "call_module")  # the node ops that run something


def cost(
    gm: torch.fx.GraphModule,
    *,
    device_types: Sequence[DeviceType],
    dtype: object | None = None,
    training: bool = True,
    autocast: bool = False,
    candidates: Sequence[FusionCandidate] = (),
    fuse: str = "cost",
) -> FusionChoice:
    """Annotate ``fwd_s`` / ``bwd_s`` per device type on every compute node (``autocast``: the stages
    run under torch.autocast at ``dtype``, fp32 weights cast on the fly), and choose per device type
    which fusion ``candidates`` fuse (``fuse``: "cost", "all" or "off"; see ``FusionChoice``). On a type
    where a group fuses, its last member carries the kernel's time and the others none, so a fused
    node's time is always the sum of its members' and ``block_times`` needs nothing else."""
    rates = {t.name: Rates(t) for t in device_types}
    nodes = [n for n in gm.graph.nodes if n.op in _COMPUTE]
    for node in nodes:
        _require_concrete(node, info(node))
    priced = _price(nodes, candidates, rates, _Pricing(dtype, training, autocast, float), fuse)
    for i, node in enumerate(nodes):
        record = annotate(
            node,
            fwd_s=tuple((t, priced.fwd[t][i]) for t in rates),
            bwd_s=tuple((t, priced.bwd[t][i]) for t in rates),
        )
        new = [note for note in priced.notes[i] if note not in record.notes]
        if new:
            annotate(node, notes=(*record.notes, *new))
    return priced.choice


UNALIGNED_NOTE = "GEMM off tensor-core alignment"


def cost_notes(gm: torch.fx.GraphModule) -> list[str]:
    """The plan's notes about a costed graph: GEMMs off tensor-core alignment, nodes priced by size."""
    return [note for note in (unaligned_gemm_note(gm), measured_rates_note(gm)) if note]


def measured_rates_note(gm: torch.fx.GraphModule) -> str | None:
    """One line for the plan saying how many nodes each device type priced from rates measured by
    size (``hetcc calibrate``), or None."""
    notes = [note for node in gm.graph.nodes for note in info(node).notes if note.startswith(CURVE_NOTE)]
    counts = Counter(note.removeprefix(CURVE_NOTE).partition(":")[0].strip() for note in notes)
    if not counts:
        return None
    per_type = ", ".join(f"{count} on {name}" for name, count in counts.items())
    return f"nodes priced at the GEMM / attention rates calibration measured by size: {per_type} (their notes say which)"


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
        f"below the tensor-core rate ({UNALIGNED_TENSOR_CORE_SHARE:.0%} of it where calibration did not "
        f"measure them): {named}{more}; padding such a "
        "dimension (a vocabulary, say) to a multiple of 8 makes them about 5x faster"
    )


@dataclass(frozen=True)
class _Pricing:
    """How nodes are priced: the compile dtype, training or not, under autocast or not, and how a
    (possibly symbolic) size becomes a number."""

    dtype: object | None
    training: bool
    autocast: bool
    value: Callable[[Any], float]


def _node_parts(node, record, rates, how: _Pricing, group=None) -> tuple[dict, tuple[str, ...]]:
    """Per device type, (GPU forward, GPU backward, host forward, host backward) seconds of one node
    (or of a fusion candidate: ``group`` and its fused ``record``), and the node's notes on how it was
    priced (a half-precision GEMM off tensor-core alignment; a rate measured by size)."""
    key, floating = _flops_key(record, how.dtype)
    has_backward = how.training and floating
    group = group if group is not None else node.meta.get(FUSION_META_KEY)
    replays = group is not None and group.backward == "recompute"
    name = op_name(node) if group is None else "fusion_group"
    low = how.autocast and name in LOWER_PRECISION_OPS
    cast = _cast_elements(node) if low else (0, 0)
    cast = (how.value(cast[0]) * CAST_BYTES, cast[1])
    unaligned = bool(_unaligned_dims(node, name))
    slow = key in _TENSOR_CORE_KEYS and unaligned
    kernel = _RATE_CLASS.get(name) if group is None else None
    kernel = "gemm_unaligned" if kernel == "gemm" and unaligned else kernel
    numbers = _numbers(record, how.value)
    kind = "op" if group is not None else _launch_kind(node, record)
    times, notes = {}, [UNALIGNED_NOTE] if slow else []
    for t, rate in rates.items():
        speed = rate.speed(key, kernel, numbers.fwd_flops, slow) if numbers.fwd_flops else None
        times[t] = _times(rate, numbers, key, has_backward, replays, cast=cast, speed=speed, kind=kind)
        note = speed and speed.note(t)
        notes += [note] if note else []
    return times, tuple(notes)


def _numbers(record, value) -> SimpleNamespace:
    """A record's sizes as numbers (its fused members' too)."""
    return SimpleNamespace(
        fwd_flops=value(record.fwd_flops), bwd_flops=value(record.bwd_flops), bytes=value(record.bytes),
        members=tuple(_numbers(m, value) for m in record.members),
    )  # fmt: skip


@dataclass
class _Priced:
    fwd: dict[str, list[float]]  # per device type, per node: seconds in that type's queue
    bwd: dict[str, list[float]]
    notes: list[tuple[str, ...]]  # per node: how it was priced, on any device type
    choice: FusionChoice


def _price(nodes, candidates, rates, how: _Pricing, fuse: str) -> _Priced:
    """Every node's queued forward and backward seconds per device type, with the candidates that
    fuse on that type (``FusionChoice``) fused: the last member carries the kernel's time, the
    other members none."""
    if fuse not in config.FUSE_MODES:
        raise HetccError(
            f"hetcc.config.fuse is {fuse!r}", hint=f"set it (or HETCC_FUSE) to one of {config.FUSE_MODES}"
        )
    parts, notes = [], []
    for node in nodes:
        times, node_notes = _node_parts(node, info(node), rates, how)
        parts.append(times)
        notes.append(node_notes)
    position = {node: i for i, node in enumerate(nodes)}
    members = [[position[m] for m in c.members] for c in candidates]
    kernels = [_node_parts(c.members[-1], c.record, rates, how, c.group)[0] for c in candidates]
    windows: dict[object, list[int]] = {}
    for i, node in enumerate(nodes):
        windows.setdefault(info(node).block, []).append(i)
    # the blocks each candidate has members in: only groups chosen there change a block's window
    touches = [{info(m).block for m in c.members} for c in candidates]
    fwd, bwd, fused, compared = {}, {}, {}, {}
    for t in rates:
        own = [p[t] for p in parts]
        group_parts = [k[t] for k in kernels]
        chosen: set[int] = set()
        chosen_in: dict[object, set[int]] = {}  # per block, the chosen groups with members in it
        compared[t] = []
        for k, candidate in enumerate(candidates):
            block = info(candidate.members[-1]).block
            window, near = windows[block], chosen_in.get(block, set())
            with_kernel = _window_s(window, own, members, group_parts, near | {k})
            as_ops = _window_s(window, own, members, group_parts, near)
            compared[t].append((with_kernel, as_ops))
            # A CPU runs a fused group's ops either way (the same seconds; a rounding must not decide).
            cpu = rates[t].type.vendor == "cpu"
            if fuse == "all" or (fuse == "cost" and not cpu and with_kernel < as_ops):
                chosen.add(k)
                for touched in touches[k]:
                    chosen_in.setdefault(touched, set()).add(k)
        sequence = _fused_sequence(range(len(nodes)), own, members, group_parts, chosen)
        queued_f, queued_b = _queue_both([part for _, part in sequence])
        fwd[t], bwd[t] = [0.0] * len(nodes), [0.0] * len(nodes)
        for (i, _), f, b in zip(sequence, queued_f, queued_b):
            fwd[t][i], bwd[t][i] = f, b
        fused[t] = frozenset(chosen)
    return _Priced(fwd, bwd, notes, FusionChoice(candidates, fused, compared))


def _fused_sequence(positions, own, members, group_parts, chosen) -> list[tuple[int, tuple]]:
    """(node position, parts) in issue order with the ``chosen`` groups as one call each, standing
    at their last member's position (the fused node's)."""
    absorbed = {i: k for k in chosen for i in members[k]}
    sequence = []
    for i in positions:
        k = absorbed.get(i)
        if k is None:
            sequence.append((i, own[i]))
        elif i == members[k][-1]:
            sequence.append((i, group_parts[k]))
    return sequence


def _window_s(window, own, members, group_parts, chosen) -> float:
    """Forward + backward seconds of one block's nodes in the queue, ``chosen`` groups fused."""
    sequence = _fused_sequence(window, own, members, group_parts, chosen)
    return sum(map(sum, _queue_both([part for _, part in sequence])))


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
        if record.dtype != torch.float32 or record.shape is None or autocast_half(arg):
            continue
        elements += math.prod(record.shape)
        tensors += 1
    return elements, tensors


def autocast_half(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value is half precision under autocast: an op autocast runs in the lower
    precision computed it, or the tensor it views."""
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
    rate: Rates,
    record,
    key: str,
    has_backward: bool,
    replays: bool = False,
    *,
    cast: tuple[float, int] = (0.0, 0),
    speed: Speed | None = None,
    kind: str | None = "op",
) -> tuple[float, float, float, float]:
    """(GPU forward, GPU backward, host forward, host backward) seconds of one node on one device type.

    A fused node runs as one Triton kernel on GPUs, and so does its generated backward (pointwise and
    row groups alike): about two memory passes. Where Triton does not run (a ``cpu`` device, short of
    the interpreter used for testing), its original ops run instead, under autograd: it costs what
    they cost, forward and backward. A group without a generated backward kernel (``replays``: one
    saved with ``backward="recompute"``) differentiates its original ops on a GPU, recomputing them
    first: its backward costs its members' forwards and backwards.
    ``cast``: bytes and tensors autocast casts first (and casts back in backward); ``speed``: its
    kernels' FLOP/s (``Rates.speed``; None: the constant rate). The host terms are zero on a CPU
    (``_queue``).
    """
    device = rate.type
    on_cpu = device.vendor == "cpu"
    host = _host_s(device, kind) if not on_cpu else (0.0, 0.0)
    cast_s = cast[0] / device.achievable_bandwidth_bps if cast[1] else 0.0
    cast_host = cast[1] * device.kernel_overhead_s
    if record.members and not on_cpu:  # one call of the fused-group op
        host = (device.host_fused_op_s, device.host_fused_backward_op_s if has_backward else 0.0)
    if record.members and (on_cpu or (replays and has_backward)):
        parts = [_times(rate, member, key, has_backward, kind="op") for member in record.members]
        members_fwd = sum(p[0] for p in parts)
        fwd = members_fwd if on_cpu else rate.time_s(record.fwd_flops, record.bytes, key)
        recomputed = 0.0 if on_cpu else members_fwd
        bwd = sum(p[1] for p in parts) + recomputed if has_backward else 0.0
        # a replay differentiates the members under torch autograd, after the group op's own wrapper
        replayed = host[1] + sum(p[2] + p[3] for p in parts) if not on_cpu else 0.0
        return fwd, bwd, host[0], replayed
    fwd = rate.time_s(record.fwd_flops, record.bytes, key, speed and speed.fwd_flops_per_s) + cast_s
    if not has_backward:
        return fwd, 0.0, host[0] + cast_host, 0.0
    bwd_rate = speed and speed.bwd_flops_per_s
    bwd = rate.time_s(record.bwd_flops, BACKWARD_MEMORY_PASSES * record.bytes, key, bwd_rate) + cast_s
    return fwd, bwd, host[0] + cast_host, host[1] + cast_host


def _host_s(device: DeviceType, kind: str | None) -> tuple[float, float]:
    if kind is None:
        return 0.0, 0.0
    shares = VIEW_HOST_SHARE if kind == "view" else (1.0, 1.0)
    return device.host_op_s * shares[0], device.host_backward_op_s * shares[1]


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
    candidates: Sequence[FusionCandidate] = (),
    fuse: str = "cost",
) -> tuple[dict, dict, FusionChoice]:
    """``block_times`` of a symbolic analysis (sizes in sympy dims) at the dims ``subs`` gives, and
    the ``FusionChoice`` there, without annotating the graph: how the microbatch search prices every
    microbatch size from one trace, as ``cost`` prices the graph traced at that size."""
    rates = {t.name: Rates(t) for t in device_types}
    owner = {name: i for i, names in enumerate(block_nodes) for name in names}
    nodes = [n for n in gm.graph.nodes if n.op in _COMPUTE]
    value = functools.cache(lambda size: number_at(size, subs))  # the repeated layers share their sizes
    how = _Pricing(dtype, training, autocast, value)
    priced = _price(nodes, candidates, rates, how, fuse)
    fwd, bwd = ({t: [0.0] * len(block_nodes) for t in rates} for _ in range(2))
    for total, times in ((fwd, priced.fwd), (bwd, priced.bwd)):
        for t in rates:
            for node, seconds in zip(nodes, times[t]):
                if node.name in owner:
                    total[t][owner[node.name]] += seconds
    return fwd, bwd, priced.choice


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
