"""Event-driven replay of one training (or inference) step of a plan: the judge of a plan's step time.

Each replica of each stage runs its share of the schedule's actions (``schedules.stage_actions`` with
the plan's replica counts, filtered by ``replica_actions``) in order, one at a time: F(m) starts once
the previous stage's replica that ran m has sent its activation, B(m) once the next stage's has sent
its gradient. After a compute, its output is sent asynchronously (the stage does not wait for the
send): a link between two devices carries one transfer at a time in each direction (links are full
duplex, and a cluster's bandwidths are per direction), in the order its sender issued them; the
planner's C_j (activations forward plus gradients back, per microbatch) charges both directions to
one link, which the search's formula keeps as the conservative estimate. A send's seconds include the
encode and decode of the codecs the sending stage's cut uses (``StageCost.codecs``, priced by
``codecs.message_s``): they hold the link, not the stage. A recomputing stage's
backward includes the forward it recomputes. Under a split schedule (zb-h1, zb-h2) a stage's B(m) is its
backward less the weight gradients (``problem.wgrad_s``) and sends the gradients back; W(m) is those
weight gradients, which wait for nothing but the stage and send nothing; each stage defers as many as
its ``StageCost.deferred`` says (what its memory holds), after the forwards its ``StageCost.warmup``
runs before its first backward. A replicated stage ends
with the all-reduce of its gradients, once all its replicas are done (``ALLREDUCE``), and where it
shards its optimizer state (ZeRO-1) with the all-gather of its updated parameters right after
(``ALLGATHER``); then a parameter tied across stages (``tied_blocks``) is summed over every device
holding it (two exchange their parts, the later stage's sent as soon as it is done: ``tied_sums``);
the step ends when the last device does.

An interleaved 1F1B plan (``chunks`` > 1: each of p devices holds v stages, ``schedules.interleaved_actions``)
replays the same way with one lane per device, running its chunks' actions in the schedule's order; a
replicated one (the pipeline replicated whole) with one lane per replica of each, running the order over
its own microbatches (``replica_interleaved_actions``), each stage's gradients summed at the end. A ZB-V
plan (``problem.schedule`` ``ZBV``, two stages per device in a V, ``zbv_actions``) likewise, every stage
but the first and the recomputing ones running B and W apart.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hetcc.errors import PlanFormatError
from hetcc.solver.codecs import Message, message_s, stage_messages
from hetcc.solver.links import exchanges, tied_sum_s
from hetcc.solver.objective import Codecs, Device, StageCost, replica_seconds, stage_costs, weight_grad_s
from hetcc.solver.problem import PartitionProblem
from hetcc.solver.schedules import (
    Action,
    rank_order,
    rank_stages,
    replica_actions,
    splits_backward,
    stage_actions,
)


@dataclass(frozen=True)
class Event:
    """One interval on the timeline; a send belongs to the replica that issues it."""

    stage: int
    kind: str  # "F", "B", "W", "SEND_F", "SEND_B", "ALLREDUCE" or "ALLGATHER"
    microbatch: int  # -1 for the all-reduce and the all-gather
    start_s: float
    end_s: float
    replica: int = 0
    device: str = ""


@dataclass(frozen=True)
class Simulation:
    """The simulated step: its length, per stage its compute busy time and the share of the step its
    devices idle (bubble; both the mean over a stage's replicas). A device running several stages
    (interleaved 1F1B, ZB-V) idles while none of them computes: its stages share its bubble."""

    step_time_s: float
    busy_s: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    overall_bubble_fraction: float
    events: tuple[Event, ...]


def simulate(
    problem: PartitionProblem,
    boundaries: Sequence[int],
    devices: Sequence[Device],
    recompute: Sequence[bool] | None = None,
    *,
    events: bool = True,
    stages: Sequence[StageCost] | None = None,
    codecs: Codecs = None,
    shard: Sequence[bool] | None = None,
    warmup: Sequence[int] | None = None,
    chunks: int = 1,
) -> Simulation:
    """Replay one step of the plan (stage k = blocks [boundaries[k], boundaries[k+1]) on the replica
    group devices[k], recomputing if recompute[k]). ``events=False`` keeps no timeline (the search's
    many replays need only the figures); ``stages``: the plan's ``stage_costs``, where the caller has
    them (else ``codecs`` pins stages' codecs, ``shard`` their sharding and ``warmup`` their forwards
    before the first backward, as in ``objective.stage_costs``). ``chunks`` > 1: an interleaved 1F1B
    plan (``schedules.interleaved_actions``), each of its K / chunks devices one lane running its chunks'
    stages in that order."""
    if stages is None:
        stages = stage_costs(problem, boundaries, devices, recompute, codecs, shard, warmup, chunks)
    k = len(stages)
    groups = [s.group for s in stages]
    split = splits_backward(problem.schedule, [s.recompute for s in stages])

    def seconds(j: int, device: int) -> tuple[float, float, float]:  # stage j's F, B and W there
        fwd, bwd = replica_seconds(problem, *stages[j].blocks, device, stages[j].recompute)
        wgrad = weight_grad_s(problem, *stages[j].blocks, device) if split[j] else 0.0
        return fwd, bwd - wgrad, wgrad

    if chunks > 1:
        ranks, schedule = k // chunks, problem.schedule  # ZB-V's V, else interleaved 1F1B's layout
        lanes = []
        for r in range(ranks):
            mine, route = rank_stages(schedule, ranks, r, chunks), tuple(stages[r].route)
            for replica, device in enumerate(groups[r]):
                order = rank_order(schedule, ranks, chunks, route, replica, problem.training)[r]
                lanes.append(_Lane(mine, replica, device, order, {j: seconds(j, device) for j in mine}))
    else:
        actions = _lane_actions(
            problem.schedule, problem.microbatches, problem.training, tuple(len(g) for g in groups),
            tuple(s.recompute for s in stages), tuple(s.deferred for s in stages), tuple(s.route for s in stages),
            tuple(s.warmup for s in stages) if problem.training else None,
        )  # fmt: skip
        lanes = [
            _Lane((j,), r, d, actions[j][r], {j: seconds(j, d)})
            for j in range(k)
            for r, d in enumerate(groups[j])
        ]
    routes = [s.route for s in stages]
    timeline = _Timeline(problem, stages, routes, events)
    for lane in lanes:
        lane.steps = timeline.steps(lane)
    remaining, received = sum(len(lane.steps) for lane in lanes), timeline.received
    while remaining:
        progressed = 0
        for lane in lanes:
            if received.get(lane.waits[0], 0) < lane.waits[1]:  # still short of a message: skip the call
                continue
            progressed += timeline.run(lane)
        if not progressed:
            raise PlanFormatError("simulated schedule deadlocked", hint="report the plan and schedule")
        remaining -= progressed
    timeline.finish(lanes)
    timeline.all_reduce(lanes)
    timeline.tied_sums(lanes)
    return timeline.result(lanes, k)


def step_floor(problem: PartitionProblem, stages: Sequence[StageCost]) -> float:
    """A lower bound of ``simulate``'s step for a plan of one stage per device (``stages``: its
    ``stage_costs``), from the costs alone. A replica computes its share of the microbatches, none
    before the first forward has crossed every stage before it; on one device, its ``warmup`` forwards
    come before its first backward, which also waits for that microbatch's forward and backward
    through every later stage. After its last compute a stage's devices sum its replicas' gradients,
    then the weights it ties to other stages (``_Timeline.tied_sums``); after its last backward (the
    input gradient, where split: W may follow) the gradient still crosses the stages before it back,
    and the first stage's devices then sum theirs. Transfers only add, and are left out. The search's
    refinement skips simulating a move whose floor cannot beat its plan."""
    split = splits_backward(problem.schedule, [s.recompute for s in stages])
    seconds = []  # per stage, per replica: F, B (the input gradient, where split) and W of one microbatch
    for j, stage in enumerate(stages):
        seconds.append([])
        for d in stage.group:
            f, b = replica_seconds(problem, *stage.blocks, d, stage.recompute)
            w = weight_grad_s(problem, *stage.blocks, d) if split[j] else 0.0
            seconds[j].append((f, b - w, w))
    trips = [0.0] * len(stages)  # from a stage's forward of a microbatch to its backward of it
    for j in range(len(stages) - 2, -1, -1):
        trips[j] = trips[j + 1] + min(f + b for f, b, _ in seconds[j + 1])
    # what each stage's devices do after their last compute: its replicas' all-reduce (and all-gather),
    # then the sums of weights tied to other stages; the first stage's ends every drain
    ends = [s.allreduce_s + s.allgather_s + t for s, t in zip(stages, _tied_s(problem, stages))]
    floor, fill, drain, m = 0.0, 0.0, 0.0, problem.microbatches
    for j, stage in enumerate(stages):
        if len(stage.group) == 1 and problem.training:
            (f, b, w), ahead = seconds[j][0], min(max(stage.warmup, 1), m)
            first_b = fill + max(f + trips[j], ahead * f)  # its first backward's start
            last_b = first_b + (m - ahead) * f + m * b
            work, to_last_b = last_b + m * w - fill, last_b - fill
        else:
            work = max(count * sum(t) for count, t in zip(stage.shares, seconds[j]))
            to_last_b = max(count * (f + b) for count, (f, b, _) in zip(stage.shares, seconds[j]))
        floor = max(floor, fill + work + ends[j], fill + to_last_b + drain + ends[0])
        fill += min(f for f, _, _ in seconds[j])
        drain += min(b for _, b, _ in seconds[j])
    return floor


def _tied_s(problem: PartitionProblem, stages: Sequence[StageCost]) -> list[float]:
    """Per stage, the seconds its devices spend summing weights tied across stages after their last
    compute (``_Timeline.tied_sums``; an exchange's first message may run before)."""
    tied = [0.0] * len(stages)
    for k, holders in _tied_holders(problem, stages):
        order = sorted(holders)  # the owner, holding the first user, first
        devices = list(dict.fromkeys(d for j in order for d in stages[j].group))
        owned = range(*stages[order[0]].blocks)
        replicated = any(len(stages[j].group) > 1 for j in holders)
        seconds = tied_sum_s(problem, k, devices, owned, replicated)[1]
        for j in holders:
            tied[j] += seconds
    return tied


def _tied_holders(problem: PartitionProblem, stages: Sequence[StageCost]) -> list[tuple[int, set[int]]]:
    """Per weight tied across stages (training only): its index and the stages holding one of its users;
    where only one stage holds it, or it has no bytes, there is nothing to sum."""
    summed = []
    for k, (users, nbytes) in enumerate(zip(problem.tied_blocks or [], problem.tied_bytes or [])):
        holders = {j for j, s in enumerate(stages) if any(s.blocks[0] <= b < s.blocks[1] for b in users)}
        if problem.training and len(holders) >= 2 and nbytes > 0:
            summed.append((k, holders))
    return summed


@functools.lru_cache(maxsize=1024)
def _lane_actions(
    schedule: str, microbatches: int, training: bool, replicas: tuple[int, ...], recompute: tuple[bool, ...],
    deferred: tuple[int, ...], routes: tuple[tuple[int, ...], ...], warmup: tuple[int, ...] | None,
) -> tuple[tuple[tuple[Action, ...], ...], ...]:  # fmt: skip
    """Per stage, per replica (``routes``: each stage's microbatch -> replica), its actions in order
    (``stage_actions``; cached: the search replays many plans of the same shape)."""
    every = stage_actions(
        schedule, len(routes), microbatches, training=training, replicas=list(replicas), recompute=list(recompute),
        deferred=list(deferred), warmup=None if warmup is None else list(warmup),
    )  # fmt: skip
    return tuple(
        tuple(tuple(replica_actions(every[j], route, r)) for r in range(replicas[j]))
        for j, route in enumerate(routes)
    )


@dataclass
class _Lane:
    stages: tuple[int, ...]  # the stages it runs, by chunk: one, or each of an interleaved rank's
    replica: int
    device: int
    actions: list
    seconds: dict[int, tuple[float, float, float]]  # per stage: its F, B and W there (B: the rest of it)
    cursor: int = 0
    free_s: float = 0.0
    busy_s: float = 0.0
    steps: list = field(default_factory=list)  # per action: what ``_Timeline.run`` needs, worked out once
    waits: tuple = (None, 0)  # (what its next action waits for, how many messages): ``run`` stopped there


class _Timeline:
    """Clock of every link, and when each activation / gradient becomes available."""

    def __init__(self, problem: PartitionProblem, stages, routes, record: bool = True):
        self.problem, self.stages, self.routes, self.record = problem, stages, routes, record
        self.last_s = 0.0  # the latest end of anything on the timeline
        self.link_free_s: dict[tuple[int, int], float] = {}
        self.arrival_s: dict[tuple[int, str, int], float] = {}  # (receiving stage, kind, mb) -> time
        self.received: dict[tuple[int, str, int], int] = {}  # messages arrived so far
        self.events: list[Event] = []
        messages = stage_messages(problem, [s.blocks for s in stages], [s.codecs for s in stages])
        # Per (stage, kind): the messages its compute sends (peer stage, message), and how many it waits for.
        self.outgoing: dict[tuple[int, str], list[tuple[int, Message]]] = {}
        self.expected: dict[tuple[int, str], int] = {}
        for (a, b), (forward, back) in messages.items():
            self.outgoing.setdefault((a, "F"), []).append((b, forward))
            self.outgoing.setdefault((b, "B"), []).append((a, back))
            self.expected[(b, "F")] = self.expected.get((b, "F"), 0) + 1
            self.expected[(a, "B")] = self.expected.get((a, "B"), 0) + 1

    def steps(self, lane: _Lane) -> list[tuple]:
        """The lane's actions as ``run`` takes them: per action (what it waits for, how many messages, its
        seconds, its sends, kind, microbatch). Its sends are shared by every action of its stage and kind:
        per message, the target stage, per replica of that stage the wire to it (link, seconds), and
        the replica each microbatch goes to."""
        device, routes = lane.device, self.routes
        plans = {
            (chunk, kind): (j, self.expected.get((j, kind), 0), t, [
                (target, [self._wire(device, peer, message) for peer in self.stages[target].group], routes[target])
                for target, message in self.outgoing.get((j, kind), ())
            ])
            for chunk, j in enumerate(lane.stages)
            for kind, t in zip("FBW", lane.seconds[j])
        }  # fmt: skip
        steps = []
        for action in lane.actions:
            kind, m = action.kind, action.microbatch
            j, expected, seconds, sends = plans[action.chunk, kind]
            steps.append(((j, kind, m), expected, seconds, sends, kind, m))
        return steps

    def _wire(self, device: int, peer: int, message: Message) -> tuple[tuple[int, int], float]:
        """(the link from ``device`` to ``peer``, one per direction: only ``device`` sends on it, so its
        transfers are booked in the order they are issued; the seconds of ``message`` on it)."""
        return (device, peer), message_s(self.problem, device, peer, message)

    def run(self, lane: _Lane) -> int:
        """Run the lane's next actions whose inputs have arrived, each with its outgoing sends (the
        stage does not wait for them; a link carries one at a time, in the order issued); how many.
        (The hot loop of every simulation: conditionals rather than ``max``, and the step's end is taken
        once every lane is done, ``finish``.)"""
        received, arrival, link_free, record = self.received, self.arrival_s, self.link_free_s, self.record
        steps, start_cursor = lane.steps, lane.cursor
        cursor, free, busy, count = start_cursor, lane.free_s, lane.busy_s, len(steps)
        while cursor < count:
            key, expected, duration, sends, kind, m = steps[cursor]
            if expected and received.get(key, 0) < expected:
                lane.waits = (key, expected)
                break
            ready = arrival.get(key, 0.0)
            start = free if free >= ready else ready
            end = start + duration
            free = end
            busy += end - start
            if record:
                self._note(lane, key[0], kind, m, start, end)
            for stage, wires, route in sends:
                link, seconds = wires[route[m]]
                target = (stage, kind, m)
                sent = link_free.get(link, 0.0)
                if sent < end:
                    sent = end
                done = sent + seconds
                link_free[link] = done
                if arrival.get(target, 0.0) < done:
                    arrival[target] = done
                received[target] = received.get(target, 0) + 1
                if record:
                    self._note(lane, key[0], f"SEND_{kind}", m, sent, done)
            cursor += 1
        if cursor == count:  # done: nothing it could wait for arrives
            lane.waits = (None, math.inf)
        lane.cursor, lane.free_s, lane.busy_s = cursor, free, busy
        return cursor - start_cursor

    def finish(self, lanes: list[_Lane]) -> None:
        """Once every lane has run its actions: the latest end of any compute or transfer so far (each
        lane's and each link's clock only ever moves on)."""
        self.last_s = max(self.last_s, *(lane.free_s for lane in lanes), *self.link_free_s.values())

    def _note(self, lane: _Lane, stage: int, kind: str, m: int, start: float, end: float) -> None:
        self.last_s = max(self.last_s, end)
        if self.record:
            name = self.problem.devices[lane.device].name
            self.events.append(Event(stage, kind, m, start, end, lane.replica, name))

    def all_reduce(self, lanes: list[_Lane]) -> None:
        """Each replicated stage sums its gradients once every replica is done; a sharding stage then
        gathers its updated parameters."""
        for j, stage in enumerate(self.stages):
            if stage.allreduce_s <= 0 and stage.allgather_s <= 0:
                continue
            mine = [lane for lane in lanes if j in lane.stages]
            start = max(lane.free_s for lane in mine)
            for kind, seconds in (("ALLREDUCE", stage.allreduce_s), ("ALLGATHER", stage.allgather_s)):
                if seconds <= 0:
                    continue
                for lane in mine:
                    lane.free_s = start + seconds
                    self._note(lane, j, kind, -1, start, lane.free_s)
                start += seconds

    def tied_sums(self, lanes: list[_Lane]) -> None:
        """Then every tied parameter held by several stages is summed over all their devices, as the
        runtime does after the replica sums: two devices exchange their parts (``links.exchanges``; the
        other's whole part leaves once it is done, over its link to the owner, which adds it after its
        own last compute and sends its part back), more sum by a ring over their slowest link."""
        for k, holders in _tied_holders(self.problem, self.stages):
            first = min(holders)
            holding = (lane for lane in lanes if holders.intersection(lane.stages))
            mine = sorted(holding, key=lambda lane: first not in lane.stages)  # the owner first
            owned = [b for j in holders.intersection(mine[0].stages) for b in range(*self.stages[j].blocks)]
            replicated = any(len(self.stages[j].group) > 1 for j in holders)
            devices = [lane.device for lane in mine]
            before, after = tied_sum_s(self.problem, k, devices, owned, replicated)
            start = max(lane.free_s for lane in mine)
            if exchanges(self.problem, devices, replicated):
                owner, other = mine
                link = (other.device, owner.device)
                there = max(other.free_s, self.link_free_s.get(link, 0.0)) + before
                self.link_free_s[link] = there
                start = max(owner.free_s, there)
            for lane in mine:
                lane.free_s = start + after
                self._note(lane, min(holders.intersection(lane.stages)), "ALLREDUCE", -1, start, lane.free_s)

    def result(self, lanes: list[_Lane], num_stages: int) -> Simulation:
        step = self.last_s
        busy_s: list[list[float]] = [[] for _ in range(num_stages)]  # per stage: its lanes' compute
        device_busy_s: list[list[float]] = [[] for _ in range(num_stages)]  # per stage: its lanes' in all
        for lane in lanes:
            if len(lane.stages) == 1:
                busy_s[lane.stages[0]].append(lane.busy_s)
            else:  # an interleaved lane's, by its steps
                for (stage, _, _), _, seconds, *_ in lane.steps:
                    busy_s[stage].append(seconds)
            for stage in lane.stages:
                device_busy_s[stage].append(lane.busy_s)
        busy = tuple(math.fsum(b) / len(self.stages[j].group) for j, b in enumerate(busy_s))
        bubble = tuple(1 - math.fsum(b) / len(b) / step if step > 0 and b else 0.0 for b in device_busy_s)
        overall = 1 - sum(lane.busy_s for lane in lanes) / (step * len(lanes)) if step > 0 else 0.0
        events = tuple(sorted(self.events, key=lambda e: (e.start_s, e.stage, e.replica, e.kind)))
        return Simulation(step, busy, bubble, overall, events)
