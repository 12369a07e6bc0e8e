"""Event-driven replay of one training (or inference) step of a plan, to check the planner's model.

Each stage runs its schedule's actions (``hetcc.solver.schedules.stage_actions``) in order, one at a time:
F(m) starts once stage s-1's activation for m has arrived, B(m) once stage s+1's gradient has. After
a compute, its output is sent asynchronously (the stage does not wait for the send): a link between
two consecutive stages carries one transfer at a time, both directions sharing it, which is what the
planner's C_j = 2 * (latency + bytes / bandwidth) per microbatch assumes. Transfers on a link go in
the order they were issued.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hetcc.errors import PlanFormatError
from hetcc.solver.objective import evaluate
from hetcc.solver.problem import PartitionProblem
from hetcc.solver.schedules import stage_actions


@dataclass(frozen=True)
class Event:
    """One interval on the timeline; a send belongs to the stage that issues it."""

    stage: int
    kind: str  # "F", "B", "SEND_F" or "SEND_B"
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    """The simulated step: its length, per-stage compute busy time and idle (bubble) fractions."""

    step_time_s: float
    busy_s: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    overall_bubble_fraction: float
    events: tuple[Event, ...]


def simulate(problem: PartitionProblem, boundaries: Sequence[int], devices: Sequence[int]) -> Simulation:
    """Replay one step of the plan (stage k = blocks [boundaries[k], boundaries[k+1]) on devices[k])."""
    plan = evaluate(problem, boundaries, devices)  # validates the plan, gives per-stage costs
    num_stages = len(plan.stages)
    actions = stage_actions(problem.schedule, num_stages, problem.microbatches, training=problem.training)
    transfer_s = [s.comm_s / (2 if problem.training else 1) for s in plan.stages[:-1]]  # one direction of C_j
    timeline = _Timeline(num_stages, transfer_s)
    cursor = [0] * num_stages
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for s in range(num_stages):
            while cursor[s] < len(actions[s]):
                action = actions[s][cursor[s]]
                duration = plan.stages[s].fwd_s if action.kind == "F" else plan.stages[s].bwd_s
                if not timeline.run(s, action.kind, action.microbatch, duration):
                    break
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PlanFormatError("simulated schedule deadlocked", hint="report the plan and schedule")
    return timeline.result(plan.stages)


class _Timeline:
    """Clock of every stage and link, and when each activation / gradient becomes available."""

    def __init__(self, num_stages: int, transfer_s: list[float]):
        self.num_stages = num_stages
        self.transfer_s = transfer_s
        self.stage_free_s = [0.0] * num_stages
        self.link_free_s = [0.0] * max(num_stages - 1, 0)
        self.arrival_s: dict[tuple[int, str, int], float] = {}  # (receiving stage, kind, mb) -> time
        self.events: list[Event] = []

    def run(self, stage: int, kind: str, microbatch: int, duration_s: float) -> bool:
        """Schedule one compute and its outgoing send; False if its input has not been produced yet."""
        needs_input = (kind == "F" and stage > 0) or (kind == "B" and stage < self.num_stages - 1)
        ready_s = self.arrival_s.get((stage, kind, microbatch)) if needs_input else 0.0
        if ready_s is None:
            return False
        start = max(self.stage_free_s[stage], ready_s)
        end = start + duration_s
        self.stage_free_s[stage] = end
        self.events.append(Event(stage, kind, microbatch, start, end))
        target = stage + 1 if kind == "F" else stage - 1
        if 0 <= target < self.num_stages:
            self._send(stage, target, kind, microbatch, end)
        return True

    def _send(self, source: int, target: int, kind: str, microbatch: int, ready_s: float) -> None:
        link = min(source, target)
        start = max(self.link_free_s[link], ready_s)
        end = start + self.transfer_s[link]
        self.link_free_s[link] = end
        self.arrival_s[(target, kind, microbatch)] = end
        self.events.append(Event(source, f"SEND_{kind}", microbatch, start, end))

    def result(self, stages) -> Simulation:
        step = max((e.end_s for e in self.events), default=0.0)
        busy = tuple(
            math.fsum(e.end_s - e.start_s for e in self.events if e.stage == s and e.kind in "FB")
            for s in range(self.num_stages)
        )
        bubble = tuple(1 - b / step if step > 0 else 0.0 for b in busy)
        overall = 1 - sum(busy) / (step * self.num_stages) if step > 0 else 0.0
        events = tuple(sorted(self.events, key=lambda e: (e.start_s, e.stage, e.kind)))
        return Simulation(step, busy, bubble, overall, events)
