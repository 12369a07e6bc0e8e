"""The step-end sum of each weight tied across stages (an embedding and the head that reads it), over
every rank holding it; each holder then has the whole gradient, bit for bit the same.

Two ranks, neither a tensor-parallel part nor a replica (``exchanges``; ``solver.links.exchanges``
prices the same rule), exchange their parts: the owner, the rank running the tie's lowest stage, posts
the receive of the other's part when its step begins, so that part travels while the owner still
computes (the other finishes its backward first: it is later in the pipeline); at step end the owner
adds it and sends its own part back, as its nonzero rows with their indices where that is smaller (an
embedding's gradient has only the rows the step looked up), and the other adds those. Both sums are
``own + other``, one addition per element in either order, so they agree exactly. More ranks sum by a
gloo all-reduce. Everything goes through host memory (gloo).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hetcc.runtime.groups import Links

_INDEX_BYTES = 8  # an int64 row index; what ``solver.links.owner_part_bytes`` prices per row


def exchanges(links: Links, index: int) -> bool:
    """Whether tied group ``index`` is summed by an exchange on this rank: two ranks hold it, and this
    one is neither a tensor-parallel part nor a replica (then neither is the other: its parts or
    replicas would hold it too)."""
    return len(links.tied_ranks[index]) == 2 and links.tensor.size == 1 and links.replicas is None


def post_parts(executors: Sequence) -> dict[int, tuple[object, torch.Tensor]]:
    """On each exchange this rank owns: the receive of the other holder's part, posted before the step's
    first action (``run_chunks``); per tied group, (the work, its buffer)."""
    links, posted = executors[0].links, {}
    for index, group in enumerate(executors[0].stage.tied):
        params = _params(executors, group)
        if params and exchanges(links, index) and _owns(executors, group):
            buffer = torch.empty(params[0].shape, dtype=params[0].dtype)
            posted[index] = (dist.irecv(buffer, src=_peer(links, index), group=links.tied[index]), buffer)
    return posted


def reduce_tied_grads(executors: Sequence, posted: dict[int, tuple[object, torch.Tensor]]) -> None:
    """Sum each tied weight's gradient over every rank holding it (each of its ranks once, its stages on
    that rank summed first): each holder then has the sum. ``posted``: ``post_parts``'s receives."""
    links = executors[0].links
    for index, group in enumerate(executors[0].stage.tied):
        params = _params(executors, group)
        if not params:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        total = sum(grads[1:], grads[0])
        what = f"gradient of tied parameter {group.name}"
        if links.tensor.size > 1:  # each part of the replica holds the same whole gradient
            total = total / links.tensor.size
        if index in posted:
            total = _as_owner(links, index, total, *posted[index], what)
        elif exchanges(links, index):
            total = _as_other(links, index, total, what)
        else:
            links.all_reduce(total, index, f"sum of the {what}")
        for param in params:
            param.grad = total if param is params[0] else total.clone()


def _as_owner(
    links: Links, index: int, own: torch.Tensor, work, theirs: torch.Tensor, what: str
) -> torch.Tensor:
    peer = _peer(links, index)
    links.wait(work, f"rank {peer}'s part of the {what}", peer)
    rows = own.reshape(own.shape[0], -1).ne(0).any(dim=1).nonzero().squeeze(1) if own.dim() else None
    sparse = rows is not None and rows.numel() * (own[0].nbytes + _INDEX_BYTES) < own.nbytes
    _send(links, index, torch.tensor([rows.numel() if sparse else -1]), what)
    if not sparse:
        _send(links, index, own, what)
    elif rows.numel():
        _send(links, index, rows, what)
        _send(links, index, own.index_select(0, rows), what)
    return own + theirs.to(own.device)


def _as_other(links: Links, index: int, own: torch.Tensor, what: str) -> torch.Tensor:
    _send(links, index, own, what)  # the owner posted its receive at its step's start
    count = int(_recv(links, index, (1,), torch.int64, what))
    if count < 0:
        return own + _recv(links, index, own.shape, own.dtype, what).to(own.device)
    if count == 0:  # the owner's part is all zeros
        return own.clone()
    rows = _recv(links, index, (count,), torch.int64, what).to(own.device)
    values = _recv(links, index, (count, *own.shape[1:]), own.dtype, what).to(own.device)
    return own.index_add(0, rows, values)


def _send(links: Links, index: int, tensor: torch.Tensor, what: str) -> None:
    peer = _peer(links, index)
    work = dist.isend(tensor.detach().cpu().contiguous(), dst=peer, group=links.tied[index])
    links.wait(work, f"sending this rank's part of the {what} to rank {peer}", peer)


def _recv(links: Links, index: int, shape, dtype: torch.dtype, what: str) -> torch.Tensor:
    peer, buffer = _peer(links, index), torch.empty(tuple(shape), dtype=dtype)
    links.wait(
        dist.irecv(buffer, src=peer, group=links.tied[index]), f"rank {peer}'s part of the {what}", peer
    )
    return buffer


def _params(executors: Sequence, group) -> list[torch.nn.Parameter]:
    return [
        executor.module.get_parameter(local)
        for executor in executors
        for stage, local in group.members
        if stage == executor.stage.index
    ]


def _owns(executors: Sequence, group) -> bool:
    return any(executor.stage.index == min(group.stages) for executor in executors)


def _peer(links: Links, index: int) -> int:
    return next(rank for rank in links.tied_ranks[index] if rank != links.rank)
