"""Codecs on the wire of a cut: what a message costs with one, and which one a stage's outgoing cut uses.

A tensor crossing a pipeline cut may be encoded before it is sent (bf16, int8, ...): fewer bytes on
the link, plus encode time on the sender and decode time on the receiver. ``problem.codecs`` lists the
rows a plan may use (``problem.WireCodec``: one per codec, direction and place, costed per cut). One message
with row c from device a (type ta) to device b (type tb) takes

    latency[a][b] + wire / bandwidth[a][b] + calls * (call_s[ta] + call_s[tb])
                  + coded * (encode_s_per_byte[ta] + decode_s_per_byte[tb])

seconds, 0 when nothing goes on the wire. Encode and decode are priced on the message's path: they
hold the link and delay the receiver, not the devices' compute lanes (the planner's C_j, the
simulator's sends). Gradients go back b -> a, encoded on b and decoded on a, only in training and
only where the cut has gradient bytes.

Per stage j < K - 1 and per direction a plan uses one row on its outgoing cut: the rows allowed on
every (replica of j, replica of j + 1) pair its microbatches take (``links``: the devices' nodes;
``cuts``) are the candidates, and the one whose worst pair takes least wins (ties: a row named "none",
then fewest wire bytes, then the name); where no row is allowed the tensors go uncoded ("none").
The objective, the DP and the simulator all price messages and choose rows here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from hetcc.errors import PlanFormatError
from hetcc.solver.links import transfer_s
from hetcc.solver.problem import PartitionProblem, PartitionSolution, WireCodec

NONE = "none"  # the name of the uncoded wire
Pair = tuple[int, int]  # (device of stage j, device of stage j + 1)
Rows = tuple[WireCodec | None, WireCodec | None]  # (activation row, gradient row); None: uncoded


class Message(NamedTuple):
    """One direction's message over a link: bytes on the wire, and what ``codec`` encodes of it (raw
    bytes, tensors); ``codec`` None sends it uncoded."""

    wire_bytes: float
    coded_bytes: float = 0.0
    calls: int = 0
    codec: WireCodec | None = None


def message_s(problem: PartitionProblem, src: int, dst: int, message: Message) -> float:
    """Seconds of ``message`` from device ``src`` to ``dst``: the link's, plus encoding on ``src`` and
    decoding on ``dst`` (nothing is sent, and nothing coded, for 0 wire bytes)."""
    seconds = transfer_s(problem, src, dst, message.wire_bytes)
    codec = message.codec
    if codec is None or message.wire_bytes <= 0:
        return seconds
    sender, receiver = problem.devices[src].type, problem.devices[dst].type
    seconds += message.calls * (codec.call_s[sender] + codec.call_s[receiver])
    return seconds + message.coded_bytes * (
        codec.encode_s_per_byte[sender] + codec.decode_s_per_byte[receiver]
    )


def raw_bytes(problem: PartitionProblem, cut: int, gradient: bool) -> float:
    """Uncoded bytes of one direction over the cut after block ``cut``."""
    return problem.cut_grad_at(cut) if gradient else problem.cut_bytes[cut]


def cut_message(problem: PartitionProblem, codec: WireCodec | None, cut: int, gradient: bool) -> Message:
    """One direction's message over the cut after block ``cut`` with ``codec`` (the chain's arrays)."""
    raw = raw_bytes(problem, cut, gradient)
    if codec is None or raw <= 0:
        return Message(raw)
    return Message(codec.cut_bytes[cut], codec.coded_bytes[cut], codec.calls[cut], codec)


def direction_s(
    problem: PartitionProblem, codec: WireCodec | None, cut: int, pair: Pair, gradient: bool
) -> float:
    """Seconds of one direction over the cut after block ``cut`` between ``pair`` = (device of stage j,
    device of stage j + 1): activations forward, gradients back."""
    src, dst = pair[::-1] if gradient else pair
    return message_s(problem, src, dst, cut_message(problem, codec, cut, gradient))


def pair_s(problem: PartitionProblem, cut: int, pair: Pair, rows: Rows) -> float:
    """C of one pair over the cut after block ``cut``: its activations forward plus, in training, their
    gradients back, with ``rows`` (uncoded where both are None: ``links.transfer_s`` each way)."""
    return direction_s(problem, rows[0], cut, pair, False) + direction_s(problem, rows[1], cut, pair, True)


def allowed(problem: PartitionProblem, codec: WireCodec, cut: int, pair: Pair) -> bool:
    """Whether a plan may put ``codec`` on the cut after block ``cut`` between ``pair``."""
    if codec.cuts is not None and not codec.cuts[cut]:
        return False
    if codec.links == "all":
        return True
    inter = problem.devices[pair[0]].node != problem.devices[pair[1]].node
    return inter == (codec.links == "inter-node")


def choose(problem: PartitionProblem, cut: int, pairs: Sequence[Pair], gradient: bool) -> WireCodec | None:
    """The row one direction uses over the cut after block ``cut`` for microbatches taking ``pairs``:
    least worst-pair seconds among the rows allowed on every pair (module docstring); None (uncoded)
    where none is allowed or the direction sends nothing."""
    if not problem.codecs or raw_bytes(problem, cut, gradient) <= 0:
        return None
    rows = [
        c
        for c in problem.codecs
        if c.gradient == gradient and all(allowed(problem, c, cut, p) for p in pairs)
    ]
    if not rows:
        return None
    return min(
        rows,
        key=lambda c: (
            max(direction_s(problem, c, cut, p, gradient) for p in pairs),
            c.name != NONE,
            c.cut_bytes[cut],
            c.name,
        ),
    )


def named_row(problem: PartitionProblem, name: str, gradient: bool) -> WireCodec | None:
    """The row of one direction named ``name``; None (uncoded) for "none" when no row has that name."""
    for codec in problem.codecs or ():
        if codec.name == name and codec.gradient == gradient:
            return codec
    if name == NONE:
        return None
    direction = "gradient" if gradient else "activation"
    known = sorted({c.name for c in problem.codecs or () if c.gradient == gradient} | {NONE})
    raise PlanFormatError(f"no {direction} codec named {name!r}", hint=f"use one of {', '.join(known)}")


def cut_rows(
    problem: PartitionProblem, cut: int, pairs: Sequence[Pair], pinned: Sequence[str] | None = None
) -> Rows:
    """(activation, gradient) rows of a cut: ``pinned`` names them (allowed or not), else ``choose``."""
    if pinned is not None:
        return named_row(problem, pinned[0], False), named_row(problem, pinned[1], True)
    return choose(problem, cut, pairs, False), choose(problem, cut, pairs, True)


def names(rows: Rows) -> tuple[str, str]:
    """(activation, gradient) codec names of ``rows``, as ``StageCost.codecs`` holds them."""
    return tuple(NONE if row is None else row.name for row in rows)


def chosen_cut_s(problem: PartitionProblem, cut: int, pair: Pair) -> float:
    """C over the cut after block ``cut`` for one pair with the rows ``choose`` picks for it: the DP's
    C_j of a slot (its replicas are interchangeable, so one pair stands for all)."""
    return pair_s(problem, cut, pair, cut_rows(problem, cut, [pair]))


def stage_messages(
    problem: PartitionProblem, blocks: Sequence[tuple[int, int]], codecs: Sequence[Sequence[str]]
) -> dict[tuple[int, int], tuple[Message, Message]]:
    """(sending stage, receiving stage) -> (activations forward, gradients back) per microbatch.

    Stage j always sends to j + 1 (its output, however small, is what the next stage waits for); with
    ``problem.cut_tensors`` each tensor goes from its producer's stage to every stage holding a
    consumer (skips included, never relayed), else the chain's cut goes to the next stage. Every
    message stage j sends, and the gradients it gets back, use its ``codecs[j]`` (per tensor with
    ``cut_tensors``: ``tensor_bytes`` on the wire, ``tensor_coded`` ones encoded), skips included: a
    stage's outgoing cut has one codec per direction, chosen on its link to stage j + 1."""
    rows = [(named_row(problem, a, False), named_row(problem, g, True)) for a, g in codecs]
    if problem.cut_tensors is None:
        return {
            (j, j + 1): tuple(cut_message(problem, rows[j][k], blocks[j][1] - 1, k == 1) for k in (0, 1))
            for j in range(len(blocks) - 1)
        }
    stage_of = [j for j, (a, b) in enumerate(blocks) for _ in range(a, b)]
    sent: dict[tuple[int, int], list[int]] = {(j, j + 1): [] for j in range(len(blocks) - 1)}
    for t, (producer, consumers, _, _) in enumerate(problem.cut_tensors):
        src = stage_of[producer]
        for dst in sorted({stage_of[c] for c in consumers} - {src}):
            sent.setdefault((src, dst), []).append(t)
    return {
        pair: tuple(_tensors_message(problem, rows[pair[0]][k], tensors, k == 1) for k in (0, 1))
        for pair, tensors in sent.items()
    }


def _tensors_message(
    problem: PartitionProblem, codec: WireCodec | None, tensors: Iterable[int], gradient: bool
) -> Message:
    """One direction's message carrying the ``cut_tensors`` entries ``tensors`` with ``codec``."""
    wire, coded, calls = 0.0, 0.0, 0
    for t in tensors:
        raw = problem.cut_tensors[t][3 if gradient else 2] if problem.training or not gradient else 0.0
        if codec is None:
            wire += raw
        elif raw > 0:
            wire += codec.tensor_bytes[t]
            if codec.tensor_coded[t]:
                coded, calls = coded + raw, calls + 1
    return Message(wire, coded, calls, codec)


def wire_bytes_per_step(problem: PartitionProblem, solution: PartitionSolution) -> tuple[float, float]:
    """(activation bytes, gradient bytes) the plan puts on the wire in one step: every stage pair's
    messages (``stage_messages`` with the stages' codecs) times the microbatches."""
    messages = stage_messages(
        problem, [s.blocks for s in solution.stages], [s.codecs for s in solution.stages]
    )
    m = problem.microbatches
    return (
        math.fsum(forward.wire_bytes for forward, _ in messages.values()) * m,
        math.fsum(back.wire_bytes for _, back in messages.values()) * m,
    )
