"""Chrome trace / Perfetto JSON of one pipeline step, simulated or measured.

Open the file in https://ui.perfetto.dev or ``chrome://tracing``: one process per stage (named after its
devices), two threads per replica of the stage: compute (``F3``, ``B3``, ``ALLREDUCE``) and sends
(``SEND_F3``), times in microseconds. The simulated and the measured trace share this layout so they can
be compared side by side.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

CATEGORIES = {"F": "forward", "B": "backward", "W": "weight gradient", "SEND_F": "send", "SEND_B": "send",
              "ALLREDUCE": "allreduce"}  # fmt: skip

Row = tuple[int, int]  # (stage, replica)


def chrome_trace(events: Iterable[tuple], rows: Mapping[Row, str], label: str) -> dict[str, Any]:
    """``events`` as ``(stage, replica, kind, microbatch, start_s, end_s)``; ``rows`` names each
    (stage, replica)'s device; ``label`` says simulated or measured. A stage is a process, each replica
    two threads (compute, send)."""
    trace: list[dict[str, Any]] = []
    for stage in sorted({stage for stage, _ in rows}):
        devices = ", ".join(name for (k, _), name in sorted(rows.items()) if k == stage)
        trace.append(_meta("process_name", stage, 0, f"stage {stage} on {devices} ({label})"))
        trace.append(_meta("process_sort_index", stage, 0, stage, key="sort_index"))
    for (stage, replica), device in sorted(rows.items()):
        trace.append(_meta("thread_name", stage, 2 * replica, f"{device} compute"))
        trace.append(_meta("thread_name", stage, 2 * replica + 1, f"{device} send"))
    for stage, replica, kind, microbatch, start_s, end_s in events:
        name = kind if microbatch < 0 else f"{kind}{microbatch}"
        trace.append({
            "name": name, "cat": CATEGORIES.get(kind, kind.lower()), "ph": "X", "ts": start_s * 1e6,
            "dur": max(end_s - start_s, 0.0) * 1e6, "pid": stage,
            "tid": 2 * replica + (1 if kind.startswith("SEND") else 0), "args": {"microbatch": microbatch},
        })  # fmt: skip
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"hetcc": label}}


def simulated_trace(simulation, rows: Mapping[Row, str]) -> dict[str, Any]:
    """The trace of ``hetcc.solver.simulate.simulate(...)``'s events."""
    events = [
        (e.stage, getattr(e, "replica", 0), e.kind, e.microbatch, e.start_s, e.end_s)
        for e in simulation.events
    ]
    named = dict(rows)
    for e in simulation.events:  # replicas the caller did not name: the event says its device
        named.setdefault((e.stage, getattr(e, "replica", 0)), getattr(e, "device", "") or f"stage {e.stage}")
    return chrome_trace(events, named, "simulated")


def measured_trace(
    folder: str | Path, ranks: Sequence[tuple[int | tuple[int, ...], int, str]]
) -> dict[str, Any]:
    """The trace of a run's ``rank<k>.json`` files (``hetcc.runtime.recorder``); ``ranks[k]`` is rank k's
    (stage, or its stages by chunk under interleaved 1F1B; replica; device). Every step is kept; time 0 is
    the first action of any rank; an action on a rank's chunk c shows on that chunk's stage."""
    per_rank = []
    for rank in range(len(ranks)):
        path = Path(folder) / f"rank{rank}.json"
        per_rank.append(json.loads(path.read_text()) if path.exists() else [])
    origin = min((e[3] for events in per_rank for e in events), default=0.0)
    stages = [(stage,) if isinstance(stage, int) else tuple(stage) for stage, _, _ in ranks]
    events = [
        (
            stages[rank][chunk[0] if chunk else 0],
            ranks[rank][1],
            kind,
            microbatch,
            start - origin,
            end - origin,
        )
        for rank, rows in enumerate(per_rank)
        for _step, kind, microbatch, start, end, *chunk in rows
    ]
    named = {(stage, replica): device for held, (_, replica, device) in zip(stages, ranks) for stage in held}
    return chrome_trace(events, named, "measured")


def write_trace(trace: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace))
    return path


def _meta(name: str, pid: int, tid: int, value: Any, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}
