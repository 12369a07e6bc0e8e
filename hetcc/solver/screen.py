"""A cheap upper bound on a sequence's best step time, for the heuristic search to pick which
sequences deserve the exact search (``dp.solve_sequence``).

Any bound b gives a plan with every period term <= b, so with P <= b: ``S(b) + (M - 1) * b`` is a
step time some plan achieves (``dp`` module docstring). The screen evaluates it at a fixed set of
bounds near the incumbent's P for every neighbour of the incumbent. Neighbours share most of the
incumbent's stages, and the DP runs from the last stage back, so the suffix tables ``g_j`` of the
incumbent are kept and a neighbour's DP starts from the longest suffix it shares with it. Seeds,
unlike the incumbent, are screened at a wider set of bounds (``wide``) and nothing is kept.
"""

from __future__ import annotations

import math

import numpy as np

from hetcc.solver.bound_rows import BoundRows
from hetcc.solver.dp import Chain, SequenceSlot

NEAR_CANDIDATES = 6  # candidate values on each side of P
NEAR_RATIOS = (0.8, 0.9, 0.95, 0.98, 1.02, 1.05, 1.1, 1.25)  # ... and the candidates at these multiples of P
WIDE_RATIOS = (1.5, 2.0, 3.0)  # ... and these, for a sequence unlike the incumbent


def screen_bounds(values: np.ndarray, near_s: float, wide: bool = False) -> np.ndarray:
    """Candidate period values to screen at: those next to ``near_s`` and at a few multiples of it;
    with ``wide`` (or without a finite ``near_s``) also the largest, where no stage term is limited,
    and coarse multiples above, for a sequence whose P may lie far from ``near_s``."""
    picks = [len(values) - 1] if wide or not math.isfinite(near_s) else []
    if math.isfinite(near_s):
        centre = int(np.searchsorted(values, near_s))
        picks += range(centre - NEAR_CANDIDATES, centre + NEAR_CANDIDATES)
        picks += np.searchsorted(
            values, near_s * np.array(NEAR_RATIOS + (WIDE_RATIOS if wide else ()))
        ).tolist()
    return values[np.unique(np.clip(picks, 0, len(values) - 1))]


class Screen:
    """``S(b) + (M - 1) * b`` at fixed bounds b for many sequences, reusing remembered suffix tables."""

    def __init__(self, chain: Chain, bounds_s: np.ndarray):
        self.bounds_s = np.asarray(bounds_s, dtype=float)
        self.rows = BoundRows(chain, self.bounds_s)
        self.period_terms = (chain.microbatches - 1) * self.bounds_s
        self._suffix_node: dict[tuple[int, int], int] = {}  # (id(stage j), node of j+1..) -> node of j..
        self._tables = [self.rows.last_suffix()]  # g of each node; node 0 is the empty suffix
        self._remembered: list[list[SequenceSlot]] = []  # alive while the screen is: ids stay unique

    @classmethod
    def around(cls, chain: Chain, incumbent: list[SequenceSlot], near_s: float, wide: bool = False) -> Screen:
        """A screen at the incumbent's candidate values near its P (``screen_bounds``); unless ``wide``
        (for sequences unlike the incumbent) it remembers the incumbent's suffixes."""
        slope = chain.microbatches - 1
        screen = cls(chain, screen_bounds(chain.term_values(incumbent), near_s if slope else math.inf, wide))
        if not wide:
            screen.remember(incumbent)
        return screen

    def remember(self, stages: list[SequenceSlot]) -> None:
        """Keep the suffix tables of ``stages`` (all but the whole sequence) for later sequences."""
        self._remembered.append(stages)
        node, shared = self._shared_suffix(stages)
        g = self._tables[node]
        for stage in reversed(stages[1 : len(stages) - shared]):
            g = self.rows.relax(stage, g)
            self._suffix_node[id(stage), node] = node = len(self._tables)
            self._tables.append(g)

    def step_s(self, stages: list[SequenceSlot]) -> float:
        """A step time some plan on ``stages`` achieves (inf when none fits at these bounds)."""
        node, shared = self._shared_suffix(stages)
        g = self._tables[node]
        for stage in reversed(stages[: len(stages) - shared]):
            g = self.rows.relax(stage, g)
        return float(np.min(g[:, 0] + self.period_terms))

    def _shared_suffix(self, stages: list[SequenceSlot]) -> tuple[int, int]:
        """The node of the longest remembered suffix of ``stages`` (never the whole) and its length."""
        node, shared = 0, 0
        for stage in reversed(stages[1:]):
            deeper = self._suffix_node.get((id(stage), node))
            if deeper is None:
                break
            node, shared = deeper, shared + 1
        return node, shared
