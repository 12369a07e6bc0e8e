"""tensor_cost: what each block costs one device of a tensor-parallel group, per degree: the
``TensorSplit`` rows the solver plans tensor parallelism with (``solver.tensor``).

For each degree t tried (2, 4, 8 up to the most like devices one node holds, or the one pinned), the
costed whole graph is rewritten for degree t (``passes.tensor_parallel``), and the graph one device runs
is analysed and priced by the passes that priced the whole one (``flops``, ``memory``, ``cost``), then
summed per block by ``partition.build_problem`` itself: a row holds what the problem's arrays would be at
degree t, per device (a weight split t ways holds 1/t of its bytes). Ops the rewrite adds take the block
of the op they complete (an all-reduce, the bias added after it) or, for what enters a sharded region
(``tensor_enter``, ``tensor_slice``, ``gather_enter``), of the op they feed.

Collectives are not compute: each is a ring over the slowest intra-node link joining devices of that type
on a node holding t of them, of the bytes of the whole tensor (half precision where autocast computed it):
an all-reduce 2(t-1)/t * bytes / bandwidth + 2(t-1) * latency, an all-gather or a reduce-scatter half
of that. Forward: ``all_reduce``, ``all_gather``, ``reduce_scatter`` and ``gather_enter``'s gather;
backward: ``tensor_enter``'s all-reduce, ``tensor_slice``'s and ``reduce_scatter``'s all-gather and
``gather_enter``'s reduce-scatter. The local graph is priced with the fusion groups that pay fused on
each type: the groups ``fuse_split`` fuses in the stage each device runs (no group crosses a collective).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.fx

from hetcc import config
from hetcc.errors import AnalysisError, HetccError
from hetcc.hardware.cluster import Cluster
from hetcc.hardware.presets import DeviceType
from hetcc.ir import annotate, info, nbytes
from hetcc.passes.blocks import Block, TiedParam, collect_blocks
from hetcc.passes.cost import autocast_half, block_times, cost
from hetcc.passes.flops import flops
from hetcc.passes.fuse import FusionChoice, fuse, fusion_candidates
from hetcc.passes.memory import memory
from hetcc.passes.partition import PlanSettings, build_problem
from hetcc.passes.remat import trainable_values
from hetcc.passes.tensor_parallel import tensor_parallel
from hetcc.solver.links import ring_allreduce_s
from hetcc.solver.problem import TensorSplit

AUTO_DEGREES = (2, 4, 8)  # what tensor_parallel="auto" prices, each up to the most like devices on a node
HALF_BYTES = 2  # bf16 / fp16
_hetcc = torch.ops.hetcc  # registered by hetcc.collectives, which tensor_parallel imports
# Collective op -> the ring it runs (forward, backward); None: nothing moves that way.
RINGS = {
    _hetcc.all_reduce.default: ("all_reduce", None),
    _hetcc.all_gather.default: ("all_gather", None),
    _hetcc.tensor_enter.default: (None, "all_reduce"),
    _hetcc.tensor_slice.default: (None, "all_gather"),
    _hetcc.reduce_scatter.default: ("reduce_scatter", "all_gather"),
    _hetcc.gather_enter.default: ("all_gather", "reduce_scatter"),
}
# placed with the op they feed
_ENTERING = (_hetcc.tensor_enter.default, _hetcc.tensor_slice.default, _hetcc.gather_enter.default)


@dataclass
class TensorPricing:
    """The rows priced (one per degree), the collectives' part of their seconds, the ops each degree had
    to gather a sharded input for (no sharding rule), and the degrees not priced, with why."""

    rows: list[TensorSplit] = field(default_factory=list)
    collective_s: dict[int, tuple[dict, dict]] = field(default_factory=dict)  # degree -> (fwd, bwd) per type
    gathered: dict[int, list[str]] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)  # compile seconds spent per degree

    def note(self, stage_degrees: Sequence[int]) -> str:
        """One line for the plan: the degrees priced, those the plan's stages run at, and the ops that
        gathered a sharded input at them."""
        tried = ", ".join(str(row.degree) for row in self.rows) or "none"
        head = f"tensor parallel: degrees priced {tried}" + "".join(
            f"; degree {t} not: {why}" for t, why in sorted(self.skipped.items())
        )
        used = sorted({t for t in stage_degrees if t > 1})
        if not used:
            return f"{head}; every stage runs at degree 1 (the fastest simulated)"
        at = ", ".join(f"stage {k} at {t}" for k, t in enumerate(stage_degrees) if t > 1)
        gathered = [f"at {t}: {_listed(self.gathered[t])}" for t in used if self.gathered.get(t)]
        why = "; ops gathering a sharded input (no sharding rule) " + "; ".join(gathered) if gathered else ""
        return f"{head}; {at}{why}"

    def summary(self, names: Sequence[str]) -> str:
        """The step's dump: per degree and block ``names``, seconds per device type (the collectives'
        part in brackets) and bytes held per device."""
        lines = []
        for row in self.rows:
            fwd_c, bwd_c = self.collective_s[row.degree]
            lines.append(f"# degree {row.degree}, priced in {self.seconds[row.degree]:.1f} s")
            for i, name in enumerate(names):
                times = ", ".join(
                    f"{k} fwd {row.fwd_s[k][i] * 1e3:.3f} ({fwd_c[k][i] * 1e3:.3f}) "
                    f"bwd {row.bwd_s[k][i] * 1e3:.3f} ({bwd_c[k][i] * 1e3:.3f}) ms"
                    for k in sorted(row.fwd_s)
                )
                held = f"state {row.state_bytes[i] / 2**20:.1f} MiB, act {row.act_bytes[i] / 2**20:.1f} MiB"
                lines.append(f"{name:<24} {times}; {held}")
            lines.extend(f"gathered: {op}" for op in self.gathered[row.degree])
        lines.extend(f"# degree {t} not priced: {why}" for t, why in sorted(self.skipped.items()))
        return "\n".join(lines)


def _listed(items: Sequence[str], most: int = 6) -> str:
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def tensor_cost(
    gm: torch.fx.GraphModule, chain: Sequence[Block], tied: Sequence[TiedParam], cluster: Cluster,
    settings: PlanSettings, dtype: object | None = None,
) -> TensorPricing:  # fmt: skip
    """The ``TensorSplit`` rows of ``gm`` (analysed and costed; its block ``chain`` and ``tied`` weights)
    on ``cluster`` for ``settings.tensor_parallel`` ("auto" or a degree); ``dtype`` as ``cost`` took it.
    A pinned degree no node has enough like devices for, or the model has nothing to split at, raises
    ``HetccError``."""
    pricing = TensorPricing()
    for degree, kinds in tried_degrees(cluster, settings.tensor_parallel).items():
        start = time.perf_counter()
        priced = tensor_row(gm, degree, chain, tied, cluster, settings, kinds, dtype)
        if priced is None:
            pricing.skipped[degree] = "no weight splits that many ways"
            continue
        row, pricing.collective_s[degree], gathered = priced
        pricing.rows.append(row)
        pricing.gathered[degree] = gathered
        pricing.seconds[degree] = time.perf_counter() - start
    if not pricing.rows and settings.tensor_parallel != "auto":
        raise HetccError(
            f"tensor_parallel={settings.tensor_parallel}: no weight of the model splits "
            f"{settings.tensor_parallel} ways (its matmuls' dimensions do not divide by it)",
            hint="use a degree dividing the hidden size and head count, 'auto', or False",
        )
    return pricing


def tried_degrees(cluster: Cluster, wanted: int | str) -> dict[int, list[DeviceType]]:
    """The degrees to price (``wanted``: "auto" or one degree), each with the device types some node holds
    that many like devices (type and memory) of; the solver plans a degree only on those."""
    per_node = Counter((d.node, d.type.name, cluster.usable_memory_bytes(d)) for d in cluster.devices)
    most: dict[str, int] = {}
    for (_, kind, _), count in per_node.items():
        most[kind] = max(most.get(kind, 0), count)
    degrees = AUTO_DEGREES if wanted == "auto" else (wanted,)
    found = {t: [k for k in cluster.types if most[k.name] >= t] for t in degrees}
    found = {t: kinds for t, kinds in found.items() if kinds}
    if not found and wanted != "auto":
        kind, count = max(most.items(), key=lambda item: item[1])
        raise HetccError(
            f"tensor_parallel={wanted}: no node holds {wanted} like devices (the most: {count} {kind})",
            hint=f"a tensor group is devices of one type and memory on one node: use a degree up to {count}, "
            "'auto' or False",
        )
    return found


def tensor_row(
    gm: torch.fx.GraphModule, degree: int, chain: Sequence[Block], tied: Sequence[TiedParam],
    cluster: Cluster, settings: PlanSettings, kinds: Sequence[DeviceType], dtype: object | None = None,
) -> tuple[TensorSplit, tuple[dict, dict], list[str]] | None:  # fmt: skip
    """The row of ``degree`` on the device types ``kinds`` (``tensor_cost``'s arguments), the collectives'
    part of its seconds (forward, backward: per type, per block) and the ops that gathered a sharded input;
    None where no weight splits ``degree`` ways."""
    local, layout = tensor_parallel(gm, degree)
    if not layout.sharded_params:
        return None
    names = [b.name for b in chain]
    choice = _analyse(local, names, settings, kinds, dtype)
    local_chain, _ = collect_blocks(local)
    if [b.name for b in local_chain] != names:
        raise AnalysisError(
            f"tensor_parallel at degree {layout.degree} changed the block chain "
            f"({len(local_chain)} blocks, {len(names)} before)",
            hint="this is a hetcc bug; please report it with the model's dump folder",
        )
    type_names = [k.name for k in kinds]
    times = block_times(local, [b.nodes for b in local_chain], type_names)
    change = choice.act_bytes_change(names) if settings.training else None
    arrays = build_problem(
        local, local_chain, tied, cluster, replace(settings, compress="off"), times, change
    )
    autocast = settings.precision != "fp32"
    fwd, bwd = _collectives_s(local, names, cluster, type_names, layout.degree, autocast, settings.training)
    row = TensorSplit(
        degree=layout.degree,
        fwd_s={k: [a + b for a, b in zip(times[0][k], fwd[k])] for k in type_names},
        bwd_s={k: [a + b for a, b in zip(times[1][k], bwd[k])] for k in type_names},
        wgrad_s=arrays.wgrad_s,  # the weight GEMMs' share of the compute; the collectives are input grads
        state_bytes=arrays.state_bytes,
        act_bytes=arrays.act_bytes,
        param_bytes=arrays.param_bytes,
        optimizer_bytes=arrays.optimizer_bytes,
    )
    return row, (fwd, bwd), list(layout.gathered_ops)


def _analyse(
    local: torch.fx.GraphModule, names: Sequence[str], settings: PlanSettings, kinds: Sequence[DeviceType],
    dtype: object | None,
) -> FusionChoice:  # fmt: skip
    """The analysis and pricing of the whole graph, run on the graph one device runs: its saved
    activations, then ``_priced``'s parts, FLOPs and seconds."""
    memory(local, training=settings.training)
    return _priced(local, names, settings, kinds, dtype)


def _priced(
    local: torch.fx.GraphModule, names: Sequence[str], settings: PlanSettings, kinds: Sequence[DeviceType],
    dtype: object | None,
) -> FusionChoice:  # fmt: skip
    """The ops the rewrite added placed in blocks, the weights' records made their parts (shape, bytes
    held), FLOPs and bytes, then seconds on ``kinds`` with the fusion groups that pay fused."""
    _place_added_ops(local, {name: i for i, name in enumerate(names)})
    flops(local)
    for node in local.graph.find_nodes(op="get_attr"):  # the records hold the whole weights: take the parts
        part = node.meta.get("val")
        if isinstance(part, torch.Tensor):
            held = int(nbytes(part)) if info(node).param_bytes else 0
            annotate(node, shape=tuple(part.shape), param_bytes=held)
    candidates = fusion_candidates(local) if config.fuse != "off" else []
    return cost(
        local, device_types=kinds, dtype=dtype, training=settings.training,
        autocast=settings.precision != "fp32", candidates=candidates, fuse=config.fuse,
    )  # fmt: skip


def fuse_split(
    local: torch.fx.GraphModule, stage: int, names: Sequence[str], kind: DeviceType, settings: PlanSettings,
    dtype: object | None,
) -> None:  # fmt: skip
    """Fuse, in the graph each device of tensor-parallel stage ``stage`` (blocks ``names``, on ``kind``)
    runs, the groups that pay fused there, chosen as ``tensor_row`` chose them (no activations measured:
    the choice is by seconds). Collectives have no lowering, so no group crosses one; a group's kernel
    is built for the local shapes."""
    for node in local.graph.nodes:
        if info(node).stage is None:
            annotate(node, stage=stage)
    choice = _priced(local, names, settings, [kind], dtype)
    fuse(local, [choice.candidates[k] for k in sorted(choice.fused.get(kind.name, ()))])


def _place_added_ops(gm: torch.fx.GraphModule, index: dict[str, int]) -> None:
    """Give the ops ``tensor_parallel`` added a block: what enters a sharded region the earliest block of
    its users, every other op the latest block of its inputs (so no op reads a later block)."""
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if info(node).block is None and node.op != "output" and node.target not in _ENTERING:
            blocks = [info(a).block for a in node.all_input_nodes if info(a).block is not None]
            if blocks:
                annotate(node, block=max(blocks, key=index.__getitem__))
    for node in reversed(nodes):
        if info(node).block is None and node.op != "output":
            blocks = [info(u).block for u in node.users if info(u).block is not None]
            if blocks:
                annotate(node, block=min(blocks, key=index.__getitem__))


def _collectives_s(
    gm: torch.fx.GraphModule, names: Sequence[str], cluster: Cluster, kinds: Sequence[str], degree: int,
    autocast: bool, training: bool,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:  # fmt: skip
    """Per device type, per block: seconds of the collectives run forward and backward (a backward one
    only where a gradient flows: its input depends on a trainable weight)."""
    index = {name: i for i, name in enumerate(names)}
    trainable = trainable_values(gm) if training else set()
    links = {kind: group_link(cluster, kind, degree) for kind in kinds}
    fwd = {kind: [0.0] * len(names) for kind in kinds}
    bwd = {kind: [0.0] * len(names) for kind in kinds}
    for node in gm.graph.nodes:
        rings = RINGS.get(node.target)
        if rings is None:
            continue
        whole = _whole_bytes(node, autocast)
        block = index[info(node).block]
        for ring, table in zip(rings, (fwd, bwd)):
            if ring is None or (table is bwd and node.all_input_nodes[0] not in trainable):
                continue
            for kind in kinds:
                seconds = ring_allreduce_s(whole, degree, *links[kind])
                table[kind][block] += seconds if ring == "all_reduce" else seconds / 2
    return fwd, bwd


def _whole_bytes(node: torch.fx.Node, autocast: bool) -> float:
    """Bytes of the whole tensor a collective moves (the larger of its input and output: a gather's
    output, a slice's input), in half precision where autocast computed it."""
    source = node.all_input_nodes[0]
    value = max((source.meta["val"], node.meta["val"]), key=lambda v: v.numel())
    size = (
        HALF_BYTES
        if autocast and value.is_floating_point() and autocast_half(source)
        else value.element_size()
    )
    return float(value.numel() * size)


def group_link(cluster: Cluster, kind: str, degree: int) -> tuple[float, float]:
    """(bandwidth, latency) a ring of ``degree`` devices of type ``kind`` runs at: the slowest link
    between two of them on any node holding that many."""
    by_node: dict[str, list] = {}
    for device in cluster.devices:
        if device.type.name == kind:
            by_node.setdefault(device.node, []).append(device)
    links = [
        cluster.link(a, b)
        for devices in by_node.values()
        if len(devices) >= degree
        for a in devices
        for b in devices
        if a.name != b.name
    ]
    return min(link.bandwidth_bps for link in links), max(link.latency_s for link in links)
