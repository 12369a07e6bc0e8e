"""ZeRO-1 for replicated stages: the optimizer state of a stage split across its r replicas.

Each replica of a sharding stage holds the weights and gradients whole but only 1/r of the optimizer
state (``problem.optimizer_for`` its type), so it holds ``state - optimizer * (1 - 1/r)`` bytes. After the
gradients' ring all-reduce each replica updates its shard of the parameters, and the updated shards
are gathered back (torch's ``ZeroRedundancyOptimizer`` broadcasts each shard from its owner), priced as
a ring all-gather of the stage's parameter bytes over the group's slowest link:
``(r - 1) * (latency + params / r / bandwidth)``, half a ring all-reduce. Sharding saves memory and
only costs time, so a stage shards where ``problem.shard_all`` asks for it, or where
``problem.shard`` allows it and the stage fits only with it (``chosen_shard``; the DP's choice for
given cuts is the same, ``dp.Chain._modes``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from hetcc.solver.links import device_ring_s, slowest_link
from hetcc.solver.problem import PartitionProblem, inflight_microbatches, replica_inflight

# A ring all-gather is the second half of a ring all-reduce: r - 1 of its 2 (r - 1) steps.
ALLGATHER_SHARE = 0.5


def allgather_s(problem: PartitionProblem, group: Sequence[int], start: int, stop: int) -> float:
    """The all-gather of the parameters of blocks ``[start, stop)`` after a sharded optimizer step
    over the replica ``group`` (0 for one device or inference)."""
    if not problem.training:
        return 0.0
    return ALLGATHER_SHARE * device_ring_s(problem, group, group_param_bytes(problem, group, start, stop))


def group_param_bytes(problem: PartitionProblem, group: Sequence[int], start: int, stop: int) -> float:
    """The parameter bytes of blocks ``[start, stop)`` that the fullest member of the replica ``group``
    holds: what its all-reduce and all-gather move (members of one device type hold the same)."""
    kinds = dict.fromkeys(problem.devices[d].type for d in group)
    return max(math.fsum(problem.params_for(kind)[start:stop]) for kind in kinds)


def step_end_rates(problem: PartitionProblem, group: Sequence[int], shard: bool) -> tuple[float, float]:
    """(seconds per parameter byte, constant seconds) of the replica ``group``'s step end: its ring
    all-reduce at the slowest link (``ring_allreduce_s``), and the all-gather after it where it shards;
    zeros for one device or inference."""
    r = len(group)
    if r < 2 or not problem.training:
        return 0.0, 0.0
    bandwidth, latency = slowest_link(problem, group)
    scale = 1.0 + (ALLGATHER_SHARE if shard else 0.0)
    return scale * 2 * (r - 1) / r / bandwidth, scale * 2 * (r - 1) * latency


def unheld_fraction(replicas: int) -> float:
    """The part of its optimizer state a replica of ``replicas`` sharding ones does not hold: 1 - 1/r."""
    return 1.0 - 1.0 / replicas


def sharded_bytes(problem: PartitionProblem, kind: str, start: int, stop: int, replicas: int) -> float:
    """Bytes of blocks ``[start, stop)``'s optimizer state one of ``replicas`` sharding replicas of
    device type ``kind`` does not hold (0 for one replica or inference)."""
    if not problem.training or replicas < 2:
        return 0.0
    return math.fsum(problem.optimizer_for(kind)[start:stop]) * unheld_fraction(replicas)


def shard_choices(problem: PartitionProblem, replicas: int) -> tuple[bool, ...]:
    """The sharding a stage on ``replicas`` devices may choose: not sharding first (it costs no time)."""
    if not problem.training or replicas < 2:
        return (False,)
    if problem.shard_all:
        return (True,)
    return (False, True) if problem.shard else (False,)


def chosen_shard(problem: PartitionProblem, replicas: int, saved_bytes: float, fits_whole: bool) -> bool:
    """Whether a stage on ``replicas`` devices shards when the plan does not say: always under
    ``shard_all``; under ``shard`` only where it saves bytes and the stage does not fit without it."""
    choices = shard_choices(problem, replicas)
    if len(choices) == 1:
        return choices[0]
    return saved_bytes > 0 and not fits_whole


def least_held_state(problem: PartitionProblem, kind: str) -> list[float]:
    """Per block, the fewest state bytes a device of type ``kind`` running it holds: all of it, or with
    sharding allowed ``o * (1 - 1/n)`` less (n = devices in the problem, the most replicas a group can
    have)."""
    state = list(problem.state_for(kind))
    n = len(problem.devices)
    if not (problem.shard or problem.shard_all) or not problem.training or n < 2:
        return state
    kept = unheld_fraction(n)
    return [s - o * kept for s, o in zip(state, problem.optimizer_for(kind))]


def sharded_whole_chain(problem: PartitionProblem) -> tuple[int, int, float] | None:
    """The plan sharding saves most memory in, for a diagnosis: every block on one replica group of
    the most numerous identical devices (type and memory), sharded. (Its first device, its replicas,
    the bytes each holds); None where replicated stages may not shard."""
    if not (problem.shard or problem.shard_all) or not problem.training or not problem.replicate:
        return None
    classes = Counter((d.type, d.memory_bytes) for d in problem.devices)
    (kind, memory), r = max(classes.items(), key=lambda item: (item[1], item[0][1]))
    if r < 2:
        return None
    first = next(i for i, d in enumerate(problem.devices) if (d.type, d.memory_bytes) == (kind, memory))
    held = replica_inflight(inflight_microbatches(problem, 0, 1, [r]), r)
    used = math.fsum(problem.state_for(kind)) - sharded_bytes(problem, kind, 0, len(problem.blocks), r)
    return first, r, used + held * math.fsum(problem.act_for(kind))
