"""The memory of a stage's replica group: what it is made of (``Footprint``: state, one microbatch's
activations, capacity, what sharding saves) and what it holds at once (``Memory``), for the microbatches
its order keeps in flight (``held_counts``); ``objective.stage_costs`` weighs them per stage."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

from hetcc.solver.problem import within_memory
from hetcc.solver.schedules import defer_weights, max_inflight, one_f_one_b, replica_actions
from hetcc.solver.sharding import chosen_shard, sharded_bytes


@functools.lru_cache(maxsize=1 << 14)
def held_counts(
    microbatches: int, warmup: int, deferred: int | None, route: tuple[int, ...], replicas: int
) -> tuple[int, ...]:
    """Per replica of a training stage (its ``route``), the most microbatches it holds at once when it
    runs ``warmup`` forwards before its first backward, its W deferred ``deferred`` B's (None: its
    backward does not split). Cached: the search costs the same stage in many plans."""
    order = one_f_one_b(microbatches, warmup)
    actions = order if deferred is None else defer_weights(order, deferred)
    return tuple(max_inflight(replica_actions(actions, route, r)) for r in range(replicas))


def most_fitting(fits, least: int, most: int) -> int:
    """The largest n in [``least``, ``most``] for which ``fits(n)``, or ``least`` where none does:
    ``n`` counts microbatches a stage holds (weight gradients deferred, forwards before its first
    backward), so whether it fits falls as n grows (a bisection on memory alone; the stage is costed
    once, at the n found)."""
    if most <= least or fits(most):
        return max(least, most)
    low, high = least, most - 1  # fits(low) or low == least
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


class Memory(NamedTuple):
    """One replica group's memory: per replica its state, activation bytes (one microbatch), microbatches
    held, bytes used and bytes its sharding saves; whether it shards; the replica nearest its limit (the
    most over it) and whether that one fits (``StageCost.fits``)."""

    state: list[float]
    act: list[float]
    held: Sequence[int]
    used: list[float]
    saved: list[float]
    shard: bool
    fits: bool
    worst: int


class Footprint(NamedTuple):
    """What one replica group's memory is made of, whatever it holds at once: per replica its state and
    one microbatch's activation bytes, its capacity and the bytes sharding its optimizer state saves;
    what a recomputing stage keeps per microbatch (its input)."""

    state: list[float]
    act: list[float]
    caps: list[float]
    saved: list[float]
    kept: float


def group_footprint(problem, start: int, stop: int, group) -> Footprint:
    """The footprint of blocks ``[start, stop)`` on replica group ``group`` (worked out once per stage:
    ``stage_costs`` weighs several held counts against it)."""
    kinds = [problem.devices[d].type for d in group]
    return Footprint(
        [math.fsum(problem.state_for(t)[start:stop]) for t in kinds],
        [math.fsum(problem.act_for(t)[start:stop]) for t in kinds],
        [problem.devices[d].memory_bytes for d in group],
        [sharded_bytes(problem, t, start, stop, len(group)) for t in kinds],
        problem.cut_bytes[start - 1] if start > 0 else 0.0,
    )


def group_memory(problem, footprint: Footprint, held, recompute: bool, shard: bool | None) -> Memory:
    """The memory of a replica group of ``footprint``, each replica holding ``held`` microbatches'
    activations at once, sharding where ``shard`` says (None: ``chosen_shard``)."""
    state, act, caps, saved, kept = footprint
    used = [w + (h * kept + a if recompute else h * a) for w, a, h in zip(state, act, held)]
    if shard is None:
        shard = chosen_shard(problem, len(caps), max(saved), all(map(within_memory, used, caps)))
    shard = bool(shard and problem.training)
    if shard:
        used = [u - s for u, s in zip(used, saved)]
    worst = max(range(len(caps)), key=lambda r: used[r] - caps[r])
    return Memory(state, act, held, used, saved, shard, within_memory(used[worst], caps[worst]), worst)
