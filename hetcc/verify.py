"""Executable IR checks run after passes when ``hetcc.config.check`` is on (always in tests;
``HETCC_CHECK=1`` for users). Each raises ``AnalysisError`` naming the node, stage or tag at fault."""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx

from hetcc import sendrecv  # noqa: F401 - registers torch.ops.hetcc.send / recv
from hetcc.errors import AnalysisError
from hetcc.ir import info

_COMPUTE = ("call_function", "call_method", "call_module")
_COMM = {torch.ops.hetcc.send.default: "send", torch.ops.hetcc.recv.default: "recv"}


def check_graph(gm: torch.fx.GraphModule, after: str, annotated: bool = True) -> None:
    """The graph lints and (once annotated) every compute node carries a record (a pass did not drop
    annotations)."""
    try:
        gm.graph.lint()
    except Exception as exc:  # noqa: BLE001 - fx raises plain RuntimeError
        raise AnalysisError(f"after {after}: the graph does not lint: {exc}") from exc
    for node in gm.graph.nodes if annotated else ():
        if node.op in _COMPUTE and "hetcc" not in node.meta:
            raise AnalysisError(f"after {after}: node %{node.name} ({node.target}) has no hetcc record")


def check_stages(gm: torch.fx.GraphModule, plan) -> None:
    """Every compute node has one stage; data only flows to the same or a later stage; stages fit."""
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE:
            continue
        stage = info(node).stage
        if stage is None:
            raise AnalysisError(f"after partition: node %{node.name} has no stage")
        for arg in node.all_input_nodes:
            source = info(arg).stage
            if arg.op in _COMPUTE and source is not None and source > stage:
                raise AnalysisError(
                    f"after partition: %{node.name} (stage {stage}) reads %{arg.name} from later stage {source}"
                )
    for stage in plan.stages:
        if stage.peak_memory_bytes > stage.device_memory_bytes * (1 + 1e-9):
            raise AnalysisError(
                f"after partition: stage {stage.index} needs {stage.peak_memory_bytes:.4g} bytes on "
                f"{stage.device}, which has {stage.device_memory_bytes:.4g}"
            )


def check_pipeline(stages) -> None:
    """Every send has exactly one matching recv on its peer, with the same shape, dtype and codecs, and
    each stage posts its sends to a peer, and its recvs from a peer, in ascending tag order (messages pair
    up in the order they are posted: nccl ignores tags)."""
    key = lambda e: (e.tag, e.src, e.dst, tuple(e.shape), e.dtype, e.codec, e.grad_codec)  # noqa: E731
    sends = Counter(key(e) for s in stages for e in s.sends)
    recvs = Counter(key(e) for s in stages for e in s.recvs)
    for edge in (sends - recvs) + (recvs - sends):
        tag, src, dst, shape, dtype, codec, grad_codec = edge
        side = "send" if edge in sends else "recv"
        raise AnalysisError(
            f"stage split: {side} tag {tag} between stages {src} -> {dst} ({dtype}{list(shape)}, codecs "
            f"{codec}/{grad_codec}) has no partner"
        )
    for stage in stages:
        _check_message_order(stage)


def _check_message_order(stage) -> None:
    last: dict[tuple[str, int], int] = {}  # (send or recv, peer stage) -> the tag posted last
    for node in stage.module.graph.nodes:
        kind = _COMM.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        peer, tag = node.args[1], node.args[2]
        if tag < last.get((kind, peer), -1):
            raise AnalysisError(
                f"stage split: stage {stage.index} posts its {kind} of tag {tag} after tag {last[kind, peer]} "
                f"({'to' if kind == 'send' else 'from'} stage {peer}); the peer posts them in tag order"
            )
        last[kind, peer] = tag
