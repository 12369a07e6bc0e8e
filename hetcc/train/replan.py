"""Move a checkpoint into the stages of another plan of the same model (``hetcc.replan``).

Weights are keyed by the model's parameter names in every stage (``StageGraph.param_names``), and so is
the optimizer state: the built-in loop hands its optimizer each parameter with its model name, which
torch keeps as each group's ``param_names`` (an older checkpoint without them numbers a stage's trainable
parameters in ``module.named_parameters()`` order). So a checkpoint of one split becomes a checkpoint of
another at the same step: per new stage, its weights and the optimizer state of its parameters, in the
groups the loop will build for it (``hetcc.train.optim.param_groups``: with weight decay, a group
without it for biases and norms), under the old run's hyper-parameters. A tied weight held by several
old stages has one value (its holders sum their gradients and step alike), taken from the first.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hetcc.errors import PlanFormatError
from hetcc.passes.comm import StageGraph
from hetcc.runtime.store import load_pipeline
from hetcc.train import checkpoint as ckpt
from hetcc.train.optim import param_groups


def trainable_names(stage: StageGraph) -> list[str]:
    """The model's names of the stage's trainable parameters, in ``module.named_parameters()`` order."""
    return [stage.param_names.get(n, n) for n, p in stage.module.named_parameters() if p.requires_grad]


def move_checkpoint(
    build: str | os.PathLike, root: str | os.PathLike, step: int, new_build: str | os.PathLike,
    new_root: str | os.PathLike,
) -> None:  # fmt: skip
    """Write the checkpoint of ``build`` at ``root``/``step`` as a checkpoint of the pipeline saved in
    ``new_build``, at the same step under ``new_root``. Both pipelines are read from their folders: the
    parameters an optimizer holds are those of the stage modules the ranks load."""
    weights, optimizer_state, settings = _by_model_name(build, root, step)
    for stage in load_pipeline(str(new_build)).stages:
        module = {
            local: weights.get(stage.param_names.get(local, local), tensor)
            for local, tensor in stage.module.state_dict().items()
        }
        optimizer = _optimizer(stage, optimizer_state, settings) if settings is not None else None
        rng = {"cpu": torch.Generator().manual_seed(stage.index).get_state()}
        ckpt.save_checkpoint(
            new_root, stage.index, step, {"module": module, "optimizer": optimizer, "rng": rng}
        )


def _optimizer(stage: StageGraph, state_by_name: dict[str, dict], settings: dict[str, Any]) -> dict:
    """The stage's optimizer state as ``torch.optim`` saves it, in the groups the loop builds."""
    named = [(stage.param_names.get(n, n), p) for n, p in stage.module.named_parameters() if p.requires_grad]
    named = list({id(p): (n, p) for n, p in named}.values())
    state, groups, index = {}, [], 0
    for group in param_groups(named, float(settings.get("weight_decay", 0.0))):
        names = [name for name, _ in group["params"]]
        ids = list(range(index, index + len(names)))
        state.update({i: state_by_name[name] for i, name in zip(ids, names) if name in state_by_name})
        groups.append({**settings, **{k: v for k, v in group.items() if k != "params"}, "params": ids,
                       "param_names": names})  # fmt: skip
        index += len(names)
    return {"state": state, "param_groups": groups}


def _by_model_name(build, root, step) -> tuple[dict[str, torch.Tensor], dict[str, dict], dict | None]:
    """Weights and optimizer state by model name, and the optimizer's settings (its first group's, with
    the largest weight decay of its groups)."""
    weights: dict[str, torch.Tensor] = {}
    optimizer_state: dict[str, dict[str, Any]] = {}
    settings = None
    for stage in load_pipeline(str(build)).stages:
        saved = ckpt.load_checkpoint(root, stage.index, step)
        for local, tensor in saved["module"].items():
            weights.setdefault(stage.param_names.get(local, local), tensor)
        if saved["optimizer"] is None:
            continue
        groups = saved["optimizer"]["param_groups"]
        settings = settings or {k: v for k, v in groups[0].items() if k not in ("params", "param_names")}
        settings["weight_decay"] = max(float(g.get("weight_decay", 0.0)) for g in groups)
        order = trainable_names(stage)
        for group in groups:
            names = group.get("param_names") or [order[i] for i in group["params"]]
            if len(names) != len(group["params"]):  # a rank of several stages wrote every stage's names
                names = _own_names(names, order, len(group["params"]), (root, stage.index, step))
            for index, name in zip(group["params"], names):
                if index in saved["optimizer"]["state"]:
                    optimizer_state.setdefault(name, saved["optimizer"]["state"][index])
    return weights, optimizer_state, settings


def _own_names(names: list[str], own: list[str], count: int, where: tuple) -> list[str]:
    """The names of one stage's ``count`` parameters from a group's names that a rank running several
    stages wrote whole (before each stage kept its own): those of the stage, in the group's order."""
    own = set(own)
    mine = [name for name in names if name in own]
    if len(mine) != count:  # a tied weight both stages of the rank hold: which copy is whose is lost
        root, stage, step = where
        raise PlanFormatError(
            f"{ckpt.step_dir(root, step)}: the optimizer state of stage {stage} does not say which of its "
            f"{count} parameters is which",
            hint="resume the old build where it ran (hetcc run --resume) to save a checkpoint again, then replan",
        )
    return mine
