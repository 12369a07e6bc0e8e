"""The arguments of ``hetcc.analyze`` and ``hetcc.compile``, checked first, so a wrong argument fails at
once with its name instead of deep in a pass or a rank (``hetcc.api`` checks ``run_local``'s itself, as
they name its ``Compiled``)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch

from hetcc.errors import HetccError, did_you_mean
from hetcc.hardware.cluster import Cluster
from hetcc.hardware.schema import check_path, finite, short_repr
from hetcc.plan import PRECISIONS
from hetcc.solver.schedules import PIPELINE_SCHEDULES


def check_plan_space(
    precision: object,
    recompute: object,
    replicate: object,
    shard: object = "auto",
    tensor_parallel: object = False,
) -> None:
    """The plan-space options of ``hetcc.compile`` (and ``replan``), before anything is traced."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise HetccError(
            f"unknown precision {precision!r}{did_you_mean(precision, PRECISIONS)}",
            hint=f"use one of {', '.join(PRECISIONS)}",
        )
    if not (recompute == "auto" or isinstance(recompute, bool)):
        raise HetccError(f"recompute must be 'auto', True or False, got {recompute!r}")
    if not isinstance(replicate, bool):
        raise HetccError(f"replicate must be True or False, got {replicate!r}")
    if shard in (2, 3) and not isinstance(shard, bool):
        raise HetccError(
            f"shard={shard} (ZeRO-{shard}: gradients{' and parameters' if shard == 3 else ''} sharded too) is not "
            "built yet: a pipeline stage holds its whole gradient until the step's last microbatch, so it would "
            "save little (DeepSpeed's pipeline engine allows ZeRO-1 only)",
            hint="use shard=1 (optimizer state sharded over a stage's replicas), 0 or 'auto'; tensor_parallel= "
            "splits a stage's weights, gradients and optimizer state over the devices of a node",
        )  # fmt: skip
    if shard not in ("auto", 0, 1) or isinstance(shard, bool):
        raise HetccError(
            f"shard must be 'auto', 0 or 1, got {shard!r}", hint="1: ZeRO-1 on every replicated stage"
        )
    _check_tensor_parallel(tensor_parallel)


def _check_tensor_parallel(value: object) -> None:
    """False, "auto", or a degree: an integer from 1 (no split) to the most like devices a node holds."""
    if value is False or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise HetccError(
            f"tensor_parallel must be False, 'auto' or a tensor degree (an integer >= 1), got {short_repr(value)}",
            hint="e.g. tensor_parallel=2 (stages on pairs of like devices of one node) or 'auto'",
        )
    if value < 1:
        raise HetccError(
            f"tensor_parallel={value}: a tensor degree is the number of devices sharing a stage's weights (>= 1)",
            hint="use 2, 4 or 8 (at most the like devices one node holds), 'auto', or False",
        )


def check_analyze_args(model, example_inputs, example_kwargs, training, dump_dir, max_block_bytes) -> None:
    _check_model(model)
    check_examples(example_inputs, example_kwargs)
    _check_flag(training, "training")
    _check_dump_dir(dump_dir)
    if max_block_bytes is not None and not (_is_number(max_block_bytes) and max_block_bytes > 0):
        raise HetccError(
            f"max_block_bytes must be a positive number of bytes or None, got {short_repr(max_block_bytes)}"
        )


def check_compile_args(model, cluster, example_inputs, example_kwargs, schedule, training, dump_dir) -> None:
    _check_model(model)
    if not isinstance(cluster, (Cluster, str, os.PathLike)):
        raise HetccError(
            f"cluster must be a hetcc.Cluster or the path of a cluster file, got {type(cluster).__name__}",
            hint="hetcc.Cluster.from_file('cluster.yaml')",
        )
    check_examples(example_inputs, example_kwargs)  # microbatches: split_microbatches names the input
    if schedule not in (*PIPELINE_SCHEDULES, "auto"):
        raise HetccError(
            f"schedule must be 'auto' or one of {', '.join(PIPELINE_SCHEDULES)}, got {short_repr(schedule)}"
        )
    _check_flag(training, "training")
    _check_dump_dir(dump_dir)


def _check_model(model: object) -> None:
    if not isinstance(model, torch.nn.Module):
        raise HetccError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def check_examples(args: object, kwargs: object, name: str = "example") -> None:
    """Positional inputs a tuple/list (or one tensor), keyword inputs a dict by name; no empty batch."""
    args_name, kwargs_name = (
        ("inputs", "inputs") if name == "inputs" else ("example_inputs", "example_kwargs")
    )
    if not isinstance(args, (tuple, list, torch.Tensor)):
        raise HetccError(f"{args_name} must be a tuple of positional inputs, got {type(args).__name__}")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise HetccError(
            f"{kwargs_name} must be a dict of input name -> value, got {short_repr(kwargs)}",
            hint="e.g. {'input_ids': ids}",
        )
    named = [(args_name, args)] if isinstance(args, torch.Tensor) else [(args_name, a) for a in args]
    named += [(f"{kwargs_name}[{key!r}]", value) for key, value in (kwargs or {}).items()]
    for where, value in named:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 0:
            raise HetccError(
                f"{where}: a batch of 0 rows (shape {tuple(value.shape)})",
                hint="pass at least one row per microbatch",
            )


def _check_flag(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise HetccError(f"{name} must be True or False, got {short_repr(value)}")


def _check_dump_dir(dump_dir: object) -> None:
    """None, or a folder that exists or can be made, and can be written."""
    if dump_dir is None:
        return
    if not isinstance(dump_dir, (str, os.PathLike)) or "\0" in str(dump_dir):
        raise HetccError(f"dump_dir must be a folder path, got {short_repr(dump_dir)}")
    folder = Path(dump_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = "is a file" if folder.exists() and not folder.is_dir() else (error.strerror or str(error))
        raise HetccError(
            f"dump_dir {str(folder)!r} cannot be used: {reason}", hint="give a writable folder"
        ) from None
    if not os.access(folder, os.W_OK):
        raise HetccError(f"dump_dir {str(folder)!r} is not writable", hint="give a writable folder")


def _is_number(value: object) -> bool:
    return finite(value)


def check_run_args(compiled_or_dir, inputs, targets, loss_fn, steps, optimizer, data=None) -> None:
    """``run_local``'s arguments, before any process starts (a Compiled is known by its pipeline)."""
    if not (isinstance(compiled_or_dir, (str, os.PathLike)) or hasattr(compiled_or_dir, "pipeline")):
        raise HetccError(
            f"run_local takes a Compiled or a saved folder, got {type(compiled_or_dir).__name__}",
            hint="pass what hetcc.compile returned, or the folder Compiled.save wrote",
        )
    if inputs is None and data is not None:
        inputs = {}
    elif not isinstance(inputs, (dict, tuple, list)) or (
        isinstance(inputs, dict) and not all(isinstance(k, str) for k in inputs)
    ):
        raise HetccError(
            f"inputs must be a dict of input name -> tensor (or a tuple), got {short_repr(inputs)}",
            hint="pass one step's batch, e.g. {'input_ids': ids}",
        )
    check_examples(
        inputs if isinstance(inputs, (tuple, list)) else (),
        inputs if isinstance(inputs, dict) else None,
        name="inputs",
    )
    if targets is not None and not isinstance(targets, torch.Tensor):
        raise HetccError(f"targets must be a tensor or None, got {type(targets).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise HetccError(f"steps must be a positive integer, got {short_repr(steps)}")
    if optimizer is not None and not (isinstance(optimizer, dict) and isinstance(optimizer.get("name"), str)):
        raise HetccError(
            f"optimizer must be None or a dict with a 'name', got {short_repr(optimizer)}",
            hint="e.g. {'name': 'adam', 'lr': 1e-4}",
        )
    if loss_fn is not None:
        if not callable(loss_fn):
            raise HetccError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        try:
            pickle.dumps(loss_fn)
        except Exception:  # noqa: BLE001 - whatever pickling raises, the fix is the same
            raise HetccError(
                f"loss_fn {short_repr(loss_fn)} cannot be pickled, so it cannot reach the rank processes",
                hint="use a function defined at module level (not a lambda or a local function)",
            ) from None


def writable_folder(folder: str | Path) -> Path:
    """``folder``, made if missing; a HetccError naming it when it is a file or cannot be written."""
    check_path(folder, "build folder", error=HetccError)
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".hetcc-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise HetccError(
            f"cannot write the build folder {folder}: {error.strerror or error}",
            hint="give a folder path you can write (not an existing file)",
        ) from None
    return folder
