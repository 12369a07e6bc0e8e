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

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hetcc.solver.objective import step_terms
from hetcc.solver.problem import MEMORY_RTOL, PartitionProblem, inflight_microbatches, round_trip_slots

PROBES_PER_ROUND = 32
_BOUND_RTOL = 1e-12  # slack on b so a term equal to a candidate value is never lost to rounding


@dataclass(frozen=True)
class SequenceSlot:
    """Position j of a device sequence (pipeline stage j): its type row, memory window, link cost per end block, slots."""

    type_row: int
    hi_memory: np.ndarray  # (N+1,) last end i whose [a, i) fits the device (a itself if none)
    comm_s: np.ndarray  # (N+1,) C_j for a stage ending at block i (inf where it cannot end)
    slots: float  # q_j when the round trip limits this stage (R_j <= P * q_j), else inf


class SequenceOptimum(NamedTuple):
    """The best plan of one device sequence: its step time, the limits that reproduce it, its P."""

    step_s: float
    term_bound_s: float
    trip_bound_s: float
    period_s: float


class Chain:
    """Per-problem arrays shared by every device sequence (prefix sums, cached windows)."""

    def __init__(self, problem: PartitionProblem):
        self.problem = problem
        self.n = len(problem.blocks)
        self.microbatches = problem.microbatches
        self.types = sorted({d.type for d in problem.devices})
        self.type_row = {t: k for k, t in enumerate(self.types)}
        costs = np.array([problem.block_cost_s(t) for t in self.types], dtype=float)
        self.cost_s = costs
        self.prefix_s = np.concatenate([np.zeros((len(self.types), 1)), np.cumsum(costs, axis=1)], axis=1)
        self.state_prefix = np.concatenate([[0.0], np.cumsum(problem.state_bytes)])
        self.act_prefix = np.concatenate([[0.0], np.cumsum(problem.act_bytes)])
        self.cut_at = np.concatenate([[0.0], np.asarray(problem.cut_bytes, dtype=float), [0.0]])
        self.factor = 2.0 if problem.training else 1.0
        self._windows: dict[tuple[float, int], np.ndarray] = {}
        self._links: dict[tuple[float, float] | None, np.ndarray] = {}
        self._candidates: dict[tuple, np.ndarray] = {}
        self._term_values: dict[int, np.ndarray] = {}
        self._log2 = np.zeros(self.n + 2, dtype=np.int64)
        self._log2[2:] = np.floor(np.log2(np.arange(2, self.n + 2))).astype(np.int64)
        self._log2_levels = [1 << k for k in range(int(self._log2[self.n + 1]) + 1)]  # spans 1, 2, 4, ...

    def stages(self, devices: list[int]) -> list[SequenceSlot]:
        """Stage records for running the chain on ``devices`` in this order (K = len(devices))."""
        k = len(devices)
        out = []
        for j, d in enumerate(devices):
            device = self.problem.devices[d]
            q = inflight_microbatches(self.problem, j, k)
            link = (
                (self.problem.latency_s[d][devices[j + 1]], self.problem.bandwidth_bps[d][devices[j + 1]])
                if j + 1 < k
                else None
            )
            slots = round_trip_slots(self.problem, j, k)
            out.append(
                SequenceSlot(
                    self.type_row[device.type],
                    self._memory_window(device.memory_bytes, q),
                    self._comm(link),
                    math.inf if slots is None else float(slots),
                )
            )
        return out

    def _comm(self, link: tuple[float, float] | None) -> np.ndarray:
        """C_j per end block for a (latency, bandwidth) link; None is the last stage (ends at N, free)."""
        if link not in self._links:
            if link is None:
                comm = np.full(self.n + 1, math.inf)
                comm[self.n] = 0.0
            else:
                comm = self.factor * (link[0] + self.cut_at / link[1])
                comm[0] = comm[self.n] = math.inf  # a middle stage ends strictly inside the chain
            self._links[link] = comm
        return self._links[link]

    def _memory_window(self, capacity: float, inflight: int) -> np.ndarray:
        """hi[a] = last end i such that blocks [a, i) fit; hi[a] = a when not even one block does."""
        key = (capacity, inflight)
        if key not in self._windows:
            w, a = self.state_prefix, self.act_prefix
            used = (w[None, :] - w[:, None]) + inflight * (a[None, :] - a[:, None])  # [start, stop]
            starts = np.arange(self.n + 1)
            fits = (used <= capacity * (1 + MEMORY_RTOL)) & (starts[:, None] < starts[None, :])
            self._windows[key] = starts + fits.sum(axis=1)  # the fitting ends are a prefix of (a, N]
        return self._windows[key]

    def term_values(self, stages: list[SequenceSlot]) -> np.ndarray:
        """Sorted distinct values a stage term can take on this sequence: the candidate bottlenecks."""
        rows = sorted({s.type_row for s in stages})
        links = {id(s.comm_s): s.comm_s for s in stages}
        key = (tuple(rows), tuple(sorted(links)))
        if key not in self._candidates:
            parts = [self._compute_values(row) for row in rows]
            parts += [comm[np.isfinite(comm)] for comm in links.values()]
            self._candidates[key] = np.unique(np.concatenate(parts))
        return self._candidates[key]

    def _compute_values(self, row: int) -> np.ndarray:
        if row not in self._term_values:
            p = self.prefix_s[row]
            diffs = p[None, :] - p[:, None]
            self._term_values[row] = np.unique(diffs[np.triu_indices(self.n + 1, 1)])
        return self._term_values[row]

    def _slack(self, bounds_s: np.ndarray) -> np.ndarray:
        return bounds_s + _BOUND_RTOL * (np.abs(bounds_s) + self.prefix_s[:, -1].max())

    def min_sums(
        self, stages: list[SequenceSlot], bounds_s: np.ndarray, trip_bounds_s=None, keep: bool = False
    ):
        """S(b) for every b in ``bounds_s``: least sum with each term <= b and each throttled R_j <= b * q_j.

        ``trip_bounds_s`` (default: ``bounds_s``) replaces b in the round-trip limits. With ``keep`` (one
        bound only) also returns per stage, first stage first, (cost by end block, window ends) for
        backtracking.
        """
        rows, width = len(bounds_s), self.n + 1
        slack = self._slack(bounds_s)
        trip_slack = slack if trip_bounds_s is None else self._slack(np.asarray(trip_bounds_s, dtype=float))
        g = np.full((rows, width), math.inf)
        g[:, self.n] = 0.0
        # Level k holds min(h[i : i + 2**k]); its last 2**k - 1 columns stay inf (never written).
        table = np.full((len(self._log2_levels), rows, width), math.inf)
        flat = table.reshape(-1)
        hi, flat_left, flat_right, empty = self._window_indices(stages, slack)
        links: dict[tuple, np.ndarray] = {}  # (comm, type) -> P_t + C_j with terms above b made inf
        kept = []
        for j in range(len(stages) - 1, -1, -1):
            stage = stages[j]
            p = self.prefix_s[stage.type_row]
            key = (id(stage.comm_s), stage.type_row)
            if key not in links:
                links[key] = np.where(stage.comm_s[None, :] > slack[:, None], math.inf, stage.comm_s + p)
            np.add(g, links[key], out=table[0])  # h[i] = P_t(i) + C_j(i) + g_{j+1}(i)
            if keep:
                kept.append((table[0, 0].copy(), hi[j, 0].copy()))
            for level, span in enumerate(self._log2_levels[:-1]):
                np.minimum(
                    table[level, :, : width - span],
                    table[level, :, span:],
                    out=table[level + 1, :, : width - span],
                )
            np.minimum(flat.take(flat_left[j]), flat.take(flat_right[j]), out=g)
            np.subtract(g, p, out=g)
            np.copyto(g, math.inf, where=empty[j])
            if math.isfinite(stage.slots):
                np.copyto(g, math.inf, where=g > (trip_slack * stage.slots)[:, None])
        return (g[:, 0], kept[::-1]) if keep else g[:, 0]

    def _window_indices(self, stages: list[SequenceSlot], slack: np.ndarray):
        """Per stage and bound row: window ends hi[a], and flat sparse-table indices of the two
        power-of-two halves covering (a, hi] (``empty`` where the window has no end)."""
        rows, width = len(slack), self.n + 1
        reach = {}  # type row -> last end whose compute fits the bound
        for row in {s.type_row for s in stages}:
            p = self.prefix_s[row]
            ends = np.searchsorted(p, (p[None, :] + slack[:, None]).ravel(), side="right") - 1
            reach[row] = ends.reshape(rows, width)
        hi = np.minimum(
            np.stack([reach[s.type_row] for s in stages]), np.stack([s.hi_memory for s in stages])[:, None, :]
        )
        starts = np.arange(width)
        length = hi - starts
        safe = np.maximum(length, 1)
        level = self._log2[safe]
        base = level * (rows * width) + np.arange(rows)[:, None] * width
        first = np.minimum(starts + 1, width - 1)  # any in-range index where the window is empty
        return hi, base + first, base + hi - (1 << level) + 1, length <= 0

    def plan(self, stages: list[SequenceSlot], bound_s: float, trip_bound_s: float | None = None):
        """(S, boundaries) of the least-sum plan within the limits of ``min_sums``; (inf, None) if none."""
        trip = None if trip_bound_s is None else [trip_bound_s]
        sums, kept = self.min_sums(stages, np.array([bound_s]), trip, keep=True)
        if not math.isfinite(sums[0]):
            return math.inf, None
        boundaries = [0]
        for h, hi in kept:
            start = boundaries[-1]
            boundaries.append(int(start + 1 + np.argmin(h[start + 1 : hi[start] + 1])))
        return float(sums[0]), boundaries

    def backtrack(
        self, stages: list[SequenceSlot], bound_s: float, trip_bound_s: float | None = None
    ) -> list[int]:
        """Boundaries of the least-sum plan within the limits of ``min_sums``."""
        return self.plan(stages, bound_s, trip_bound_s)[1]

    def period_s(self, stages: list[SequenceSlot], boundaries: list[int]) -> float:
        """P of a plan on this sequence (``objective.step_terms``) from the prefix sums the DP uses."""
        spans = list(zip(boundaries, boundaries[1:]))
        compute = [
            self.prefix_s[s.type_row][b] - self.prefix_s[s.type_row][a] for s, (a, b) in zip(stages, spans)
        ]
        comm = [float(s.comm_s[b]) for s, (_, b) in zip(stages, spans)]
        return step_terms(compute, comm, [s.slots for s in stages])[1]


def solve_sequence(chain: Chain, devices: list[int], incumbent_s: float = math.inf) -> SequenceOptimum | None:
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
        s, boundaries = chain.plan(stages, term_s, trip_s)
        if boundaries is None or s + slope * term_s >= best_s:
            return found
        period = chain.period_s(stages, boundaries)
        if s + slope * period < best_s:
            found = SequenceOptimum(s + slope * period, term_s, trip_s, period)
            best_s = found.step_s
        if period <= term_s:
            return found
        trip_s = min(period, trip_s) - 4 * _BOUND_RTOL * (period + scale)


def screen_sequence(chain: Chain, devices: list[int], near_s: float) -> float:
    """A step time some plan on this sequence achieves, from one DP pass at bounds near ``near_s``.

    An upper bound on ``solve_sequence``'s value at a fraction of its cost: the heuristic search uses
    it to pick which neighbouring sequences deserve the exact search. ``near_s`` is the incumbent's P.
    """
    stages = chain.stages(devices)
    values = chain.term_values(stages)
    slope = chain.microbatches - 1
    picks = [len(values) - 1]  # the largest candidate: no stage term is limited there
    if slope and math.isfinite(near_s):
        centre = int(np.searchsorted(values, near_s))
        picks += range(centre - 6, centre + 6)
        picks += np.searchsorted(
            values, near_s * np.array([0.8, 0.9, 0.95, 0.98, 1.02, 1.05, 1.1, 1.25])
        ).tolist()
    index = np.unique(np.clip(picks, 0, len(values) - 1))
    sums = chain.min_sums(stages, values[index])
    return float(np.min(sums + slope * values[index]))


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
