"""Several independent ``solve`` calls at once, in forked worker processes.

The tensor-degree search solves one problem per degree assignment it tries, and ``schedule="auto"``
one per schedule: independent and deterministic, each seconds long on a large cluster. ``solve_each``
runs them in ``config.solver_workers`` processes (0: one per CPU core) where the jobs are large enough
to pay for starting the processes (``PARALLEL_WORK``), on Linux; else one after another. ``Solves``
starts jobs as they come, so that the caller goes on meanwhile ("auto" searches while the pipelines
that interleaved 1F1B is laid on are solved). The answers
are the same either way: each job is the same ``solve`` call, and a forked worker inherits the
parent's knobs (``hetcc.config``). The solver is numpy and Python: a worker never calls torch, so
forking a process that has loaded it is safe there (torch's own DataLoader forks its workers too);
macOS's system libraries are not fork-safe, so it solves one after another. A worker first freezes what
it inherits (``gc.freeze``): its collector then never walks the compiling process's graphs, whose pages
each walk would copy into the worker (copy-on-write) and which a solve never reads. ``map_forked`` runs
other solver jobs side by side the same way (the microbatch search's counts, each solving its own
problems one after another in its worker).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from hetcc import config
from hetcc.errors import InfeasiblePlanError
from hetcc.solver.problem import PartitionProblem, PartitionSolution
from hetcc.solver.solve import Searched, search_plans, solve_searched

# Blocks x devices x microbatches summed over the jobs: below it they solve faster one after another
# than processes start (the 70B problem's tensor groups are ~73,000 each, GPT-2 medium's ~7,000).
PARALLEL_WORK = 200_000

Job, Answer = TypeVar("Job"), TypeVar("Answer")


def solve_each(
    problems: Sequence[PartitionProblem], rerank: int = 0, searched: Sequence[Searched | None] | None = None
) -> list[PartitionSolution | InfeasiblePlanError]:
    """``solve(problem, rerank)`` of each problem, in order; a problem no plan fits gives its
    InfeasiblePlanError in its place rather than raising. ``searched``: per problem, what
    ``solve.search_plans`` found for it (or for it under a schedule its searches see alike), so that job
    only re-ranks and refines (``solve.solve_searched``); None: the job searches. Where a worker dies,
    its jobs are solved again in this process."""
    with Solves(problems) as solves:
        pending = [
            solves.submit(p, rerank, found) for p, found in zip(problems, searched or [None] * len(problems))
        ]
        return [answer() for answer in pending]


class Solves:
    """``solve`` jobs handed to forked workers as they are submitted, so that the caller works on (a
    search, say) while they run; or, where the work of ``problems`` (every problem that will be
    submitted) does not pay for starting processes, each solved in this process when its answer is
    asked for. A context manager: leaving it waits for the workers, or cancels what has not started
    where it is left by an error."""

    def __init__(self, problems: Sequence[PartitionProblem]):
        self.workers = _workers(problems)  # 1: each job solved here, when its answer is asked for
        context = multiprocessing.get_context("fork") if self.workers > 1 else None
        self._pool = (
            ProcessPoolExecutor(self.workers, mp_context=context, initializer=gc.freeze) if context else None
        )

    def __enter__(self) -> Solves:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=error is not None)

    def submit(
        self, problem: PartitionProblem, rerank: int = 0, searched: Searched | None = None
    ) -> Callable[[], PartitionSolution | InfeasiblePlanError]:
        """``solve_each``'s job for ``problem``, started; call what it returns for the answer."""
        answer = self.submit_searched(problem, rerank, searched)
        return lambda: answer()[0]

    def submit_searched(
        self, problem: PartitionProblem, rerank: int = 0, searched: Searched | None = None
    ) -> Callable[[], tuple[PartitionSolution | InfeasiblePlanError, Searched | None]]:
        """``submit``, its answer with what its searches found (None where no plan fits), for the caller to
        re-rank under another schedule the searches see alike without searching again."""
        job = (problem, rerank, searched)
        if self._pool is None:
            return lambda: _solve_or_error(job)
        try:
            future = self._pool.submit(_solve_or_error, job)
        except BrokenProcessPool:  # a worker died before: solve here instead
            return lambda: _solve_or_error(job)

        def answer() -> tuple[PartitionSolution | InfeasiblePlanError, Searched | None]:
            try:
                return future.result()
            except BrokenProcessPool:  # a worker died (killed, out of memory): solve here instead
                return _solve_or_error(job)

        return answer


def forks(problems: Sequence[PartitionProblem]) -> bool:
    """Whether ``Solves`` hands these problems' solves to forked workers (their work pays for it)."""
    return _workers(problems) > 1


def map_forked(function: Callable[[Job], Answer], jobs: Sequence[Job]) -> list[Answer]:
    """``[function(job) for job in jobs]``, the jobs side by side in forked workers (one per CPU core, or
    ``config.solver_workers``), each of which solves its own problems one after another (its ``Solves``
    do not fork again); in this process where it does not fork, or for a job whose worker died.
    ``function`` is a module-level function, its answers plain data (they are pickled back)."""
    workers = min(len(jobs), worker_count())
    if workers < 2 or not sys.platform.startswith("linux"):
        return [function(job) for job in jobs]
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_serial_worker) as pool:
        futures = [pool.submit(function, job) for job in jobs]
        answers = []
        for job, future in zip(jobs, futures):
            try:
                answers.append(future.result())
            except BrokenProcessPool:  # a worker died (killed, out of memory): run it here instead
                answers.append(function(job))
        return answers


def _serial_worker() -> None:
    gc.freeze()
    config.solver_workers = 1


def _workers(problems: Sequence[PartitionProblem]) -> int:
    # Forks only on Linux: macOS's system libraries are not fork-safe.
    if len(problems) < 2 or not sys.platform.startswith("linux"):
        return 1
    if sum(len(p.blocks) * len(p.devices) * p.microbatches for p in problems) < PARALLEL_WORK:
        return 1
    return min(len(problems), worker_count())


def worker_count() -> int:
    """The workers jobs may run in at once: ``config.solver_workers``, or one per CPU core."""
    return config.solver_workers or os.cpu_count() or 1


def _solve_or_error(job: tuple) -> tuple[PartitionSolution | InfeasiblePlanError, Searched | None]:
    """``solve(problem, rerank)`` (its searches skipped where ``searched`` is given), with what they found."""
    problem, rerank, searched = job
    try:
        problem.validate()
        searched = search_plans(problem, rerank) if searched is None else searched
        return solve_searched(problem, searched, rerank), searched
    except InfeasiblePlanError as error:
        return error, None
