"""Which devices, in which order: the search around the exact per-sequence DP.

Devices that are interchangeable (same type, memory and node, and swapping them leaves every link
the same) form a group; only the sequence of group labels matters, so the search permutes groups,
choosing how many of each to use, not cards. Devices may be left unused.

- When the number of distinct label sequences (lengths 1..min(blocks, devices)) is at most
  ``config.exact_order_limit``, every one is solved exactly: the result is optimal (``exact=True``).
- Beyond that: seed sequences (node by node, fastest node first; all devices fastest first; largest
  memory first; prefixes of each, i.e. "only the best k devices"), then local search on the label
  sequence (drop one device, add one next to its group, insert an unused group, swap adjacent runs,
  move a run to either end). A neighbour is screened with one DP pass near the incumbent's
  period P and solved exactly only if that already beats the incumbent; the search stops when no
  move helps or ``LOCAL_SEARCH_EVALUATIONS`` sequences were tried (``exact=False``).

Both share an incumbent, and skip a sequence whose device multiset cannot beat it
(``partition.compute_bound_s`` on those devices alone, cached per multiset of types).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from hetcc import config
from hetcc.solver.bound import compute_bound_s
from hetcc.solver.dp import Chain, SequenceOptimum, screen_sequence, solve_sequence
from hetcc.solver.problem import PartitionProblem

LOCAL_SEARCH_EVALUATIONS = 400  # sequences solved by the heuristic's local search at most


def interchangeable_groups(problem: PartitionProblem) -> list[list[int]]:
    """Device indices grouped so that any two in a group can swap without changing the problem."""
    bw = np.asarray(problem.bandwidth_bps, dtype=float)
    lat = np.asarray(problem.latency_s, dtype=float)
    groups: list[list[int]] = []
    for d, device in enumerate(problem.devices):
        for group in groups:
            rep = problem.devices[group[0]]
            same = (rep.type, rep.memory_bytes, rep.node) == (device.type, device.memory_bytes, device.node)
            if same and _swap_is_symmetry(bw, lat, group[0], d):
                group.append(d)
                break
        else:
            groups.append([d])
    return groups


def _swap_is_symmetry(bw: np.ndarray, lat: np.ndarray, a: int, b: int) -> bool:
    perm = np.arange(len(bw))
    perm[[a, b]] = [b, a]
    return all(np.array_equal(m, m[np.ix_(perm, perm)]) for m in (bw, lat))


def count_sequences(sizes: list[int], max_length: int, cap: int) -> int:
    """Distinct label sequences using at most ``sizes[g]`` of label g, length 1..max_length (capped)."""
    by_length = [1] + [0] * max_length  # sequences of each length over the labels seen so far
    for size in sizes:
        nxt = [0] * (max_length + 1)
        for length, ways in enumerate(by_length):
            if ways:
                for c in range(min(size, max_length - length) + 1):
                    nxt[length + c] += ways * math.comb(length + c, c)
        by_length = nxt
    return min(sum(by_length) - 1, cap)


def search(problem: PartitionProblem):
    """(boundaries, devices, exact, sequences searched) of the best plan found, or None if none fits."""
    chain = Chain(problem)
    groups = interchangeable_groups(problem)
    max_length = min(len(problem.blocks), len(problem.devices))
    total = count_sequences([len(g) for g in groups], max_length, config.exact_order_limit + 1)
    state = _Search(chain, groups, max_length)
    for seed in _seeds(problem, groups, max_length):
        state.try_labels(seed)
    exact = total <= config.exact_order_limit
    if exact:
        for labels in _all_sequences([len(g) for g in groups], max_length):
            state.try_labels(labels)
    else:
        if state.best_labels is None:  # memory is tight: look for any seed prefix that fits
            for seed in _seeds(problem, groups, max_length, every_prefix=True):
                state.try_labels(seed)
        state.local_search(LOCAL_SEARCH_EVALUATIONS)
    if state.best_labels is None:
        return None
    devices = state.devices(state.best_labels)
    best = state.best
    boundaries = chain.backtrack(chain.stages(devices), best.term_bound_s, best.trip_bound_s)
    return boundaries, devices, exact, state.solved


class _Search:
    """Incumbent and memo shared by the seeds, the exhaustive sweep and the local search."""

    def __init__(self, chain: Chain, groups: list[list[int]], max_length: int):
        self.chain, self.groups, self.max_length = chain, groups, max_length
        self.best_s = math.inf
        self.best: SequenceOptimum | None = None
        self.best_labels: tuple[int, ...] | None = None
        self.seen: set[tuple[int, ...]] = set()
        self.solved = 0
        self._type_of = [chain.problem.devices[g[0]].type for g in groups]
        self._bounds: dict[tuple, float] = {}

    def devices(self, labels) -> list[int]:
        used = Counter()
        out = []
        for g in labels:
            out.append(self.groups[g][used[g]])
            used[g] += 1
        return out

    def try_labels(self, labels) -> bool:
        """Solve one label sequence exactly against the incumbent; True when it became the new best."""
        labels = tuple(labels)
        if not self._worth_solving(labels):
            return False
        return self._solve(labels)

    def _worth_solving(self, labels: tuple[int, ...]) -> bool:
        if labels in self.seen or not labels or len(labels) > self.max_length:
            return False
        self.seen.add(labels)
        return self._set_bound(labels) < self.best_s

    def _solve(self, labels: tuple[int, ...]) -> bool:
        self.solved += 1
        found = solve_sequence(self.chain, self.devices(labels), self.best_s)
        if found is None:
            return False
        self.best, self.best_s = found, found.step_s
        self.best_labels = labels
        return True

    def _set_bound(self, labels) -> float:
        """``lower_bound`` restricted to this multiset of devices: no order of them does better."""
        key = tuple(sorted(Counter(self._type_of[g] for g in labels).items()))
        if key not in self._bounds:
            rows = [self.chain.type_row[t] for t, _ in key]
            counts = np.array([c for _, c in key], dtype=float)
            self._bounds[key] = compute_bound_s(self.chain.cost_s[rows], counts, self.chain.microbatches - 1)
        return self._bounds[key]

    def local_search(self, budget: int) -> None:
        """Moves on the label sequence until none helps or ``budget`` sequences were tried.

        Each neighbour is first screened (one DP pass near the incumbent's period, a value some
        plan achieves); only one that beats the incumbent is solved exactly and becomes the new best.
        """
        start = self.solved
        improved = self.best_labels is not None
        while improved and self.solved - start < budget:
            improved = False
            for labels in _neighbours(self.best_labels, [len(g) for g in self.groups]):
                if self.solved - start >= budget:
                    break
                labels = tuple(labels)
                if not self._worth_solving(labels):
                    continue
                self.solved += 1
                if screen_sequence(self.chain, self.devices(labels), self.best.period_s) < self.best_s:
                    improved |= self._solve(labels)


def _all_sequences(sizes: list[int], max_length: int):
    """Every label sequence of length 1..max_length using at most sizes[g] of label g."""
    remaining = list(sizes)
    prefix: list[int] = []

    def extend():
        if prefix:
            yield tuple(prefix)
        if len(prefix) == max_length:
            return
        for g, left in enumerate(remaining):
            if left:
                remaining[g] -= 1
                prefix.append(g)
                yield from extend()
                prefix.pop()
                remaining[g] += 1

    yield from extend()


def _runs(labels) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for g in labels:
        if runs and runs[-1][0] == g:
            runs[-1] = (g, runs[-1][1] + 1)
        else:
            runs.append((g, 1))
    return runs


def _flatten(runs) -> tuple[int, ...]:
    return tuple(g for g, c in runs for _ in range(c) if c > 0)


def _neighbours(labels, sizes: list[int]):
    """Drop/add one device of a run, insert an unused group, swap adjacent runs, move a run to an end."""
    runs = _runs(labels)
    used = Counter(labels)
    for r, (g, c) in enumerate(runs):
        yield _flatten(runs[:r] + [(g, c - 1)] + runs[r + 1 :])
        if used[g] < sizes[g]:
            yield _flatten(runs[:r] + [(g, c + 1)] + runs[r + 1 :])
    for g in range(len(sizes)):
        if used[g] == 0:
            for r in range(len(runs) + 1):
                yield _flatten(runs[:r] + [(g, 1)] + runs[r:])
    for r in range(len(runs) - 1):
        yield _flatten(runs[:r] + [runs[r + 1], runs[r]] + runs[r + 2 :])
    for r in range(1, len(runs)):
        yield _flatten([runs[r]] + runs[:r] + runs[r + 1 :])
        yield _flatten(runs[: r - 1] + runs[r:] + [runs[r - 1]])


def _seeds(problem: PartitionProblem, groups: list[list[int]], max_length: int, every_prefix: bool = False):
    """Plausible sequences to start from; their prefixes cover 'use only the best k devices'."""
    devices = problem.devices
    chain_cost = {g: sum(problem.block_cost_s(devices[members[0]].type)) for g, members in enumerate(groups)}
    node_speed = Counter()
    for g, members in enumerate(groups):
        node_speed[devices[members[0]].node] += len(members) / max(chain_cost[g], 1e-300)
    by_node = sorted(
        range(len(groups)),
        key=lambda g: (-node_speed[devices[groups[g][0]].node], devices[groups[g][0]].node, chain_cost[g]),
    )
    fastest = sorted(range(len(groups)), key=lambda g: chain_cost[g])
    roomiest = sorted(range(len(groups)), key=lambda g: -devices[groups[g][0]].memory_bytes)
    for order in (by_node, fastest, roomiest):
        labels = [g for g in order for _ in groups[g]][:max_length]
        lengths = range(1, len(labels) + 1) if every_prefix else (len(labels) * i // 8 for i in range(1, 9))
        for k in sorted({max(1, k) for k in lengths}, reverse=True):
            yield labels[:k]
