"""``hetcc::send`` / ``hetcc::recv``: point-to-point transfers as graph ops.

They are ``torch.library`` custom ops so a stage's graph prints, traces (fake kernels) and
differentiates with them inside: the backward of ``send`` receives the gradient of the sent tensor
from the peer, and the backward of ``recv`` sends the gradient of the received tensor back. Each op
carries the peer stage, a tag naming the cut edge, and the shape and dtype, so ``stage<k>.py`` shows
what crosses where.

The ops move data through the *current transport* (``use_transport``): the distributed runtime's
``hetcc.runtime.transport.LinkTransport`` or ``LocalTransport``, an in-process mailbox used to run all
stages in one process. ``recv`` takes an ``anchor``: a 0-d tensor that requires grad (the stage's
``hetcc_anchor`` buffer), because autograd only records an op that has a differentiable input; without
it, the gradient of a received tensor would never reach the backward of ``recv``.

Codecs (``hetcc.wire``): where a cut's tensor crosses encoded, the sender's graph runs
``encode(x, codec)`` and sends the uint8 payload with ``send(payload, ..., source=x)``, and the
receiver's runs ``decode(recv(...), anchor, codec, ...)``. Gradients follow the straight-through rule:
``decode``'s backward (or ``recv``'s, for a tensor sent whole) encodes the gradient with the edge's
``grad_codec`` and hands it to the transport; ``send``'s backward decodes it into the gradient of ``x``.

This module sits below the passes (``comm`` inserts the ops and the anchor, ``codegen`` prints them) and
the runtime (which runs them), and imports neither.

Every tensor the ops move is counted in process-local counters (``transfer_stats``), which the runtime
reports per rank as provenance: they show that the transfers of a run went through these ops.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Protocol

import torch

from hetcc.errors import RuntimeFailure
from hetcc.wire import NO_CODEC, get_codec

ANCHOR_NAME = "hetcc_anchor"


class Transport(Protocol):
    """Moves one tensor per (tag, direction); ``grad`` marks the backward direction. A ``recv`` fails
    unless what arrives is the shape and dtype it records (``fits_spec``).

    ``replaying``: a recomputed forward is running (activation checkpointing): its ``recv`` returns
    what the first forward received and its ``send`` moves nothing; the ops count those as replayed."""

    replaying: bool

    def carries_gradient(self, tag: int) -> bool:
        """Whether the gradient of edge ``tag`` crosses the cut (the peer sends or waits for it)."""
        ...

    def send(self, tensor: torch.Tensor, peer: int, tag: int, *, grad: bool) -> None: ...

    def recv(
        self, peer: int, tag: int, shape: list[int], dtype: torch.dtype, *, grad: bool
    ) -> torch.Tensor: ...


_current: list[Transport] = []

# What ``transfer_stats`` reports; ``grads_filled`` / ``grads_dropped`` count gradients exchanged outside
# the ops (``LinkTransport.settle_gradients``), ``replayed`` the forward sends and recvs of recomputed
# forwards, which move nothing.
TRANSFER_STATS = (
    "sends",
    "recvs",
    "bytes_sent",
    "bytes_received",
    "grads_filled",
    "grads_dropped",
    "replayed",
)
_transfers: Counter[str] = Counter()


def transfer_stats() -> dict[str, int]:
    """Tensors (forward and gradient) and bytes the ops moved in this process since the last reset."""
    return {key: _transfers[key] for key in TRANSFER_STATS}


def reset_transfer_stats() -> None:
    _transfers.clear()


def count_settled_gradient(*, sent: bool) -> None:
    """Count a gradient the runtime sent (zeros) or received (and dropped) outside the ops."""
    _transfers["grads_filled" if sent else "grads_dropped"] += 1


def _count(tensor: torch.Tensor, *, sent: bool, replayed: bool = False) -> None:
    if replayed:
        _transfers["replayed"] += 1
        return
    _transfers["sends" if sent else "recvs"] += 1
    _transfers["bytes_sent" if sent else "bytes_received"] += tensor.numel() * tensor.element_size()


@contextlib.contextmanager
def use_transport(transport: Transport) -> Iterator[Transport]:
    """Route ``hetcc::send``/``hetcc::recv`` through ``transport`` for the block."""
    _current.append(transport)
    try:
        yield transport
    finally:
        _current.pop()


def _transport() -> Transport:
    if not _current:
        raise RuntimeFailure(
            "hetcc.send/hetcc.recv ran outside a transport",
            hint="run stage modules through hetcc.runtime (run_local / launch) or inside "
            "hetcc.sendrecv.use_transport(LocalTransport())",
        )
    return _current[-1]


class LocalTransport:
    """In-process mailbox: a send is stored until the matching recv takes it (tests, debugging)."""

    def __init__(self) -> None:
        self.mailbox: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self.replaying = False

    def carries_gradient(self, tag: int) -> bool:
        """Every floating-point edge's gradient: in one process nothing waits for one that is not sent."""
        return True

    def send(self, tensor: torch.Tensor, peer: int, tag: int, *, grad: bool) -> None:
        self.mailbox.setdefault((tag, grad), []).append(tensor.detach().clone())

    def recv(self, peer: int, tag: int, shape: list[int], dtype: torch.dtype, *, grad: bool) -> torch.Tensor:
        kind = "gradient" if grad else "activation"
        queue = self.mailbox.get((tag, grad))
        if not queue:
            raise RuntimeFailure(
                f"recv of {kind} tag {tag} from stage {peer}: nothing was sent",
                hint="run stages in pipeline order (forward 0..K-1, backward K-1..0)",
            )
        tensor = queue.pop(0)
        if not fits_spec(
            tensor.shape, tensor.dtype, shape, dtype, mixed_precision=grad
        ):  # a gradient's op casts it
            raise RuntimeFailure(
                f"recv of {kind} tag {tag} from stage {peer}: received {describe_spec(tensor.shape, tensor.dtype)}, "
                f"but the recv records {describe_spec(shape, dtype)}",
                hint="run stages of one split together, on inputs of the microbatch shape they were traced with",
            )
        return tensor


def fits_spec(
    shape, dtype: torch.dtype, recorded_shape, recorded_dtype: torch.dtype, mixed_precision: bool
) -> bool:
    """Whether a tensor of ``shape`` x ``dtype`` is what a send or recv that records ``recorded_shape`` x
    ``recorded_dtype`` moves: the same shape and dtype; under mixed precision any floating-point dtype for
    a floating-point one (autocast's, which the fp32 trace does not record)."""
    floats = dtype.is_floating_point and recorded_dtype.is_floating_point
    return tuple(shape) == tuple(recorded_shape) and (dtype == recorded_dtype or (mixed_precision and floats))


def describe_spec(shape, dtype: torch.dtype) -> str:
    """``float32[4, 8]``, as error messages name a tensor's dtype and shape."""
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


@torch.library.custom_op("hetcc::send", mutates_args=())
def send(
    tensor: torch.Tensor,
    peer: int,
    tag: int,
    shape: list[int],
    dtype: torch.dtype,
    source: torch.Tensor | None = None,
    grad_codec: str = "none",
) -> torch.Tensor:
    """Send ``tensor`` to stage ``peer``; returns a 0-d token that keeps the send in the graph.

    ``source``: the tensor ``tensor`` encodes (``hetcc.encode``'s input), which takes the gradient; the
    gradient arrives encoded with ``grad_codec`` and is decoded here (``hetcc.wire``)."""
    transport = _transport()
    transport.send(tensor, peer, tag, grad=False)
    _count(tensor, sent=True, replayed=transport.replaying)
    return (tensor if source is None else source).new_zeros(())  # differentiable where the sent value is


@send.register_fake
def _send_fake(tensor, peer, tag, shape, dtype, source=None, grad_codec="none"):
    return (tensor if source is None else source).new_empty(())


def _send_setup(ctx, inputs, output) -> None:
    tensor, ctx.peer, ctx.tag, _shape, _dtype, source, ctx.grad_codec = inputs
    ctx.coded = source is not None
    target = source if ctx.coded else tensor
    ctx.differentiable = target.dtype.is_floating_point
    ctx.sent_dtype = target.dtype  # under autocast, not always the traced ``dtype``
    ctx.grad_shape = list(target.shape)


def _send_backward(ctx, grad_token):
    transport = _transport()
    if not (ctx.differentiable and transport.carries_gradient(ctx.tag)):
        return None, None, None, None, None, None, None
    wire_shape, wire_dtype = gradient_wire(ctx.grad_shape, ctx.sent_dtype, ctx.grad_codec)
    wire = transport.recv(ctx.peer, ctx.tag, wire_shape, wire_dtype, grad=True)
    _count(wire, sent=False)
    if ctx.grad_codec == NO_CODEC:
        grad = wire.to(ctx.sent_dtype)
    else:
        grad = get_codec(ctx.grad_codec).decode(wire, ctx.grad_shape, ctx.sent_dtype)
    if ctx.coded:
        return None, None, None, None, None, grad, None
    return grad, None, None, None, None, None, None


send.register_autograd(_send_backward, setup_context=_send_setup)


@torch.library.custom_op("hetcc::recv", mutates_args=())
def recv(
    anchor: torch.Tensor, peer: int, tag: int, shape: list[int], dtype: torch.dtype, grad_codec: str = "none"
) -> torch.Tensor:
    """Receive the tensor of edge ``tag`` from stage ``peer`` (``anchor`` only ties it to autograd); its
    gradient goes back encoded with ``grad_codec``."""
    transport = _transport()
    tensor = transport.recv(peer, tag, shape, dtype, grad=False)
    _count(tensor, sent=False, replayed=transport.replaying)
    return tensor


@recv.register_fake
def _recv_fake(anchor, peer, tag, shape, dtype, grad_codec="none"):
    return anchor.new_empty(shape, dtype=dtype)


def _recv_setup(ctx, inputs, output) -> None:
    _, ctx.peer, ctx.tag, ctx.shape, _traced, ctx.grad_codec = inputs
    ctx.dtype = output.dtype  # what arrived: under autocast, the dtype the sender produced


def _recv_backward(ctx, grad):
    if ctx.dtype.is_floating_point:
        _send_gradient(grad, ctx.shape, ctx.dtype, ctx.peer, ctx.tag, ctx.grad_codec)
    return None, None, None, None, None, None


recv.register_autograd(_recv_backward, setup_context=_recv_setup)


def _send_gradient(grad, shape, dtype, peer: int, tag: int, grad_codec: str) -> None:
    """The backward of a received tensor: its gradient (zeros where autograd produced none), encoded
    with ``grad_codec``, handed to the transport for stage ``peer``."""
    transport = _transport()
    if not transport.carries_gradient(tag):
        return
    grad = grad if grad is not None else torch.zeros(shape, dtype=dtype)
    wire = grad if grad_codec == NO_CODEC else get_codec(grad_codec).encode(grad)
    transport.send(wire, peer, tag, grad=True)
    _count(wire, sent=True)


@torch.library.custom_op("hetcc::encode", mutates_args=())
def encode(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    """``tensor`` encoded with ``codec`` (``hetcc.wire``): the uint8 payload a ``send`` moves."""
    return get_codec(codec).encode(tensor)


@encode.register_fake
def _encode_fake(tensor, codec):
    return tensor.new_empty([get_codec(codec).payload_bytes(tensor.shape)], dtype=torch.uint8)


@torch.library.custom_op("hetcc::decode", mutates_args=())
def decode(
    payload: torch.Tensor,
    anchor: torch.Tensor,
    codec: str,
    shape: list[int],
    dtype: torch.dtype,
    peer: int,
    tag: int,
    grad_codec: str = "none",
) -> torch.Tensor:
    """The tensor of edge ``tag`` decoded from the ``payload`` a ``recv`` took. Like ``recv``'s, its
    backward sends the gradient to stage ``peer`` encoded with ``grad_codec`` (``anchor`` ties it to
    autograd): straight through the lossy forward codec."""
    return get_codec(codec).decode(payload, shape, dtype)


@decode.register_fake
def _decode_fake(payload, anchor, codec, shape, dtype, peer, tag, grad_codec="none"):
    return anchor.new_empty(shape, dtype=dtype)


def _decode_setup(ctx, inputs, output) -> None:
    _, _, _, ctx.shape, ctx.dtype, ctx.peer, ctx.tag, ctx.grad_codec = inputs


def _decode_backward(ctx, grad):
    _send_gradient(grad, ctx.shape, ctx.dtype, ctx.peer, ctx.tag, ctx.grad_codec)
    return None, None, None, None, None, None, None, None


decode.register_autograd(_decode_backward, setup_context=_decode_setup)


def gradient_wire(shape, dtype: torch.dtype, grad_codec: str) -> tuple[list[int], torch.dtype]:
    """Shape and dtype of the gradient of a ``shape`` x ``dtype`` tensor on the wire under ``grad_codec``."""
    if grad_codec == NO_CODEC:
        return list(shape), dtype
    return [get_codec(grad_codec).payload_bytes(shape)], torch.uint8


def new_anchor(device: torch.device | str | None = None) -> torch.Tensor:
    """The 0-d tensor a stage passes to every ``recv`` so received tensors join autograd."""
    return torch.zeros((), device=device, requires_grad=True)


def attach_anchor(module: torch.nn.Module, device: torch.device | str | None = None) -> None:
    """(Re)register the stage's anchor as a non-persistent buffer (never saved with the weights)."""
    if hasattr(module, ANCHOR_NAME):
        delattr(module, ANCHOR_NAME)
    module.register_buffer(ANCHOR_NAME, new_anchor(device), persistent=False)
