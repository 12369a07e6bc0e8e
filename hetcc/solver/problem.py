"""The partition problem: blocks -> stages -> replica groups of devices, from numbers alone (no torch).

A chain of N blocks is cut into K contiguous stages; each stage runs on a group of one or more devices
(replicas holding the same blocks; each microbatch passes one replica per stage). ``PartitionProblem``
holds every number the solver needs (per-block seconds per device type, state, parameter and activation
bytes, per device type where they differ, cut bytes, device memory, link bandwidth and latency) and the
plan space to search (replicas, recomputation, ZeRO-1 sharding of replicas' optimizer state, a codec per
cut: ``WireCodec``, tensor-parallel groups of identical devices: ``TensorSplit``, planned by
``solver.tensor``); it round-trips through JSON exactly, so an outside planner can be fed the same numbers.
``StageCost`` and ``PartitionSolution`` are what a plan costs; the model behind those costs is
``solver.objective``.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from hetcc.errors import PlanFormatError
from hetcc.solver.problem_checks import validate_problem
from hetcc.solver.schedules import downstream_replicas, recorded_warmup

# Relative slack on memory capacity, so that a plan filling a device exactly is not lost to rounding.
MEMORY_RTOL = 1e-9


def within_memory(used_bytes, capacity_bytes):
    """Whether ``used_bytes`` fit in ``capacity_bytes`` (up to ``MEMORY_RTOL``)."""
    return used_bytes <= capacity_bytes * (1 + MEMORY_RTOL)


# A device type f"{type}/tp{t}" is a tensor group of t devices (``solver.tensor``).
TENSOR_GROUP_MARK = "/tp"


def composite_type(kind: str, degree: int) -> str:
    """The device type of a tensor-parallel group of ``degree`` devices of type ``kind``."""
    return f"{kind}{TENSOR_GROUP_MARK}{degree}"


@dataclass(frozen=True)
class ProblemDevice:
    """One device as the solver sees it: usable ``memory_bytes`` after runtime reserves."""

    name: str
    type: str
    memory_bytes: float
    node: str

    @property
    def tensor_degree(self) -> int:
        """The devices it stands for: t for a tensor group (``composite_type``), else 1."""
        _, mark, degree = self.type.rpartition(TENSOR_GROUP_MARK)
        return int(degree) if mark and degree.isdigit() else 1


@dataclass(frozen=True)
class WireCodec:
    """One codec the plan may put on a cut's wire, for one direction; its costs over the whole cut.

    A row per codec, direction and place (a codec may have several rows, one per set of links and cuts
    it may use; a row named "none" may list the uncoded wire explicitly). Seconds of
    a message with it are ``codecs.message_s``; where a plan may use it, ``links`` and ``cuts``.
    """

    name: str  # "bf16", "int8", ... (rows of one name and direction cost the same)
    gradient: bool  # False: activations forward; True: their gradients back
    cut_bytes: list[float]  # per cut: bytes on the wire with this codec (what it cannot code at full size)
    coded_bytes: list[float]  # per cut: raw bytes of the tensors it encodes
    calls: list[int]  # per cut: how many tensors it encodes
    encode_s_per_byte: dict[str, float]  # per device type: encode seconds per raw byte
    decode_s_per_byte: dict[str, float]  # per device type: decode seconds per raw byte
    call_s: dict[str, float]  # per device type: fixed seconds per encode or per decode call
    tensor_bytes: list[float] | None = None  # per ``cut_tensors`` entry: its wire bytes with this codec
    tensor_coded: list[bool] | None = None  # per ``cut_tensors`` entry: whether this codec encodes it
    links: str = "all"  # where the plan may use it: "all", "intra-node" or "inter-node"
    cuts: list[bool] | None = None  # per cut: whether the plan may use it there (None: every cut)


@dataclass(frozen=True)
class TensorSplit:
    """What each of ``degree`` devices does per block when a stage runs it tensor-parallel (Megatron-style:
    identical devices of one node, each ~1/degree of the work plus the collectives between them). One row
    per degree; ``solver.tensor`` makes each such group one device of type ``f"{type}/tp{degree}"``.
    """

    degree: int
    fwd_s: dict[str, list[float]]  # per device type, per block: seconds on each device, collectives included
    bwd_s: dict[str, list[float]]
    wgrad_s: dict[str, list[float]] | None  # the weight-gradient part of bwd_s (needed if the problem's is)
    state_bytes: list[float]  # per block: bytes on each device
    act_bytes: list[float]
    param_bytes: list[float]
    optimizer_bytes: list[float] | None  # None: no optimizer state to shard


@dataclass
class PartitionProblem:
    """Everything the solver needs, in seconds and bytes (per microbatch where it says so)."""

    blocks: list[str]
    fwd_s: dict[str, list[float]]
    bwd_s: dict[str, list[float]]
    state_bytes: list[float]
    act_bytes: list[float]
    cut_bytes: list[float]
    devices: list[ProblemDevice]
    bandwidth_bps: list[list[float]]
    latency_s: list[list[float]]
    microbatches: int
    schedule: str = "1f1b"
    training: bool = True
    # The plan space: stages on groups of identical devices, and per-stage activation recomputation.
    replicate: bool = False
    recompute: bool = False
    recompute_all: bool = False  # every stage recomputes (the user asked for it)
    max_stages: int = 0  # plans of at most this many stages (0: as many as blocks and devices allow)
    # Bytes of each block's parameters (its gradient in a replica all-reduce); None: ``state_bytes``.
    param_bytes: list[float] | None = None
    # Gradient bytes sent back over each cut in training (tensors that depend on no trainable parameter,
    # like masks, send none); None: ``cut_bytes``.
    cut_grad_bytes: list[float] | None = None
    # Parameters held by several blocks (tied embeddings): the blocks using each, and its bytes. Every
    # stage holding one sums its gradient with the others at step end (when more than one stage does).
    tied_blocks: list[list[int]] | None = None
    tied_bytes: list[float] | None = None
    # Per tied weight, per user block (as ``tied_blocks``): the most bytes of the weight's gradient one
    # microbatch of that block makes nonzero, 8 bytes of row index included per row (an embedding lookup
    # touches only the rows it reads); the weight's bytes where the block uses it whole. None: every
    # use whole. Two holders exchange their parts, the owner's as its nonzero rows (``links.tied_sum_s``).
    tied_grad_bytes: list[list[float]] | None = None
    # Every tensor crossing a cut, once: [producer block, consumer blocks, bytes, gradient bytes]. The
    # runtime sends each from its producer's stage straight to each stage holding a consumer; the
    # simulator replays exactly that (the search's chain formula charges ``cut_bytes`` on each link it
    # passes). None: the chain model alone.
    cut_tensors: list[list] | None = None
    # Per device type, the seconds of each block's backward that compute weight gradients (a zero-bubble
    # schedule defers them: ``schedules.SPLIT_SCHEDULES``); None: none of it (the backward runs whole).
    wgrad_s: dict[str, list[float]] | None = None
    # The codecs each stage's outgoing cut may use, per direction (``codecs``); None: every tensor uncoded.
    codecs: list[WireCodec] | None = None
    # ZeRO-1 (``solver.sharding``): the bytes of each block's ``state_bytes`` that are optimizer state
    # (None: none), and whether replicated stages may (``shard``) or must (``shard_all``) split it.
    optimizer_bytes: list[float] | None = None
    shard: bool = False
    shard_all: bool = False
    # Per device type, the per-block "state_bytes", "act_bytes", "param_bytes" or "optimizer_bytes" a
    # device of that type holds instead of the arrays above (a tensor-parallel group holds ~1/t of the
    # weights); read them with ``state_for``, ``act_for``, ``params_for`` and ``optimizer_for``. None: none.
    type_bytes: dict[str, dict[str, list[float]]] | None = None
    # Tensor parallelism: one row per degree a stage may run at (``solver.tensor``); None: none. The
    # plain solver ignores it: ``tensor.solve_tensor`` plans with it.
    tensor_splits: list[TensorSplit] | None = None
    # Self-description for outside planners (the costs above already include them).
    precision: str = "fp32"
    optimizer: str = ""
    batch_size: int = 0  # rows of one step's batch (microbatch size = batch_size / microbatches)
    batch_dim: str = "dim 0 of every input"

    def validate(self) -> None:
        """Raise PlanFormatError naming the first inconsistent field."""
        validate_problem(self)

    def stage_limit(self) -> int:
        """The most stages a plan may have: one block and one device each at least, and ``max_stages``."""
        return min(len(self.blocks), len(self.devices), self.max_stages or len(self.blocks))

    def block_cost_s(self, device_type: str) -> list[float]:
        """Seconds per microbatch of each block on ``device_type`` (forward, plus backward if training)."""
        if not self.training:
            return list(self.fwd_s[device_type])
        return [f + b for f, b in zip(self.fwd_s[device_type], self.bwd_s[device_type])]

    def cut_grad_at(self, cut: int) -> float:
        """Gradient bytes sent back over the cut after block ``cut`` (0 outside training)."""
        if not self.training:
            return 0.0
        return (self.cut_bytes if self.cut_grad_bytes is None else self.cut_grad_bytes)[cut]

    def state_for(self, device_type: str) -> list[float]:
        """Per block, the state bytes (parameters, gradients, optimizer state) a ``device_type`` holds."""
        return self._bytes_for(device_type, "state_bytes")

    def act_for(self, device_type: str) -> list[float]:
        """Per block, the activation bytes per microbatch a ``device_type`` device saves for backward."""
        return self._bytes_for(device_type, "act_bytes")

    def params_for(self, device_type: str) -> list[float]:
        """Per block, the parameter bytes (its gradient in a replica all-reduce) on ``device_type``; where
        neither ``type_bytes`` nor ``param_bytes`` gives them, its ``state_for``."""
        params = self._bytes_for(device_type, "param_bytes")
        return self.state_for(device_type) if params is None else params

    def optimizer_for(self, device_type: str) -> list[float]:
        """Per block, the part of ``state_for(device_type)`` that is optimizer state (zeros: none given)."""
        optimizer = self._bytes_for(device_type, "optimizer_bytes")
        return [0.0] * len(self.blocks) if optimizer is None else optimizer

    def _bytes_for(self, device_type: str, name: str) -> list[float] | None:
        """``type_bytes[device_type][name]`` where given, else the problem's array ``name``."""
        own = (self.type_bytes or {}).get(device_type, {})
        return own[name] if name in own else getattr(self, name)

    def to_json(self) -> str:
        data = asdict(self)
        data["bandwidth_bps"] = [[_encode(v) for v in row] for row in self.bandwidth_bps]
        data["latency_s"] = [[_encode(v) for v in row] for row in self.latency_s]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> PartitionProblem:
        """Inverse of ``to_json`` (``"inf"`` strings become float infinity), validated."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError(f"expected a JSON object, got {type(data).__name__}")
            data["devices"] = [ProblemDevice(**dev) for dev in data["devices"]]
            if data.get("codecs") is not None:
                data["codecs"] = [WireCodec(**row) for row in data["codecs"]]
            if data.get("tensor_splits") is not None:
                data["tensor_splits"] = [TensorSplit(**row) for row in data["tensor_splits"]]
            for key in ("bandwidth_bps", "latency_s"):
                data[key] = [[math.inf if v == "inf" else v for v in row] for row in data[key]]
            problem = cls(**data)
            problem.validate()
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            if isinstance(exc, PlanFormatError):
                raise
            raise PlanFormatError(
                f"not a partition problem: {exc}", hint="write it with PartitionProblem.to_json"
            ) from exc
        return problem


def _encode(value: float) -> float | str:
    return "inf" if value == math.inf else value


@dataclass(frozen=True)
class StageCost:
    """One stage of a plan: its blocks ``[start, stop)``, its replica group and its costs.

    Times are per microbatch on one replica (the slowest of the group where types differ):
    ``compute_s`` is forward + backward (+ the recomputed forward). ``busy_s`` is the stage's share of
    the period, ``max_d shares[d] * compute_s(d) / M``; ``comm_s`` is the cut's transfer per
    microbatch, ``link_busy_s`` the busiest link's share of the period; ``allreduce_s`` sums the
    replicas' gradients at step end; with ``shard`` (ZeRO-1, ``solver.sharding``) each replica holds
    ``sharded_bytes`` less optimizer state and ``allgather_s`` gathers the updated parameters after it.
    Memory figures (``state_bytes``, ``act_bytes``, ``sharded_bytes``: per device type) are the fullest
    replica's (``inflight`` microbatches).
    ``codecs`` names the rows of ``problem.codecs`` the outgoing cut's messages use ("none": uncoded).
    """

    blocks: tuple[int, int]
    device: int  # the first replica
    device_name: str
    fwd_s: float
    bwd_s: float
    compute_s: float
    comm_s: float
    state_bytes: float
    act_bytes: float
    inflight: int
    memory_bytes: float
    memory_capacity_bytes: float
    devices: tuple[int, ...] = ()
    device_names: tuple[str, ...] = ()
    shares: tuple[int, ...] = ()  # microbatches each replica runs
    route: tuple[int, ...] = ()  # the replica of each microbatch (``route_microbatches``)
    recompute: bool = False
    busy_s: float = math.nan
    link_busy_s: float = math.nan
    allreduce_s: float = 0.0
    codecs: tuple[str, str] = ("none", "none")  # (activation, gradient) codec of the outgoing cut
    shard: bool = False  # its replicas shard their optimizer state (ZeRO-1)
    allgather_s: float = 0.0  # the sharded step's parameter all-gather, after the all-reduce
    sharded_bytes: float = 0.0  # optimizer state a replica does not hold: memory = state - this + acts
    deferred: int = 0  # weight gradients it defers under a split schedule (``schedules.stage_actions``)
    warmup: int = 0  # forwards before its first backward (``schedules.stage_actions``; 0 for inference)

    @property
    def fits(self) -> bool:
        return within_memory(self.memory_bytes, self.memory_capacity_bytes)

    @property
    def group(self) -> tuple[int, ...]:
        return self.devices or (self.device,)


@dataclass(frozen=True)
class PartitionSolution:
    """A plan with its objective step time, its simulated step, a lower bound no simulated step beats,
    and the gap (simulated / bound - 1 once simulated; objective / bound - 1 from ``evaluate`` alone).

    ``period_s`` is P, the steady-state seconds per microbatch of the model (``step_time``): at least
    ``bottleneck_s``, more when a 1F1B round trip limits the pipeline.
    """

    stages: tuple[StageCost, ...]
    step_time_s: float
    period_s: float
    lower_bound_s: float
    gap: float
    exact: bool = True
    orders_searched: int = 1
    simulated_s: float = math.nan  # the event-driven simulator's step for this plan (the judge)
    chunks: int = 1  # stages per device; > 1: interleaved 1F1B, stage j on the device of j mod K / chunks

    @property
    def boundaries(self) -> list[int]:
        return [s.blocks[0] for s in self.stages] + [self.stages[-1].blocks[1]]

    @property
    def devices(self) -> list[int]:
        """The first device of every stage (its only one unless the stage is replicated)."""
        return [s.device for s in self.stages]

    @property
    def groups(self) -> list[tuple[int, ...]]:
        """Every stage's replica group (device indices)."""
        return [s.group for s in self.stages]

    @property
    def recompute(self) -> list[bool]:
        return [s.recompute for s in self.stages]

    @property
    def shard(self) -> list[bool]:
        return [s.shard for s in self.stages]

    @property
    def warmup(self) -> list[int] | None:
        """Every stage's forwards before its first backward (None for inference: there are none)."""
        return recorded_warmup(self.stages)

    @property
    def bottleneck_s(self) -> float:
        return max(max(_or(s.busy_s, s.compute_s), _or(s.link_busy_s, s.comm_s)) for s in self.stages)

    def to_dict(self) -> dict:
        """Plain JSON-able data (infinite step times stay floats; json writes them as Infinity)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PartitionSolution:
        tuples = ("blocks", "devices", "device_names", "shares", "route", "codecs")
        stages = tuple(
            StageCost(**{**s, **{k: tuple(s[k]) for k in tuples if k in s}}) for s in data["stages"]
        )
        known = {f.name for f in fields(cls)} - {"stages"}
        return cls(stages=stages, **{k: data[k] for k in known if k in data})


def _or(value: float, default: float) -> float:
    return default if math.isnan(value) else value


def inflight_microbatches(
    problem: PartitionProblem, stage: int, num_stages: int, replicas: Sequence[int] | None = None
) -> int:
    """Microbatches whose saved activations stage ``stage`` (all its replicas together) holds at its peak:
    W_j = min(M, ``schedules.downstream_replicas``) for 1F1B, and for a zero-bubble schedule at 1F1B's
    warm-up deferring no weight gradient (each deferred one or extra forward holds one more;
    ``objective.stage_costs`` takes as many as fit, so the search checks memory at this least), M for
    GPipe, 1 for inference."""
    if not problem.training:
        return 1
    if problem.schedule == "gpipe":
        return problem.microbatches
    return min(problem.microbatches, downstream_replicas(stage, num_stages, replicas))


def replica_inflight(stage_inflight: int, replicas: int) -> int:
    """What one of ``replicas`` round-robin replicas holds of a stage's ``stage_inflight`` microbatches.

    The microbatches a 1F1B or GPipe stage holds at once are consecutive, so a replica taking every
    r-th one holds at most ceil(W / r) of them.
    """
    return -(-stage_inflight // replicas)


def round_trip_slots(
    problem: PartitionProblem, stage: int, num_stages: int, replicas: Sequence[int] | None = None
) -> int | None:
    """W_j when stage ``stage`` must finish a backward before it may start another forward, else None.

    That is a training 1F1B (or zero-bubble) stage whose warm-up W_j is below M. GPipe stages, stages whose
    warm-up already covers all M microbatches, and inference never wait on a backward.
    """
    inflight = min(
        problem.microbatches, downstream_replicas(stage, num_stages, replicas)
    )  # forwards before a B
    if problem.training and problem.schedule != "gpipe" and inflight < problem.microbatches:
        return inflight
    return None


@functools.lru_cache(maxsize=4096)
def route_microbatches(microbatches: int, seconds: tuple[float, ...]) -> tuple[int, ...]:
    """The replica each microbatch runs on, for replicas taking ``seconds[d]`` per microbatch.

    Each microbatch goes to the replica that would finish its share soonest, ``(count_d + 1) * t_d``
    (ties to the lower index): this minimises the slowest replica's total ``count_d * t_d`` and, for
    equal replicas, is round-robin. (Cached: the search and the simulator cost many plans whose groups
    repeat.)
    """
    if len(seconds) == 1:
        return (0,) * microbatches
    counts = [0] * len(seconds)
    route = []
    for _ in range(microbatches):
        d = min(range(len(seconds)), key=lambda i: ((counts[i] + 1) * seconds[i], i))
        counts[d] += 1
        route.append(d)
    return tuple(route)


def steady_share(count: int, microbatches: int) -> float:
    """The part of the (M - 1) steady-state periods that ``count`` back-to-back microbatches on one
    replica (or one link) fill: (count - 1) / (M - 1). The first of them is in the fill S already,
    so a replica taking every r-th microbatch adds (ceil(M / r) - 1) * T_j, not (M - 1) * T_j / r."""
    return (count - 1) / (microbatches - 1) if microbatches > 1 else 1.0
