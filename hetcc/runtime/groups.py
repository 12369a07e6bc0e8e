"""Process groups per link, and transfers whose every wait has a deadline.

A rank runs one replica of one stage, or under interleaved 1F1B and ZB-V one replica of each of its stages, all
over this one set of links (``hetcc.runtime.layout``). Each pair of ranks that exchanges
tensors talks over the backend its two devices share: ``nccl`` between GPUs of one vendor (RCCL answers
to the same name on AMD), ``gloo`` across vendors and whenever a CPU is involved; so do the replicas of
a stage when they sum their gradients. Every wait goes through ``Work.wait(timeout)``; a timeout or a
lost peer becomes ``RuntimeFailure`` naming the peer and what this rank waited for.

Point-to-point messages between two ranks pair up in the order they are posted, on every backend: nccl
ignores tags, and gloo, which matches by tag, is given each message's position in its rank pair's
sequence as the tag. A CPU run therefore pairs messages exactly as a GPU run does, and the senders and
receivers above (``hetcc.runtime.transport``) must post each pair's messages in one agreed order.
Under ZB-V two ranks post and take their messages in different orders, but each stage pair's in one:
each such pair (``channels``) then talks over a process group of its own, whose messages pair up in
their own order, and the two stages of one rank at the V's turn hand theirs over in memory, in order.
"""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hetcc.collectives import LocalTensorGroup, ProcessTensorGroup, TensorGroup
from hetcc.errors import RuntimeFailure

GPU_VENDORS = ("nvidia", "amd")
_TAG_WRAP = 1 << 30  # gloo tags count messages per rank pair and direction, modulo this


def link_backend(vendor_a: str, vendor_b: str) -> str:
    """Backend for a link between devices of two vendors ("nvidia", "amd", "cpu", ...)."""
    a, b = vendor_a.lower(), vendor_b.lower()
    return "nccl" if a == b and a in GPU_VENDORS else "gloo"


def link_backends(vendors: Sequence[str]) -> dict[tuple[int, int], str]:
    """Backend of every rank pair ``(i, j)`` with ``i < j``, given each rank's device vendor."""
    return {
        (i, j): link_backend(vendors[i], vendors[j])
        for i in range(len(vendors))
        for j in range(i + 1, len(vendors))
    }


def world_backend(vendors: Sequence[str]) -> str:
    """Backend of the default group: nccl only when every rank is a GPU of one vendor."""
    first = vendors[0].lower()
    return "nccl" if first in GPU_VENDORS and all(v.lower() == first for v in vendors) else "gloo"


class Links:
    """The process group of every rank pair, of every tied-parameter group, of every replicated
    stage's replicas and of every tensor-parallel replica's parts, plus timed waits.

    ``vendors``: per rank; ``tied_ranks``: per tied group, every rank holding the parameter;
    ``replica_ranks``: per replicated stage (and part), its replicas' ranks; ``tensor_ranks``: per
    tensor-parallel replica, its parts' ranks (``tensor``: this rank's, a ``hetcc.collectives`` group);
    ``channels``: (rank a, rank b, stage s, stage t) per stage pair whose messages keep an order of their
    own (``RankLayout.channels``).
    Must be built on every rank with the same arguments (``new_group`` is collective).
    """

    def __init__(
        self,
        vendors: Sequence[str],
        tied_ranks: Sequence[Sequence[int]],
        timeout_s: float,
        device: torch.device | str = "cpu",
        replica_ranks: Sequence[Sequence[int]] = (),
        tensor_ranks: Sequence[Sequence[int]] = (),
        channels: Sequence[tuple[int, int, int, int]] = (),
    ):
        self.rank, self.timeout_s, self.device = dist.get_rank(), timeout_s, torch.device(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        default = dist.get_backend()
        self.pairs: dict[tuple[int, int], object] = {}
        for pair, backend in link_backends(vendors).items():
            if backend != default:
                self.pairs[pair] = dist.new_group(list(pair), backend=backend, timeout=self.timeout)
        self.tied_ranks = [sorted(ranks) for ranks in tied_ranks]
        self.tied = [dist.new_group(ranks, backend="gloo", timeout=self.timeout) for ranks in self.tied_ranks]
        self.replicas = None  # (group, backend) of this rank's stage's replicas
        for ranks in replica_ranks:
            backend = world_backend([vendors[rank] for rank in ranks])
            group = dist.new_group(sorted(ranks), backend=backend, timeout=self.timeout)
            if self.rank in ranks:
                self.replicas = (group, backend)
        self.tensor: TensorGroup = LocalTensorGroup()  # the collectives of this rank's stage graph
        for ranks in tensor_ranks:
            backend = world_backend([vendors[rank] for rank in ranks])
            group = dist.new_group(list(ranks), backend=backend, timeout=self.timeout)
            if self.rank in ranks:
                self.tensor = ProcessTensorGroup(group)
        self.channels: dict[tuple[int, int], object] = {}  # (stage s, stage t), s < t -> its group
        for a, b, *stages in channels:
            group = dist.new_group(
                sorted((a, b)), backend=link_backend(vendors[a], vendors[b]), timeout=self.timeout
            )
            if self.rank in (a, b):
                self.channels[min(stages), max(stages)] = group
        # (sending stage, receiving stage), both on this rank -> the messages not yet taken
        self.loopback: dict[tuple[int, int], deque] = {}
        self.gloo_peers = {
            j if i == self.rank else i
            for (i, j), backend in link_backends(vendors).items()
            if backend == "gloo" and self.rank in (i, j)
        }
        self.pending: list[tuple[object, torch.Tensor, str]] = []
        self.sent_count: dict[tuple, int] = {}  # (peer rank, channel) -> messages posted to it
        self.received_count: dict[tuple, int] = {}  # (peer rank, channel) -> messages posted from it

    def group(self, peer: int):
        return self.pairs.get((min(self.rank, peer), max(self.rank, peer)))

    def isend(
        self, tensor: torch.Tensor, peer: int, what: str, stages: tuple[int, int] | None = None
    ) -> None:
        """Start sending; the work is waited for (with the timeout) in ``wait_sends``. ``stages``: (the
        sending stage, the receiving one), which picks the stage pair's channel where it has one."""
        if peer == self.rank:  # two stages of this rank: handed over in memory, in order
            self.loopback.setdefault(stages, deque()).append(tensor.detach().clone())
            return
        group, channel = self._channel(peer, stages)
        tensor = tensor.detach().to(self._wire_device(peer)).contiguous()
        work = dist.isend(tensor, dst=peer, group=group, tag=_next(self.sent_count, (peer, channel)))
        self.pending.append((work, tensor, f"{what} to rank {peer}"))

    def recv(
        self, peer: int, shape, dtype: torch.dtype, what: str, stages: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """The next message from ``peer`` (of the stage pair ``stages``, sending stage first, where it has
        a channel), which must hold ``shape`` x ``dtype`` (nothing on the wire says what a message holds:
        the caller checks that)."""
        if peer == self.rank:
            queue = self.loopback.get(stages)
            if not queue:
                raise RuntimeFailure(
                    f"rank {self.rank}: stage {stages[1]} waits for {what} from stage {stages[0]} on the same rank, "
                    "which its order has not sent yet",
                    hint="the schedule runs a receiving stage before its sender on one rank: report it as a hetcc bug",
                )
            return queue.popleft().to(self.device)
        group, channel = self._channel(peer, stages)
        buffer = torch.empty(tuple(shape), dtype=dtype, device=self._wire_device(peer))
        work = dist.irecv(buffer, src=peer, group=group, tag=_next(self.received_count, (peer, channel)))
        self.wait(work, f"{what} from rank {peer}", peer)
        return buffer.to(self.device)

    def _channel(self, peer: int, stages: tuple[int, int] | None) -> tuple[object, tuple[int, int] | None]:
        """(the group of the message, the channel it counts in): the stage pair's own, or the rank pair's."""
        pair = (min(stages), max(stages)) if stages is not None else None
        if pair in self.channels:
            return self.channels[pair], pair
        return self.group(peer), None

    def _wire_device(self, peer: int) -> torch.device:
        """gloo moves host memory: tensors for a gloo link are staged through the CPU."""
        return torch.device("cpu") if peer in self.gloo_peers else self.device

    def wait_sends(self) -> None:
        pending, self.pending = self.pending, []
        for work, _tensor, what in pending:
            self.wait(work, f"completion of send of {what}", None)

    def all_reduce(self, tensor: torch.Tensor, group_index: int, what: str) -> None:
        """Sum ``tensor`` in place over tied group ``group_index`` (gloo, through host memory)."""
        self._sum(tensor, self.tied[group_index], "gloo", what)

    def sum_over_replicas(self, tensor: torch.Tensor, what: str) -> None:
        """Sum ``tensor`` in place over the replicas of this rank's stage (nothing if it has one)."""
        if self.replicas is not None:
            self._sum(tensor, *self.replicas, what)

    def any_rank(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` is true on any rank of the job (every rank must call it)."""
        return self.reduce_world(float(flag), "max", what) > 0

    def reduce_world(self, value: float, op: str, what: str) -> float:
        """``value`` summed (``op`` "sum"), or its max or min, over every rank of the job, in float64
        (every rank must call it)."""
        device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        tensor = torch.tensor([value], dtype=torch.float64, device=device)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        self.wait(dist.all_reduce(tensor, op=reduce_op, async_op=True), what, None)
        return float(tensor.item())

    def gather_world(self, value: float, what: str) -> list[float]:
        """Every rank's ``value``, by rank (every rank must call it): a sum of one-hot vectors, a plain
        tensor collective (an object gather just before the process group is destroyed has ended ranks
        with "terminate called without an active exception" under torchrun)."""
        device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        values = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
        values[self.rank] = value
        self.wait(dist.all_reduce(values, async_op=True), what, None)
        return values.tolist()

    def _sum(self, tensor: torch.Tensor, group, backend: str, what: str) -> None:
        wire = tensor.cpu() if backend == "gloo" else tensor
        work = dist.all_reduce(wire, group=group, async_op=True)
        self.wait(work, what, None)
        if wire is not tensor:
            tensor.copy_(wire)

    def wait(self, work, what: str, peer: int | None) -> None:
        """``work.wait`` with the deadline; any failure names this rank, the peer and the wait."""
        try:
            work.wait(self.timeout)
        except Exception as error:  # noqa: BLE001 - every backend raises its own type
            peer_text = f" (peer rank {peer})" if peer is not None else ""
            raise RuntimeFailure(
                f"rank {self.rank} failed waiting for {what}{peer_text}: {type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}",
                hint=f"check that {f'rank {peer}' if peer is not None else 'every peer'} is alive; "
                f"waits time out after hetcc.config.comm_timeout_s = {self.timeout_s:g} s",
            ) from error


def _next(counts: dict[tuple, int], key: tuple) -> int:
    """The position of the next message with a peer (on one channel, ``key``) in one direction: gloo's tag
    for it (nccl ignores tags and pairs messages in this order anyway). Wraps long before a 32-bit tag
    would."""
    position = counts.get(key, 0)
    counts[key] = (position + 1) % _TAG_WRAP
    return position
