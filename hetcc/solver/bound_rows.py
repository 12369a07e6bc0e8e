"""One stage of the DP in ``dp.Chain.min_sums`` for a set of bounds b at once (one row per bound).

``g_j(a) = min over ends i in (a, hi(a)] of P_t[i] - P_t[a] + C_j[i] + g_{j+1}(i)``: a sliding-window
minimum of ``h = P_t + C_j + g_{j+1}``, answered for every row and every mode of the stage with one
sparse table. What depends on the bounds alone (which ends a link term allows, the window of ends,
the table's indices) is kept per kind of stage, so a set of rows used for many sequences (the
screen's) computes it once.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np


class Window(NamedTuple):
    """Per mode, row and start a: the last end ``hi`` and the flat sparse-table indices of the two
    power-of-two halves covering (a, hi] (both the table's inf column where the window is empty)."""

    hi: np.ndarray  # (modes, rows, N+1)
    left: np.ndarray
    right: np.ndarray
    levels: int  # sparse-table levels above the first that some window needs


class Table(NamedTuple):
    """A sparse table, (levels, modes, rows, N+2), through views made once: level 0's columns 0..N
    (h), the whole flat, and per level k its two halves 2**k apart with level k+1's columns they fill."""

    first: np.ndarray
    flat: np.ndarray
    levels: list[tuple[np.ndarray, np.ndarray, np.ndarray]]


class BoundRows:
    """Bounds b (``trip_bounds_s`` replaces b in the round-trip limits) and per-kind caches for them.

    The caches key on the identities of the chain's arrays, which live as long as the chain.
    """

    def __init__(self, chain, bounds_s, trip_bounds_s=None):
        self.chain = chain
        self.count, self.width = len(bounds_s), chain.n + 1
        self._starts = np.arange(self.width)
        self._pair_base = self._starts * (self.width + 2) + 1  # start a, last end hi -> a * (N+3) + hi + 1
        self._row_bases: dict[int, np.ndarray] = {}
        self.slack = chain._slack(np.asarray(bounds_s, dtype=float))
        self.trip_slack = (
            self.slack if trip_bounds_s is None else chain._slack(np.asarray(trip_bounds_s, dtype=float))
        )
        self._costs: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._windows: dict[tuple, Window] = {}
        # Per slot record (the chain keeps one per kind alive, so its id names it): its costs, window and
        # round-trip limit per row, found through the keys above once, as a sequence repeats a kind of stage.
        self._of_stage: dict[int, tuple[tuple[np.ndarray, np.ndarray], Window, np.ndarray | None]] = {}
        self._reaches: dict[tuple, np.ndarray] = {}
        # Per mode count: (levels, modes, rows, N+2); column N+1 of level 0 stays inf (the empty window's
        # answer), and level k's last 2**k - 1 columns are never written.
        self._tables: dict[int, Table] = {}

    def last_suffix(self) -> np.ndarray:
        """g_K: nothing left to place costs 0 at the chain's end and is impossible before it."""
        g = np.full((self.count, self.width), math.inf)
        g[:, -1] = 0.0
        return g

    def relax(self, stage, g: np.ndarray, kept: list | None = None) -> np.ndarray:
        """g_j from g_{j+1} (rows × N+1). With ``kept`` appends, per mode of the stage, (h of row 0,
        window ends of row 0, g of row 0 in that mode) for backtracking."""
        found_for = self._of_stage.get(id(stage))
        if found_for is None:
            limit = (self.trip_slack * stage.slots)[:, None] if math.isfinite(stage.slots) else None
            found_for = self._of_stage[id(stage)] = (self._cost(stage), self._window(stage), limit)
        (cost, sum_prefix), window, limit = found_for
        table = self._table(len(stage.modes))
        np.add(g, cost, out=table.first)  # h[i] = S-prefix(i) + C_j(i) + g_{j+1}(i)
        for low, high, out in table.levels[: window.levels]:
            np.minimum(low, high, out=out)
        found = np.minimum(table.flat.take(window.left), table.flat.take(window.right))
        found -= sum_prefix
        if kept is not None:
            kept.append(
                [
                    (table.first[m, 0].copy(), window.hi[m, 0].copy(), found[m, 0].copy())
                    for m in range(len(found))
                ]
            )
        best = found[0]
        for other in found[1:]:  # the best mode per row and start
            np.minimum(best, other, out=best)
        if limit is not None:  # a least suffix above the round-trip limit: every suffix is
            best[best > limit] = math.inf
        return best

    def _table(self, modes: int) -> Table:
        if modes not in self._tables:
            spans = _spans(self.width)
            array = np.full((len(spans), modes, self.count, self.width + 1), math.inf)
            levels = [
                (array[k, ..., :-span], array[k, ..., span:], array[k + 1, ..., :-span])
                for k, span in enumerate(spans[:-1])
            ]
            self._tables[modes] = Table(array[0, ..., : self.width], array.reshape(-1), levels)
        return self._tables[modes]

    def _cost(self, stage) -> tuple[np.ndarray, np.ndarray]:
        """Per mode: T+A prefix + C_j by end block (inf where the link term exceeds b), and the prefix
        the window's minimum is measured from."""
        key = (
            id(stage.comm_s),
            stage.link_share,
            tuple((id(m.sum_prefix), m.constant_s) for m in stage.modes),
        )
        if key not in self._costs:
            end_costs, sum_prefixes, link_term = self.chain.end_costs(stage, key)
            over = link_term[None, :] > self.slack[:, None]
            self._costs[key] = np.where(over, math.inf, end_costs[:, None, :]), sum_prefixes
        return self._costs[key]

    def _window(self, stage) -> Window:
        key = (stage.share, tuple((id(m.term_prefix), id(m.hi_memory)) for m in stage.modes))
        if key not in self._windows:
            hi = np.array(
                [np.minimum(self._reach(m.term_prefix, stage.share), m.hi_memory) for m in stage.modes]
            )
            self._windows[key] = self._indices(hi)
        return self._windows[key]

    def _reach(self, term_prefix: np.ndarray, share: float) -> np.ndarray:
        """Per row and start a: the last end whose period term share * T stays within the bound."""
        key = (id(term_prefix), share)
        if key not in self._reaches:
            allowed = self.slack[:, None] / share if share > 0 else np.full((self.count, 1), math.inf)
            ends = np.searchsorted(term_prefix, (term_prefix[None, :] + allowed).ravel(), side="right") - 1
            self._reaches[key] = ends.reshape(self.count, self.width)
        return self._reaches[key]

    def _indices(self, hi: np.ndarray) -> Window:
        """The window's table indices: per (start, last end), its level and the columns of its two halves
        (``_window_columns``), offset by that level's plane and the mode and row."""
        modes = len(hi)
        level, left, right = _window_columns(self.width)
        pair = hi + self._pair_base  # (start, last end) -> its entry; a last end below start is empty
        plane = level.take(pair)
        offset = plane * (modes * self.count * (self.width + 1)) + self._row_base(modes)
        return Window(hi, left.take(pair) + offset, right.take(pair) + offset, int(plane.max()))

    def _row_base(self, modes: int) -> np.ndarray:
        """Per mode and row, the flat index of its first column in a table plane."""
        if modes not in self._row_bases:
            rows = np.arange(modes * self.count).reshape(modes, self.count, 1)
            self._row_bases[modes] = rows * (self.width + 1)
        return self._row_bases[modes]


@functools.lru_cache(maxsize=16)
def _log2(width: int) -> np.ndarray:
    """floor(log2(k)) for k = 0 .. width (0 for k < 2)."""
    out = np.zeros(width + 1, dtype=np.int64)
    out[2:] = np.floor(np.log2(np.arange(2, width + 1))).astype(np.int64)
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=16)
def _spans(width: int) -> list[int]:
    """The sparse table's window spans 1, 2, 4, ... up to ``width`` ends (N+1 for N blocks)."""
    return [1 << k for k in range(int(_log2(width)[width]) + 1)]


@functools.lru_cache(maxsize=16)
def _window_columns(width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per start a and last end hi of a chain of ``width`` = N+1 ends (entry a * (N+3) + hi + 1, hi from -1
    to N+1): the sparse-table level covering the window of ends (a, hi] with two halves, and the columns of
    the halves, ``a + 1`` and ``hi + 1 - 2**level`` (level 0 and column N+1, the table's inf column, where
    the window is empty)."""
    start, last = np.meshgrid(np.arange(width), np.arange(-1, width + 1), indexing="ij")
    length = last - start
    level = _log2(width).take(np.clip(length, 1, width))  # 0 where the window is empty
    empty = length <= 0
    left = np.where(empty, width, start + 1)
    right = np.where(empty, width, last + 1 - np.left_shift(1, level))
    columns = tuple(a.reshape(-1) for a in (level, left, right))
    for a in columns:
        a.setflags(write=False)
    return columns
