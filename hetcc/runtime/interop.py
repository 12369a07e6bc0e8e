"""Hand hetcc's stages to ``torch.distributed.pipelining``, which moves the tensors itself.

pipelining runs a chain: stage 0 takes the model inputs, every later stage takes exactly what the
previous one returned. ``pipelining_schedule`` checks that a split is such a chain (no skip connection
over a stage, no model input after stage 0) and wraps this rank's stage in a ``PipeliningModule``: the
stage's computation without its send/recv ops (``hetcc.passes.codegen.compute_module``), taking its
arguments in the order the previous stage sends them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetcc.errors import PlanFormatError
from hetcc.passes.codegen import compute_module
from hetcc.passes.comm import StageGraph
from hetcc.solver.schedules import INTERLEAVED, ZBV, rank_stages

# hetcc's schedules and torch.distributed.pipelining's: ZB-H1 is torch's interleaved zero-bubble
# schedule with one stage per rank (a schedule of several stages per rank: it takes a list of them).
_SCHEDULES = {
    "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zb-h1": "ScheduleInterleavedZeroBubble",
    INTERLEAVED: "ScheduleInterleaved1F1B", ZBV: "ScheduleZBVZeroBubble",
}  # fmt: skip
_MULTI_STAGE = ("zb-h1", INTERLEAVED, ZBV)


class PipeliningModule(torch.nn.Module):
    """``compute_module(stage)`` taking its received tensors in the previous stage's send order, and
    returning a single output bare (a tensor, not a 1-tuple) to the next stage or the loss function."""

    def __init__(self, stage: StageGraph, previous: StageGraph | None):
        super().__init__()
        self.compute = compute_module(stage)
        order = [edge.tag for edge in previous.sends] if previous is not None else []
        self.permutation = [order.index(edge.tag) for edge in stage.recvs]
        self.single_output = stage.is_last and stage.num_outputs == 1

    def forward(self, *args):
        if self.permutation:
            args = tuple(args[i] for i in self.permutation)
        out = self.compute(*args)
        return out[0] if self.single_output or len(out) == 1 else out


def pipelining_schedule(
    stages: list[StageGraph],
    rank: int,
    microbatches: int,
    schedule: str = "1f1b",
    loss_fn: Callable | None = None,
    device: torch.device | str = "cpu",
    ranks: int | None = None,
):
    """This rank's ``torch.distributed.pipelining`` schedule for a chain-shaped split: of its one stage,
    under interleaved 1F1B over ``ranks`` ranks of its stages rank, rank + ranks, ... (hetcc's
    placement, ``placement.interleaved_ranks``), under ZB-V of its stages rank and 2 * ranks - 1 - rank
    (``placement.zbv_ranks``)."""
    if schedule not in _SCHEDULES:
        raise PlanFormatError(
            f"hetcc hands torch.distributed.pipelining its {', '.join(_SCHEDULES)} schedules, not {schedule!r}",
            hint="run this plan with hetcc's runtime, or compile it with schedule='1f1b' for torch",
        )
    _check_chain(stages)
    from torch.distributed import pipelining  # 0.4-4 s to import: only where a schedule is built

    positions = len(stages) // 2 if schedule == ZBV else ranks or len(stages)  # ranks holding stages
    held = [
        pipelining.PipelineStage(
            PipeliningModule(stages[k], stages[k - 1] if k else None).to(device),
            k,
            len(stages),
            torch.device(device),
        )
        for k in rank_stages(schedule, positions, rank, len(stages) // positions)
    ]
    stages_here = held if schedule in _MULTI_STAGE else held[0]
    return getattr(pipelining, _SCHEDULES[schedule])(stages_here, microbatches, loss_fn=loss_fn)


def _check_chain(stages: list[StageGraph]) -> None:
    for stage in stages:
        if stage.tensor is not None:
            raise PlanFormatError(
                f"stage {stage.index} is tensor parallel ({stage.tensor.degree} ranks per replica), which "
                "torch.distributed.pipelining does not run (one rank per stage)",
                hint="run this plan with hetcc's runtime, or compile it with tensor_parallel=False for torch",
            )
        coded = [e.value for e in stage.sends if (e.codec, e.grad_codec) != ("none", "none")]
        if coded:
            raise PlanFormatError(
                f"stage {stage.index} sends {coded[:3]} through codecs, which torch.distributed.pipelining "
                "would not apply (it moves tensors itself)",
                hint="run this plan with hetcc's runtime, or compile it with compress='off' for torch",
            )
        bad_recv = [e.value for e in stage.recvs if e.src != stage.index - 1]
        bad_send = [e.value for e in stage.sends if e.dst != stage.index + 1]
        if bad_recv or bad_send or (stage.index > 0 and stage.inputs):
            raise PlanFormatError(
                f"stage {stage.index} is not part of a chain (skips: {bad_recv + bad_send}, "
                f"model inputs: {list(stage.inputs) if stage.index else []})",
                hint="torch.distributed.pipelining needs each stage to feed only the next one; "
                "use hetcc's runtime for this split",
            )
