"""What moving bytes between a problem's devices costs: one message over a link, a ring all-reduce over
a group's slowest link, the step-end sum of tied weights; and each group's slowest and fastest link."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

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
    the head) over the devices of the first and the last stage: what the first stage's devices spend on
    it after their last compute (``tied_sum_s``; the first stage holds only block 0's use, as far as
    the formula knows); 0 for one stage or inference. The search's formula counts these; the simulator
    times every tied weight over all its holders."""
    devices = list(dict.fromkeys([*first, *last]))
    if not problem.training or not problem.tied_blocks:
        return 0.0
    n = len(problem.blocks)
    return math.fsum(
        tied_sum_s(problem, k, devices, {0}, len(first) > 1 or len(last) > 1)[1]
        for k, (users, nbytes) in enumerate(zip(problem.tied_blocks, problem.tied_bytes or []))
        if 0 in users and n - 1 in users and nbytes > 0
    )


def exchanges(problem: PartitionProblem, devices: Sequence[int], replicated: bool = False) -> bool:
    """Whether the holders ``devices`` of a tied weight (the owner, the holder of its first user, first;
    ``replicated``: a stage holding it has replicas) sum its gradient by an exchange rather than a ring:
    two devices, neither a tensor-parallel group, no replicas (``runtime.tied.exchanges`` decides the
    same from its ranks). The other sends the owner its part whole as soon as it is done (the owner
    receives it while it still computes); the owner adds it and sends its own part back as its nonzero
    rows, with their indices, where that is smaller: an embedding's gradient has only the rows the step
    looked up."""
    return (
        len(devices) == 2 and not replicated and all(problem.devices[d].tensor_degree == 1 for d in devices)
    )


def owner_part_bytes(problem: PartitionProblem, k: int, blocks: Iterable[int]) -> float:
    """The most bytes the owner of tied weight ``k``, holding its users among ``blocks`` (every
    microbatch of them), sends back in an exchange: its nonzero rows with their indices, or the whole
    weight where that is no larger (``tied_grad_bytes``)."""
    nbytes = problem.tied_bytes[k]
    if problem.tied_grad_bytes is None:
        return nbytes
    held = set(blocks)
    rows = math.fsum(g for b, g in zip(problem.tied_blocks[k], problem.tied_grad_bytes[k]) if b in held)
    return min(nbytes, rows * problem.microbatches)


def tied_sum_s(
    problem: PartitionProblem, k: int, devices: Sequence[int], owned: Iterable[int], replicated: bool = False
) -> tuple[float, float]:
    """(before, after) of the step-end sum of tied weight ``k`` over its holders ``devices`` (the owner
    first, holding its users among blocks ``owned``; ``replicated`` as ``exchanges``): seconds of what
    may run while the owner still computes (an exchange's first message, the other's part whole) and of
    what comes after the last of them is done (the owner's part back: three messages, a count, the rows
    and their values; or a ring over their slowest link)."""
    nbytes = problem.tied_bytes[k]
    if not exchanges(problem, devices, replicated):
        return 0.0, device_ring_s(problem, devices, nbytes)
    owner, other = devices
    there = problem.latency_s[other][owner] + nbytes / problem.bandwidth_bps[other][owner]
    back = owner_part_bytes(problem, k, owned)
    return there, 3 * problem.latency_s[owner][other] + back / problem.bandwidth_bps[owner][other]


def transfer_s(problem: PartitionProblem, src: int, dst: int, nbytes: float) -> float:
    """One uncoded message of ``nbytes`` over the src -> dst link (nothing is sent for 0 bytes); with
    a codec, ``codecs.message_s``."""
    if nbytes <= 0:
        return 0.0
    return problem.latency_s[src][dst] + nbytes / problem.bandwidth_bps[src][dst]
