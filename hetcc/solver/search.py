"""Which devices, grouped how, in which order: the search around the exact per-sequence DP.

Devices that are interchangeable (same type, memory and node, and swapping them leaves every link
the same) form a group with a label; only the sequence of labels matters, so the search permutes
groups, choosing how many of each to use, not cards. A sequence is a tuple of slots ``(label, r)``:
one pipeline stage on r devices of that label (r > 1 only when ``problem.replicate``: a replicated
stage; replica groups are drawn from one label, so they are uniform in type and link). Devices may be
left unused. Recomputation and sharding are chosen per stage inside the DP (``dp.Mode``), not here.

- When the number of distinct label sequences (lengths 1..min(blocks, devices)) is at most
  ``config.exact_order_limit``, every one is solved exactly: the result is optimal (``exact=True``).
- Beyond that: seed sequences (node by node, fastest node first; all devices fastest first; largest
  memory first; prefixes of each, i.e. "only the best k devices"; with replicas also every label as
  one replicated stage, or two), then local search on the sequence (drop or add one device, insert an
  unused group, split or merge a replicated stage, swap adjacent runs, move a run to either end).
  Every sequence but the first is screened (``solver.screen``: one DP pass at bounds near the
  incumbent's period P, a step time some plan achieves) and solved exactly only if that already beats
  the incumbent. The local search climbs from the incumbent and, when no move helps, again from the
  best solved sequence not climbed from yet, until ``LOCAL_SEARCH_EVALUATIONS`` sequences were
  tried (``exact=False``).

The exhaustive sweep skips a sequence whose device multiset cannot beat the incumbent
(``bound.compute_bound_s`` on those devices alone, cached per multiset of types); the heuristic needs
no such test, since a screen that beats the incumbent is a plan that does.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import NamedTuple

import numpy as np

from hetcc import config
from hetcc.solver.bound import compute_bound_s
from hetcc.solver.dp import Chain, SequenceOptimum, solve_sequence
from hetcc.solver.problem import PartitionProblem
from hetcc.solver.screen import Screen

LOCAL_SEARCH_EVALUATIONS = 600  # sequences solved by the heuristic's local search at most
# With runners-up for the simulator to re-rank (``keep`` > 1) every seed is solved and the local search
# is shorter: on the synthetic benchmarks a longer search lowers the objective but raises the simulated
# step of the re-ranked winner (up to 17% at 96 blocks x 64 devices; the formula and the simulator
# disagree on those plans), and the seeds are often the plans the simulator prefers.
RERANKED_EVALUATIONS = 400
SEED_SOLVES = 4  # seeds solved exactly whatever their screen, best screen first
FINALIST_SLACK = 0.05  # runners-up within 5% of the best objective are kept for the simulator to judge


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


def count_sequences(sizes: list[int], max_length: int, cap: int, replicate: bool = False) -> int:
    """Distinct slot sequences using at most ``sizes[g]`` devices of label g, length 1..max_length
    (capped). Label g in c slots: 1 way without replicas, C(sizes[g], c) replica counts with them."""
    by_length = [1] + [0] * max_length  # sequences of each length over the labels seen so far
    for size in sizes:
        nxt = [0] * (max_length + 1)
        for length, ways in enumerate(by_length):
            if ways:
                for c in range(min(size, max_length - length) + 1):
                    counts = math.comb(size, c) if replicate else 1
                    nxt[length + c] += ways * math.comb(length + c, c) * counts
        by_length = nxt
    return min(sum(by_length) - 1, cap)


def search(problem: PartitionProblem, keep: int = 1, solved: Solved | None = None):
    """The best plan found, or None if none fits: ``Found`` with its boundaries, replica groups,
    recompute flags, whether the search was exhaustive, how many sequences it solved, up to ``keep``
    runner-up plans (``Found.candidates``, best first, the winner included) and its shard flags.
    ``solved``: what another search of ``problem`` solved, shared (``Solved``)."""
    solved = Solved(problem) if solved is None else solved
    chain = solved.chain
    groups = interchangeable_groups(problem)
    sizes = [len(g) for g in groups]
    max_length = problem.stage_limit()
    total = count_sequences(sizes, max_length, config.exact_order_limit + 1, problem.replicate)
    state = _Search(solved, groups, max_length, keep)
    exact = total <= config.exact_order_limit
    if exact:
        for labels in itertools.chain(
            _seeds(problem, groups, max_length), _all_sequences(sizes, max_length, problem.replicate)
        ):
            state.try_labels(labels)
    else:
        state.try_seeds(_seeds(problem, groups, max_length), screened=keep == 1)
        if state.best_labels is None:  # memory is tight: look for any seed prefix that fits
            state.try_seeds(_seeds(problem, groups, max_length, every_prefix=True), screened=keep == 1)
        state.local_search(LOCAL_SEARCH_EVALUATIONS if keep == 1 else RERANKED_EVALUATIONS)
    if state.best_labels is None:
        return None
    plans = []
    for optimum, labels in state.finalists():
        devices = state.devices(labels)
        boundaries, recompute, shard = chain.backtrack(
            chain.stages(devices), optimum.term_bound_s, optimum.trip_bound_s, shard=True
        )
        plans.append((boundaries, devices, recompute, shard))
    boundaries, devices, recompute, shard = plans[0]
    return Found(boundaries, devices, recompute, exact, state.solved, plans, shard)


class Found(NamedTuple):
    boundaries: list[int]
    groups: list[tuple[int, ...]]
    recompute: list[bool]
    exact: bool
    solved: int
    candidates: list[tuple[list[int], list[tuple[int, ...]], list[bool], list[bool]]]  # ... and shard flags
    shard: list[bool]


class Solved:
    """The searches of one problem share its chain (``dp.Chain``: its cached slots and windows) and what
    each sequence's DP found: the optimum, or that none beats a threshold. A sequence solved against
    one threshold answers another exactly: its optimum where it found one (a plan beating the new
    threshold or not), no plan below any threshold up to the one it was tried at."""

    def __init__(self, problem: PartitionProblem):
        self.chain = Chain(problem)
        self._found: dict[tuple, tuple[SequenceOptimum | None, float]] = {}

    def sequence(self, labels: tuple, devices: list, beat_s: float) -> SequenceOptimum | None:
        """``dp.solve_sequence`` of the sequence ``labels`` (on ``devices``) against ``beat_s``."""
        if labels in self._found:
            optimum, tried_s = self._found[labels]
            if optimum is not None:
                return optimum if optimum.step_s < beat_s else None
            if beat_s <= tried_s:
                return None
        found = solve_sequence(self.chain, devices, beat_s)
        self._found[labels] = (found, beat_s)
        return found


class _Search:
    """Incumbent and memo shared by the seeds, the exhaustive sweep and the local search."""

    def __init__(self, solved: Solved, groups: list[list[int]], max_length: int, keep: int = 1):
        self.chain, self.groups, self.max_length, self.keep = solved.chain, groups, max_length, keep
        self.sequences = solved
        self.replicate = self.chain.problem.replicate
        self._finalists: list[tuple[SequenceOptimum, tuple]] = []  # earlier incumbents, best last
        self.best_s = math.inf
        self.best: SequenceOptimum | None = None
        self.best_labels: tuple[int, ...] | None = None
        self.seen: set[tuple[int, ...]] = set()
        self.solved = 0
        self._type_of = [self.chain.problem.devices[g[0]].type for g in groups]
        self._bounds: dict[tuple, float] = {}

    def devices(self, labels) -> list[tuple[int, ...]]:
        """The replica group (device indices) of every slot of a sequence."""
        used = Counter()
        out = []
        for g, r in labels:
            out.append(tuple(self.groups[g][used[g] : used[g] + r]))
            used[g] += r
        return out

    def finalists(self) -> list[tuple[SequenceOptimum, tuple]]:
        """The best sequence and up to ``keep - 1`` runners-up (within ``FINALIST_SLACK`` of the
        incumbent when they were solved), best first."""
        ranked = sorted(self._finalists, key=lambda item: item[0].step_s)
        return [item for item in ranked if item[0].step_s <= self.best_s * (1 + FINALIST_SLACK)][: self.keep]

    @property
    def threshold_s(self) -> float:
        """What a sequence must beat to be solved: the incumbent, or with runners-up kept (``keep`` > 1)
        the incumbent plus ``FINALIST_SLACK``, so plans the simulator may prefer are not discarded."""
        return self.best_s * (1 + FINALIST_SLACK) if self.keep > 1 else self.best_s

    def try_labels(self, labels) -> bool:
        """Solve one label sequence exactly against the incumbent; True when it became the new best."""
        labels = tuple(labels)
        if not self._worth_solving(labels):
            return False
        return self._solve(labels) is not None and self.best_labels == labels

    def try_seeds(self, seeds, screened: bool = True) -> None:
        """The heuristic's seeds: solve them in order until there is an incumbent, screen the rest
        around it (wide: a seed's P may lie far from the incumbent's) and solve them best screen
        first: the best ``SEED_SOLVES`` whatever their screen (a screen's bounds lie a little above a
        seed's own P, so it ranks seeds better than it prices them), the rest when it beats the
        incumbent. Unless ``screened``: every seed, as ``try_labels``."""
        if not screened:
            for seed in seeds:
                self.try_labels(seed)
            return
        fresh = [labels for labels in dict.fromkeys(tuple(seed) for seed in seeds) if self._is_new(labels)]
        while self.best is None and fresh:
            self._solve(fresh.pop(0))
        if not fresh:
            return
        incumbent = self.chain.stages(self.devices(self.best_labels))
        screen = Screen.around(self.chain, incumbent, self.best.period_s, wide=True)
        screened = sorted(
            (screen.step_s(self.chain.stages(self.devices(labels))), k, labels)
            for k, labels in enumerate(fresh)
        )
        self.solved += len(screened)
        for rank, (screen_s, _, labels) in enumerate(screened):
            if rank < SEED_SOLVES or screen_s < self.threshold_s:
                self.solved -= 1  # counted once, by _solve
                self._solve(labels)

    def _is_new(self, labels: tuple) -> bool:
        if labels in self.seen or not labels or len(labels) > self.max_length:
            return False
        self.seen.add(labels)
        return True

    def _worth_solving(self, labels: tuple) -> bool:
        """New, and its devices' bound does not rule it out. (A screen needs no bound: a screen that
        beats the incumbent is a plan that does, so the bound never rules out what a screen lets in.)"""
        return self._is_new(labels) and self._set_bound(labels) < self.threshold_s

    def _solve(self, labels: tuple[int, ...], incumbent_s: float = -math.inf) -> SequenceOptimum | None:
        """The sequence's optimum if it beats the threshold (or ``incumbent_s``, if larger), else None;
        it becomes the incumbent when it beats it."""
        self.solved += 1
        found = self.sequences.sequence(labels, self.devices(labels), max(self.threshold_s, incumbent_s))
        if found is None:
            return None
        self._finalists.append((found, labels))
        if found.step_s < self.best_s:
            self.best, self.best_s = found, found.step_s
            self.best_labels = labels
        return found

    def _set_bound(self, labels) -> float:
        """``lower_bound`` restricted to this multiset of devices: no order of them does better."""
        counts = Counter()
        for g, r in labels:
            counts[self._type_of[g]] += r
        key = tuple(sorted(counts.items()))
        # A bound cut short at the threshold stays above every later one (the incumbent only improves).
        if key not in self._bounds:
            rows = [self.chain.type_row[t] for t, _ in key]
            counts = np.array([c for _, c in key], dtype=float)
            self._bounds[key] = compute_bound_s(
                self.chain.cost_s[rows], counts, self.chain.microbatches - 1, self.replicate, self.threshold_s
            )
        return self._bounds[key]

    def local_search(self, budget: int) -> None:
        """Hill climbing from the incumbent; when it stops improving and ``budget`` evaluations are
        left, again from the best solved sequence not climbed from yet (another seed's basin)."""
        end = self.solved + budget
        climbed: set[tuple] = set()
        while self.solved < end:
            ranked = sorted(self._finalists, key=lambda item: item[0].step_s)
            start = next((item for item in ranked if item[1] not in climbed), None)
            if start is None:
                return
            self._climb(*start, end, climbed)

    def _climb(self, optimum: SequenceOptimum, labels: tuple, end: int, climbed: set) -> None:
        """Moves on the label sequence while one helps and fewer than ``end`` evaluations were made.

        Each neighbour is first screened (one DP pass near the current sequence's P, a value some
        plan achieves); only one that beats the current sequence is solved exactly and moved to.
        """
        improved = True
        while improved and self.solved < end:
            improved = False
            climbed.add(labels)
            screen = Screen.around(self.chain, self.chain.stages(self.devices(labels)), optimum.period_s)
            for neighbour in _neighbours(labels, [len(g) for g in self.groups], self.replicate):
                if self.solved >= end:
                    break
                neighbour = tuple(neighbour)
                if not self._is_new(neighbour):
                    continue
                self.solved += 1
                if screen.step_s(self.chain.stages(self.devices(neighbour))) < optimum.step_s:
                    found = self._solve(neighbour, optimum.step_s)
                    if found is not None and found.step_s < optimum.step_s:
                        optimum, labels, improved = found, neighbour, True


def _all_sequences(sizes: list[int], max_length: int, replicate: bool = False):
    """Every slot sequence of length 1..max_length using at most sizes[g] devices of label g."""
    remaining = list(sizes)
    prefix: list[tuple[int, int]] = []

    def extend():
        if prefix:
            yield tuple(prefix)
        if len(prefix) == max_length:
            return
        for g, left in enumerate(remaining):
            for r in range(1, (left if replicate else min(left, 1)) + 1):
                remaining[g] -= r
                prefix.append((g, r))
                yield from extend()
                prefix.pop()
                remaining[g] += r

    yield from extend()


def _runs(slots) -> list[list[tuple[int, int]]]:
    """Maximal runs of consecutive slots of one label."""
    runs: list[list[tuple[int, int]]] = []
    for slot in slots:
        if runs and runs[-1][0][0] == slot[0]:
            runs[-1].append(slot)
        else:
            runs.append([slot])
    return runs


def _neighbours(slots, sizes: list[int], replicate: bool):
    """Sequences one move away: drop or add a device, insert an unused label, split or merge a
    replicated stage, swap adjacent runs, move a run to either end."""
    slots = list(slots)
    used = Counter()
    for g, r in slots:
        used[g] += r
    for i, (g, r) in enumerate(slots):
        yield tuple(slots[:i] + ([(g, r - 1)] if r > 1 else []) + slots[i + 1 :])
        if used[g] < sizes[g]:
            yield tuple(slots[: i + 1] + [(g, 1)] + slots[i + 1 :])
            if replicate:
                yield tuple(slots[:i] + [(g, r + 1)] + slots[i + 1 :])
        if replicate and r > 1:
            yield tuple(slots[:i] + [(g, r - 1), (g, 1)] + slots[i + 1 :])
            yield tuple(slots[:i] + [(g, r // 2), (g, r - r // 2)] + slots[i + 1 :])
        if replicate and i + 1 < len(slots) and slots[i + 1][0] == g:
            yield tuple(slots[:i] + [(g, r + slots[i + 1][1])] + slots[i + 2 :])
    for g in range(len(sizes)):
        if used[g] == 0:
            for i in range(len(slots) + 1):
                yield tuple(slots[:i] + [(g, 1)] + slots[i:])
                if replicate and sizes[g] > 1:
                    yield tuple(slots[:i] + [(g, sizes[g])] + slots[i:])
    runs = _runs(slots)
    flat = lambda parts: tuple(slot for run in parts for slot in run)  # noqa: E731
    for r in range(len(runs) - 1):
        yield flat(runs[:r] + [runs[r + 1], runs[r]] + runs[r + 2 :])
    for r in range(1, len(runs)):
        yield flat([runs[r]] + runs[:r] + runs[r + 1 :])
        yield flat(runs[: r - 1] + runs[r:] + [runs[r - 1]])


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
        slots = [(g, 1) for g in order for _ in groups[g]][:max_length]
        if problem.replicate:  # every label as one replicated stage, as two, or as stages of r devices
            yield from _prefixes([(g, len(groups[g])) for g in order][:max_length], True)
            halves = [(g, r) for g in order for r in _halves(len(groups[g]))][:max_length]
            yield from _prefixes(halves, True)
            for width in (2, 4):
                split = [(g, r) for g in order for r in _widths(len(groups[g]), width)][:max_length]
                yield from _prefixes(split, every_prefix)
        yield from _prefixes(slots, every_prefix)


def _widths(size: int, width: int) -> list[int]:
    """``size`` devices as stages of ``width`` replicas (the remainder as one more stage)."""
    return [width] * (size // width) + ([size % width] if size % width else [])


def _halves(size: int) -> list[int]:
    return [size] if size == 1 else [size // 2, size - size // 2]


def _prefixes(slots: list, every: bool):
    lengths = range(1, len(slots) + 1) if every else (len(slots) * i // 8 for i in range(1, 9))
    for k in sorted({max(1, k) for k in lengths}, reverse=True):
        yield tuple(slots[:k])
