"""Spawn one process per rank, watch them, and report a failure first cause first.

Every rank beats a heartbeat (a shared array of wall-clock times, written by a thread every
``BEAT_S``) and writes its result or its error, with the time it failed, to ``rank<k>.pt``. The parent
polls them. A failure is a rank that wrote an error, a process that ended without a result (killed by
a signal, ``os._exit``, a crash before its stage started) or one whose heartbeat stopped while it is
still there (SIGSTOP, swapped out). From the first failure on, the other ranks get ``GRACE_S`` to
report what they saw; then every rank still there is killed. So a run that fails returns within the
communication timeout (peers waiting on a silent rank give up after it) plus a small constant, however
many steps it was asked for, and the error lists the ranks in the order they failed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from hetcc.errors import RuntimeFailure

BEAT_S = 0.2  # how often a rank's heartbeat thread writes the time
STALE_S = 10.0  # a live rank whose heartbeat is this old has stopped (SIGSTOP, frozen) ...
STALE_SHARE = 0.25  # ... or this share of the communication timeout, if longer (busy machines)
GRACE_S = 5.0  # after the first failure, how long the other ranks get to report before being killed
POLL_S = 0.05


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure: when (seconds after the ranks were started) and what."""

    rank: int
    after_s: float
    message: str
    trace: str = ""


@dataclass
class _Watch:
    """What the parent saw of one rank."""

    ended_at: float | None = None
    stopped: bool = False
    state: str = ""  # the process's state letter when it was found stopped (Linux: T = stopped)
    killed_by_hetcc: bool = False
    report: dict | None = None


def spawn_ranks(world: int, worker: Callable, job: dict) -> tuple[list[dict], list[RankFailure]]:
    """Run ``worker(rank, world, job, beats)`` in ``world`` spawned processes; returns each rank's report
    (``None`` where there is none) and the failures, first first (empty when every rank succeeded)."""
    context = mp.get_context("spawn")
    beats = context.Array("d", world, lock=False)
    processes = [context.Process(target=worker, args=(rank, world, job, beats)) for rank in range(world)]
    start = time.time()
    try:
        for process in processes:
            process.start()
        stale_s = max(STALE_S, STALE_SHARE * float(job.get("timeout_s", 0.0)))
        watches = _supervise(processes, beats, job["results"], stale_s)
    finally:  # an interrupted caller (Ctrl-C) leaves no rank behind
        for process in processes:
            if process.pid is not None and process.is_alive():
                process.kill()
                process.join(10)
    failures = [
        failure
        for rank, watch in enumerate(watches)
        if (failure := _failure(rank, watch, processes[rank].exitcode, beats[rank], start)) is not None
    ]
    return [w.report for w in watches], sorted(failures, key=lambda f: f.after_s)


def _supervise(processes: list, beats, results: str, stale_s: float) -> list[_Watch]:
    watches = [_Watch() for _ in processes]
    first_failure = None
    while True:
        now = time.time()
        for rank, (process, watch) in enumerate(zip(processes, watches)):
            if watch.report is None:
                watch.report = _read_report(results, rank)
            if watch.ended_at is None and not process.is_alive():
                watch.ended_at = now
                watch.report = watch.report or _read_report(results, rank)
            elif watch.ended_at is None and beats[rank] and now - beats[rank] > stale_s and not watch.stopped:
                watch.stopped, watch.state = True, _process_state(process.pid)
            if first_failure is None and _has_failed(watch, process):
                first_failure = now
        if all(w.ended_at is not None for w in watches):
            return watches
        if first_failure is not None and now - first_failure > GRACE_S:
            break
        time.sleep(POLL_S)
    for process, watch in zip(processes, watches):
        if watch.ended_at is None:
            process.kill()  # SIGKILL: a stopped process cannot take SIGTERM
            process.join(10)
            watch.killed_by_hetcc, watch.ended_at = True, time.time()
    return watches


def _has_failed(watch: _Watch, process) -> bool:
    if watch.report is not None:
        return not watch.report["ok"]
    return watch.stopped or (watch.ended_at is not None and process.exitcode is not None)


def _read_report(results: str, rank: int) -> dict | None:
    path = os.path.join(results, f"rank{rank}.pt")  # written under another name, then renamed
    return torch.load(path, weights_only=True) if os.path.exists(path) else None


def _failure(rank: int, watch: _Watch, code: int | None, beat: float, start: float) -> RankFailure | None:
    report = watch.report
    if report is not None:
        if report["ok"]:
            return None
        return RankFailure(rank, report["time"] - start, f"rank {rank}: {report['error']}", report["trace"])
    # no report: the rank's last heartbeat bounds when it stopped (its peers noticed only later)
    last = (beat or watch.ended_at or start) - start
    if watch.stopped:
        state = "; the process was stopped (state T), e.g. by SIGSTOP" if watch.state in ("T", "t") else ""
        return RankFailure(
            rank, last, f"rank {rank} stopped responding (its heartbeat stopped{state}) and was "
            "killed by hetcc",
        )  # fmt: skip
    if watch.killed_by_hetcc:
        return RankFailure(
            rank, watch.ended_at - start,
            f"rank {rank} was still running {GRACE_S:g} s after the first failure and was killed by hetcc",
        )  # fmt: skip
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        return RankFailure(
            rank, last, f"rank {rank} was killed by {name} (exit code {code}) without a result"
        )
    if not beat:
        return RankFailure(
            rank, last, f"rank {rank} exited with code {code} before its stage started. {_bootstrap()}"
        )
    return RankFailure(
        rank, last, f"rank {rank} exited with code {code} without a result (os._exit or a crash)"
    )


def _process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat (Linux; '' elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _bootstrap() -> str:
    """Why a spawned rank dies before running: it re-imports the caller's ``__main__``."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    where = f" ({main})" if main else ""
    return (
        f"Spawned ranks re-import the script that called run_local{where}: if it calls run_local (or "
        'anything that starts processes) at top level, put that under `if __name__ == "__main__":`; the '
        "rank's own traceback is on stderr above"
    )


def failure_error(failures: list[RankFailure]) -> RuntimeFailure:
    """One error listing every failure, the first (the cause) first with its traceback's tail."""
    lines = [f"+{f.after_s:.2f} s  {f.message}" for f in failures]
    first = failures[0]
    tail = first.trace.strip().splitlines()[-6:] if first.trace else []
    text = "pipeline run failed; ranks in the order they failed:\n  " + "\n  ".join(lines)
    if tail:
        text += f"\n  where rank {first.rank} failed:\n      " + "\n      ".join(tail)
    hint = "the first line is the cause; ranks after it lost it as a peer" if len(failures) > 1 else None
    error = RuntimeFailure(text, hint=hint)
    error.failures = failures
    return error


# ---------------------------------------------------------------------------------- in the rank


def start_heartbeat(beats, rank: int) -> None:
    """A daemon thread writing the time into ``beats[rank]``: stops only when the process stops."""

    def beat() -> None:
        while True:
            beats[rank] = time.time()
            time.sleep(BEAT_S)

    threading.Thread(target=beat, name=f"hetcc-heartbeat-{rank}", daemon=True).start()


def write_report(results: str, rank: int, report: dict) -> None:
    """Save the report under a temporary name and rename it: the parent never reads half a file."""
    path = os.path.join(results, f"rank{rank}.pt")
    torch.save(report, path + ".tmp")
    os.replace(path + ".tmp", path)


def error_report(error: BaseException) -> dict:
    return {
        "ok": False, "time": time.time(), "error": f"{type(error).__name__}: {error}",
        "trace": traceback.format_exc(),
    }  # fmt: skip
