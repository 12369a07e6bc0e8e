"""Where every rank of a plan runs (``RankPlacement``, the one record of a rank), the torchrun command
per node that puts it there, and the check each rank makes at start that it got the device the plan was
made for.

The placement is a list of ranks (``PipelineMeta.placement``, saved in ``pipeline.json``'s
``meta.placement`` and in ``placement.json``), one per rank of the pipeline (``rank`` = the process-group
rank, stage order, replicas of a stage next to each other)::

    {"rank": 2, "stage": 2, "replica": 0, "vendor": "nvidia", "device": "t4-1", "node": "node1",
     "local_index": 1, "type": "T4", "memory_bytes": 16106127360, "node_rank": 1, "local_rank": 0}

torchrun starts ``--nproc-per-node`` processes per node (``--node-rank`` under its static rendezvous,
the default); the process with ``GROUP_RANK`` n and ``LOCAL_RANK`` l is the rank whose ``node_rank`` is n
and ``local_rank`` l, whatever RANK torchrun numbered it, and it runs on GPU ``local_index`` of that
node: so a stage lands on its planned device even when a node's stages are not consecutive.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetcc.solver.schedules import INTERLEAVED, ZBV, rank_stages

GIB = 1024**3


@dataclass(frozen=True)
class RankPlacement:
    """One rank: the stage and replica it runs (and its part of the replica, where the stage is tensor
    parallel) and the device the plan put it on. A pipeline split by hand (``save_stages`` without a
    plan) knows only the stage, the replica, the part and the vendor."""

    rank: int
    stage: int
    replica: int = 0
    vendor: str = "cpu"
    device: str | None = None  # the cluster's device name
    node: str | None = None  # the host
    local_index: int | None = None  # device ordinal on that host
    type: str | None = None  # the device type; None: the rank's device is not checked at start
    memory_bytes: int = 0  # of that device (0: unknown)
    node_rank: int | None = None  # torchrun's GROUP_RANK of the node
    local_rank: int | None = None  # torchrun's LOCAL_RANK on that node
    tensor: int = 0  # its part of a tensor-parallel replica: 0..t-1 (``hetcc.passes.tensor_parallel``)
    # under interleaved 1F1B: every stage it runs, by chunk (``stage`` first; ``schedules.interleaved_actions``)
    chunks: tuple[int, ...] = ()

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages this rank runs, by chunk: ``chunks``, or ``stage`` alone."""
        return self.chunks or (self.stage,)


def placement(
    stage_devices: Sequence[Sequence[Any]], tensor: Sequence[int] | None = None
) -> tuple[RankPlacement, ...]:
    """Ranks for stages whose replicas run on ``stage_devices[k]`` (``hetcc.hardware`` Device records,
    in the cluster's order), with each rank's node rank and local rank for torchrun. ``tensor[k]``: stage
    k's tensor degree t (None: 1 everywhere); its devices are then its replicas' t devices in turn."""
    degrees = tensor or [1] * len(stage_devices)
    ranks = [
        (stage, position // degrees[stage], device, position % degrees[stage])
        for stage, devices in enumerate(stage_devices)
        for position, device in enumerate(devices)
    ]
    by_order = sorted(range(len(ranks)), key=lambda rank: ranks[rank][2].index)
    nodes = list(dict.fromkeys(ranks[rank][2].node for rank in by_order))
    position = {}  # rank -> (node rank, local rank)
    for node_rank, node in enumerate(nodes):
        on_node = [rank for rank in by_order if ranks[rank][2].node == node]
        position.update({rank: (node_rank, local_rank) for local_rank, rank in enumerate(on_node)})
    return tuple(
        _rank(rank, stage, replica, device, *position[rank], part)
        for rank, (stage, replica, device, part) in enumerate(ranks)
    )


def ranks_for(
    replicas: Sequence[int], vendor: str = "cpu", tensor: Sequence[int] | None = None
) -> tuple[RankPlacement, ...]:
    """A placement without devices (a pipeline split by hand): ``replicas[k]`` replicas of stage k, each
    ``tensor[k]`` ranks (None: 1), in stage order, on ``vendor``."""
    degrees = tensor or [1] * len(replicas)
    stages = [
        (stage, replica, part)
        for stage, count in enumerate(replicas)
        for replica in range(count)
        for part in range(degrees[stage])
    ]
    return tuple(
        RankPlacement(rank, stage, replica, vendor, tensor=part)
        for rank, (stage, replica, part) in enumerate(stages)
    )


def interleaved_ranks(
    ranks: int, chunks: int, vendor: str = "cpu", replicas: int = 1
) -> tuple[RankPlacement, ...]:
    """A placement without devices for interleaved 1F1B: ``ranks`` pipeline positions, position r running
    the ``chunks`` stages r, r + ranks, ... (``schedules.interleaved_actions``), each on ``replicas``
    ranks (the pipeline replicated whole: rank r * replicas + i is replica i of position r), on
    ``vendor``."""
    return tuple(
        RankPlacement(
            r * replicas + i, r, i, vendor=vendor, chunks=rank_stages(INTERLEAVED, ranks, r, chunks)
        )
        for r in range(ranks)
        for i in range(replicas)
    )


def zbv_ranks(ranks: int, vendor: str = "cpu") -> tuple[RankPlacement, ...]:
    """A placement without devices for ZB-V: ``ranks`` ranks, rank r running stages r and 2 * ranks - 1 - r
    (``schedules.zbv_actions``), on ``vendor``."""
    return tuple(
        RankPlacement(r, r, vendor=vendor, chunks=rank_stages(ZBV, ranks, r, 2)) for r in range(ranks)
    )


def _rank(
    rank: int, stage: int, replica: int, device: Any, node_rank: int, local_rank: int, part: int
) -> RankPlacement:
    return RankPlacement(
        rank, stage, replica, vendor=device.vendor, device=device.name, node=device.node,
        local_index=device.local_index, type=device.type.name, memory_bytes=int(device.memory_bytes),
        node_rank=node_rank, local_rank=local_rank, tensor=part,
    )  # fmt: skip


def rank_at(ranks: Sequence[RankPlacement], node_rank: int, local_rank: int) -> RankPlacement:
    """The placement of the process torchrun started as (GROUP_RANK, LOCAL_RANK)."""
    for entry in ranks:
        if entry.node_rank == node_rank and entry.local_rank == local_rank:
            return entry
    raise LookupError(f"the placement has no rank at node rank {node_rank}, local rank {local_rank}")


def torchrun_commands(
    ranks: Sequence[RankPlacement], directory: str, endpoint: str, extra: Sequence[str] = ()
) -> list[tuple[str, str]]:
    """One ``(node, command)`` per node: torchrun with the static rendezvous at ``endpoint`` (``HOST:PORT``,
    reachable from every node), the node's rank and its process count, preceded by a comment line
    saying which stage each of its processes runs on which GPU."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous endpoint {endpoint!r} is not HOST:PORT")
    nodes = sorted({(e.node_rank, e.node) for e in ranks})
    commands = []
    for node_rank, node in nodes:
        entries = sorted((e for e in ranks if e.node_rank == node_rank), key=lambda e: e.local_rank)
        words = [
            "torchrun", f"--nnodes={len(nodes)}", f"--node-rank={node_rank}",
            f"--nproc-per-node={len(entries)}", f"--master-addr={host}", f"--master-port={port}",
            "-m", "hetcc.launch", directory, *extra,
        ]  # fmt: skip
        layout = ", ".join(
            f"rank {e.rank} = {_stages(e)}{_replica(e, ranks)} on {e.device} ({e.type}{_gpu_index(e)})"
            for e in entries
        )
        commands.append((node, f"# node {node_rank} ({node}): {layout}\n{shlex.join(words)}"))
    return commands


def _gpu_index(entry: RankPlacement) -> str:
    return "" if entry.vendor == "cpu" else f", GPU {entry.local_index}"


def _stages(entry: RankPlacement) -> str:
    return f"stage {entry.stage}" if not entry.chunks else f"stages {', '.join(map(str, entry.chunks))}"


def _replica(entry: RankPlacement, ranks: Sequence[RankPlacement]) -> str:
    replicas = sum(1 for e in ranks if e.stage == entry.stage)
    return f" replica {entry.replica}/{replicas}" if replicas > 1 else ""


def device_mismatch(entry: RankPlacement, found: Mapping[str, Any]) -> str | None:
    """Why the device a rank found (``{"vendor", "name", "memory_bytes"}``) is not the one the plan has
    for it, or None. The type matches when its family is in the driver's name ("A100" in "NVIDIA
    A100-SXM4-80GB", "RTX4090" in "NVIDIA GeForce RTX 4090") and the memory is within 15%."""
    planned, got = float(entry.memory_bytes), float(found.get("memory_bytes") or 0)
    where = f"rank {entry.rank} (stage {entry.stage}) was planned on {entry.device}, a {entry.type}"
    if found["vendor"] != entry.vendor:
        return f"{where} ({entry.vendor}), but found {found['name']} ({found['vendor']})"
    if entry.vendor == "cpu":
        return None
    family_ok = _family(entry.type or "") in _key(found["name"])
    memory_ok = not planned or abs(got - planned) <= 0.15 * max(planned, got)
    if family_ok and memory_ok:
        return None
    return f"{where} with {planned / GIB:.0f} GiB, but found {found['name']} with {got / GIB:.0f} GiB"


def _key(name: str) -> str:
    return "".join(ch for ch in name.upper() if ch.isalnum())


def _family(type_name: str) -> str:
    """A100-80GB -> A100, H100-SXM -> H100, MI250X-GCD -> MI250X, RTX-4090 -> RTX4090."""
    parts = type_name.upper().split("-")
    return _key("".join(parts[:2]) if parts[0] == "RTX" else parts[0])
