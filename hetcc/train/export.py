"""The trained weights as one state dict: every stage of a build folder or a checkpoint merged and keyed by
the model's own parameter names."""

from __future__ import annotations

import json
import os
from pathlib import Path

import safetensors.torch
import torch

from hetcc.runtime.files import folder_file, read_document, read_tensors
from hetcc.train.checkpoint import load_checkpoint, locate


def export(source: str | os.PathLike, path: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """Merge every stage's weights into one state dict keyed by the model's parameter names.

    ``source``: a build folder (``pipeline.json`` + ``stage<k>.safetensors``: the weights it was saved
    with, or the trained ones in its ``checkpoints/`` folder when there is one), a checkpoint folder (its
    newest complete step) or one ``step-<n>`` folder. Writes ``path`` (safetensors, a tied weight once;
    the metadata ``hetcc.aliases`` lists its other names) when given, and returns the state dict with every
    name the model has, so ``model.load_state_dict(hetcc.export(...))`` works as it is.
    """
    stage_names, stage_states = _stage_weights(Path(source))
    merged: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for names, state in zip(stage_names, stage_states):
        for local, tensor in state.items():
            name = names.get(local, local)
            merged.setdefault(name, tensor)
            if local != name:
                aliases[local] = name
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        metadata = {"format": "hetcc-export", "hetcc.aliases": json.dumps(aliases)}
        safetensors.torch.save_file(merged, str(path), metadata=metadata)
    return {**merged, **{alias: merged[name] for alias, name in aliases.items()}}


def _stage_weights(source: Path) -> tuple[list[dict[str, str]], list[dict[str, torch.Tensor]]]:
    """Per stage: local name -> model name, and the stage's weights by local name."""
    build, checkpoint = locate(source)
    document = read_document(str(build))  # validated: types, paths, stage indices
    names = [dict(entry["param_names"]) for entry in document["stages"]]
    if checkpoint is None:
        states = [read_tensors(folder_file(str(build), e["weights"], "weights")) for e in document["stages"]]
        return names, states
    root, step = checkpoint
    states = [load_checkpoint(root, k, step)["module"] for k in range(len(names))]
    return names, states
