"""``LinkTransport``: ``hetcc::send``/``hetcc::recv`` over the process groups of ``Links``.

A stage's ops name their edge (tag) and peer stage, but not the microbatch: the executor sets
``microbatch`` before it runs a forward or backward, and the wire tag is unique per (edge, direction,
microbatch) within a step. Sends are non-blocking and waited for, with the timeout, at the end of the
step (``Links.wait_sends``): a blocking gloo send waits for its recv, and 1F1B would deadlock. Receives
block with the timeout; a failure is a ``RuntimeFailure`` naming the peer and the tensor.

Gradients cross exactly the differentiable edges (``CommEdge.requires_grad``): each peer waits for
those and no others. Which gradients the ops' backward moves is decided by autograd at run time, so
``settle_gradients`` makes up the difference after each backward.
"""

from __future__ import annotations

import torch

from hetcc.passes.comm import StageGraph
from hetcc.runtime.groups import Links
from hetcc.runtime.ops import count_settled_gradient


class LinkTransport:
    """One stage's transfers on this rank; one rank runs one stage, so peer stage = peer rank."""

    def __init__(self, links: Links, stage: StageGraph, microbatches: int):
        self.links, self.microbatches, self.microbatch = links, microbatches, 0
        self.edges = {edge.tag: edge for edge in (*stage.recvs, *stage.sends)}
        self.grad_recvs = [edge for edge in stage.recvs if edge.requires_grad]
        self.grad_sends = [edge for edge in stage.sends if edge.requires_grad]
        self.gradients_moved: set[tuple[int, int]] = set()  # (tag, microbatch)

    def carries_gradient(self, tag: int) -> bool:
        return self.edges[tag].requires_grad

    def send(self, tensor: torch.Tensor, peer: int, tag: int, *, grad: bool) -> None:
        m, name = self.microbatch, self.edges[tag].value
        what = f"B{m} grad of {name}" if grad else f"F{m} {name}"
        self.links.isend(tensor, peer, self.wire_tag(tag, grad), what)
        if grad:
            self.gradients_moved.add((tag, m))

    def recv(self, peer: int, tag: int, shape: list[int], dtype: torch.dtype, *, grad: bool) -> torch.Tensor:
        m, name = self.microbatch, self.edges[tag].value
        what = f"{'B' if grad else 'F'}{m} {'grad of ' if grad else ''}{name} (stage {peer})"
        tensor = self.links.recv(peer, self.wire_tag(tag, grad), shape, dtype, what)
        if grad:
            self.gradients_moved.add((tag, m))
        return tensor

    def wire_tag(self, tag: int, grad: bool) -> int:
        """Unique per (edge, direction, microbatch) within a step."""
        return (tag * 2 + int(grad)) * self.microbatches + self.microbatch

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
