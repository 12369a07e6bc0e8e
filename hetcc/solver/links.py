"""What moving bytes between a problem's devices costs: one message over a link, a ring all-reduce over
a group's slowest link, the step-end sum of tied weights; and each group's slowest and fastest link."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hetcc.solver.problem import PartitionProblem


def ring_allreduce_s(nbytes: float, replicas: int, bandwidth_bps: float, latency_s: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``replicas`` devices: 2 (r - 1) steps of
    nbytes / r each over the slowest link of the ring."""
    if replicas <= 1:
        return 0.0
    return 2 * (replicas - 1) * (latency_s + nbytes / replicas / bandwidth_bps)


def slowest_link(problem: PartitionProblem, devices: Sequence[int]) -> tuple[float, float]:
    """(least bandwidth, largest latency) between any two of ``devices`` (at least two): a ring over them
    runs at that pace."""
    pairs = [(a, b) for a in devices for b in devices if a != b]
    return (
        min(problem.bandwidth_bps[a][b] for a, b in pairs),
        max(problem.latency_s[a][b] for a, b in pairs),
    )


def fastest_link(problem: PartitionProblem, devices: Sequence[int]) -> tuple[float, float]:
    """(most bandwidth, least latency) between any two of ``devices`` (at least two): no transfer
    between them is faster (``bound.lower_bound``'s tied-weight sums)."""
    pairs = [(a, b) for a in devices for b in devices if a != b]
    return (
        max(problem.bandwidth_bps[a][b] for a, b in pairs),
        min(problem.latency_s[a][b] for a, b in pairs),
    )


def device_ring_s(problem: PartitionProblem, devices: Sequence[int], nbytes: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``devices`` at their slowest link (0 for one device)."""
    if len(devices) < 2:
        return 0.0
    return ring_allreduce_s(nbytes, len(devices), *slowest_link(problem, devices))


def end_tied_s(problem: PartitionProblem, first: Sequence[int], last: Sequence[int]) -> float:
    """Step-end sum of the weights tied between the chain's first and last blocks (an embedding tied to
    the head) over the devices of the first and the last stage: a ring per weight over their slowest
    link; 0 for one stage or inference. The search's formula counts these; the simulator times every
    tied weight over all its holders."""
    devices = list(dict.fromkeys([*first, *last]))
    if not problem.training or not problem.tied_blocks:
        return 0.0
    n = len(problem.blocks)
    return math.fsum(
        device_ring_s(problem, devices, nbytes)
        for users, nbytes in zip(problem.tied_blocks, problem.tied_bytes or [])
        if 0 in users and n - 1 in users and nbytes > 0
    )


def transfer_s(problem: PartitionProblem, src: int, dst: int, nbytes: float) -> float:
    """One uncoded message of ``nbytes`` over the src -> dst link (nothing is sent for 0 bytes); with
    a codec, ``codecs.message_s``."""
    if nbytes <= 0:
        return 0.0
    return problem.latency_s[src][dst] + nbytes / problem.bandwidth_bps[src][dst]
