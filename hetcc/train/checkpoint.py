"""Checkpoints of a running pipeline, and the trained weights as one state dict.

A checkpoint folder holds one folder per saved step; every rank writes its own stage there::

    <dir>/step-00000004/stage<k>.safetensors     weights (model.*), optimizer tensors (optimizer.*), RNG (rng.*)
    <dir>/step-00000004/stage<k>.json            step, optimizer hyper-parameters and scalar state, and the
                                                 loop's record (data position, settings)
    <dir>/step-00000004/stage<k>.manifest.json   sha256 of the two files above; written last
    <dir>/step-00000004/stage<k>.replica<r>.rng.safetensors   the RNG of replica r > 0 of a replicated stage

Each stage keeps its two newest complete steps (``prune``).

Each file is written to a temporary name, fsynced and renamed, and the manifest comes last, so a crash
mid-write leaves at most a step without a manifest (or with a file whose checksum disagrees): such a
step is not complete and the previous one is used. A step is complete when every stage's manifest is
there and matches. Tensors go to safetensors and everything else to JSON: nothing is unpickled.

``locate`` finds the build folder and the step a folder names (``hetcc.train.export`` reads it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from hetcc.errors import PlanFormatError
from hetcc.runtime.files import read_document, read_tensors

FORMAT = "hetcc-checkpoint"
VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


# ----------------------------------------------------------------------------------------- save


def save_checkpoint(root: str | os.PathLike, stage: int, step: int, state: Mapping[str, Any]) -> Path:
    """Write one stage's ``state`` (``StageExecutor.state_dict()`` plus ``optimizer``, ``rng`` and the
    loop's JSON-able ``train`` record) at ``step``, atomically."""
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, document = _split_state(state)
    document.update(format=FORMAT, version=VERSION, stage=stage, step=step)
    names = {"weights": f"stage{stage}.safetensors", "state": f"stage{stage}.json"}
    _write_atomic(folder / names["weights"], safetensors.torch.save(tensors))
    _write_atomic(folder / names["state"], json.dumps(document, indent=1).encode())
    manifest = {
        "format": FORMAT, "version": VERSION, "stage": stage, "step": step,
        "files": {name: _sha256(folder / name) for name in names.values()},
    }  # fmt: skip
    _write_atomic(folder / f"stage{stage}.manifest.json", json.dumps(manifest, indent=1).encode())
    return folder


def save_replica_rng(root: str | os.PathLike, stage: int, replica: int, step: int, rng: Mapping) -> None:
    """A replica other than 0 keeps only its RNG (weights and optimizer state equal replica 0's)."""
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.cpu().contiguous() for k, v in rng.items()}
    _write_atomic(folder / f"stage{stage}.replica{replica}.rng.safetensors", safetensors.torch.save(tensors))


def load_replica_rng(root: str | os.PathLike, stage: int, replica: int, step: int) -> dict | None:
    """The replica's RNG at ``step`` (None if it did not write it: the replica then takes replica 0's,
    and a resume with dropout on that replica is no longer bit-identical)."""
    path = step_dir(root, step) / f"stage{stage}.replica{replica}.rng.safetensors"
    try:
        return safetensors.torch.load_file(str(path))
    except (OSError, safetensors.SafetensorError):
        return None


def _split_state(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (module, optimizer state, RNG) for safetensors; the rest as JSON-able values."""
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in _unaliased(state["module"]).items()}
    tensors.update({f"rng.{k}": v.cpu().contiguous() for k, v in state.get("rng", {}).items()})
    document: dict[str, Any] = {
        "optimizer": None, "loss_scale": state.get("loss_scale"), "train": state.get("train") or {}
    }  # fmt: skip
    optimizer = state.get("optimizer")
    if optimizer is not None:
        scalars: dict[str, dict[str, Any]] = {}
        for index, entry in optimizer["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer.{index}.{key}"] = value.detach().cpu().contiguous()
                else:
                    scalars.setdefault(str(index), {})[key] = value
        document["optimizer"] = {"param_groups": optimizer["param_groups"], "state": scalars}
    return tensors, document


def stage_optimizer_state(state: Mapping[str, Any], positions: list[int]) -> dict[str, Any]:
    """The part of an optimizer's ``state_dict()`` ``state`` for the parameters at ``positions`` (in its
    numbering), numbered from 0 in that order: one stage's, where a rank runs several (interleaved 1F1B)."""
    local = {position: index for index, position in enumerate(positions)}
    groups = []
    for group in state["param_groups"]:
        kept = [k for k, i in enumerate(group["params"]) if i in local]
        part = {**group, "params": [local[group["params"][k]] for k in kept]}
        if "param_names" in group:  # the names of this stage's parameters only, as ``params``
            part["param_names"] = [group["param_names"][k] for k in kept]
        groups.append(part)
    kept_state = {local[i]: entry for i, entry in state["state"].items() if i in local}
    return {**state, "state": kept_state, "param_groups": groups}


def merged_optimizer_state(parts: list[tuple[Mapping[str, Any], list[int]]], optimizer) -> Mapping[str, Any]:
    """``optimizer``'s state dict from its stages' parts (``stage_optimizer_state``'s, each with its
    positions): the saved state and hyper-parameters in ``optimizer``'s numbering. A rank of one stage
    saved its optimizer's state dict whole: that is returned as it is."""
    if len(parts) == 1:
        return parts[0][0]
    state = {positions[int(i)]: entry for saved, positions in parts for i, entry in saved["state"].items()}
    groups = [  # the saved hyper-parameters; the optimizer's own parameters and their names
        {**saved, **{key: group[key] for key in ("params", "param_names") if key in group}}
        for group, saved in zip(
            optimizer.state_dict()["param_groups"], parts[0][0]["param_groups"], strict=True
        )
    ]
    return {"state": state, "param_groups": groups}


def _unaliased(module_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A tensor held under several names (tied weights) once, under its first name."""
    seen: set[tuple] = set()
    kept = {}
    for name, tensor in module_state.items():
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
        )
        if key not in seen:  # state_dict() detaches: a tied weight is two tensors over one storage
            seen.add(key)
            kept[name] = tensor
    return kept


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------- find


def saved_steps(root: str | os.PathLike) -> list[int]:
    """Steps that have a folder under ``root`` (complete or not), newest first."""
    if not Path(root).is_dir():
        return []
    matches = (_STEP_DIR.match(entry.name) for entry in Path(root).iterdir() if entry.is_dir())
    return sorted((int(m.group(1)) for m in matches if m), reverse=True)


def stage_is_complete(root: str | os.PathLike, stage: int, step: int) -> bool:
    """The stage's manifest is there and every file it names has its checksum."""
    folder = step_dir(root, step)
    try:
        manifest = json.loads((folder / f"stage{stage}.manifest.json").read_text())
        files = manifest["files"]
        return manifest.get("step") == step and all(_sha256(folder / n) == h for n, h in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def latest_stage_step(root: str | os.PathLike, stage: int) -> int | None:
    """The newest step at which this stage's checkpoint is complete (what one rank can check alone)."""
    return next((step for step in saved_steps(root) if stage_is_complete(root, stage, step)), None)


def latest_complete_step(root: str | os.PathLike, num_stages: int) -> int | None:
    """The newest step at which every stage's checkpoint is complete."""
    for step in saved_steps(root):
        if all(stage_is_complete(root, k, step) for k in range(num_stages)):
            return step
    return None


def prune(root: str | os.PathLike, stage: int, keep: int = 2) -> None:
    """Delete this stage's files from all but its ``keep`` newest complete steps (and step folders left
    empty). Two are enough to resume: ranks agree on the newest step all of them have, and a rank is
    never more than one checkpoint ahead of another (the step after needs every rank)."""
    complete = [step for step in saved_steps(root) if stage_is_complete(root, stage, step)]
    for step in complete[keep:]:
        folder = step_dir(root, step)
        names = [f"stage{stage}.manifest.json", f"stage{stage}.safetensors", f"stage{stage}.json"]
        names += [p.name for p in folder.glob(f"stage{stage}.replica*.rng.safetensors")]
        for name in names:
            (folder / name).unlink(missing_ok=True)  # the manifest first: never a manifest without files
        try:
            folder.rmdir()  # only when empty: other stages' files may still be there
        except OSError:
            pass


# ----------------------------------------------------------------------------------------- load


def load_checkpoint(root: str | os.PathLike, stage: int, step: int) -> dict[str, Any]:
    """One stage's state at ``step`` as ``save_checkpoint`` took it (checksums checked first)."""
    folder = step_dir(root, step)
    if not folder.is_dir():
        kept = ", ".join(str(k) for k in sorted(saved_steps(root)))
        raise PlanFormatError(
            f"{folder}: no checkpoint of step {step} ({f'steps saved: {kept}' if kept else 'no step saved'})",
            hint="pass one of the saved steps' folders, or the checkpoint folder for its newest complete step",
        )
    if not stage_is_complete(root, stage, step):
        raise PlanFormatError(
            f"{folder}: the checkpoint of stage {stage} is incomplete or its checksums do not match",
            hint="resume from the step before (each stage keeps its two newest) or start again",
        )
    try:  # checksums matched: a failure here is a manifest written for other files
        tensors = read_tensors(str(folder / f"stage{stage}.safetensors"))
        document = json.loads((folder / f"stage{stage}.json").read_text(encoding="utf-8"))
        return _unpack(tensors, document)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise PlanFormatError(
            f"{folder}: the checkpoint of stage {stage} cannot be read ({type(error).__name__}: {error})",
            hint="resume from the step before (each stage keeps its two newest) or start again",
        ) from error


def _unpack(tensors: dict[str, torch.Tensor], document: dict) -> dict[str, Any]:
    state: dict[str, Any] = {"module": {}, "rng": {}, "optimizer": None, "step": int(document["step"])}
    state["train"] = dict(document.get("train") or {})
    if document.get("loss_scale"):
        state["loss_scale"] = dict(document["loss_scale"])
    optimizer_tensors: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        kind, _, rest = key.partition(".")
        if kind == "model":
            state["module"][rest] = tensor
        elif kind == "rng":
            state["rng"][rest] = tensor
        elif kind == "optimizer":
            index, _, name = rest.partition(".")
            optimizer_tensors.setdefault(int(index), {})[name] = tensor
    if document.get("optimizer") is not None:
        saved = document["optimizer"]
        entries = {int(i): dict(values) for i, values in saved["state"].items()}
        for index, values in optimizer_tensors.items():
            entries.setdefault(index, {}).update(values)
        state["optimizer"] = {"state": entries, "param_groups": saved["param_groups"]}
    return state


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random state (dropout draws from it), for a bit-identical resume."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Mapping[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ----------------------------------------------------------------------------------- build folder


def locate(source: Path) -> tuple[Path, tuple[Path, int] | None]:
    """(build folder, (checkpoint folder, step) or None for the build's own weights)."""
    if _STEP_DIR.match(source.name):
        root, step = source.parent, int(source.name.split("-")[1])
    elif (source / "pipeline.json").exists():
        root = source / "checkpoints"
        found = latest_complete_step(root, _num_stages(source))
        return source, (root, found) if found is not None else None
    else:
        root, step = source, None
    build = _build_of(root)
    if step is None:
        step = latest_complete_step(root, _num_stages(build))
        if step is None:
            raise PlanFormatError(
                f"{root} holds no complete checkpoint", hint="run with checkpoint_dir= first"
            )
    return build, (root, step)


def _build_of(root: Path) -> Path:
    """A checkpoint folder holds the pipeline it belongs to (``pipeline/``), names it in ``build.json``,
    or sits inside it."""
    if (root / "pipeline" / "pipeline.json").exists():
        return root / "pipeline"
    pointer = root / "build.json"
    if pointer.exists():
        try:
            return Path(json.loads(pointer.read_text(encoding="utf-8"))["build"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise PlanFormatError(
                f"{pointer} does not name a build folder ({type(error).__name__}: {error})",
                hint="pass the build folder itself, or rerun with checkpoint_dir=",
            ) from error
    if (root.parent / "pipeline.json").exists():
        return root.parent
    raise PlanFormatError(
        f"{root} is neither a build folder nor a checkpoint folder hetcc wrote",
        hint="pass the build folder (with pipeline.json) or the checkpoint_dir of a run",
    )


def _num_stages(build: Path) -> int:
    return int(read_document(str(build))["num_stages"])


def write_build_pointer(root: str | os.PathLike, build: str | os.PathLike) -> None:
    """Record which build folder a checkpoint folder belongs to (so ``export`` needs only the latter)."""
    Path(root).mkdir(parents=True, exist_ok=True)
    _write_atomic(Path(root) / "build.json", json.dumps({"build": os.path.abspath(build)}).encode())
