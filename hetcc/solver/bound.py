"""Step times no plan can beat: one for the simulated step (what a plan reports its gap to), one for
the search's objective (what lets it skip device sets that cannot win)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from hetcc.solver.links import fastest_link
from hetcc.solver.problem import MEMORY_RTOL, PartitionProblem
from hetcc.solver.schedules import SPLIT_SCHEDULES
from hetcc.solver.sharding import least_held_state

ROUNDS = 300


def lower_bound(
    problem: PartitionProblem,
    ways: Mapping[tuple[str, float], Sequence[Way]] | None = None,
    *,
    contiguous: bool = True,
    within_s: float = math.inf,
) -> float:
    """A simulated step time no plan (replicated, recomputing or not) can beat: the larger of

    - the chain: microbatch 0 runs every block's forward, then every backward, one after the other, so
      the step takes at least ``sum_i min_t c_t[i]``; under a split schedule (zb-h1) only the input
      gradients are on that chain (a stage's weight gradients may run beside the stages before it),
      except the first block's, whose stage runs its backward whole;
    - the balance with memory: a device is busy at most the whole step. Let x[i, t] be the share of
      block i's M microbatches run by devices of class t (a type and memory size, n_t devices of
      capacity K_t). Then ``step >= M * sum_i x[i, t] * c_t[i] / n_t`` for every t, and, since a device
      running any microbatch of block i holds all of its state s_t[i] (its type's ``state_for``),
      ``sum_i x[i, t] * s_t[i] <= n_t * K_t`` (where replicas may shard their optimizer state o, s is
      at least ``s - o (1 - 1/n)`` with n devices in all: ``sharding.least_held_state``).
      The least such step is a linear program; any Lagrange weights lambda_t >= 0 with
      ``sum_t lambda_t n_t = 1`` and mu_t >= 0 give a value no larger than it,
      ``sum_i min_t (lambda_t M c_t[i] + mu_t s_t[i]) - sum_t mu_t n_t K_t``, improved here by
      subgradient steps. Communication and recomputation only add, so they are left out (codecs too:
      their encode and decode are priced on the messages, never on a compute lane);
    - with the fill, in that balance: a device runs one stage, blocks [f, l], and idles while no
      microbatch can reach it: before the first one's forwards through blocks < f end, at least
      ``F(f) = sum_(j<f) min_t fwd_t[j]``, and, training under 1f1b or gpipe, after its last
      backward, while that microbatch's backwards of blocks < f run, ``B(f)`` likewise (under zb-h1
      weight gradients may fill that tail); in inference, after its last forward, the forwards of
      blocks > l. Block i on a device means blocks f..i on it, so f >= lo(i), the first block with
      ``sum s[lo(i)..i] <= K`` (and l <= hi(i) likewise): the device idles at least
      ``I[i] = F(lo(i)) + B(lo(i))`` (inference: ``F(lo(i))`` and the forwards after hi(i)) for each
      of its blocks, and, as its blocks' ``s[i] / K`` sum to at most 1, at least
      ``sum_(i on it) s[i] / K * I[i]``. So block i's share on class t adds
      ``x[i, t] * s_t[i] / K_t * I_t[i]`` seconds of idle to ``M * x[i, t] * c_t[i]`` in the
      ``n_t * step`` its devices have.

    - with a tied weight (``tied_blocks``) whose first and last users no device can hold together with
      the blocks between them (every way's state of that span above its capacity): every plan holds it
      on two or more stages and sums its gradient over their devices once they are done: a ring that
      moves at least its bytes, or an exchange whose last message, the owner's part, moves at least
      the rows its users' lookups touch (``tied_grad_bytes``), over the fastest link, after two
      latencies (``_tied_sums``). That last message leaves after the owner's last compute, and the
      owner holds the first user: where that is block 0, the chain ends before it, so the chain gains
      it; and each device holding the first or the last user idles that long: charged to those two
      blocks' columns like the fill (a device holds at most one of them).

    ``within_s`` (a plan's simulated step): the bound returned is at most ``within_s``, so it need only
    hold for plans no slower than that, on each of whose devices the compute of its blocks and its fill
    fit in ``within_s``: a device holding block i then starts no earlier than the least f with
    ``m sum c[f..i] + I(f) <= within_s`` (as well as fitting in memory; m the fewest microbatches a
    device runs: M, or 1 where stages may have replicas, which share them), and since a device running
    a share x of the microbatches computes ``x M sum_(i on it) c[i] <= within_s - I(f)``, charging block
    i's share ``x M c[i] / (within_s - I[i]) * I[i]`` (``I[i] <= I(f)``) charges it at most ``I(f)``, as
    the memory shares do: the fill is charged either way (each a valid bound; the larger is kept, and
    never less than the bound without ``within_s``, which is computed too: the balance is approximate).

    ``ways`` widens the plan space the bound covers (``solver.tensor``): per class, every ``Way`` its
    devices may run blocks (default: one device of the class's own type). A way of w devices together
    spends w * c[i] device-seconds and holds w * s[i] bytes per block i, so the constraints of class t
    become ``M sum_(i, way) x * w * c <= n_t * step`` and ``sum_(i, way) x * w * s <= n_t K_t``, and
    the minimum over t runs over the ways of each class: a bound for every plan using any of them.

    The fill and the tied sums suppose each device runs one stage, contiguous blocks. Under interleaved
    1F1B a device runs several (its chunks): it can be fed before the blocks before its last chunk have
    run, and hold a tied weight's two users without the blocks between them. ``contiguous=False`` leaves
    both terms out: a bound for those plans too.
    """
    classes = sorted({(d.type, d.memory_bytes) for d in problem.devices})
    rows = [(k, way) for k, c in enumerate(classes) for way in (ways or {}).get(c, [Way(c[0], 1)])]
    kinds = [way.kind for _, way in rows]
    costs = np.array([problem.block_cost_s(kind) for kind in kinds], dtype=float)
    counts = np.array([sum((d.type, d.memory_bytes) == c for d in problem.devices) for c in classes], float)
    capacity = np.array([m for _, m in classes], dtype=float)
    chain = float(_chain_costs(problem, kinds, costs).min(axis=0).sum())
    state = np.array([least_held_state(problem, kind) for kind in kinds], dtype=float)
    owner = np.array([k for k, _ in rows])
    width = np.array([way.devices for _, way in rows], dtype=float)[:, None]
    sums = _tied_sums(problem, state, capacity[owner]) if contiguous else []
    chain += max((seconds for (first, _), seconds in sums if first == 0), default=0.0)
    fills = (
        _fill_idle_s(problem, kinds, state, capacity[owner], costs, within_s) if contiguous else [0 * costs]
    )
    balance = 0.0
    for idle in fills:
        for (first, last), seconds in sums:
            idle[:, first] += seconds
            idle[:, last] += seconds
        balance = max(balance, _memory_balance_bound(
            problem.microbatches * costs * width + idle * width, state * width, owner, counts, capacity
        ))  # fmt: skip
    return min(within_s, max(chain, balance))


class Way(NamedTuple):
    """One way a device class may run blocks in ``lower_bound``: ``devices`` of them together, each
    costed and holding bytes as a device of type ``kind``."""

    kind: str
    devices: int


def _chain_costs(problem: PartitionProblem, kinds: list[str], costs: np.ndarray) -> np.ndarray:
    """Per row and block, what one microbatch's chain of forwards and backwards must spend on it."""
    if problem.schedule not in SPLIT_SCHEDULES or problem.wgrad_s is None or not problem.training:
        return costs
    weights = np.array([problem.wgrad_s[kind] for kind in kinds], dtype=float)
    weights[:, 0] = 0.0  # the first block is in the first stage, which does not split
    return costs - weights


def _fill_idle_s(
    problem: PartitionProblem, kinds: list[str], state: np.ndarray, capacity: np.ndarray, costs: np.ndarray,
    within_s: float = math.inf,
) -> list[np.ndarray]:  # fmt: skip
    """Per row (a way, of per-device ``state``, ``capacity`` and ``costs``: seconds per block) and block i:
    the idle seconds a device running block i is charged for it, I[i] from the earliest first block a
    device holding i may have, weighed by its memory share, ``s[i] / K * I[i]``, and where ``within_s``
    is finite also by its time share, ``M c[i] / (within_s - I[i]) * I[i]`` (``lower_bound``'s fill):
    one array per weighing, the first without ``within_s``."""

    def fastest(table: dict[str, list[float]]) -> np.ndarray:  # per block, its least time on any row
        return np.array([table[kind] for kind in kinds], dtype=float).min(axis=0)

    forwards = fastest(problem.fwd_s)
    before = np.concatenate([[0.0], np.cumsum(forwards)])  # before[f] = F(f), f = 0..N
    if problem.training and problem.schedule not in SPLIT_SCHEDULES:
        before += np.concatenate([[0.0], np.cumsum(fastest(problem.bwd_s))])  # + B(f)
    after = np.concatenate([np.cumsum(forwards[::-1])[::-1], [0.0]])  # after[k]: forwards of blocks >= k
    room = capacity * (1 + MEMORY_RTOL)
    blocks = np.arange(state.shape[1])
    # per row and block: I from memory alone; with within_s, I before f and in all
    alone, starts, idle = np.empty_like(state), np.empty_like(state), np.empty_like(state)
    least = 1 if problem.replicate else problem.microbatches  # microbatches a device runs, at least
    for r, held in enumerate(state):
        prefix = np.concatenate([[0.0], np.cumsum(held)])
        lo = np.minimum(np.searchsorted(prefix, prefix[1:] - room[r], side="left"), blocks)
        tail = 0.0
        if not problem.training:
            hi = np.maximum(np.searchsorted(prefix, prefix[:-1] + room[r], side="right") - 2, blocks)
            tail = after[hi + 1]
        alone[r] = before[lo] + tail
        if math.isfinite(within_s):  # blocks f..i and the fill before f in within_s: f >= lo
            busy = np.concatenate([[0.0], np.cumsum(least * costs[r])])
            for i in blocks:
                fits = busy[i + 1] - busy[lo[i] : i + 1] + before[lo[i] : i + 1] <= within_s * (1 + 1e-9)
                lo[i] = lo[i] + int(np.argmax(fits)) if fits.any() else i
            starts[r] = before[lo]
            idle[r] = starts[r] + tail
    fills = [alone * state / room[:, None]]
    if math.isfinite(within_s):  # the bound without within_s stays among them: never weaker than it
        fills += [
            idle * state / room[:, None],
            idle * problem.microbatches * costs / np.maximum(within_s - starts, 1e-300),
        ]
    return fills


def _tied_sums(problem: PartitionProblem, state: np.ndarray, capacity: np.ndarray) -> list[tuple]:
    """Per tied weight every plan must sum over two or more devices at step end (``lower_bound``): its
    (first, last) user blocks and the least seconds of that sum. ``state``: per row (a way) and block, the
    bytes a device holds; ``capacity``: per row."""
    if not problem.training or not problem.tied_blocks or len(problem.devices) < 2:
        return []
    fastest, latency = fastest_link(problem, range(len(problem.devices)))
    prefix = np.concatenate([np.zeros((len(state), 1)), np.cumsum(state, axis=1)], axis=1)
    sums = []
    for k, (users, nbytes) in enumerate(zip(problem.tied_blocks, problem.tied_bytes or [])):
        first, last = min(users), max(users)
        spans = prefix[:, last + 1] - prefix[:, first]  # per row: one device holding first..last
        if first < last and nbytes > 0 and bool(np.all(spans > capacity * (1 + MEMORY_RTOL))):
            least = nbytes  # the least the owner's part back can be (``links.owner_part_bytes``)
            if problem.tied_grad_bytes is not None:
                least = min(nbytes, min(problem.tied_grad_bytes[k]) * problem.microbatches)
            sums.append(((first, last), 2 * latency + least / fastest))
    return sums


def _memory_balance_bound(work, state, owner, counts, capacity) -> float:
    """The Lagrangian bound of ``lower_bound`` for rows (ways) ``work`` and ``state`` (device-seconds of
    all M microbatches, fill included, and bytes per block), row r belonging to class ``owner[r]`` of
    ``counts`` devices of ``capacity``."""
    first = np.unique(owner, return_index=True)[1]  # each class's first row
    speed = counts / np.maximum(work[first].sum(axis=1), 1e-300)
    share = speed / speed.sum()  # lambda_t * n_t
    room = counts * capacity
    # mu_t = nu_t * (seconds a block of class t costs per byte of state it holds): nu_t is unitless.
    per_byte = work[first].mean(axis=1) / np.maximum(state[first].mean(axis=1), 1e-300)
    nu = np.zeros(len(counts))
    columns = np.arange(work.shape[1])
    best = 0.0
    for step in range(ROUNDS):
        mu = nu * per_byte * share / counts
        priced = (share / counts)[owner][:, None] * work + mu[owner][:, None] * state
        row = priced.argmin(axis=0)
        best = max(best, float(priced[row, columns].sum() - (mu * room).sum()))
        load = np.bincount(owner[row], weights=work[row, columns], minlength=len(counts)) / counts
        share = share * np.exp(load / max(float(load.max()), 1e-300) / math.sqrt(step + 1))
        share = share / share.sum()
        held = np.bincount(owner[row], weights=state[row, columns], minlength=len(counts))
        nu = np.maximum(0.0, nu + (held - room) / np.maximum(room, 1e-300) / math.sqrt(step + 1))
    return best


def objective_bound(problem: PartitionProblem) -> float:
    """A value of the search's objective (``objective.step_time``) no plan beats; see ``compute_bound_s``."""
    types = sorted({d.type for d in problem.devices})
    costs = np.array([problem.block_cost_s(t) for t in types], dtype=float)
    counts = np.array([sum(d.type == t for d in problem.devices) for t in types], dtype=float)
    return compute_bound_s(costs, counts, problem.microbatches - 1, problem.replicate)


def compute_bound_s(
    costs: np.ndarray, counts: np.ndarray, slope: int, replicate: bool = False, enough_s: float = math.inf
) -> float:
    """The objective's bound for devices of types ``costs[t]`` (seconds per block), ``counts[t]`` of each.

    The weight search stops early once the bound reaches ``enough_s`` (a caller asking only "can these
    devices beat ``enough_s``?" then has its answer, a valid bound no larger than the full one).

    Communication (codecs' time included) and all-reduces only add, and P >= max_j B_j, so T >= sum_j T_j + (M - 1) max_j B_j.
    Two bounds on that:

    - integrality: every block runs on some device, so sum_j T_j >= sum_i min_t c_t[i], and the stage
      holding the costliest block has (M - 1) B_j >= (ceil(M / r) - 1) c_t[i] with r <= counts[t]
      replicas (the only bound used when replicas are allowed);
    - balance: relax "each block on one device" to fractions x[i, d] >= 0 summing to 1 and let B be
      the largest device load; min sum c x + (M - 1) * B is a lower bound. By LP duality, for any weights
      lambda_d >= 0 with sum_d lambda_d = M - 1 it is at least sum_i min_d (1 + lambda_d) * c_d[i].
      Weights start proportional to device speed and are improved by exponentiated-gradient steps;
      whichever weights are used, the value stays a valid bound.
    """
    cheapest = costs.min(axis=0)
    if not replicate:
        integral = float(cheapest.sum()) + slope * float(cheapest.max())
        return max(integral, _balance_bound(costs, counts, slope, enough_s=enough_s))
    # With replicas B_j = (ceil(M / r) - 1) / (M - 1) * T_j: a block on r <= counts[t] devices of type
    # t adds at least (ceil(M / counts[t]) - 1) * c_t[i]; the balance relaxation does not carry over.
    # Also (M - 1) B_j >= M T_j / r_j - T_j, so T >= M * (largest device load T_j / r_j): the balance
    # relaxation of M * max load, without the fill term.
    m = slope + 1
    steady = np.array([math.ceil(m / c) - 1 for c in counts], dtype=float)
    integral = float(cheapest.sum()) + float((costs * steady[:, None]).min(axis=0).max())
    return max(integral, _balance_bound(costs, counts, m, base=0.0, enough_s=enough_s))


def _balance_bound(
    costs: np.ndarray, counts: np.ndarray, slope: int, rounds: int = 200, base: float = 1.0, enough_s=math.inf
) -> float:
    """max over type weight shares of sum_i min_t (base + slope * share_t / count_t) * c_t[i] (the
    search stops once it reaches ``enough_s``)."""
    if slope == 0:
        return base * float(costs.min(axis=0).sum())
    speed = counts / np.maximum(costs.sum(axis=1), 1e-300)
    share = speed / speed.sum()
    columns = np.arange(costs.shape[1])
    best = 0.0
    for step in range(rounds):
        scaled = (base + slope * share / counts)[:, None] * costs
        best = max(best, float(scaled.min(axis=0).sum()))
        if best >= enough_s:
            break
        owner = scaled.argmin(axis=0)
        per_device = np.bincount(owner, weights=costs[owner, columns], minlength=len(counts)) / counts
        gradient = per_device / max(float(per_device.max()), 1e-300)
        share = share * np.exp(gradient / math.sqrt(step + 1))
        share = share / share.sum()
    return best
