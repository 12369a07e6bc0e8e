"""Codecs on the wire, as the planner sees them: which codec each cut may use and what it costs.

``compile(..., compress=...)`` says where tensors that cross a cut may be encoded (``hetcc.wire``):

- ``"off"`` (the default): nowhere.
- ``"auto"``: every cut may use any codec no lossier than the budget (``DEFAULT_BUDGET``: int8 for
  activations, bf16 for gradients), or none; the solver takes per cut the fastest (``solver.codecs``),
  and a codec stays only where it shortens the simulated step (``keep_paying_codecs``).
- a dict that pins codecs per link kind (``"inter-node"``, ``"intra-node"``) or per cut (the name of the
  block before it, e.g. ``"h.11"``), each a codec name (activations; gradients uncoded) or a pair
  ``(activations, gradients)``; its ``"budget"`` entry (a codec name or a pair) lets every cut it does
  not pin choose as ``"auto"`` does within that budget. A cut pin wins over a link-kind pin.

A codec is priced per cut from the shapes of the tensors crossing it: the bytes on the wire (its
payload where it applies, ``Codec.applies``, else the tensor whole: the rule the ``comm`` pass applies)
and, per device type, the roofline of its encode and decode work plus one host op per call.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.fx

from hetcc import ir
from hetcc.errors import PlanFormatError
from hetcc.hardware.cluster import Cluster
from hetcc.passes.blocks import Block, CutTensor
from hetcc.passes.comm import wire_codecs
from hetcc.solver.codecs import allowed, stage_messages
from hetcc.solver.objective import evaluate
from hetcc.solver.problem import PartitionProblem, PartitionSolution, WireCodec
from hetcc.solver.simulate import simulate
from hetcc.wire import CODECS, NO_CODEC, get_codec, within_budget

DEFAULT_BUDGET = ("int8", "bf16")  # the lossiest codec "auto" may choose for activations, gradients
LINK_KINDS = ("intra-node", "inter-node")
# A codec stays on a cut only if dropping it lengthens the simulated step by more than this share.
PAYS_RTOL = 0.005
_SIZING_ELEMENTS = 1 << 20  # the tensor whose encode prices a codec per byte


@dataclass(frozen=True)
class CompressSpec:
    """``compress`` read: the auto budget (None: no auto) and the pins by link kind and by cut."""

    budget: tuple[str, str] | None = None
    links: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    cuts: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def off(self) -> bool:
        return self.budget is None and not self.links and not self.cuts


def compress_spec(compress: object, block_names: Sequence[str] = ()) -> CompressSpec:
    """``compress`` checked and read; ``block_names``: the chain's blocks, which cut pins must name."""
    if compress in ("off", None, False):
        return CompressSpec()
    if compress == "auto":
        return CompressSpec(budget=DEFAULT_BUDGET)
    if not isinstance(compress, Mapping):
        raise PlanFormatError(
            f"compress must be 'off', 'auto' or a dict, got {compress!r}",
            hint="e.g. compress={'inter-node': ('int8', 'bf16')} or compress={'budget': 'int4'}",
        )
    budget, links, cuts = None, {}, {}
    for key, value in compress.items():
        pair = _pair(value, key)
        if key == "budget":
            budget = pair
        elif key in LINK_KINDS:
            links[key] = pair
        elif not block_names or key in block_names[:-1]:
            cuts[key] = pair
        else:
            raise PlanFormatError(
                f"compress names {key!r}, which is neither 'budget', a link kind ({', '.join(LINK_KINDS)}) "
                "nor a block of the model with a cut after it",
                hint="pin a cut by the name of the block before it (see the plan's blocks: compiled.explain())",
            )
    return CompressSpec(budget, links, cuts)


def _pair(value: object, key: str) -> tuple[str, str]:
    """A codec name (activations only) or an (activations, gradients) pair, each a known codec."""
    if isinstance(value, str):
        value = (value, NO_CODEC)
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"activations", "gradients"})
        if unknown:
            raise PlanFormatError(
                f"compress[{key!r}] has unknown keys {unknown}", hint="give 'activations' and/or 'gradients'"
            )
        value = (value.get("activations", NO_CODEC), value.get("gradients", NO_CODEC))
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, str) for v in value)):
        raise PlanFormatError(
            f"compress[{key!r}] must be a codec name or an (activations, gradients) pair, got {value!r}"
        )
    for name in value:
        get_codec(name)  # names the known codecs
    return tuple(value)


def codec_rows(
    gm: torch.fx.GraphModule,
    chain: Sequence[Block],
    cluster: Cluster,
    spec: CompressSpec,
    training: bool,
    crossing: Sequence[CutTensor],
    subs: dict | None = None,
) -> list[WireCodec] | None:
    """The problem's ``codecs``: one row per (codec, direction, where it may go); None when off.
    ``crossing``: the tensors of the problem's ``cut_tensors`` (``blocks.crossing_once``)."""
    if spec.off:
        return None
    names = [b.name for b in chain[:-1]]
    pinned_cut = [name in spec.cuts for name in names]
    free_cuts = [not p for p in pinned_cut]
    wanted: dict[tuple[str, bool, str, tuple[bool, ...]], None] = {}
    for direction, gradient in ((0, False), (1, True)):
        if gradient and not training:
            continue
        for name, pair in spec.cuts.items():
            mask = tuple(n == name for n in names)
            wanted[(pair[direction], gradient, "all", mask)] = None
        for kind, pair in spec.links.items():
            wanted[(pair[direction], gradient, kind, tuple(free_cuts))] = None
        if spec.budget is not None:
            free_links = [k for k in LINK_KINDS if k not in spec.links]
            where = "all" if len(free_links) == 2 else (free_links[0] if free_links else None)
            for codec in CODECS:
                if where is not None and within_budget(codec, spec.budget[direction]):
                    wanted[(codec, gradient, where, tuple(free_cuts))] = None
    tensors = _crossing(gm, chain, crossing, subs)
    return [
        _row(codec, gradient, links, list(mask), tensors, cluster)
        for codec, gradient, links, mask in wanted
        if any(mask)
    ]


@dataclass(frozen=True)
class _Crossing:
    """The tensors of the chain's cuts and of the problem's ``cut_tensors``: (shape, dtype, grad) each."""

    by_cut: list[list[tuple[tuple[int, ...], torch.dtype, bool]]]  # per cut
    entries: list[tuple[tuple[int, ...], torch.dtype, bool]]  # per cut_tensors entry


def _crossing(gm, chain: Sequence[Block], crossing: Sequence[CutTensor], subs) -> _Crossing:
    nodes = {n.name: n for n in gm.graph.nodes}
    spec = lambda c: (*_shape_dtype(nodes[c.node], subs), bool(c.grad))  # noqa: E731
    return _Crossing([list(map(spec, block.cut_tensors)) for block in chain[:-1]], list(map(spec, crossing)))


def _shape_dtype(node: torch.fx.Node, subs: dict | None) -> tuple[tuple[int, ...], torch.dtype]:
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    dims = (d.node.expr if isinstance(d, torch.SymInt) else d for d in val.shape)
    return tuple(int(ir.number_at(d, subs or {})) for d in dims), val.dtype


def _row(codec: str, gradient: bool, links: str, mask: list[bool], tensors: _Crossing, cluster) -> WireCodec:
    """One ``WireCodec``: the wire bytes, coded bytes and calls of every cut (and cut tensor) under
    ``codec`` in one direction, and its seconds per byte and per call on every device type."""

    def cost(shape, dtype, grad) -> tuple[float, float, int]:
        """(wire bytes, coded raw bytes, encode calls) of one tensor in this direction."""
        if gradient and not grad:
            return 0.0, 0.0, 0  # no gradient comes back for it
        raw = float(math.prod(shape) * dtype.itemsize)
        if codec != NO_CODEC and wire_codecs(shape, dtype, grad, codec, NO_CODEC)[0] != NO_CODEC:
            return float(get_codec(codec).payload_bytes(shape)), raw, 1
        return raw, 0.0, 0

    per_cut = [[cost(*t) for t in items] for items in tensors.by_cut]
    entries = [cost(*t) for t in tensors.entries]
    encode, decode, call = _seconds(codec, cluster)
    return WireCodec(
        name=codec,
        gradient=gradient,
        cut_bytes=[math.fsum(w for w, _, _ in cut) for cut in per_cut],
        coded_bytes=[math.fsum(c for _, c, _ in cut) for cut in per_cut],
        calls=[sum(n for _, _, n in cut) for cut in per_cut],
        encode_s_per_byte=encode,
        decode_s_per_byte=decode,
        call_s=call,
        tensor_bytes=[w for w, _, _ in entries],
        tensor_coded=[n > 0 for _, _, n in entries],
        links=links,
        cuts=mask,
    )


def _seconds(codec: str, cluster: Cluster) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Per device type: encode and decode seconds per raw fp32 byte (the roofline of the codec's work on
    a large tensor) and seconds per call (one host op and one kernel)."""
    if codec == NO_CODEC:
        zero = {t.name: 0.0 for t in cluster.types}
        return zero, dict(zero), dict(zero)
    flops, moved = get_codec(codec).work((_SIZING_ELEMENTS,))
    per_byte = {
        t.name: max(flops / t.achievable_flops(torch.float32), moved / t.achievable_bandwidth_bps)
        / (4 * _SIZING_ELEMENTS)
        for t in cluster.types
    }
    call = {t.name: t.host_op_s + t.kernel_overhead_s for t in cluster.types}
    return per_byte, dict(per_byte), call


def keep_paying_codecs(
    problem: PartitionProblem, solution: PartitionSolution
) -> tuple[PartitionSolution, list[str]]:
    """``solution`` with each codec the solver chose (not one pinned: "none" is allowed there) dropped
    in stage order wherever the plan without it simulates within ``PAYS_RTOL`` of the plan with every
    chosen codec, and a note per cut that keeps one."""
    if problem.codecs is None:
        return solution, []
    codecs = [list(s.codecs) for s in solution.stages]
    step = _simulated(problem, solution, codecs)
    limit, groups = step * (1 + PAYS_RTOL), solution.groups
    for j, stage in enumerate(solution.stages[:-1]):
        pair = (groups[j][0], groups[j + 1][0])
        for direction, gradient in ((0, False), (1, True)):
            if codecs[j][direction] == NO_CODEC or not _none_allowed(
                problem, stage.blocks[1] - 1, pair, gradient
            ):
                continue
            trial = [list(p) for p in codecs]
            trial[j][direction] = NO_CODEC
            without = _simulated(problem, solution, trial)
            if without <= limit:
                codecs, step = trial, without
    pinned = [tuple(p) for p in codecs]
    scored = evaluate(
        problem,
        solution.boundaries,
        groups,
        solution.recompute,
        bound_s=solution.lower_bound_s,
        codecs=pinned,
        warmup=solution.warmup,
    )
    kept = replace(scored, simulated_s=step, gap=step / solution.lower_bound_s - 1, exact=solution.exact,
                   orders_searched=solution.orders_searched)  # fmt: skip
    return kept, _notes(problem, kept)


def _none_allowed(problem: PartitionProblem, cut: int, pair: tuple[int, int], gradient: bool) -> bool:
    return any(
        row.name == NO_CODEC and row.gradient == gradient and allowed(problem, row, cut, pair)
        for row in problem.codecs
    )


def _simulated(problem, solution, codecs) -> float:
    layout = (solution.boundaries, solution.groups, solution.recompute)
    codecs = [tuple(p) for p in codecs]
    return simulate(problem, *layout, events=False, codecs=codecs, warmup=solution.warmup).step_time_s


def stage_wire_bytes(
    problem: PartitionProblem, solution: PartitionSolution
) -> list[tuple[float, float, float, float]]:
    """Per stage, what it sends per microbatch (to every later stage: skips included) and the gradients
    it gets back: (activations, gradients) bytes whole, then on the wire with its codecs."""
    blocks = [s.blocks for s in solution.stages]
    whole = stage_messages(problem, blocks, [(NO_CODEC, NO_CODEC)] * len(blocks))
    coded = stage_messages(problem, blocks, [s.codecs for s in solution.stages])
    totals = [[0.0, 0.0, 0.0, 0.0] for _ in blocks]
    for offset, messages in ((0, whole), (2, coded)):
        for (src, _), (forward, back) in messages.items():
            totals[src][offset] += forward.wire_bytes
            totals[src][offset + 1] += back.wire_bytes if problem.training else 0.0
    return [tuple(t) for t in totals]


def _notes(problem: PartitionProblem, solution: PartitionSolution) -> list[str]:
    notes = []
    for j, (stage, sizes) in enumerate(zip(solution.stages[:-1], stage_wire_bytes(problem, solution))):
        if stage.codecs == (NO_CODEC, NO_CODEC):
            continue
        act, grad = stage.codecs
        notes.append(
            f"compress: stage {j} sends activations as {act}, gradients come back as {grad}: "
            f"{_mib(sizes[0])} -> {_mib(sizes[2])} forward, {_mib(sizes[1])} -> {_mib(sizes[3])} back "
            "per microbatch"
        )
    return notes or ["compress: no codec shortens the simulated step; every cut sends tensors whole"]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"
