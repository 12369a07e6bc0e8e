"""Move a checkpoint into the stages of another plan of the same model (``hetcc.replan``).

Weights are keyed by the model's parameter names in every stage (``StageGraph.param_names``), and so is
the optimizer state once each stage's optimizer indices are named: an optimizer numbers a stage's
trainable parameters in ``module.named_parameters()`` order (``StageExecutor``). So a checkpoint of one
split becomes a checkpoint of another at the same step: per new stage, its weights and the optimizer
state of its parameters, under the old run's hyper-parameters. A tied weight held by several old stages
has one value (its holders sum their gradients and step alike), taken from the first.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hetcc.errors import PlanFormatError
from hetcc.passes.comm import StageGraph
from hetcc.runtime.store import load_pipeline
from hetcc.train import checkpoint as ckpt


def trainable_names(stage: StageGraph) -> list[str]:
    """The model's names of the stage's trainable parameters, in the order its optimizer numbers them."""
    return [stage.param_names.get(n, n) for n, p in stage.module.named_parameters() if p.requires_grad]


def move_checkpoint(
    build: str | os.PathLike, root: str | os.PathLike, step: int, new_build: str | os.PathLike,
    new_root: str | os.PathLike,
) -> None:  # fmt: skip
    """Write the checkpoint of ``build`` at ``root``/``step`` as a checkpoint of the pipeline saved in
    ``new_build``, at the same step under ``new_root``. Both pipelines are read from their folders: the
    parameter order an optimizer numbers is that of the stage modules the ranks load."""
    weights, optimizer_state, groups = _by_model_name(build, root, step)
    for stage in load_pipeline(str(new_build)).stages:
        module = {
            local: weights.get(stage.param_names.get(local, local), tensor)
            for local, tensor in stage.module.state_dict().items()
        }
        names = trainable_names(stage)
        optimizer = None
        if groups is not None:
            state = {i: optimizer_state[name] for i, name in enumerate(names) if name in optimizer_state}
            optimizer = {"state": state, "param_groups": [{**groups[0], "params": list(range(len(names)))}]}
        rng = {"cpu": torch.Generator().manual_seed(stage.index).get_state()}
        ckpt.save_checkpoint(
            new_root, stage.index, step, {"module": module, "optimizer": optimizer, "rng": rng}
        )


def _by_model_name(
    build, root, step
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list | None]:
    weights: dict[str, torch.Tensor] = {}
    optimizer_state: dict[str, dict[str, Any]] = {}
    groups = None
    for stage in load_pipeline(str(build)).stages:
        saved = ckpt.load_checkpoint(root, stage.index, step)
        for local, tensor in saved["module"].items():
            weights.setdefault(stage.param_names.get(local, local), tensor)
        if saved["optimizer"] is None:
            continue
        if len(saved["optimizer"]["param_groups"]) != 1:
            raise PlanFormatError(f"{root}: stage {stage.index}'s optimizer has several parameter groups")
        groups = groups or saved["optimizer"]["param_groups"]
        for index, name in enumerate(trainable_names(stage)):
            if index in saved["optimizer"]["state"]:
                optimizer_state.setdefault(name, saved["optimizer"]["state"][index])
    return weights, optimizer_state, groups
