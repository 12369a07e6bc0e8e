"""What ``hetcc.replan`` does around its ``compile``: find the checkpoint it starts from, keep the options
of the run it continues, and write the new build with the checkpoint moved into its stages."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from hetcc.api.compiled import Compiled
from hetcc.errors import HetccError
from hetcc.runtime.contract import PipelineMeta
from hetcc.train import checkpoint as ckpt
from hetcc.train.replan import move_checkpoint


def newest_checkpoint(source: str | Path) -> tuple[Path, Path, int]:
    """``(build folder, checkpoint folder, step)`` of a build folder with ``checkpoints/``, a checkpoint
    folder, or one ``step-<n>`` folder."""
    build, found = ckpt.locate(Path(source))
    if found is None:
        raise HetccError(f"{source} holds no complete checkpoint", hint="train with checkpoint_dir= first")
    root, step = found
    return Path(build), Path(root), step


def run_options(meta: PipelineMeta) -> dict[str, Any]:
    """The old run's microbatches, schedule and optimizer, as ``compile`` options (``replan`` keeps
    them)."""
    optimizer = (meta.optimizer or {"name": "adam"})["name"]
    return {"microbatches": meta.microbatches, "schedule": meta.schedule, "optimizer": optimizer}


def plan_space_options(meta: PipelineMeta) -> dict[str, Any]:
    """The old build's precision and plan space (checked when ``pipeline.json`` was read), as ``compile``
    options."""
    return {"precision": meta.precision, "replicate": meta.plan_space.replicate,
            "recompute": meta.plan_space.recompute, "shard": meta.plan_space.shard,
            "tensor_parallel": meta.plan_space.tensor_parallel}  # fmt: skip


def save_replanned(compiled: Compiled, build: Path, root: Path, step: int, out: Path) -> None:
    """Save ``compiled`` to ``out`` with the old build's batch (what ``hetcc run`` trains on) and the
    checkpoint at ``root``/``step`` moved into its stages at the same step in ``out/checkpoints``."""
    compiled.save(out)
    for name in ("inputs.safetensors", "targets.safetensors"):
        if (build / name).exists():
            shutil.copyfile(build / name, out / name)
    move_checkpoint(build, root, step, out, out / "checkpoints")
