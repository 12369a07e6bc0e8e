"""``LinkTransport``: ``hetcc::send``/``hetcc::recv`` over the process groups of ``Links``.

A stage's ops name their edge (tag) and peer *stage*, but not the microbatch or the peer *rank*: the
executor sets ``microbatch`` before it runs a forward or backward, and the rank layout says which
replica of the peer stage runs that microbatch (``RankLayout.rank_running``). Between tensor-parallel
stages (every tensor crossing a cut is whole on each of a replica's t ranks) part j of the sending
replica sends to the receiving replica's parts i with i mod t_send = j, and part i receives from part
i mod t_send; gradients go back the same way: part j of the sending stage receives from part
j mod t_receive, which sends to every part j with j mod t_receive = i. Sends are non-blocking and
waited for, with the timeout, at the end of the step (``Links.wait_sends``): a blocking gloo send waits
for its recv, and 1F1B would deadlock. Receives block with the timeout; a failure is a
``RuntimeFailure`` naming the peer and the tensor.

Order: messages between two ranks pair up in the order they are posted (``Links``; nccl ignores tags),
so both ends post them in one order derived from the plan. Every stage runs its forwards, and its
backwards, in microbatch order; under interleaved 1F1B two ranks exchange the messages of several stage
pairs, and Megatron's order (``schedules.interleaved_actions``) posts and takes each rank pair's in one
order on both ends, so each rank's stages use one transport each over the same links; under ZB-V only
each stage pair's are in one order, and every message names its stage pair, whose channel it takes
(``Links``). Within a forward, the stage's graph posts its sends to a peer and its
recvs from it in ascending tag order (``passes.comm``). A backward runs the ops' backwards in whatever
order autograd picks on each side, so they do not touch the wire: ``recv``'s backward hands its gradient
to the transport, which sends the microbatch's gradients after the backward (``settle_gradients``), in
tag order, zeros where autograd produced none (say, the tensor only fed a comparison); ``send``'s
backward takes its gradient from the transport, which receives all of that peer stage's gradients of
the microbatch, in tag order, when the first is asked for, and after the backward receives and drops
those of a peer no op asked for (a sent tensor that needed no gradient). Gradients cross exactly the
differentiable edges (``CommEdge.requires_grad``).

What a message holds: nothing on the wire says, so the first time an edge carries a tensor between two
ranks the sender announces its shape and dtype in a small header, which the receiver checks against
what its ``recv`` records; the sender checks every tensor against what its ``send`` records. Either
failure names the stage, the tensor and both shapes. Under mixed precision a floating-point tensor
crosses in the dtype autocast produced, which the graph (traced in fp32) does not record: the announced
dtype is what that edge carries between those two ranks from then on, and its gradients come back in it.
An edge with a codec (``hetcc.wire``) carries its uint8 payload; the decoded tensor is in the traced
dtype, so its gradient comes back in that dtype, or as its gradient codec's payload.

Recomputation (``keep_received``): a stage whose forward runs again during backward
(``torch.utils.checkpoint``) keeps what it received for each microbatch; while ``replaying``, a
forward ``recv`` returns the kept tensor and a forward ``send`` sends nothing.
"""

from __future__ import annotations

import torch

from hetcc.errors import RuntimeFailure
from hetcc.passes.comm import CommEdge, StageGraph
from hetcc.runtime.groups import Links
from hetcc.runtime.layout import RankLayout
from hetcc.sendrecv import count_settled_gradient, describe_spec, fits_spec
from hetcc.wire import NO_CODEC

# The dtypes a header can name (its code is the index; new ones go at the end).
WIRE_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn, torch.float8_e5m2,
)  # fmt: skip
# A header is int64[2 + HEADER_DIMS]: dtype code, rank, then the sizes (padded with -1); one size for
# every message, so a header never pairs with a buffer of another size.
HEADER_DIMS = 16


class LinkTransport:
    """One stage's transfers on this rank, each addressed to the rank that runs the peer stage's
    replica for the current microbatch."""

    def __init__(
        self,
        links: Links,
        stage: StageGraph,
        layout: RankLayout | None = None,
        *,
        mixed_precision: bool = False,
        keep_received: bool = False,
    ):
        self.links, self.index, self.microbatch = links, stage.index, 0
        self.layout, self.mixed_precision, self.keep_received = layout, mixed_precision, keep_received
        self.edges = {edge.tag: edge for edge in (*stage.recvs, *stage.sends)}
        self.grads_out = _by_tag(e for e in stage.recvs if e.requires_grad)  # gradients this stage sends
        self.grads_in = _by_tag(e for e in stage.sends if e.requires_grad)  # ... and receives
        self.computed: dict[int, torch.Tensor] = {}  # tag -> gradient recv's backward gave (this microbatch)
        self.arrived: dict[int, torch.Tensor] = {}  # tag -> gradient received, not yet taken by an op
        self.asked: set[int] = set()  # peer stages whose gradients of this microbatch were received
        self.wire_dtypes: dict[tuple[int, int], torch.dtype] = {}  # (tag, peer rank) -> announced dtype
        self.crossed: dict[int, torch.dtype] = {}  # tag -> the dtype its tensor crossed in (its gradient's)
        self.received: dict[tuple[int, int], torch.Tensor] = {}  # (tag, microbatch), kept for replay
        self.replaying = False

    def carries_gradient(self, tag: int) -> bool:
        return self.edges[tag].requires_grad

    def peer_ranks(self, peer_stage: int) -> list[int]:
        """The ranks of ``peer_stage`` this rank sends to for the current microbatch: one, or none or
        several between tensor-parallel stages (see the module docstring)."""
        if self.layout is None:
            return [peer_stage]
        part, degree = self._part()
        return [
            self.layout.rank_running(peer_stage, self.microbatch, p)
            for p in range(self.layout.tensor_degree(peer_stage))
            if p % degree == part
        ]

    def peer_rank(self, peer_stage: int) -> int:
        """The rank of ``peer_stage`` this rank receives from for the current microbatch."""
        if self.layout is None:
            return peer_stage
        part, _ = self._part()
        return self.layout.rank_running(
            peer_stage, self.microbatch, part % self.layout.tensor_degree(peer_stage)
        )

    def _part(self) -> tuple[int, int]:
        """This rank's part of its stage's replica, and the stage's tensor degree."""
        return self.layout.ranks[self.links.rank].tensor, self.layout.tensor_degree(self.index)

    def send(self, tensor: torch.Tensor, peer: int, tag: int, *, grad: bool) -> None:
        if grad:  # recv's backward: sent with the microbatch's other gradients by ``settle_gradients``
            self.computed[tag] = tensor.detach()
            return
        if self.replaying:
            return  # a recomputed forward: the tensor was sent by the first forward
        edge = self.edges[tag]
        if not fits_spec(tensor.shape, tensor.dtype, *edge.wire, self.mixed_precision):
            raise RuntimeFailure(
                f"stage {self.index} computed {edge.value} (tag {edge.tag}) for stage {peer} as "
                f"{describe_spec(tensor.shape, tensor.dtype)}, but the plan records "
                f"{describe_spec(*edge.wire)}",
                hint="run the pipeline on inputs of the microbatch shape it was compiled for, or compile "
                "it again for the shapes you run",
            )
        what = f"F{self.microbatch} {edge.value}"
        self.crossed.setdefault(tag, tensor.dtype)
        for rank in self.peer_ranks(peer):
            if (tag, rank) not in self.wire_dtypes:
                self.wire_dtypes[(tag, rank)] = tensor.dtype
                self.links.isend(_header(tensor), rank, f"shape and dtype of {what}", (self.index, peer))
            self.links.isend(tensor.to(self.wire_dtypes[(tag, rank)]), rank, what, (self.index, peer))

    def recv(self, peer: int, tag: int, shape: list[int], dtype: torch.dtype, *, grad: bool) -> torch.Tensor:
        if grad:  # send's backward
            if peer not in self.asked:
                self._receive_gradients(peer)
            return self.arrived.pop(tag)
        m, edge = self.microbatch, self.edges[tag]
        if self.replaying:
            return self.received[(tag, m)].detach()
        rank = self.peer_rank(peer)
        what = f"F{m} {edge.value} (stage {peer})"
        if (tag, rank) not in self.wire_dtypes:
            header = self.links.recv(
                rank, [2 + HEADER_DIMS], torch.int64, f"shape and dtype of {what}", (peer, self.index)
            )
            self.wire_dtypes[(tag, rank)] = self._check_header(header, edge, peer, shape, dtype)
            self.crossed[tag] = self.wire_dtypes[(tag, rank)]
        tensor = self.links.recv(rank, shape, self.wire_dtypes[(tag, rank)], what, (peer, self.index))
        if self.keep_received:
            self.received[(tag, m)] = tensor
        return tensor

    def forget(self, microbatch: int) -> None:
        """Drop what was kept for replaying ``microbatch`` (its backward is done)."""
        self.received = {key: value for key, value in self.received.items() if key[1] != microbatch}

    def settle_gradients(self) -> None:
        """After the backward of the current microbatch: send the gradient of every received tensor, in
        tag order (zeros where autograd produced none), then receive the gradients of peers no op asked,
        and drop those no op took."""
        m = self.microbatch
        for edge in self.grads_out:
            shape, dtype = self._grad_wire(edge)
            grad = self.computed.pop(edge.tag, None)
            if grad is None:  # a zero payload decodes to zeros under every codec
                grad = torch.zeros(shape, dtype=dtype)
                count_settled_gradient(sent=True)
            if tuple(grad.shape) != tuple(shape) or (grad.dtype == torch.uint8) != (dtype == torch.uint8):
                raise RuntimeFailure(  # a gradient has no header: the receiver would misread it
                    f"stage {self.index}: the gradient of {edge.value} (tag {edge.tag}) is "
                    f"{describe_spec(grad.shape, grad.dtype)}, but the edge sends {describe_spec(shape, dtype)}",
                    hint="the stage's graph and pipeline.json disagree on the edge's codecs: compile and save the "
                    "pipeline again rather than editing its files",
                )
            for rank in self.peer_ranks(edge.src):
                self.links.isend(grad.to(dtype), rank, f"B{m} grad of {edge.value}", (self.index, edge.src))
        for peer in sorted({edge.dst for edge in self.grads_in} - self.asked):
            self._receive_gradients(peer)
        for _ in self.arrived:
            count_settled_gradient(sent=False)
        self.computed, self.arrived, self.asked = {}, {}, set()

    def _receive_gradients(self, peer: int) -> None:
        """Every gradient ``peer`` sends back for the current microbatch, in tag order."""
        self.asked.add(peer)
        rank = self.peer_rank(peer)
        for edge in (e for e in self.grads_in if e.dst == peer):
            what = f"B{self.microbatch} grad of {edge.value} (stage {peer})"
            shape, dtype = self._grad_wire(edge)
            self.arrived[edge.tag] = self.links.recv(rank, list(shape), dtype, what, (peer, self.index))

    def _grad_wire(self, edge: CommEdge) -> tuple[tuple[int, ...], torch.dtype]:
        """What the gradient of ``edge`` crosses as: its codec's payload, or the tensor in the dtype it
        crossed in (announced by its header; an encoded activation is decoded to the traced dtype)."""
        sent = edge.dtype if edge.codec != NO_CODEC else self.crossed[edge.tag]
        return edge.grad_wire(sent)

    def _check_header(
        self, header: torch.Tensor, edge: CommEdge, peer: int, shape: list[int], dtype: torch.dtype
    ) -> torch.dtype:
        """The dtype announced for ``edge``, once checked against what this stage's recv records."""
        code, rank, *sizes = header.tolist()
        sent_dtype = WIRE_DTYPES[code] if 0 <= code < len(WIRE_DTYPES) else None
        sent_shape = sizes[: max(rank, 0)]
        if sent_dtype is None or not fits_spec(sent_shape, sent_dtype, shape, dtype, self.mixed_precision):
            sent = describe_spec(sent_shape, sent_dtype) if sent_dtype else f"dtype code {code}{sent_shape}"
            raise RuntimeFailure(
                f"stage {self.index} received {sent} from stage {peer} where its recv of {edge.value} "
                f"(tag {edge.tag}) records {describe_spec(shape, dtype)}",
                hint="the two stages disagree on what crosses their cut, or in which order: run the stage "
                "files of one compile together (compile and save the pipeline again rather than mixing or "
                "editing its files); if they are, report it as a hetcc bug with both stage<k>.py files",
            )
        return sent_dtype


def _by_tag(edges) -> list[CommEdge]:
    return sorted(edges, key=lambda edge: edge.tag)


def _header(tensor: torch.Tensor) -> torch.Tensor:
    """What the first message of an edge between two ranks announces: its dtype and shape."""
    if tensor.dtype not in WIRE_DTYPES or tensor.dim() > HEADER_DIMS:
        raise RuntimeFailure(
            f"cannot send a {describe_spec(tensor.shape, tensor.dtype)} tensor between stages",
            hint=f"send tensors of at most {HEADER_DIMS} dimensions and one of the dtypes "
            f"{', '.join(str(d).removeprefix('torch.') for d in WIRE_DTYPES)}",
        )
    sizes = list(tensor.shape) + [-1] * (HEADER_DIMS - tensor.dim())
    return torch.tensor([WIRE_DTYPES.index(tensor.dtype), tensor.dim(), *sizes], dtype=torch.int64)
