"""The exact partition of a block chain over one fixed sequence of devices.

The objective mixes a sum and a maximum, ``T = S + (M - 1) * B`` with ``S = sum_j (T_j + C_j)`` and
``B = max_j max(T_j, C_j)``. For a bound ``b`` let ``S(b)`` be the least sum over partitions whose
every stage term is ``<= b``; then ``min T = min_b S(b) + (M - 1) * b`` over the finitely many values
a stage term can take (``b*`` = the optimum's own bottleneck gives ``S(b*) <= S*``, and every other
``b`` gives a real plan no better than its bound). ``S(b)`` is a shortest path over cut positions,
computed for many ``b`` at once: stage j ending at block i costs ``P_t[i] - P_t[a] + C_j[i]`` for a
start ``a`` in a window ``[lo(i), i)`` whose lower end rises with i (the compute and memory limits
are monotone in the stage's length), so each stage is a sliding-window minimum, answered for every
row with a sparse table in O(N log N).

``S`` falls in steps as ``b`` grows; the candidate values are searched coarse to fine, skipping every
interval whose best possible value ``S(right end) + (M - 1) * b(left end)`` cannot beat the best
plan so far (of this order or an earlier one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hetcc.passes.partition import MEMORY_RTOL, PartitionProblem, inflight_microbatches

PROBES_PER_ROUND = 32
_BOUND_RTOL = 1e-12  # slack on b so a term equal to a candidate value is never lost to rounding


@dataclass(frozen=True)
class Stage:
    """Stage j of a device sequence: its type row, memory window and link cost per end block."""

    type_row: int
    lo_memory: np.ndarray  # (N+1,) first start a whose [a, i) fits the device
    comm_s: np.ndarray  # (N+1,) C_j for a stage ending at block i (inf where it cannot end)


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

    def stages(self, devices: list[int]) -> list[Stage]:
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
            out.append(
                Stage(
                    self.type_row[device.type], self._memory_window(device.memory_bytes, q), self._comm(link)
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
        """lo[i] = first start a such that blocks [a, i) fit; lo[i] = i when not even one block does."""
        key = (capacity, inflight)
        if key not in self._windows:
            w, a = self.state_prefix, self.act_prefix
            used = (w[None, :] - w[:, None]) + inflight * (a[None, :] - a[:, None])  # [start, stop]
            starts = np.arange(self.n + 1)
            fits = (used <= capacity * (1 + MEMORY_RTOL)) & (starts[:, None] < starts[None, :])
            self._windows[key] = starts - fits.sum(axis=0)  # the fitting starts are a suffix of [0, i)
        return self._windows[key]

    def term_values(self, stages: list[Stage]) -> np.ndarray:
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

    def min_sums(self, stages: list[Stage], bounds_s: np.ndarray, keep: bool = False):
        """S(b) for every b in ``bounds_s``: least sum of stage terms with each term <= b (inf if none).

        With ``keep`` (one bound only) also returns per-stage (f_before - P, lo) for backtracking.
        """
        rows, width = len(bounds_s), self.n + 1
        slack = bounds_s + _BOUND_RTOL * (np.abs(bounds_s) + self.prefix_s[:, -1].max())
        f = np.full((rows, width), math.inf)
        f[:, 0] = 0.0
        # Level k holds min(g[a : a + 2**k]); its last 2**k - 1 columns stay inf (never written).
        table = np.full((len(self._log2_levels), rows, width), math.inf)
        flat = table.reshape(-1)
        lo, flat_left, flat_right, empty = self._window_indices(stages, slack)
        links: dict[int, np.ndarray] = {}  # id(comm_s) -> comm with terms above the bound made inf
        kept = []
        for j, stage in enumerate(stages):
            p = self.prefix_s[stage.type_row]
            if id(stage.comm_s) not in links:
                links[id(stage.comm_s)] = np.where(
                    stage.comm_s[None, :] > slack[:, None], math.inf, stage.comm_s
                )
            np.subtract(f, p, out=table[0])
            if keep:
                kept.append((table[0, 0].copy(), lo[j, 0].copy()))
            for level, span in enumerate(self._log2_levels[:-1]):
                np.minimum(
                    table[level, :, : width - span],
                    table[level, :, span:],
                    out=table[level + 1, :, : width - span],
                )
            best = np.minimum(flat.take(flat_left[j]), flat.take(flat_right[j]))
            best[empty[j]] = math.inf
            f = best + p + links[id(stage.comm_s)]
        return (f[:, self.n], kept) if keep else f[:, self.n]

    def _window_indices(self, stages: list[Stage], slack: np.ndarray):
        """Per stage and bound row: window starts lo[i], and flat sparse-table indices of the two
        power-of-two halves covering [lo, i) (``empty`` where the window has no start)."""
        rows, width = len(slack), self.n + 1
        reach = {}  # type row -> first start whose compute fits the bound
        for row in {s.type_row for s in stages}:
            p = self.prefix_s[row]
            reach[row] = np.searchsorted(p, (p[None, :] - slack[:, None]).ravel(), side="left").reshape(
                rows, width
            )
        lo = np.maximum(
            np.stack([reach[s.type_row] for s in stages]), np.stack([s.lo_memory for s in stages])[:, None, :]
        )
        length = np.arange(width) - lo
        safe = np.maximum(length, 1)
        level = self._log2[safe]
        base = level * (rows * width) + np.arange(rows)[:, None] * width
        return lo, base + lo, base + lo + safe - (1 << level), length <= 0

    def backtrack(self, stages: list[Stage], bound_s: float) -> list[int]:
        """Boundaries of the least-sum plan whose every term is <= ``bound_s``."""
        _, kept = self.min_sums(stages, np.array([bound_s]), keep=True)
        boundaries = [self.n]
        for g, lo in reversed(kept):
            stop = boundaries[-1]
            start = int(lo[stop] + np.argmin(g[lo[stop] : stop]))
            boundaries.append(start)
        return boundaries[::-1]


def solve_sequence(chain: Chain, devices: list[int], incumbent_s: float = math.inf):
    """Best (step time, bottleneck bound) on this device sequence, or None if none beats ``incumbent_s``.

    The returned step time is the bound ``S(b) + (M - 1) * b``, which the plan at ``b`` meets or beats.
    """
    stages = chain.stages(devices)
    s_inf = float(chain.min_sums(stages, np.array([math.inf]))[0])
    if not math.isfinite(s_inf):
        return None
    slope = chain.microbatches - 1
    if slope == 0:
        return (s_inf, math.inf) if s_inf < incumbent_s else None
    values = chain.term_values(stages)
    known = {-1: math.inf, len(values) - 1: s_inf}
    best = (s_inf + slope * float(values[-1]), float(values[-1]))
    limit = min(incumbent_s, best[0])
    while True:
        active = _open_intervals(known, values, slope, min(limit, best[0]))
        if not active:
            break
        probes = _spread(active, PROBES_PER_ROUND)
        sums = chain.min_sums(stages, values[probes])
        for index, s in zip(probes, sums):
            known[int(index)] = float(s)
            if s + slope * values[index] < best[0]:
                best = (float(s + slope * values[index]), float(values[index]))
    return best if best[0] < incumbent_s else None


def screen_sequence(chain: Chain, devices: list[int], near_s: float) -> float:
    """A step time some plan on this sequence achieves, from one DP pass at bounds near ``near_s``.

    An upper bound on ``solve_sequence``'s value at a fraction of its cost: the heuristic search uses
    it to pick which neighbouring sequences deserve the exact search.
    """
    stages = chain.stages(devices)
    values = chain.term_values(stages)
    slope = chain.microbatches - 1
    picks = [len(values) - 1]  # the largest candidate: S there is the unconstrained least sum
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
