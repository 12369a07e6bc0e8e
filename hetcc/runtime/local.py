"""Run a whole pipeline on this machine: one spawned process per stage, talking over gloo.

``run_local`` saves the pipeline to a folder (or takes a saved one), checks the whole folder once, and
every rank loads only its own stage from there (``load_rank``), so a local check exercises the same
files ``hetcc.launch`` runs on a cluster. Every stage runs on this machine's CPU over gloo, whatever
devices the plan names (it says so once). The ranks are watched by ``hetcc.runtime.supervisor``: a
rank that fails, dies or stops ends the run within the communication timeout plus a few seconds, and
the error lists the ranks in the order they failed, the cause first.
With ``checkpoint_dir`` each rank checkpoints its stage (``hetcc.train.checkpoint``) and ``resume``
continues bit-identically from the newest complete checkpoint.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hetcc import config
from hetcc.errors import HetccError, PlanFormatError, RuntimeFailure
from hetcc.kernels import launch_stats, reset_launch_stats
from hetcc.passes.comm import StageGraph
from hetcc.runtime.executor import StageExecutor
from hetcc.runtime.groups import GPU_VENDORS, Links
from hetcc.runtime.layout import RankLayout, placements
from hetcc.runtime.ops import reset_transfer_stats, transfer_stats
from hetcc.runtime.store import (
    Pipeline,
    PipelineOutline,
    load_pipeline,
    load_stage,
    read_outline,
    save_stages,
)
from hetcc.runtime.supervisor import error_report, failure_error, spawn_ranks, start_heartbeat, write_report
from hetcc.solver.schedules import stage_actions
from hetcc.train import checkpoint as ckpt


@dataclass
class RunResult:
    """What a run produced, and which code produced it.

    ``losses``: one per step (mean over microbatches), ``losses[i]`` of step ``first_step + i``
    (``first_step``: the steps a resumed run's checkpoint had done, else 0); ``outputs``: the last
    step's flat model outputs concatenated over microbatches; ``grads``: after the last backward, by
    model parameter name.

    ``stats``: one dict per rank, counted over all steps:

    - ``sends`` / ``recvs``: tensors the stage's ``hetcc::send``/``hetcc::recv`` ops moved, activations
      and gradients (a gradient is sent by ``recv``'s backward, received by ``send``'s);
      ``bytes_sent`` / ``bytes_received``: their sizes.
    - ``grads_filled`` / ``grads_dropped``: gradients exchanged outside the ops so every peer's wait is
      matched: zeros sent for a received tensor autograd never differentiated, a gradient received and
      dropped for a sent tensor that needed none (``LinkTransport.settle_gradients``).
    - ``replayed``: forward sends and recvs of a recomputed forward (``meta["recompute"]``), which
      move nothing: the recv returns what the first forward received, the send is skipped.
    - ``fused_triton`` / ``fused_interpreter`` / ``fused_eager``: fused-group forwards by backend:
      generated kernel on a GPU, generated kernel through ``TRITON_INTERPRET=1``, original ops.
    - ``backward_triton`` / ``backward_interpreter``: generated backward kernel launches;
      ``backward_recompute``: group backwards that differentiated the original ops instead.
    """

    losses: list[float] = field(default_factory=list)
    outputs: tuple = ()
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: list[dict[str, int]] = field(default_factory=list)
    first_step: int = 0


@dataclass(frozen=True)
class Checkpointing:
    """Where a rank checkpoints its stage: every ``every`` steps (0: only at the end of the run), and
    whether it first resumes from the newest complete checkpoint there."""

    directory: str
    every: int = 0
    resume: bool = False


def run_local(
    stages_or_dir: list[StageGraph] | Pipeline | str,
    inputs: Mapping[str, Any] | tuple | list,
    targets: torch.Tensor | None = None,
    loss_fn: Callable | None = None,
    steps: int = 1,
    schedule: str = "1f1b",
    microbatches: int = 1,
    optimizer: Mapping | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
) -> RunResult:
    """Train ``steps`` steps of the pipeline with one local process per stage and return the result.

    ``inputs``: model inputs by placeholder name (or positionally in placeholder order); each is split
    into ``microbatches`` equal chunks along dim 0, which must match the traced (microbatch) shapes.
    ``loss_fn(output, target)`` must be picklable (a module-level function); without it the model's
    first output must be a scalar loss. ``optimizer``: e.g. ``{"name": "sgd", "lr": 0.1}``.
    ``checkpoint_dir``: every stage checkpoints there every ``checkpoint_every`` steps and at the end
    (the trained weights: ``hetcc.export(checkpoint_dir, "model.safetensors")``); ``resume=True`` first
    loads the newest complete checkpoint there, and ``steps`` more steps are run.
    """
    stage_actions(schedule, 1, microbatches)  # validates the schedule arguments early
    _check_count("steps", steps, minimum=1)
    _check_count("checkpoint_every", checkpoint_every, minimum=0)
    _check_picklable(loss_fn)
    if resume and checkpoint_dir is None:
        raise HetccError(
            "resume=True needs checkpoint_dir=", hint="pass the checkpoint_dir of the earlier run"
        )
    with tempfile.TemporaryDirectory(prefix="hetcc_run_") as scratch:
        directory = _pipeline_folder(stages_or_dir, scratch, checkpoint_dir)
        load_pipeline(directory)  # every file checked once, here; each rank then reads only its own stage
        outline = read_outline(directory)
        world = len(rank_stages(outline))
        check_inputs_taken(outline, inputs)
        check_microbatch_shapes(outline, split_microbatches(named_inputs(outline, inputs), microbatches)[0])
        checkpointing = None
        if checkpoint_dir is not None:
            checkpointing = Checkpointing(os.fspath(checkpoint_dir), checkpoint_every, resume)
            if resume and ckpt.latest_complete_step(checkpoint_dir, len(outline.stages)) is None:
                raise HetccError(
                    f"{checkpoint_dir} holds no complete checkpoint to resume from",
                    hint="run without resume=True first, with checkpoint_dir= and checkpoint_every=",
                )
        _say_where_it_runs(outline)
        job = dict(
            directory=directory, inputs=inputs, targets=targets, loss_fn=loss_fn, steps=steps,
            schedule=schedule, microbatches=microbatches, optimizer=optimizer,
            timeout_s=config.comm_timeout_s, port=_free_port(), results=scratch, checkpoint=checkpointing,
        )  # fmt: skip
        reports, failures = spawn_ranks(world, _worker, job)
        if failures:
            raise failure_error(failures)
        return _collect(reports)


def rank_stages(outline: PipelineOutline) -> list[int]:
    """The stage each rank runs (rank -> stage index): the one place ranks are mapped to stages
    (``meta["placement"]``, replicas of a stage included; else rank = stage)."""
    return [placement.stage for placement in placements(outline.meta, len(outline.stages))]


def load_rank(directory: str, rank: int) -> tuple[PipelineOutline, StageGraph]:
    """What ``rank`` runs: the folder's outline and its own stage, the only graph and weights it reads
    (a damaged file of another stage fails that stage's ranks, not this one)."""
    outline = read_outline(directory)
    return outline, load_stage(directory, rank_stages(outline)[rank])


def run_rank(
    outline: PipelineOutline,
    stage: StageGraph,
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
    checkpoint: Checkpointing | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Run this rank's ``stage`` (or replica of it) for ``steps`` steps (torch.distributed already
    initialised); returns ``losses`` (the step's mean over every microbatch, last stage only),
    ``outputs`` (last stage: microbatch -> this rank's flat outputs), ``grads``, ``stats`` and
    ``first_step`` as ``RunResult`` has them. The rank's RNG (dropout) starts from ``seed + rank``:
    runs repeat exactly."""
    torch.manual_seed(seed + rank)
    layout = RankLayout.from_meta(outline.meta, len(outline.stages), microbatches)
    if layout.ranks[rank].stage != stage.index:
        raise HetccError(
            f"rank {rank} runs stage {layout.ranks[rank].stage}, not the stage {stage.index} given"
        )
    timeout_s = config.comm_timeout_s if timeout_s is None else timeout_s
    vendors = layout.vendors()
    if torch.device(device).type == "cpu":  # a GPU plan checked on CPU ranks: every link is gloo
        vendors = ["cpu"] * layout.num_ranks
    tied_ranks = [layout.holders(group.stages) for group in stage.tied]
    links = Links(vendors, tied_ranks, timeout_s, device, replica_ranks=layout.replica_groups())
    executor = StageExecutor(stage, links, microbatches, loss_fn, optimizer, device, layout=layout)
    chunks = split_microbatches(named_inputs(outline, inputs), microbatches)
    check_microbatch_shapes(outline, chunks[0])
    target_chunks = list(targets.chunk(microbatches)) if isinstance(targets, torch.Tensor) else None
    actions = layout.actions(schedule, rank)
    losses, last = [], None
    if checkpoint is not None and checkpoint.resume:
        _resume(executor, checkpoint.directory, layout.ranks[rank].replica)
    first_step = executor.step_index
    replica = layout.ranks[rank].replica
    reset_transfer_stats()
    reset_launch_stats()
    for _ in range(steps):
        last = executor.step(chunks, target_chunks, actions)
        if stage.is_last:
            losses.append(last.mean_loss)
        if checkpoint is not None and checkpoint.every and executor.step_index % checkpoint.every == 0:
            _checkpoint(executor, checkpoint.directory, replica)
    if checkpoint is not None and not (checkpoint.every and executor.step_index % checkpoint.every == 0):
        _checkpoint(executor, checkpoint.directory, replica)  # the trained weights at the end of the run
    outputs = dict(zip(last.microbatches, last.outputs))  # this replica's microbatches (last stage)
    stats = {**transfer_stats(), **launch_stats()}
    return {
        "losses": losses, "outputs": outputs, "grads": executor.named_grads(), "stats": stats,
        "first_step": first_step,
    }  # fmt: skip


def _checkpoint(executor: StageExecutor, directory: str, replica: int) -> None:
    """Replicas hold equal weights and optimizer state: replica 0 writes the stage, every other replica
    only its own RNG (its dropout draws differ)."""
    stage, step, rng = executor.stage.index, executor.step_index, ckpt.rng_state(executor.device)
    if replica:
        ckpt.save_replica_rng(directory, stage, replica, step, rng)
        return
    ckpt.save_checkpoint(directory, stage, step, {**executor.state_dict(), "rng": rng})
    ckpt.prune(directory, stage)


def _resume(executor: StageExecutor, directory: str, replica: int) -> None:
    """Load the newest step every rank has complete (ranks agree on it: an all-reduce of their newest)."""
    mine = ckpt.latest_stage_step(directory, executor.stage.index)
    device = executor.device if dist.get_backend() == "nccl" else torch.device("cpu")
    newest = torch.tensor([-1 if mine is None else mine], dtype=torch.int64, device=device)
    work = dist.all_reduce(newest, op=dist.ReduceOp.MIN, async_op=True)
    executor.links.wait(work, "the ranks' agreement on the checkpoint to resume from", None)
    step = int(newest.item())
    if step < 0:
        raise RuntimeFailure(
            f"{directory}: no complete checkpoint of every stage to resume from",
            hint="run with checkpoint_dir= first; a step folder without a stage's manifest is incomplete",
        )
    state = ckpt.load_checkpoint(directory, executor.stage.index, step)
    executor.load_state_dict(state)
    rng = ckpt.load_replica_rng(directory, executor.stage.index, replica, step) if replica else state["rng"]
    ckpt.set_rng_state(rng or state["rng"], executor.device)


def named_inputs(outline: PipelineOutline, inputs: Mapping[str, Any] | tuple | list) -> dict[str, Any]:
    """Model inputs by placeholder name; positional inputs follow the model's placeholder order."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    names = outline.meta.get("inputs")
    if not names:
        names = list(dict.fromkeys(name for stage in outline.stages for name in stage.inputs))
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


def check_microbatch_shapes(outline: PipelineOutline, microbatch: dict[str, Any]) -> None:
    """Every stage's graph was traced at one microbatch's shapes; fail before any rank waits."""
    for stage in outline.stages:
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


def _pipeline_folder(stages_or_dir, scratch: str, checkpoint_dir) -> str:
    """The folder the ranks load: the one given, else the pipeline saved into the checkpoint folder
    (which then holds what ``export`` and a resume need) or into scratch space."""
    if isinstance(stages_or_dir, (str, os.PathLike)):
        if checkpoint_dir is not None:
            ckpt.write_build_pointer(checkpoint_dir, stages_or_dir)
        return os.fspath(stages_or_dir)
    folder = (
        os.path.join(checkpoint_dir, "pipeline")
        if checkpoint_dir is not None
        else os.path.join(scratch, "pipeline")
    )
    if isinstance(stages_or_dir, Pipeline):
        save_stages(stages_or_dir.stages, folder, stages_or_dir.meta)
    else:
        save_stages(list(stages_or_dir), folder)
    return folder


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise HetccError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_picklable(loss_fn) -> None:
    """Spawned ranks receive ``loss_fn`` pickled: a lambda or a nested function cannot travel."""
    try:
        pickle.dumps(loss_fn)
    except Exception as error:  # noqa: BLE001 - pickle raises PicklingError, AttributeError, TypeError
        raise HetccError(
            f"loss_fn {loss_fn!r} cannot be sent to the spawned ranks: {type(error).__name__}: {error}",
            hint="define the loss with `def` at the top level of a module (not a lambda or a nested "
            "function), or pass a torch function such as torch.nn.functional.cross_entropy",
        ) from None


def check_inputs_taken(outline: PipelineOutline, inputs: Mapping[str, Any] | tuple | list) -> None:
    """A tensor input the model was not traced with would be ignored silently (say, ``labels`` given
    to a plan compiled without them, whose model then returns logits, not a loss): refuse it."""
    if not isinstance(inputs, Mapping):
        return
    taken = set(outline.meta.get("inputs") or ()) | {n for stage in outline.stages for n in stage.inputs}
    unknown = sorted(k for k, v in inputs.items() if isinstance(v, torch.Tensor) and k not in taken)
    if unknown:
        raise HetccError(
            f"inputs {unknown} are not inputs of the compiled model (it takes {sorted(taken)}): the plan "
            "was compiled without them",
            hint=f"compile with {unknown} in example_kwargs (e.g. labels, so the model returns its loss), "
            "or leave them out here",
        )


def _say_where_it_runs(outline: PipelineOutline) -> None:
    """Once per run: a plan made for GPUs runs here on local CPU processes over gloo."""
    vendors = outline.meta.get("vendors") or []
    if any(str(v).lower() in GPU_VENDORS for v in vendors):
        placement = outline.meta.get("placement") or []
        kinds = {str(p.get("type") or p.get("vendor")) for p in placement} or set(map(str, vendors))
        devices = sorted(kinds)
        print(
            f"hetcc.run_local: the plan is for {', '.join(devices)} devices; every stage runs here as a "
            "local CPU process over gloo (fused kernels on their CPU path)",
            file=sys.stderr,
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, job: dict, beats) -> None:
    """Entry point of one spawned rank: result or error goes to ``rank<k>.pt`` in the results folder."""
    start_heartbeat(beats, rank)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=job["timeout_s"]),
        )  # fmt: skip
        outline, stage = load_rank(job["directory"], rank)
        result = run_rank(
            outline, stage, rank, job["inputs"], job["targets"], steps=job["steps"], schedule=job["schedule"],
            microbatches=job["microbatches"], loss_fn=job["loss_fn"], optimizer=job["optimizer"],
            timeout_s=job["timeout_s"], checkpoint=job["checkpoint"],
        )  # fmt: skip
        write_report(job["results"], rank, {"ok": True, **result})
    except Exception as error:  # noqa: BLE001 - reported to the parent with the traceback
        write_report(job["results"], rank, error_report(error))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(reports: list[dict]) -> RunResult:
    grads: dict[str, torch.Tensor] = {}
    for report in reports:
        for name, grad in report["grads"].items():
            grads.setdefault(name, grad)
    losses = next(report["losses"] for report in reports if report["losses"])  # any last-stage replica
    outputs = {m: out for report in reports for m, out in report["outputs"].items()}
    stats = [dict(report["stats"]) for report in reports]
    return RunResult(
        losses=list(losses), outputs=_concat_outputs([outputs[m] for m in sorted(outputs)]), grads=grads,
        stats=stats, first_step=reports[0]["first_step"],  # the step every rank resumed at
    )  # fmt: skip
