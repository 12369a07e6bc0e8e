"""One step's batch in microbatches: its rows, the first microbatch (what ``hetcc.compile`` traces),
and for ``microbatches="auto"`` the search: every divisor of the batch priced from a single trace with
a symbolic batch dimension, and the count whose plan simulates fastest kept (a count whose lower bound
is above a plan already found is not planned)."""

from __future__ import annotations

import inspect
import logging
import math
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from hetcc import config
from hetcc.errors import HetccError, InfeasiblePlanError
from hetcc.hardware.cluster import Cluster
from hetcc.passes.cost import block_times_at
from hetcc.passes.fuse import fusion_candidates
from hetcc.passes.partition import PlanSettings, build_problem
from hetcc.passes.schedule_search import AUTO_SCHEDULES, schedule_bound, solve_schedules
from hetcc.passes.trace import without_stack_traces
from hetcc.solver.parallel import forks, map_forked, worker_count
from hetcc.solver.problem import PartitionProblem
from hetcc.train.data import split_microbatches

# A count planned in this long, its schedules solved one after another, has the next counts planned side
# by side (``_plan_counts``); shorter ones are not worth starting processes for.
PARALLEL_COUNT_S = 1.0


def search_microbatches(
    model: torch.nn.Module,
    cluster: Cluster,
    args,
    kwargs: dict,
    settings: PlanSettings,
    dtype: object | None,
    analyze: Callable[..., Any],
) -> tuple[int, list[tuple[int, float]], list[str]]:
    """(best M, (M, simulated step) for every M planned, notes): one trace of the whole batch with its
    dim 0 symbolic (``torch.export.Dim``), then for every divisor M of the batch the analysis is
    evaluated at batch / M rows (sympy) and priced; no retrace per M. Each count is planned and
    simulated unless its lower bound shows it cannot beat a count already planned (``_plan_counts``).

    Each M prices the fusion groups as the compile at that M does (``passes.cost``: a group fuses on a
    device type where its kernel beats its ops there, at that microbatch's sizes), so the figure kept
    for the chosen M is the plan's. A model that does not trace with a symbolic batch keeps the largest divisor
    of the batch up to 8, and the plan says why. ``analyze`` is ``hetcc.api.analyze``, passed in
    because ``hetcc.api`` imports this module.
    """
    rows = settings.batch_rows
    if rows <= 1:
        return 1, [], []
    fallback = max(m for m in range(1, min(rows, 8) + 1) if rows % m == 0)
    batch = torch.export.Dim("batch", min=1, max=rows)
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
        shapes = {
            name: ({0: batch} if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows else None)
            for name, v in bound.arguments.items()
        }
        with _quiet(), without_stack_traces():  # priced only: no source lines wanted
            symbolic = analyze(model, args, kwargs, dynamic_shapes=shapes, training=settings.training)
        symbol = symbolic.dim_symbols["batch"]
    except (HetccError, TypeError, KeyError, RuntimeError, ValueError) as error:
        reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        return fallback, [], [f"microbatches: kept {fallback} (no trace with a symbolic batch: {reason})"]
    candidates = fusion_candidates(symbolic.graph) if config.fuse != "off" else []
    priced = []
    for m in (m for m in range(1, rows + 1) if rows % m == 0):
        at, subs = symbolic.evaluate(batch=rows // m), {symbol: rows // m}
        fwd, bwd, choice = block_times_at(
            symbolic.graph, [b.nodes for b in at.blocks], cluster.types, subs, dtype=dtype,
            training=settings.training, autocast=settings.precision != "fp32", candidates=candidates,
            fuse=config.fuse,
        )  # fmt: skip
        change = choice.act_bytes_change([b.name for b in at.blocks], subs) if settings.training else None
        priced.append(build_problem(
            symbolic.graph, at.blocks, at.tied_params, cluster, replace(settings, microbatches=m),
            (fwd, bwd), act_change=change, subs=subs,
        ))  # fmt: skip
    # a pinned tensor degree: each count under the schedules the compile may keep (one stage per device)
    tried, notes = _plan_counts(priced, settings.schedule, settings.tensor_parallel in (False, "auto"))
    best_s, best_m = min((s, m) for m, s in tried)
    if math.isinf(best_s):
        return fallback, tried, [*notes, f"microbatches: no count fits in memory; kept {fallback}"]
    return best_m, tried, notes


def _plan_counts(
    problems: list[PartitionProblem], schedule: str, multi_stage: bool = True
) -> tuple[list[tuple[int, float]], list[str]]:
    """((M, simulated step) of each count planned, in order of M; notes): ``problems`` (one per count)
    planned in order of their lower bounds (``schedule_search.schedule_bound``: the least over the
    schedules tried), skipping each whose bound exceeds the fastest plan found so far: no plan of it can be faster,
    so the count kept is the one planning every count would keep; a note names those skipped.

    Where one count's planning took ``PARALLEL_COUNT_S`` or more and does not fork solvers of its own
    (``parallel.forks``: a small problem on many devices, whose search is long), the next counts are
    planned side by side (``parallel.map_forked``), as many at once as there are workers, each wave
    skipping by the fastest plan of the waves before it: a count planned that one after another would
    skip cannot be kept either, so the count kept is the same."""
    bounds = [schedule_bound(p, schedule, multi_stage) for p in problems]
    waiting = sorted(zip(bounds, problems), key=lambda item: (item[0], item[1].microbatches))
    tried, skipped, best_s, width = [], [], math.inf, 1
    while waiting:
        wave = []
        while waiting and len(wave) < width:
            bound, problem = waiting.pop(0)
            if bound > best_s:
                skipped.append(f"M={problem.microbatches} ({bound * 1e3:.2f} ms)")
            else:
                wave.append((problem, schedule, multi_stage))
        start = time.perf_counter()
        steps = map_forked(_planned_s, wave) if len(wave) > 1 else [_planned_s(job) for job in wave]
        if (
            wave
            and time.perf_counter() - start >= PARALLEL_COUNT_S
            and not forks([wave[0][0]] * len(AUTO_SCHEDULES))
        ):
            width = worker_count()
        tried += [(job[0].microbatches, step_s) for job, step_s in zip(wave, steps)]
        best_s = min([best_s, *steps])
    notes = [
        f"microbatches: not planned, as its lower bound exceeds the fastest plan ({best_s * 1e3:.2f} ms): "
        + ", ".join(skipped)
    ] if skipped else []  # fmt: skip
    return sorted(tried), notes


def _planned_s(job: tuple[PartitionProblem, str, bool]) -> float:
    """The simulated step of ``solve_schedules(*job)``'s plan; inf where no plan fits."""
    try:
        return solve_schedules(*job)[1].simulated_s
    except InfeasiblePlanError:
        return math.inf


@contextmanager
def _quiet():
    """torch.export's own warnings about the symbolic dim are not the user's business here."""
    names = ("torch._dynamo", "torch.fx.experimental.symbolic_shapes", "torch.export")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def batch_rows(args, kwargs: dict) -> int:
    """Rows of one step's batch: dim 0 of the first tensor input (0 if there is none)."""
    values = list(args) if isinstance(args, (tuple, list)) else [args]
    for value in [*values, *kwargs.values()]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


def first_microbatch(args: tuple, kwargs: dict[str, Any], microbatches: int) -> tuple[tuple, dict]:
    """The first of ``microbatches`` equal chunks of the example batch (what hetcc traces)."""
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    if not isinstance(kwargs, dict):
        raise HetccError(f"example_kwargs must be a dict of input name -> value, got {type(kwargs).__name__}")
    first = split_microbatches({**dict(enumerate(args)), **kwargs}, microbatches)[0]
    return tuple(first[i] for i in range(len(args))), {k: first[k] for k in kwargs}
