"""The exact partition of a block chain over one fixed sequence of devices.

The objective is ``T = S + (M - 1) * P`` with ``S = sum_j (T_j + C_j)`` and the period
``P = max(max_j max(T_j, C_j), max_{j throttled} R_j / q_j)``, where ``R_j`` is the suffix sum
``sum_{i >= j} (T_i + C_i)`` (see ``objective.step_time``). For a bound ``b`` let ``S(b)`` be the least
sum over plans with every stage term ``<= b`` and every throttled ``R_j <= b * q_j``; then
``min T = min_b S(b) + (M - 1) * b`` (``b`` = the optimum's own P gives ``S(b) <= S*``, and every other
``b`` gives a real plan no worse than its bound).

``S(b)`` is a shortest path over cut positions, run from the last stage back: ``g_j(a)`` is the least
suffix sum ``R_j`` of stages j..K-1 starting at block ``a`` that meets every limit inside the suffix.
Stage j covering ``[a, i)`` costs ``P_t[i] - P_t[a] + C_j[i]`` for an end ``i`` in a window
``(a, hi(a)]`` whose upper end rises with ``a`` (the compute and memory limits are monotone in the
stage's length), so each stage is a sliding-window minimum, answered for every bound with a sparse
table in O(N log N). The round-trip limit ``R_j <= b * q_j`` caps the very value being minimised:
if the least suffix from ``a`` breaks it, every suffix from ``a`` does, so setting ``g_j(a) = inf``
there keeps the recursion exact.

Stage terms take finitely many values ``v``; ``S(v)`` falls in steps as ``v`` grows and is searched
coarse to fine, skipping every interval whose best possible value ``S(right end) + (M - 1) * b(left
end)`` cannot beat the best plan so far (of this order or an earlier one). A round trip can make
the optimum's P fall strictly between two values ``v_a < v_{a+1}``; there ``S(b)`` depends on the
round-trip limit alone, and ``_descend`` walks it down: solve with limit ``rho``, take that plan's
own P, retry with ``rho`` just below it, until no plan left in the interval can win.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hetcc.solver.bound_rows import BoundRows
from hetcc.solver.codecs import chosen_cut_s
from hetcc.solver.links import end_tied_s
from hetcc.solver.objective import step_terms
from hetcc.solver.problem import (
    PartitionProblem,
    inflight_microbatches,
    replica_inflight,
    round_trip_slots,
    steady_share,
    within_memory,
)
from hetcc.solver.sharding import shard_choices, step_end_rates, unheld_fraction

PROBES_PER_ROUND = 32
_BOUND_RTOL = 1e-12  # slack on b so a term equal to a candidate value is never lost to rounding


@dataclass(frozen=True)
class Mode:
    """One way to run a stage of a slot: with or without recomputation, replicas sharding their
    optimizer state (ZeRO-1, ``solver.sharding``) or not.

    ``term_prefix`` prefix-sums T (per-microbatch seconds on one replica); ``sum_prefix`` adds the
    stage's all-reduce (and all-gather) seconds per parameter byte, so ``sum_prefix[i] - sum_prefix[a]
    + constant_s`` is the stage's contribution T_j + A_j to S.
    """

    recompute: bool
    term_prefix: np.ndarray  # (N+1,)
    sum_prefix: np.ndarray  # (N+1,)
    constant_s: float
    hi_memory: np.ndarray  # (N+1,) last end i whose [a, i) fits the device (a itself if none)
    shard: bool = False


@dataclass(frozen=True)
class SequenceSlot:
    """Position j of a sequence (pipeline stage j): r identical replicas, their modes, link cost per end
    block, the period shares of the stage and its outgoing link, and the round-trip slots."""

    modes: tuple[Mode, ...]
    share: float  # B_j = share * T_j: steady_share(ceil(M / r), M)
    comm_s: np.ndarray  # (N+1,) C_j for a stage ending at block i (inf where it cannot end)
    link_share: float  # L_j = link_share * C_j
    slots: float  # W_j when the round trip limits this stage (R_j <= P * W_j), else inf


class SequenceOptimum(NamedTuple):
    """The best plan of one sequence: its step time, the limits that reproduce it, its P."""

    step_s: float
    term_bound_s: float
    trip_bound_s: float
    period_s: float


class Chain:
    """Per-problem arrays shared by every sequence of replica groups (prefix sums, cached windows)."""

    def __init__(self, problem: PartitionProblem):
        self.problem = problem
        self.n = len(problem.blocks)
        self.microbatches = problem.microbatches
        self.types = sorted({d.type for d in problem.devices})
        self.type_row = {t: k for k, t in enumerate(self.types)}
        costs = np.array([problem.block_cost_s(t) for t in self.types], dtype=float)
        self.cost_s = costs
        self.prefix_s = np.concatenate([np.zeros((len(self.types), 1)), np.cumsum(costs, axis=1)], axis=1)
        fwd = np.array([problem.fwd_s[t] for t in self.types], dtype=float)
        self.recompute_prefix_s = self.prefix_s + np.concatenate(
            [np.zeros((len(self.types), 1)), np.cumsum(fwd, axis=1)], axis=1
        )
        # Row arrays made once: the caches below key on their identity.
        self._term_rows = {
            (row, recompute): (self.recompute_prefix_s if recompute else self.prefix_s)[row].copy()
            for row in range(len(self.types))
            for recompute in (False, True)
        }
        # Per device type: prefix sums of the state, activation, parameter and optimizer bytes it holds.
        self.state_prefix, self.act_prefix, self.param_prefix, self.optimizer_prefix = (
            {t: np.concatenate([[0.0], np.cumsum(read(t))]) for t in self.types}
            for read in (problem.state_for, problem.act_for, problem.params_for, problem.optimizer_for)
        )
        self.cut_at = np.concatenate([[0.0], np.asarray(problem.cut_bytes, dtype=float), [0.0]])
        grads = [problem.cut_grad_at(i) for i in range(self.n - 1)]
        self.grad_at = np.concatenate([[0.0], np.asarray(grads, dtype=float), [0.0]])
        # Messages per cut: the activations forward, and their gradients back where there are any.
        self.messages_at = (self.cut_at > 0).astype(float) + (self.grad_at > 0)
        self._windows: dict[tuple, np.ndarray] = {}
        self._end_costs: dict[tuple, tuple] = {}
        self._depths: dict[int, tuple[int, float]] = {}
        self._slots: dict[tuple, SequenceSlot] = {}  # one record per kind: the screen keys on identity
        self._links: dict[tuple | None, np.ndarray] = {}
        self._sums: dict[tuple, np.ndarray] = {}
        self._candidates: dict[tuple, np.ndarray] = {}
        self._term_values: dict[tuple, np.ndarray] = {}

    def stages(self, groups: list) -> list[SequenceSlot]:
        """Slot records for running the chain on ``groups`` in this order (a device index, or a tuple of
        interchangeable devices: one replicated stage)."""
        problem = self.problem
        groups = [tuple(g) if isinstance(g, (tuple, list)) else (g,) for g in groups]
        replicas = [len(g) for g in groups]
        depths = np.cumsum(replicas[::-1])[::-1].tolist()  # devices from stage j to the last
        k, m = len(groups), self.microbatches
        out = []
        for j, group in enumerate(groups):
            d, r = group[0], len(group)
            device = problem.devices[d]
            held, slots = self._by_depth(depths[j])
            held = replica_inflight(held, r) if problem.training else 1
            link, link_share, pair = None, 1.0, None
            if j + 1 < k:
                pair = (d, groups[j + 1][0])
                link = self._link_key(*pair)
                link_share = steady_share(-(-m // math.lcm(r, replicas[j + 1])), m)
            reduced = group if j == 0 and r > 1 and problem.training else r  # its all-reduce is timed
            tied = end_tied_s(problem, group, groups[-1]) if j == 0 and k > 1 else 0.0
            key = (device.type, device.memory_bytes, reduced, held, link, link_share, slots, tied)
            if key not in self._slots:
                modes = self._modes(device, group, held, first=j == 0, tied_s=tied)
                self._slots[key] = SequenceSlot(
                    modes, steady_share(-(-m // r), m), self._comm(link, pair), link_share, slots
                )
            out.append(self._slots[key])
        return out

    def _by_depth(self, depth: int) -> tuple[int, float]:
        """W_j and the round-trip slots (inf if none) of a stage with ``depth`` devices from it to the
        last stage: both depend on nothing else (``schedules.downstream_replicas``)."""
        if depth not in self._depths:
            slots = round_trip_slots(self.problem, 0, depth)
            self._depths[depth] = (
                inflight_microbatches(self.problem, 0, depth),
                math.inf if slots is None else float(slots),
            )
        return self._depths[depth]

    def end_costs(self, stage: SequenceSlot, key: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per mode of ``stage`` (``key`` names its link and modes): C_j + T+A prefix by end block, the
        T+A prefixes (modes, 1, N+1), and the link's period term by end block."""
        if key not in self._end_costs:
            modes = stage.modes
            link_term = stage.comm_s * stage.link_share if stage.link_share else np.zeros(self.n + 1)
            self._end_costs[key] = (
                np.array([stage.comm_s + m.sum_prefix + m.constant_s for m in modes]),
                np.array([m.sum_prefix for m in modes])[:, None, :],
                link_term,
            )
        return self._end_costs[key]

    def _modes(
        self, device, group: tuple[int, ...], held: int, first: bool, tied_s: float = 0.0
    ) -> tuple[Mode, ...]:
        """The stage's modes (recomputation x sharding); the first stage's constant holds its replicas'
        all-reduce (and, sharding, all-gather) latency and the step-end sum of weights tied to the last
        stage. A mode is left out where one without its recomputation or sharding has the same memory
        window: it would only cost time."""
        row, r, problem = self.type_row[device.type], len(group), self.problem
        choices = [False]
        if problem.training and problem.recompute_all:
            choices = [True]
        elif problem.training and problem.recompute:
            choices.append(True)
        modes = []
        for recompute, shard in itertools.product(choices, shard_choices(problem, r)):
            term = self._term_rows[row, recompute]
            # seconds per parameter byte and constant at step end (all-reduce, all-gather): timed for stage 0
            per_byte, constant = step_end_rates(problem, group, shard) if first else (0.0, 0.0)
            key = (row, recompute, per_byte)
            if key not in self._sums:
                self._sums[key] = term + per_byte * self.param_prefix[device.type] if per_byte else term
            window = self._memory_window(device, held, recompute, unheld_fraction(r) * shard)
            if any(m.recompute <= recompute and m.shard <= shard and np.array_equal(window, m.hi_memory)
                   for m in modes):  # fmt: skip
                continue
            modes.append(Mode(recompute, term, self._sums[key], tied_s + constant, window, shard))
        return tuple(modes)

    def _link_key(self, src: int, dst: int) -> tuple:
        """What C_j of a stage on ``src`` sending to ``dst`` depends on: the link's (latency, bandwidth);
        with codecs also the way back, both device types and whether the link leaves the node."""
        problem = self.problem
        link = (problem.latency_s[src][dst], problem.bandwidth_bps[src][dst])
        if not problem.codecs:
            return link
        a, b = problem.devices[src], problem.devices[dst]
        back = (problem.latency_s[dst][src], problem.bandwidth_bps[dst][src])
        return (*link, *back, a.type, b.type, a.node == b.node)

    def _comm(self, link: tuple | None, pair: tuple[int, int] | None) -> np.ndarray:
        """C_j per end block for the link ``link`` keys (between the devices of ``pair``); None is the
        last stage (ends at N, free). With codecs each cut takes its cheapest rows (``codecs.choose``)."""
        if link not in self._links:
            if link is None:
                comm = np.full(self.n + 1, math.inf)
                comm[self.n] = 0.0
            elif not self.problem.codecs:
                comm = self.messages_at * link[0] + (self.cut_at + self.grad_at) / link[1]
            else:
                comm = np.array(
                    [0.0] + [chosen_cut_s(self.problem, i, pair) for i in range(self.n - 1)] + [0.0]
                )
            if link is not None:
                comm[0] = comm[self.n] = math.inf  # a middle stage ends strictly inside the chain
            self._links[link] = comm
        return self._links[link]

    def _memory_window(self, device, held: int, recompute: bool, unheld: float = 0.0) -> np.ndarray:
        """hi[a] = last end i such that blocks [a, i) fit on ``device``; hi[a] = a when not even one block
        does. ``unheld``: the part of the optimizer state a sharding replica does not hold."""
        capacity, kind = device.memory_bytes, device.type
        key = (kind, capacity, held, recompute, unheld)
        if key not in self._windows:
            w, a = self.state_prefix[kind], self.act_prefix[kind]
            if unheld:
                w = w - unheld * self.optimizer_prefix[kind]
            span_act = a[None, :] - a[:, None]  # [start, stop]
            if recompute:  # keeps each held microbatch's inputs, rebuilds one microbatch's activations
                used = (w[None, :] - w[:, None]) + held * self.cut_at[:, None] + span_act
            else:
                used = (w[None, :] - w[:, None]) + held * span_act
            starts = np.arange(self.n + 1)
            fits = within_memory(used, capacity) & (starts[:, None] < starts[None, :])
            self._windows[key] = starts + fits.sum(axis=1)  # the fitting ends are a prefix of (a, N]
        return self._windows[key]

    def term_values(self, stages: list[SequenceSlot]) -> np.ndarray:
        """Sorted distinct values a period term can take on this sequence: the candidate bottlenecks."""
        compute = {
            (id(mode.term_prefix), s.share): (mode.term_prefix, s.share) for s in stages for mode in s.modes
        }
        links = {(id(s.comm_s), s.link_share): (s.comm_s, s.link_share) for s in stages}
        key = (tuple(sorted(compute)), tuple(sorted(links)))
        if key not in self._candidates:
            parts = [self._compute_values(prefix) * share for prefix, share in compute.values()]
            parts += [comm[np.isfinite(comm)] * share for comm, share in links.values()]
            self._candidates[key] = np.unique(np.concatenate(parts))
        return self._candidates[key]

    def _compute_values(self, prefix: np.ndarray) -> np.ndarray:
        key = id(prefix)
        if key not in self._term_values:
            diffs = prefix[None, :] - prefix[:, None]
            self._term_values[key] = np.unique(diffs[np.triu_indices(self.n + 1, 1)])
        return self._term_values[key]

    def _slack(self, bounds_s: np.ndarray) -> np.ndarray:
        return bounds_s + _BOUND_RTOL * (np.abs(bounds_s) + self.recompute_prefix_s[:, -1].max())

    def min_sums(
        self, stages: list[SequenceSlot], bounds_s: np.ndarray, trip_bounds_s=None, keep: bool = False
    ):
        """S(b) for every b in ``bounds_s``: least sum with each period term <= b and each throttled
        R_j <= b * W_j.

        ``trip_bounds_s`` (default: ``bounds_s``) replaces b in the round-trip limits. With ``keep`` (one
        bound only) also returns per stage, first stage first, per mode (cost by end block, window
        ends, the mode's suffix values) for backtracking.
        """
        rows = BoundRows(self, bounds_s, trip_bounds_s)
        g = rows.last_suffix()
        kept = []
        for stage in reversed(stages):
            g = rows.relax(stage, g, kept if keep else None)
        return (g[:, 0], kept[::-1]) if keep else g[:, 0]

    def plan(self, stages: list[SequenceSlot], bound_s: float, trip_bound_s: float | None = None):
        """(S, boundaries, each stage's mode) of the least-sum plan within the limits of ``min_sums``
        (ties to the earlier mode: the one without recomputation or sharding); (inf, None, None) if none."""
        trip = None if trip_bound_s is None else [trip_bound_s]
        sums, kept = self.min_sums(stages, np.array([bound_s]), trip, keep=True)
        if not math.isfinite(sums[0]):
            return math.inf, None, None
        boundaries, modes = [0], []
        for stage, per_mode in zip(stages, kept):
            start = boundaries[-1]
            choice = min(range(len(per_mode)), key=lambda k: per_mode[k][2][start])
            h, hi, _ = per_mode[choice]
            boundaries.append(int(start + 1 + np.argmin(h[start + 1 : hi[start] + 1])))
            modes.append(stage.modes[choice])
        return float(sums[0]), boundaries, modes

    def backtrack(self, stages: list[SequenceSlot], bound_s: float, trip_bound_s=None, shard: bool = False):
        """(boundaries, recompute flags) of the least-sum plan within the limits of ``min_sums``; with
        ``shard`` also its shard flags."""
        _, boundaries, modes = self.plan(stages, bound_s, trip_bound_s)
        flags = [None] * 2 if modes is None else [[m.recompute for m in modes], [m.shard for m in modes]]
        return (boundaries, *flags) if shard else (boundaries, flags[0])

    def period_s(self, stages: list[SequenceSlot], boundaries: list[int], modes: list[Mode]) -> float:
        """P of a plan on this sequence (``objective.step_terms``) from the prefix sums the DP uses."""
        compute, busy, comm, link, extra = [], [], [], [], []
        for stage, (a, b), mode in zip(stages, zip(boundaries, boundaries[1:]), modes):
            t = mode.term_prefix[b] - mode.term_prefix[a]
            compute.append(t)
            busy.append(stage.share * t)
            comm.append(float(stage.comm_s[b]))
            link.append(stage.link_share * float(stage.comm_s[b]))
            extra.append(mode.sum_prefix[b] - mode.sum_prefix[a] - t + mode.constant_s)
        slots = [s.slots for s in stages]
        return step_terms(compute, comm, slots, busy_s=busy, link_busy_s=link, extra_s=extra)[1]


def solve_sequence(chain: Chain, devices: list, incumbent_s: float = math.inf) -> SequenceOptimum | None:
    """The best plan on this device sequence, or None if none beats ``incumbent_s``.

    Its ``step_s`` is the bound ``S(b) + (M - 1) * b`` at the optimal b, which the plan meets.
    """
    stages = chain.stages(devices)
    s_free = float(chain.min_sums(stages, np.array([math.inf]))[0])
    if not math.isfinite(s_free):
        return None
    slope = chain.microbatches - 1
    if slope == 0:  # one microbatch: no period term, and no stage ever waits on a round trip
        return SequenceOptimum(s_free, math.inf, math.inf, 0.0) if s_free < incumbent_s else None
    values = chain.term_values(stages)
    known = {-1: math.inf, len(values): s_free}  # candidate index -> S(values[index]); len: b = inf
    best: SequenceOptimum | None = None
    best_s = incumbent_s
    while active := _open_intervals(known, values, slope, best_s):
        probes = _spread(active, PROBES_PER_ROUND)
        for index, s in zip(probes, chain.min_sums(stages, values[probes])):
            known[int(index)] = float(s)
            if s + slope * values[index] < best_s:
                v = float(values[index])
                best = SequenceOptimum(float(s + slope * v), v, v, v)
                best_s = best.step_s
    for a, ceiling_s in _between_candidates(chain, stages, known, values, slope, best_s):
        found = _descend(chain, stages, float(values[a]), ceiling_s, best_s)
        if found is not None:
            best, best_s = found, found.step_s
    return best


def _between_candidates(
    chain: Chain, stages: list[SequenceSlot], known: dict, values: np.ndarray, slope: int, best_s
):
    """Intervals (v_a, v_{a+1}) where a round trip may put the optimum's P, most promising first.

    After the coarse-to-fine search, a gap (a, z) between probed candidates is either flat (S
    constant on [v_a, v_z]: its best is at v_a) or every bound >= v_{a+1} in it is pruned; what is
    left is a bound b just above v_a, where S(b) = S(v_a, round-trip limit b), which lies between
    S(v_z) and S(v_a, no round-trip limit).
    """
    keys = sorted(known)
    gaps = [(a, z) for a, z in zip(keys, keys[1:]) if a >= 0 and known[a] != known[z]]
    gaps = [(a, z) for a, z in gaps if known[z] + slope * values[a] < best_s]
    if not gaps:
        return []
    starts = np.array([a for a, _ in gaps])
    free = chain.min_sums(stages, values[starts], np.full(len(starts), math.inf))
    out = []
    for (a, z), s_free in zip(gaps, free):
        floor_s = max(known[z], float(s_free)) + slope * values[a]
        if s_free < known[a] and floor_s < best_s:  # else the round-trip limit never binds here
            out.append((floor_s, a, float(values[a + 1]) if a + 1 < len(values) else math.inf))
    return [(a, ceiling) for _, a, ceiling in sorted(out)]


def _descend(chain: Chain, stages: list[SequenceSlot], term_s: float, trip_s: float, best_s: float):
    """Best plan with terms <= ``term_s`` and term_s < P <= ``trip_s`` beating ``best_s``, or None.

    Each round solves with round-trip limit ``trip_s``; its plan's own P is a real value; any better
    plan must have a smaller P (it cannot have a smaller S), so the limit drops just below that P.
    It stops once no plan left can beat ``best_s`` (S only grows as the limit falls, and P > term_s).
    """
    slope = chain.microbatches - 1
    scale = float(chain.prefix_s[:, -1].max()) + abs(trip_s if math.isfinite(trip_s) else term_s)
    found = None
    while True:
        s, boundaries, modes = chain.plan(stages, term_s, trip_s)
        if boundaries is None or s + slope * term_s >= best_s:
            return found
        period = chain.period_s(stages, boundaries, modes)
        if s + slope * period < best_s:
            found = SequenceOptimum(s + slope * period, term_s, trip_s, period)
            best_s = found.step_s
        if period <= term_s:
            return found
        trip_s = min(period, trip_s) - 4 * _BOUND_RTOL * (period + scale)


def _open_intervals(known: dict[int, float], values: np.ndarray, slope: int, best_s: float):
    """Gaps between probed candidates that could still hold a better plan, most promising first."""
    keys = sorted(known)
    active = []
    for a, b in zip(keys, keys[1:]):
        if b - a < 2 or known[a] == known[b]:
            continue
        floor_s = known[b] + slope * float(values[a + 1])
        if floor_s < best_s:
            active.append((floor_s, a, b))
    active.sort()
    return active


def _spread(active, budget: int) -> np.ndarray:
    """Up to ``budget`` probe indices spread evenly inside the most promising gaps."""
    active = active[:budget]
    share = max(1, budget // len(active))
    probes = []
    for _, a, b in active:
        inner = b - a - 1
        count = min(share, inner)
        probes.extend(a + 1 + (np.arange(count) * inner) // count)
    return np.unique(np.array(probes, dtype=np.int64))
