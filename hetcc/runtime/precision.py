"""Mixed precision for a stage: autocast around its forward, and loss scaling agreed by every rank.

``bf16-mixed`` / ``fp16-mixed`` keep the module, its gradients and the optimizer state in fp32 (master
weights) and run each stage's forward under ``torch.autocast``. Tensors cross a cut in the dtype
autocast produced there (see ``LinkTransport``), so each stage computes what one eager forward under the
same autocast would.

``fp16-mixed`` also scales the loss: fp16 gradients underflow without it. A step's gradients are
unscaled on every rank; if any rank found an inf or nan, all ranks skip the step and halve the scale,
else all step, and the scale doubles after ``growth_interval`` good steps in a row (the policy and
defaults of ``torch.amp.GradScaler``, whose found-inf flags are per process; here they are agreed over
every rank of the pipeline first, which that class does not do).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch

from hetcc.plan import PRECISIONS

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # a precision's half format as a torch dtype


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast computes in under ``precision`` (None: plain fp32)."""
    half = PRECISIONS[precision]
    return HALF_DTYPES[half] if half is not None else None


def forward_context(precision: str, device: torch.device):
    """The context a stage's forward (and its loss) runs in."""
    dtype = autocast_dtype(precision)
    return torch.autocast(device.type, dtype) if dtype is not None else contextlib.nullcontext()


class LossScaler:
    """Dynamic loss scale (``torch.amp.GradScaler``'s policy); the found-inf decision is the caller's
    agreement over all ranks (``Links.any_rank``), so every rank skips or steps together."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self.scale, self.growth_factor, self.backoff_factor = float(init_scale), growth_factor, backoff_factor
        self.growth_interval, self.good_steps = growth_interval, 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, grads: Iterable[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; whether any of them has an inf or nan (this rank)."""
        grads = [grad for grad in grads if grad is not None]
        if not grads:
            return False
        torch._foreach_mul_(grads, 1.0 / self.scale)
        return not bool(torch.stack([grad.isfinite().all() for grad in grads]).all())

    def update(self, found_inf: bool) -> None:
        """After a step (``found_inf``: skipped): back off at once, grow after enough good steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            grown = self.scale * self.growth_factor
            self.scale = grown if math.isfinite(grown) else self.scale
            self.good_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
