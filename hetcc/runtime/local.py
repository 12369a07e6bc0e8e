"""Run a whole pipeline on this machine: one spawned process per stage, talking over gloo.

``run_local`` saves the pipeline to a folder (or takes a saved one) and every rank loads its stage from
there, so a local check exercises the same files ``hetcc.launch`` runs on a cluster. Each rank writes
its result (or its error) to a file; a rank that dies or hangs is reported with every other rank's
error, and the call never waits longer than the communication timeout allows.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetcc import config
from hetcc.errors import HetccError, PlanFormatError, RuntimeFailure
from hetcc.kernels import launch_stats, reset_launch_stats
from hetcc.passes.comm import StageGraph
from hetcc.runtime.executor import StageExecutor
from hetcc.runtime.groups import Links
from hetcc.runtime.ops import reset_transfer_stats, transfer_stats
from hetcc.runtime.store import Pipeline, load_pipeline, save_stages
from hetcc.solver.schedules import stage_actions


@dataclass
class RunResult:
    """What a run produced, and which code produced it.

    ``losses``: one per step (mean over microbatches); ``outputs``: the last step's flat model outputs
    concatenated over microbatches; ``grads``: after the last backward, by model parameter name.

    ``stats``: one dict per rank, counted over all steps:

    - ``sends`` / ``recvs``: tensors the stage's ``hetcc::send``/``hetcc::recv`` ops moved, activations
      and gradients (a gradient is sent by ``recv``'s backward, received by ``send``'s);
      ``bytes_sent`` / ``bytes_received``: their sizes.
    - ``grads_filled`` / ``grads_dropped``: gradients exchanged outside the ops so every peer's wait is
      matched: zeros sent for a received tensor autograd never differentiated, a gradient received and
      dropped for a sent tensor that needed none (``LinkTransport.settle_gradients``).
    - ``fused_triton`` / ``fused_interpreter`` / ``fused_eager``: fused-group forwards by backend:
      generated kernel on a GPU, generated kernel through ``TRITON_INTERPRET=1``, original ops.
    - ``backward_triton`` / ``backward_interpreter``: generated backward kernel launches;
      ``backward_recompute``: group backwards that differentiated the original ops instead.
    """

    losses: list[float] = field(default_factory=list)
    outputs: tuple = ()
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: list[dict[str, int]] = field(default_factory=list)


def run_local(
    stages_or_dir: list[StageGraph] | Pipeline | str,
    inputs: Mapping[str, Any] | tuple | list,
    targets: torch.Tensor | None = None,
    loss_fn: Callable | None = None,
    steps: int = 1,
    schedule: str = "1f1b",
    microbatches: int = 1,
    optimizer: Mapping | None = None,
) -> RunResult:
    """Train ``steps`` steps of the pipeline with one local process per stage and return the result.

    ``inputs``: model inputs by placeholder name (or positionally in placeholder order); each is split
    into ``microbatches`` equal chunks along dim 0, which must match the traced (microbatch) shapes.
    ``loss_fn(output, target)`` must be picklable (a module-level function); without it the model's
    first output must be a scalar loss. ``optimizer``: e.g. ``{"name": "sgd", "lr": 0.1}``.
    """
    stage_actions(schedule, 1, microbatches)  # validates the schedule arguments early
    with tempfile.TemporaryDirectory(prefix="hetcc_run_") as scratch:
        directory = _as_directory(stages_or_dir, os.path.join(scratch, "pipeline"))
        pipeline = load_pipeline(directory)
        num_stages = len(pipeline.stages)
        check_microbatch_shapes(pipeline, split_microbatches(named_inputs(pipeline, inputs), microbatches)[0])
        job = dict(
            directory=directory, inputs=inputs, targets=targets, loss_fn=loss_fn, steps=steps,
            schedule=schedule, microbatches=microbatches, optimizer=optimizer,
            timeout_s=config.comm_timeout_s, port=_free_port(), results=scratch,
        )  # fmt: skip
        exit_codes = _spawn_and_join(num_stages, job, deadline_s=config.comm_timeout_s * 2 + 60 + 5 * steps)
        return _collect(scratch, num_stages, exit_codes)


def run_rank(
    pipeline: Pipeline,
    rank: int,
    inputs: Mapping[str, Any] | tuple | list,
    targets: torch.Tensor | None,
    *,
    steps: int,
    schedule: str,
    microbatches: int,
    loss_fn: Callable | None = None,
    optimizer: Mapping | None = None,
    timeout_s: float | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Run this rank's stage for ``steps`` steps (torch.distributed already initialised); returns
    ``losses`` and ``outputs`` (last stage only), ``grads`` and ``stats`` as ``RunResult`` has them."""
    stage = pipeline.stages[rank]
    timeout_s = config.comm_timeout_s if timeout_s is None else timeout_s
    vendors = pipeline.meta.get("vendors") or ["cpu"] * len(pipeline.stages)
    if torch.device(device).type == "cpu":  # a GPU plan checked on CPU ranks: every link is gloo
        vendors = ["cpu"] * len(pipeline.stages)
    links = Links(vendors, [group.stages for group in stage.tied], timeout_s, device)
    executor = StageExecutor(stage, links, microbatches, loss_fn, optimizer, device)
    chunks = split_microbatches(named_inputs(pipeline, inputs), microbatches)
    check_microbatch_shapes(pipeline, chunks[0])
    target_chunks = list(targets.chunk(microbatches)) if isinstance(targets, torch.Tensor) else None
    actions = stage_actions(schedule, len(pipeline.stages), microbatches)[rank]
    losses, last = [], None
    reset_transfer_stats()
    reset_launch_stats()
    for _ in range(steps):
        last = executor.step(chunks, target_chunks, actions)
        if stage.is_last:
            losses.append(float(torch.stack(last.losses).mean()))
    outputs = _concat_outputs(last.outputs) if stage.is_last else ()
    stats = {**transfer_stats(), **launch_stats()}
    return {"losses": losses, "outputs": outputs, "grads": executor.named_grads(), "stats": stats}


def named_inputs(pipeline: Pipeline, inputs: Mapping[str, Any] | tuple | list) -> dict[str, Any]:
    """Model inputs by placeholder name; positional inputs follow the model's placeholder order."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    names = pipeline.meta.get("inputs")
    if not names:
        names = list(dict.fromkeys(name for stage in pipeline.stages for name in stage.inputs))
    if len(inputs) != len(names):
        raise PlanFormatError(
            f"got {len(inputs)} positional inputs for model inputs {names}",
            hint="pass inputs as a dict keyed by input name",
        )
    return dict(zip(names, inputs))


def split_microbatches(inputs: Mapping[Any, Any], microbatches: int) -> list[dict[Any, Any]]:
    """One step's batch as ``microbatches`` equal chunks of every tensor along dim 0 (clones: a view
    would carry the whole batch's storage); scalars, 0-d tensors and other values go to every chunk."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise HetccError(f"microbatches must be a positive integer, got {microbatches!r}")
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] % microbatches:
            raise HetccError(
                f"input {name!r} has {value.shape[0]} rows (shape {tuple(value.shape)}) and does not split "
                f"into {microbatches} equal microbatches along dim 0",
                hint=f"pass a batch whose size is a multiple of {microbatches}, or change microbatches",
            )
    chunks = [dict(inputs) for _ in range(microbatches)]
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            for chunk, part in zip(chunks, value.chunk(microbatches)):
                chunk[name] = part.clone()
    return chunks


def check_microbatch_shapes(pipeline: Pipeline, microbatch: dict[str, Any]) -> None:
    """Every stage's graph was traced at one microbatch's shapes; fail before any rank waits."""
    for stage in pipeline.stages:
        for name in stage.inputs:
            if name not in microbatch:
                raise PlanFormatError(f"stage {stage.index} needs model input {name!r}, which was not given")
            value, traced = microbatch[name], stage.input_shapes.get(name)
            if traced is not None and isinstance(value, torch.Tensor) and tuple(value.shape) != traced:
                raise PlanFormatError(
                    f"input {name!r}: a microbatch has shape {tuple(value.shape)} but stage {stage.index} "
                    f"was traced with {traced}",
                    hint="trace the model with one microbatch's inputs (batch / microbatches rows)",
                )


def _concat_outputs(per_microbatch: list[tuple]) -> tuple:
    columns = zip(*per_microbatch)
    return tuple(
        (torch.stack(col) if col[0].dim() == 0 else torch.cat(col))
        if isinstance(col[0], torch.Tensor)
        else col[0]
        for col in columns
    )


def _as_directory(stages_or_dir, scratch: str) -> str:
    if isinstance(stages_or_dir, (str, os.PathLike)):
        return os.fspath(stages_or_dir)
    if isinstance(stages_or_dir, Pipeline):
        save_stages(stages_or_dir.stages, scratch, stages_or_dir.meta)
    else:
        save_stages(list(stages_or_dir), scratch)
    return scratch


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn_and_join(num_stages: int, job: dict, deadline_s: float) -> list[int | None]:
    context = mp.get_context("spawn")
    processes = [context.Process(target=_worker, args=(rank, num_stages, job)) for rank in range(num_stages)]
    for process in processes:
        process.start()
    end = time.monotonic() + deadline_s
    for process in processes:
        process.join(max(0.0, end - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(5)
    return [process.exitcode for process in processes]


def _worker(rank: int, num_stages: int, job: dict) -> None:
    """Entry point of one spawned rank: result or error goes to ``rank<k>.pt`` in the results folder."""
    torch.set_num_threads(1)
    path = os.path.join(job["results"], f"rank{rank}.pt")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=num_stages,
            timeout=datetime.timedelta(seconds=job["timeout_s"]),
        )  # fmt: skip
        pipeline = load_pipeline(job["directory"])
        result = run_rank(
            pipeline, rank, job["inputs"], job["targets"], steps=job["steps"], schedule=job["schedule"],
            microbatches=job["microbatches"], loss_fn=job["loss_fn"], optimizer=job["optimizer"],
            timeout_s=job["timeout_s"],
        )  # fmt: skip
        torch.save({"ok": True, **result}, path)
    except Exception as error:  # noqa: BLE001 - reported to the parent with the traceback
        torch.save(
            {"ok": False, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}, path
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(results: str, num_stages: int, exit_codes: list[int | None]) -> RunResult:
    reports, problems = [], []
    for rank in range(num_stages):
        path = os.path.join(results, f"rank{rank}.pt")
        report = torch.load(path, weights_only=True) if os.path.exists(path) else None
        reports.append(report)
        if report is None:
            code = exit_codes[rank]
            status = (
                "was stopped after the deadline" if code is None or code < 0 else f"exited with code {code}"
            )
            problems.append(f"rank {rank} {status} without a result")
        elif not report["ok"]:
            problems.append(f"rank {rank}: {report['error']}")
    if problems:
        raise RuntimeFailure(
            "pipeline run failed:\n  " + "\n  ".join(problems),
            hint="the first failing rank is usually the cause; the others lost it as a peer",
        )
    grads: dict[str, torch.Tensor] = {}
    for report in reports:
        for name, grad in report["grads"].items():
            grads.setdefault(name, grad)
    last = reports[-1]
    stats = [dict(report["stats"]) for report in reports]
    return RunResult(losses=list(last["losses"]), outputs=tuple(last["outputs"]), grads=grads, stats=stats)
