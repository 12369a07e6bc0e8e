"""``LinkTransport``: ``hetcc::send``/``hetcc::recv`` over the process groups of ``Links``.

A stage's ops name their edge (tag) and peer *stage*, but not the microbatch or the peer *rank*: the
executor sets ``microbatch`` before it runs a forward or backward, and the rank layout says which
replica of the peer stage runs that microbatch (``RankLayout.rank_running``). The wire tag is unique per
(edge, direction, microbatch) within a step. Sends are non-blocking and waited for, with the timeout,
at the end of the step (``Links.wait_sends``): a blocking gloo send waits for its recv, and 1F1B would
deadlock. Receives block with the timeout; a failure is a ``RuntimeFailure`` naming the peer and the
tensor.

Gradients cross exactly the differentiable edges (``CommEdge.requires_grad``): each peer waits for
those and no others. Which gradients the ops' backward moves is decided by autograd at run time, so
``settle_gradients`` makes up the difference after each backward.

Mixed precision (``announce_dtypes``): a tensor crosses in the dtype autocast produced, which the graph
(traced in fp32) does not record, so the first time an edge carries a tensor between two ranks the
sender announces its dtype in a one-element message; later tensors of that edge and pair, and the
gradients coming back (a gradient has its tensor's dtype), use it without a header.

Recomputation (``keep_received``): a stage whose forward runs again during backward
(``torch.utils.checkpoint``) keeps what it received for each microbatch; while ``replaying``, a
forward ``recv`` returns the kept tensor and a forward ``send`` sends nothing.
"""

from __future__ import annotations

import torch

from hetcc.passes.comm import StageGraph
from hetcc.runtime.groups import Links
from hetcc.runtime.layout import RankLayout
from hetcc.runtime.ops import count_settled_gradient

# The dtypes a dtype header can name (its code is the index).
WIRE_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip


class LinkTransport:
    """One stage's transfers on this rank, each addressed to the rank that runs the peer stage's
    replica for the current microbatch."""

    def __init__(
        self,
        links: Links,
        stage: StageGraph,
        microbatches: int,
        layout: RankLayout | None = None,
        *,
        announce_dtypes: bool = False,
        keep_received: bool = False,
    ):
        self.links, self.microbatches, self.microbatch = links, microbatches, 0
        self.layout, self.announce_dtypes, self.keep_received = layout, announce_dtypes, keep_received
        self.edges = {edge.tag: edge for edge in (*stage.recvs, *stage.sends)}
        self.grad_recvs = [edge for edge in stage.recvs if edge.requires_grad]
        self.grad_sends = [edge for edge in stage.sends if edge.requires_grad]
        self.gradients_moved: set[tuple[int, int]] = set()  # (tag, microbatch)
        self.wire_dtypes: dict[tuple[int, int], torch.dtype] = {}  # (tag, peer rank) -> dtype on the wire
        self.received: dict[tuple[int, int], torch.Tensor] = {}  # (tag, microbatch), kept for replay
        self.replaying = False

    def carries_gradient(self, tag: int) -> bool:
        return self.edges[tag].requires_grad

    def peer_rank(self, peer_stage: int) -> int:
        """The rank running ``peer_stage`` for the current microbatch."""
        return peer_stage if self.layout is None else self.layout.rank_running(peer_stage, self.microbatch)

    def send(self, tensor: torch.Tensor, peer: int, tag: int, *, grad: bool) -> None:
        if self.replaying and not grad:
            return  # a recomputed forward: the tensor was sent by the first forward
        m, name, rank = self.microbatch, self.edges[tag].value, self.peer_rank(peer)
        what = f"B{m} grad of {name}" if grad else f"F{m} {name}"
        if self.announce_dtypes:
            tensor = tensor.to(self._wire_dtype(tensor, rank, tag, grad, what))
        self.links.isend(tensor, rank, self.wire_tag(tag, grad), what)
        if grad:
            self.gradients_moved.add((tag, m))

    def recv(self, peer: int, tag: int, shape: list[int], dtype: torch.dtype, *, grad: bool) -> torch.Tensor:
        m, name = self.microbatch, self.edges[tag].value
        if self.replaying and not grad:
            return self.received[(tag, m)].detach()
        rank = self.peer_rank(peer)
        what = f"{'B' if grad else 'F'}{m} {'grad of ' if grad else ''}{name} (stage {peer})"
        if self.announce_dtypes:
            dtype = self._announced_dtype(rank, tag, grad, dtype, what)
        tensor = self.links.recv(rank, self.wire_tag(tag, grad), shape, dtype, what)
        if grad:
            self.gradients_moved.add((tag, m))
        elif self.keep_received:
            self.received[(tag, m)] = tensor
        return tensor

    def wire_tag(self, tag: int, grad: bool) -> int:
        """Unique per (edge, direction, microbatch) within a step."""
        return (tag * 2 + int(grad)) * self.microbatches + self.microbatch

    def forget(self, microbatch: int) -> None:
        """Drop what was kept for replaying ``microbatch`` (its backward is done)."""
        self.received = {key: value for key, value in self.received.items() if key[1] != microbatch}

    def settle_gradients(self) -> None:
        """After the backward of the current microbatch, exchange the gradients of differentiable edges
        that the ops did not, so every peer's wait is matched: zeros for a received tensor whose gradient
        never reached ``recv``'s backward (say, it only fed a comparison), and receive and drop the
        gradient of a sent tensor that needed none (its token did not require grad)."""
        m = self.microbatch
        for edge in self.grad_recvs:
            if (edge.tag, m) not in self.gradients_moved:
                self.send(torch.zeros(edge.shape, dtype=edge.dtype), edge.src, edge.tag, grad=True)
                count_settled_gradient(sent=True)
        for edge in self.grad_sends:
            if (edge.tag, m) not in self.gradients_moved:
                self.recv(edge.dst, edge.tag, list(edge.shape), edge.dtype, grad=True)
                count_settled_gradient(sent=False)
        self.gradients_moved = {moved for moved in self.gradients_moved if moved[1] != m}

    def _wire_dtype(self, tensor: torch.Tensor, rank: int, tag: int, grad: bool, what: str) -> torch.dtype:
        """The sender's side: announce the dtype of an edge's first tensor to this peer rank; a gradient
        travels in the dtype its tensor was received in (the receiver of the tensor sends it)."""
        key = (tag, rank)
        if key not in self.wire_dtypes:
            self.wire_dtypes[key] = tensor.dtype
            if not grad:
                code = torch.tensor([WIRE_DTYPES.index(tensor.dtype)], dtype=torch.int64)
                self.links.isend(code, rank, self._header_tag(tag), f"dtype of {what}")
        return self.wire_dtypes[key]

    def _announced_dtype(
        self, rank: int, tag: int, grad: bool, traced: torch.dtype, what: str
    ) -> torch.dtype:
        key = (tag, rank)
        if key not in self.wire_dtypes:
            if grad:  # gradient of a tensor this rank sent: its dtype was announced when it was sent
                return traced
            code = self.links.recv(rank, self._header_tag(tag), [1], torch.int64, f"dtype of {what}")
            self.wire_dtypes[key] = WIRE_DTYPES[int(code.item())]
        return self.wire_dtypes[key]

    def _header_tag(self, tag: int) -> int:
        """A tag no data transfer uses: data wire tags stay below 2 * edges * M, far below 2**24."""
        return (1 << 24) + tag * self.microbatches + self.microbatch
