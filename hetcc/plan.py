"""``hetcc.Plan``: the stages hetcc chose (each on a replica group of devices, recomputing or not), what
each costs, and how that compares with the baselines. Its step time is the simulated one."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from hetcc.errors import PlanFormatError, format_bytes
from hetcc.hardware.schema import finite, read_text
from hetcc.solver.schedules import (
    MULTI_STAGE,
    PIPELINE_SCHEDULES,
    SPLIT_SCHEDULES,
    ZBV,
    recorded_warmup,
    splits_backward,
    stage_warmups,
    zb_deferrals,
)

PLAN_FORMAT_VERSION = 1
PLAN_FILE = "plan.json"
# The next step for any saved file this hetcc cannot read (a plan, a pipeline of another version).
RECOMPILE = (
    "compile the model again with this hetcc (`hetcc compile ... --out DIR`, or hetcc.compile(...).save(DIR))"
)
MAX_PLAN_BYTES = 64 * 2**20  # plan.json / problem.json: a 70B model's are a few MB
# The precisions a plan runs in -> the half format autocast computes matmuls in (None: fp32 throughout),
# which is also the key of their FLOP/s peak. The one list: the compiler, the runtime, the CLI and the
# run's figures read it.
PRECISIONS: dict[str, str | None] = {"fp32": None, "bf16-mixed": "bf16", "fp16-mixed": "fp16"}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes one stage holds on its device."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float  # saved activations of the in-flight microbatches

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes


@dataclass(frozen=True)
class PlanStage:
    index: int
    device: str
    device_type: str
    blocks: tuple[str, ...]
    nodes: tuple[str, ...]
    fwd_flops: float  # per microbatch
    bwd_flops: float
    fwd_s: float  # per microbatch on its device
    bwd_s: float
    compute_s: float
    comm_s: float  # activations to the next stage and gradients back, per microbatch
    inflight: int  # microbatches whose activations are held at the peak
    memory: MemoryBreakdown  # of the fullest replica
    device_memory_bytes: float  # usable memory of that replica's device
    bubble: float = 0.0  # share of the step this stage's devices idle (from the simulator)
    # the replica group, each replica's ``tensor`` devices in turn; ``device`` is its first
    devices: tuple[str, ...] = ()
    shares: tuple[int, ...] = ()  # microbatches each replica runs
    recompute: bool = False  # activations recomputed in backward (keeps only the stage's inputs)
    precision: str = "fp32"
    allreduce_s: float = 0.0  # replicas' gradient sum at step end
    allgather_s: float = 0.0  # then, under ZeRO-1, the updated weights gathered from their owners
    shard: bool = False  # its replicas shard the optimizer state (ZeRO-1)
    codecs: tuple[str, str] = ("none", "none")  # of its outgoing cut: activations, gradients (hetcc.wire)
    # Per microbatch, what it sends (to every later stage) and the gradients it gets back: bytes whole,
    # then on the wire with its codecs: (activations, gradients, activations on the wire, gradients on it).
    wire_bytes: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    tensor: int = 1  # tensor degree: each replica is this many devices, each with its part of the weights
    deferred: int = 0  # weight gradients it defers under a split schedule (each holds its microbatch)
    warmup: int = 0  # forwards before its first backward (``schedules.stage_actions``); 0: the schedule's

    def __post_init__(self):
        if not self.devices:
            object.__setattr__(self, "devices", (self.device,))

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total_bytes


@dataclass(frozen=True)
class Plan:
    stages: tuple[PlanStage, ...]
    step_time_s: float  # the simulated step (hetcc.solver.simulate): the judge
    lower_bound_s: float  # no plan's simulated step is below it (hetcc.solver.bound.lower_bound)
    gap: float  # step_time / lower_bound - 1
    baselines: dict[str, float]  # name -> simulated step in s (inf when it does not fit in memory)
    microbatches: int
    schedule: str
    training: bool
    simulated_step_s: float = math.nan  # the same as step_time_s (kept for readers of older plans)
    exact: bool = True  # whether the device-order search was exhaustive
    notes: tuple[str, ...] = field(default=())
    objective_s: float = math.nan  # the search's fast formula (hetcc.solver.objective) for this plan
    precision: str = "fp32"
    microbatch_rows: int = 0  # rows of one microbatch (0: unknown)
    microbatch_search: tuple[tuple[int, float], ...] = ()  # (M, best simulated step) per M tried

    @property
    def stage_of(self) -> dict[str, int]:
        """Node name -> the stage that runs it."""
        return {name: s.index for s in self.stages for name in s.nodes}

    @property
    def ranks(self) -> int:
        """The ranks the plan runs on unless stages are replicated or tensor parallel: one per stage, or
        under interleaved 1F1B one per pipeline position (a device, or a group of replicas), each running
        its stages j, j + ranks, ..."""
        return len({s.device for s in self.stages}) if self.schedule in MULTI_STAGE else len(self.stages)

    @property
    def chunks(self) -> int:
        """Stages per rank: 1, or under interleaved 1F1B v (``schedules.interleaved_actions``)."""
        return len(self.stages) // self.ranks

    def speedup(self, baseline: str) -> float:
        return self.baselines[baseline] / self.step_time_s

    def to_json(self) -> str:
        return json.dumps({"format": PLAN_FORMAT_VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError(f"expected a JSON object, got {type(data).__name__}")
            version = data.pop("format")
            if version != PLAN_FORMAT_VERSION:
                raise ValueError(f"format {version}, this hetcc reads {PLAN_FORMAT_VERSION}")
            unknown = set(data) - {f.name for f in fields(cls)}
            if unknown:
                raise ValueError(f"unknown plan fields {sorted(unknown)}")
            lists = {key: data.pop(key, []) for key in ("stages", "notes", "microbatch_search")}
            for key, value in lists.items():
                if not isinstance(value, list):
                    raise TypeError(f"{key} must be a list, got {type(value).__name__}")
            stages = tuple(_stage_from_dict(s) for s in lists["stages"])
            if data.get("schedule") in SPLIT_SCHEDULES and not any("deferred" in s for s in lists["stages"]):
                stages = _zb_h1_deferred(stages, data.get("training", True))  # written before plans said it
            search = tuple((m, t) for m, t in lists["microbatch_search"])
            plan = cls(stages=stages, **data, notes=tuple(lists["notes"]), microbatch_search=search)
            _check_plan(plan)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise PlanFormatError(f"not a hetcc plan: {exc}", hint="write plans with Plan.to_json()") from exc
        return plan

    def explain(self) -> str:
        return explain(self)


def read_plan(folder: str | Path) -> Plan:
    """``folder/plan.json`` as ``Plan``: the one reader of a saved plan (``hetcc explain``, the report, a
    run's figures, re-pricing). Errors name the file and the field."""
    path = Path(folder) / PLAN_FILE
    text = read_saved(path, "plan file")
    try:
        return Plan.from_json(text)
    except PlanFormatError as error:
        message = str(error).partition("\n")[0]
        raise PlanFormatError(
            f"{path}: {message}",
            hint=RECOMPILE,
        ) from None


def read_saved(path: Path, what: str) -> str:
    """The text of a file ``hetcc compile`` wrote: it must exist, be UTF-8 and at most MAX_PLAN_BYTES."""
    if not path.exists():
        raise PlanFormatError(f"{path} does not exist", hint="run `hetcc compile ... --out DIR` first")
    return read_text(path, what, error=PlanFormatError, max_bytes=MAX_PLAN_BYTES)


def _stage_from_dict(data: dict) -> PlanStage:
    if not isinstance(data, dict):
        raise TypeError(f"a stage must be a JSON object, got {type(data).__name__}")
    known = {f.name for f in fields(PlanStage)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown stage fields {sorted(unknown)}")
    lists = [k for k in ("blocks", "nodes", "devices", "shares", "codecs", "wire_bytes") if k in data]
    for key in lists:
        if not isinstance(data[key], list):
            raise TypeError(
                f"stage {data.get('index')}'s {key} must be a list, got {type(data[key]).__name__}"
            )
    if not isinstance(data.get("memory"), dict):
        raise TypeError(f"stage {data.get('index')}'s memory must be a JSON object of byte counts")
    tuples = {k: tuple(data[k]) for k in lists}
    return PlanStage(**{**data, **tuples, "memory": MemoryBreakdown(**data["memory"])})


def _zb_h1_deferred(stages: tuple[PlanStage, ...], training: object) -> tuple[PlanStage, ...]:
    """``stages`` each deferring ZB-H1's weight gradients (what every zb-h1 plan ran before plans recorded
    a stage's deferral: ``schedules.zb_deferrals``; none where the backward runs whole)."""
    replicas = [len(s.devices) // s.tensor if _count(s.tensor, 1) else 1 for s in stages]
    split = (
        splits_backward("zb-h1", [bool(s.recompute) for s in stages]) if training else [False] * len(stages)
    )
    most = zb_deferrals(replicas)
    return tuple(replace(s, deferred=most[k] if split[k] else 0) for k, s in enumerate(stages))


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _figure(value: object, infinite: bool = False) -> bool:
    """A time, count or size: a number >= 0, finite unless ``infinite`` (a baseline that does not fit)."""
    return (finite(value) or (infinite and value == math.inf)) and value >= 0


def _count(value: object, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _fail(field_name: str, why: str) -> PlanFormatError:
    return PlanFormatError(f"plan field {field_name!r}: {why}", hint="write plans with Plan.to_json()")


def _check_plan(plan: Plan) -> None:
    """Values a plan file may hold, so a bad one fails here and not in arithmetic or a printed table later:
    every time, FLOP count and byte count is a finite number >= 0 (a baseline may be inf: does not fit)."""
    if not _count(plan.microbatches, 1):
        raise _fail("microbatches", f"must be a positive integer, got {plan.microbatches!r}")
    if plan.schedule not in PIPELINE_SCHEDULES:
        raise _fail(
            "schedule", f"unknown schedule {plan.schedule!r}; use one of {', '.join(PIPELINE_SCHEDULES)}"
        )
    if plan.schedule in MULTI_STAGE and len(plan.stages) % plan.ranks:
        raise _fail(
            "stages",
            f"{len(plan.stages)} interleaved stages on {plan.ranks} devices, not the same count each",
        )
    if plan.precision not in PRECISIONS:
        raise _fail("precision", f"unknown precision {plan.precision!r}; use one of {', '.join(PRECISIONS)}")
    for name in ("step_time_s", "lower_bound_s"):
        if not (_figure(getattr(plan, name)) and getattr(plan, name) > 0):
            raise _fail(name, f"must be a positive number of seconds, got {getattr(plan, name)!r}")
    for name in ("simulated_step_s", "objective_s"):  # NaN: not recorded
        value = getattr(plan, name)
        if not (_figure(value) or (_number(value) and math.isnan(value))):
            raise _fail(name, f"must be a number of seconds >= 0 (or NaN), got {value!r}")
    if not finite(plan.gap):
        raise _fail("gap", f"must be a finite number, got {plan.gap!r}")
    if not _count(plan.microbatch_rows):
        raise _fail("microbatch_rows", f"must be a row count >= 0, got {plan.microbatch_rows!r}")
    if not all(_count(m, 1) and _figure(t, infinite=True) for m, t in plan.microbatch_search):
        raise _fail("microbatch_search", "must list [microbatches >= 1, seconds >= 0] pairs")
    if not all(isinstance(note, str) for note in plan.notes):
        raise _fail("notes", "must be a list of text lines")
    if not all(isinstance(getattr(plan, name), bool) for name in ("training", "exact")):
        raise _fail(
            "training", f"training and exact must be true or false, got {plan.training!r}, {plan.exact!r}"
        )
    if not isinstance(plan.baselines, dict) or not all(_figure(v, True) for v in plan.baselines.values()):
        raise _fail("baselines", "must map a baseline name to seconds >= 0 (inf: does not fit)")
    if not plan.stages or [s.index for s in plan.stages] != list(range(len(plan.stages))):
        raise _fail("stages", "must be a non-empty list indexed 0, 1, ... in order")
    for stage in plan.stages:
        _check_stage(stage, plan.microbatches)
    warmup = recorded_warmup(plan.stages)
    if plan.training and warmup is not None:  # the ranks run these: a bad one must not reach them
        replicas = [len(s.devices) // s.tensor for s in plan.stages]
        try:
            stage_warmups(plan.schedule, replicas, plan.microbatches, warmup)
        except PlanFormatError as error:
            raise _fail("stages[*].warmup", error.args[0]) from None


def _check_stage(stage: PlanStage, microbatches: int) -> None:
    at = f"stages[{stage.index}]"
    if not stage.devices or not all(isinstance(d, str) for d in (stage.device, *stage.devices)):
        raise _fail("stages", f"stage {stage.index} names no devices")
    if not all(isinstance(b, str) for b in (*stage.blocks, *stage.nodes)) or not stage.blocks:
        raise _fail("stages", f"stage {stage.index}: blocks and nodes must be lists of names")
    if (
        not isinstance(stage.recompute, bool)
        or not isinstance(stage.shard, bool)
        or not isinstance(stage.device_type, str)
    ):
        raise _fail(at, "recompute must be true or false, device_type a name")
    if stage.precision not in PRECISIONS:
        raise _fail(f"{at}.precision", f"unknown precision {stage.precision!r}")
    numbers = {f.name: getattr(stage, f.name) for f in fields(PlanStage) if f.type in ("float", "int")}
    numbers |= {f"memory.{f.name}": getattr(stage.memory, f.name) for f in fields(MemoryBreakdown)}
    for name, value in numbers.items():
        if not _figure(value):
            raise _fail(f"{at}.{name}", f"must be a finite number >= 0, got {value!r}")
    if len(stage.codecs) != 2 or not all(isinstance(name, str) and name for name in stage.codecs):
        # names only: the runtime reads each edge's codecs from pipeline.json, which checks them
        raise _fail(f"{at}.codecs", f"must be two codec names (activations, gradients), got {stage.codecs!r}")
    if len(stage.wire_bytes) != 4 or not all(_figure(b) for b in stage.wire_bytes):
        raise _fail(f"{at}.wire_bytes", f"must be four byte counts >= 0, got {stage.wire_bytes!r}")
    if stage.bubble > 1:
        raise _fail(f"{at}.bubble", f"a share of the step, got {stage.bubble!r}")
    if not all(_count(n) for n in stage.shares):
        raise _fail("stages", f"stage {stage.index}: shares must be microbatch counts")
    if not _count(stage.tensor, 1) or len(stage.devices) % stage.tensor:
        raise _fail(
            f"{at}.tensor",
            f"must be a degree >= 1 dividing its {len(stage.devices)} devices, got {stage.tensor!r}",
        )
    replicas = len(stage.devices) // stage.tensor
    if stage.shares and (len(stage.shares) != replicas or sum(stage.shares) != microbatches):
        raise _fail(
            "stages", f"stage {stage.index}: shares {list(stage.shares)} do not cover the microbatches"
        )


def _block_range(blocks: tuple[str, ...]) -> str:
    return blocks[0] if len(blocks) == 1 else f"{blocks[0]} .. {blocks[-1]} ({len(blocks)})"


def _group(stage: PlanStage) -> str:
    """The stage's device, or its first device and how many more ("a100-0 +3 more", not a device name)."""
    if len(stage.devices) == 1:
        return stage.device
    return f"{stage.devices[0]} +{len(stage.devices) - 1} more"


def _memory(used: float, avail: float) -> str:
    if not avail:
        return "-"
    if used < 2**30:
        return f"{format_bytes(used)}/{format_bytes(avail)} ({used / avail:.0%})"
    return f"{used / 2**30:.2f}/{avail / 2**30:.1f} GiB ({used / avail:.0%})"


def explain(plan: Plan) -> str:
    """A table a person reads in ten seconds, and the one line that matters."""
    total_flops = sum(s.fwd_flops + s.bwd_flops for s in plan.stages) or 1.0
    rows = f", {plan.microbatch_rows} rows each" if plan.microbatch_rows else ""
    header = (
        f"{'stage':<5} {'devices (replicas)':<22} {'type':<11} {'blocks':<42} {'FLOPs':>5} "
        f"{'memory used/avail':>24} {'compute ms/mb':>13} {'comm ms/mb':>10} {'recompute':>9} {'bubble':>6}"
    )
    coded = any(s.codecs != ("none", "none") for s in plan.stages)
    sharded = any(s.shard for s in plan.stages)
    split = any(s.tensor > 1 for s in plan.stages)
    deferring = plan.schedule in SPLIT_SCHEDULES and plan.training
    warming = plan.training and plan.schedule != "gpipe" and any(s.warmup for s in plan.stages)
    if split:
        header += f" {'tp':>3}"
    if warming:
        header += f" {'warm-up':>7}"
    if deferring:
        header += f" {'W deferred':>10}"
    if sharded:
        header += f" {'zero-1':>6}"
    if coded:
        header += f" {'codecs':>13} {'MiB/mb out, before -> on the wire':>34}"
    devices = sum(len(s.devices) for s in plan.stages[: plan.ranks if plan.chunks > 1 else len(plan.stages)])
    chunks = f" ({plan.chunks} stages each)" if plan.chunks > 1 else ""
    lines = [
        f"hetcc plan: {len(plan.stages)} stages on {devices} devices{chunks}, "
        f"{plan.precision}, {plan.schedule}, {plan.microbatches} microbatches{rows}",
        header,
    ]
    for s in plan.stages:
        lines.append(
            f"{s.index:<5} {_group(s):<22} {s.device_type:<11} {_block_range(s.blocks):<42} "
            f"{(s.fwd_flops + s.bwd_flops) / total_flops:>5.0%} "
            f"{_memory(s.peak_memory_bytes, s.device_memory_bytes):>24} "
            f"{s.compute_s * 1e3:>13.2f} {s.comm_s * 1e3:>10.2f} {'yes' if s.recompute else 'no':>9} {s.bubble:>6.0%}"
            + (f" {s.tensor:>3}" if split else "")
            + (f" {s.warmup:>7}" if warming else "")
            + (f" {s.deferred:>10}" if deferring else "")
            + (f" {'yes' if s.shard else 'no':>6}" if sharded else "")
            + (f" {'/'.join(s.codecs):>13} {_wire(s):>34}" if coded else "")
        )
    lines.append("ms/mb: per microbatch on one replica; memory: the fullest replica's device")
    if plan.chunks > 1:
        turn = f"{2 * plan.ranks - 1} - j" if plan.schedule == ZBV else f"j + {plan.ranks}, ..."
        lines.append(
            f"{plan.schedule}: device of stage j runs stages j, {turn}; memory: all its stages hold; bubble: "
            "its idle share of the step"
            + ("; each replica runs its own microbatches" if len(plan.stages[0].devices) > 1 else "")
        )
    if split:
        lines.append(
            "tp: tensor degree: each replica is tp devices of one node, each with 1/tp of the weights"
        )
    if warming:
        lines.append("warm-up: forwards the stage runs before its first backward (each holds its microbatch)")
    if deferring:
        lines.append(
            "W deferred: weight gradients the stage runs later (each holds its microbatch's activations; "
            "fewer where memory is short)"
        )
    if sharded:
        lines.append(
            "zero-1: the stage's replicas each hold 1/r of its optimizer state (memory: the fullest's share)"
        )
    if coded:
        lines.append("codecs: activations/gradients on the stage's outgoing cut; MiB/mb: forward + back")
    lines.append(_headline(plan))
    lines.append(
        "baselines (one stage per listed device, simulated): "
        + ", ".join(f"{name} {_ms(t)}" for name, t in plan.baselines.items())
    )
    if not math.isnan(plan.objective_s):
        lines.append(f"objective (the search's formula) {plan.objective_s * 1e3:.2f} ms")
    if plan.microbatch_search:
        tried = ", ".join(f"M={m}: {_ms(t)}" for m, t in plan.microbatch_search)
        lines.append(f"microbatch counts tried: {tried}")
    lines.extend(plan.notes)
    return "\n".join(lines)


def _wire(stage: PlanStage) -> str:
    act, grad, act_wire, grad_wire = (b / 2**20 for b in stage.wire_bytes)
    return f"{act:.2f}+{grad:.2f} -> {act_wire:.2f}+{grad_wire:.2f}" if act or grad else "-"


def _ms(seconds: float) -> str:
    return "does not fit" if math.isinf(seconds) else f"{seconds * 1e3:.2f} ms"


def _headline(plan: Plan) -> str:
    uniform = plan.baselines.get("uniform", math.nan)
    if math.isinf(uniform):
        versus = "uniform does not fit in memory"
    else:
        versus = f"{uniform / plan.step_time_s:.2f}x faster than uniform"
    return (
        f"simulated step {plan.step_time_s * 1e3:.2f} ms, {versus}, "
        f"{plan.gap:.1%} above the lower bound ({plan.lower_bound_s * 1e3:.2f} ms)"
    )
