"""The built-in loop's optimizer and learning-rate schedule, from JSON-able settings.

``{"name": "adamw", "lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]}``: a ``torch.optim`` class by
the planner's name (``hetcc.passes.partition.OPTIMIZERS``: the state it keeps is what the plan's memory
counts) with its keyword arguments. With ``weight_decay`` > 0, parameters of fewer than two dimensions
(biases, normalisation scales) form a second group without decay, as nanoGPT and most LM recipes do.

``{"warmup_steps": 100, "decay": "cosine", "total_steps": 5000, "min_lr_ratio": 0.1}``: the learning
rate ramps linearly over the warmup, then decays to ``min_lr_ratio`` of itself at ``total_steps`` along
a cosine (or a line, or not at all). It is a ``torch.optim.lr_scheduler.LambdaLR`` (torchtitan's way) of
the step alone, so a resumed run takes it up at its step, with the settings given at resume.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from hetcc.errors import HetccError, did_you_mean
from hetcc.passes.partition import optimizer as optimizer_entry

DECAYS = ("constant", "linear", "cosine")


def build_optimizer(
    spec: Mapping[str, Any] | None,
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
    shard_group: Any = None,
) -> torch.optim.Optimizer | None:
    """A ``torch.optim`` optimizer over ``named_params`` from ``spec`` (None, or a name the planner knows
    that steps nothing, such as "none": no optimizer). ``shard_group``: the process group of a stage's
    replicas whose optimizer state is sharded over them (ZeRO-1): torch's ``ZeroRedundancyOptimizer``
    around the same optimizer (it takes parameters without their names)."""
    named = [(name, p) for name, p in named_params if p.requires_grad]
    if spec is None or not named:
        return None
    options = dict(spec)
    entry = optimizer_entry(options.pop("name", "sgd"))
    if entry.torch_class is None:
        return None
    options = {**entry.defaults, **options}
    groups = param_groups(named, float(options.get("weight_decay", 0.0)))
    kind = getattr(torch.optim, entry.torch_class)
    try:
        if shard_group is not None:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            plain = [{**g, "params": [p for _, p in g["params"]]} for g in groups]
            return ZeroRedundancyOptimizer(plain, optimizer_class=kind, process_group=shard_group, **options)
        return kind(groups, **options)
    except (TypeError, ValueError) as error:
        raise HetccError(
            f"optimizer {dict(spec)}: {error}",
            hint=f"use the keyword arguments of torch.optim.{entry.torch_class}",
        ) from None


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the state tensors ``optimizer`` holds on this rank (a ``ZeroRedundancyOptimizer``: its
    shard's); 0 without one."""
    if optimizer is None:
        return 0
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the one that steps
    return sum(
        t.numel() * t.element_size() for s in local.state.values() for t in s.values() if torch.is_tensor(t)
    )


def param_groups(named: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """One group, or (with weight decay) one with decay for matrices and embeddings and one without for
    parameters of fewer than two dimensions. Parameters go in with their model names, which torch keeps
    as each group's ``param_names`` (a checkpoint moved into another split finds them by name)."""
    if weight_decay <= 0:
        return [{"params": named}]
    decay = [(n, p) for n, p in named if p.dim() >= 2]
    rest = [(n, p) for n, p in named if p.dim() < 2]
    return [
        {"params": group, "weight_decay": wd} for group, wd in ((decay, weight_decay), (rest, 0.0)) if group
    ]


def apply_settings(optimizer: torch.optim.Optimizer, spec: Mapping[str, Any]) -> dict[str, tuple]:
    """After loading a checkpoint's optimizer state, set the hyper-parameters of ``spec`` (the run's
    settings win over the checkpoint's); returns what changed: name -> (checkpoint's, now)."""
    changed = {}
    options = {k: v for k, v in spec.items() if k != "name"}
    for group in optimizer.param_groups:
        for key, value in options.items():
            if key == "weight_decay" and group.get("weight_decay") == 0.0 and len(optimizer.param_groups) > 1:
                continue  # the group without decay keeps none
            before = group.get(key)
            value = tuple(value) if isinstance(before, tuple) else value
            if before != value:
                changed.setdefault(key, (before, value))
            group[key] = value
        group["initial_lr"] = group["lr"]
    return changed


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate as a multiple of the optimizer's ``lr`` at each step (see the module docstring)."""

    warmup_steps: int = 0
    decay: str = "constant"
    total_steps: int | None = None  # where the decay ends (default: the run's last step)
    min_lr_ratio: float = 0.1

    def __post_init__(self):
        if self.decay not in DECAYS:
            raise HetccError(
                f"lr schedule: unknown decay {self.decay!r}", hint=f"use one of {', '.join(DECAYS)}"
            )
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise HetccError(f"lr schedule: warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not 0.0 <= float(self.min_lr_ratio) <= 1.0:
            raise HetccError(f"lr schedule: min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")

    @classmethod
    def from_spec(cls, spec: LRSchedule | Mapping[str, Any] | None, total_steps: int) -> LRSchedule:
        """From a dict (JSON settings) or an ``LRSchedule``; ``total_steps`` fills an unset end."""
        if spec is None:
            return cls(total_steps=total_steps)
        if isinstance(spec, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(spec) - known)
            if unknown:
                raise HetccError(
                    f"lr schedule: unknown setting {unknown[0]!r}",
                    hint=f"use {', '.join(sorted(known))}" + did_you_mean(unknown[0], known),
                )
            spec = cls(**spec)
        return spec if spec.total_steps is not None else cls(**{**asdict(spec), "total_steps": total_steps})

    def factor(self, step: int) -> float:
        """The multiple of ``lr`` used by the optimizer step of ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.decay == "constant":
            return 1.0
        span = max(1, (self.total_steps or step) - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def scheduler(self, optimizer: torch.optim.Optimizer, step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
        """A ``LambdaLR`` that has set the learning rate of ``step`` (a resumed run's first step)."""
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor, last_epoch=step - 1)

    def describe(self) -> str:
        warmup = f"{self.warmup_steps} warmup steps, then " if self.warmup_steps else ""
        if self.decay == "constant":
            return f"{warmup}constant"
        return f"{warmup}{self.decay} decay to {self.min_lr_ratio:g} x lr at step {self.total_steps}"
