"""Wall-clock start and end of every F/B action a rank runs, for ``hetcc run --trace`` (measured timeline).

Off unless ``HETCC_TRACE_DIR`` names a folder (spawned ranks inherit it); then each rank rewrites
``rank<k>.json`` there after every step: ``[[step, kind, microbatch, start_s, end_s, chunk], ...]`` in
``time.time()`` seconds, which ranks on one host share (``chunk``: which of the rank's stages ran it,
under interleaved 1F1B; 0 otherwise). ``hetcc.report.timeline`` merges the files.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

TRACE_DIR_ENV = "HETCC_TRACE_DIR"


class ActionRecorder:
    """Adds up each step's action times; keeps the actions' wall-clock spans only when tracing is on."""

    def __init__(self, rank: int):
        self.folder = os.environ.get(TRACE_DIR_ENV) or None
        self.rank = rank
        self.step = 0
        self.events: list[list] = []

    @contextmanager
    def record(self, kind: str, microbatch: int, result, chunk: int = 0) -> Iterator[None]:
        """Time one action: its wall time is added to ``result.busy_s`` (always: two clock reads), and
        its start and end are kept for the trace when tracing is on."""
        start, begun = time.perf_counter(), time.time() if self.folder is not None else 0.0
        try:
            yield
        finally:
            result.busy_s += time.perf_counter() - start
            if self.folder is not None:
                self.events.append([self.step, kind, microbatch, begun, time.time(), chunk])

    def end_step(self) -> None:
        if self.folder is not None:
            os.makedirs(self.folder, exist_ok=True)
            with open(os.path.join(self.folder, f"rank{self.rank}.json"), "w") as f:
                json.dump(self.events, f)
        self.step += 1
