"""The trained weights as one state dict: every stage of a build folder or a checkpoint merged and keyed by
the model's own names, with exactly the keys of ``model.state_dict()``."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from hetcc.hardware.schema import short_repr
from hetcc.runtime.files import folder_file, read_document, read_tensors
from hetcc.train.checkpoint import load_checkpoint, locate


def export(source: str | os.PathLike, path: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """Merge every stage's weights into one state dict keyed by the model's names.

    ``source``: a build folder (``pipeline.json`` + ``stage<k>.safetensors``: the weights it was saved
    with, or the trained ones in its ``checkpoints/`` folder when there is one), a checkpoint folder (its
    newest complete step) or one ``step-<n>`` folder. A build of ``hetcc.compile`` records the keys of
    ``model.state_dict()`` (``meta.state_dict`` in pipeline.json); the result holds exactly those:
    parameters and persistent buffers, every name of a tied weight, no non-persistent buffer (which the
    stages hold too), so ``model.load_state_dict(hetcc.export(...))`` loads strictly, and so does the
    safetensors file written to ``path`` when given (a tied weight copied under each of its names). A key
    no stage holds (a parameter the forward never reads is not traced) is left out with a warning.

    A folder without that record (an older build, ``save_stages`` without meta) gives every tensor the
    stages hold, by the model's names; its file holds a tied weight once, the metadata ``hetcc.aliases``
    listing its other names.
    """
    document, held, aliases = _stage_weights(Path(source))
    every_name = {**held, **{alias: held[name] for alias, name in aliases.items()}}
    keys = document["meta"].state_dict
    if keys is None:
        if path is not None:
            _write(path, held, {"format": "hetcc-export", "hetcc.aliases": json.dumps(aliases)})
        return every_name
    state = _recorded_keys(every_name, keys, source)
    if path is not None:
        _write(path, _copies_per_name(state), {"format": "hetcc-export"})
    return state


def _stage_weights(source: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, str]]:
    """pipeline.json, every stage's tensors merged by the model's name (a tied weight once), and the
    other names the stages hold a tied weight under -> its model name."""
    build, checkpoint = locate(source)
    document = read_document(str(build))  # validated: types, paths, stage indices
    if checkpoint is None:
        states = [read_tensors(folder_file(str(build), e["weights"], "weights")) for e in document["stages"]]
    else:
        root, step = checkpoint
        states = [load_checkpoint(root, k, step)["module"] for k in range(len(document["stages"]))]
    held: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for entry, state in zip(document["stages"], states):
        for local, tensor in state.items():
            name = entry["param_names"].get(local, local)  # parameters: local name -> model name
            held.setdefault(name, tensor)
            if local != name:
                aliases[local] = name
    return document, held, aliases


def _recorded_keys(held: dict[str, torch.Tensor], keys: dict[str, str], source) -> dict[str, torch.Tensor]:
    """The held tensors under exactly the recorded ``state_dict`` keys: a key takes the tensor held
    under any name of its tie group (the keys sharing its first key)."""
    by_group: dict[str, torch.Tensor] = {}
    for name, tensor in held.items():
        if name in keys:
            by_group.setdefault(keys[name], tensor)
    missing = [key for key, first in keys.items() if first not in by_group]
    if missing:
        warnings.warn(
            f"hetcc.export({str(source)!r}): no stage holds {short_repr(missing)} of the model's state_dict "
            "(the traced forward never reads them, so the pipeline neither holds nor trains them); the "
            "export leaves them out: load it with model.load_state_dict(..., strict=False)",
            stacklevel=3,
        )
    return {key: by_group[first] for key, first in keys.items() if first in by_group}


def _copies_per_name(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses two names for one tensor: a tied weight's later names get their own copy."""
    seen: set[int] = set()
    copies = {}
    for name, tensor in state.items():
        copies[name] = tensor.clone() if id(tensor) in seen else tensor
        seen.add(id(tensor))
    return copies


def _write(path: str | os.PathLike, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(state, str(path), metadata=metadata)
