"""Train a whole pipeline on this machine: one spawned process per rank, talking over gloo, each running
the built-in loop (``hetcc.train.loop``) on its ``PipelineRank``.

``run_local`` saves the pipeline to a folder (or takes a saved one), checks the whole folder once, and
every rank loads only its own stage from there, so a local check exercises the same files
``hetcc.launch`` runs on a cluster. Every stage runs on this machine's CPU over gloo, whatever devices
the plan names (it says so once). The ranks are watched by ``hetcc.runtime.supervisor``: a rank that
fails, dies or stops ends the run within the communication timeout plus a few seconds, and the error
lists the ranks in the order they failed, the cause first.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from hetcc import config
from hetcc.errors import HetccError, PlanFormatError
from hetcc.hardware.schema import short_repr
from hetcc.passes.comm import StageGraph
from hetcc.runtime.contract import PipelineMeta
from hetcc.runtime.groups import GPU_VENDORS
from hetcc.runtime.store import Pipeline, PipelineOutline, load_pipeline, read_outline, save_stages
from hetcc.runtime.supervisor import error_report, failure_error, spawn_ranks, start_heartbeat, write_report
from hetcc.solver.schedules import MULTI_STAGE, stage_actions
from hetcc.train import checkpoint as ckpt
from hetcc.train.data import TARGET_KEYS, split_microbatches
from hetcc.train.loop import TrainSettings, check_settings, train
from hetcc.train.rank import PipelineRank


@dataclass
class RunResult:
    """What a run produced, and which code produced it.

    ``losses``: one per step (the mean over microbatches), ``losses[i]`` of step ``first_step + i``
    (``first_step``: the steps a resumed run's checkpoint had done, else 0); ``records``: the per-step
    figures (``hetcc.train.metrics``: loss, lr, grad_norm, step_s, tokens_per_s, achieved FLOP/s per
    device type, the bytes the reporting rank sent ...); ``eval_losses``: (step, loss) of each evaluation; ``outputs``: the last step's flat
    model outputs concatenated over microbatches; ``grads``: after the last backward, by model parameter
    name; ``summary``: the measured step and stages next to the plan's simulated ones; ``notes``: what
    a resumed run resumed with; ``checkpoint_dir``: where the trained weights are (None: not saved);
    ``metrics``: the metrics.jsonl written.

    ``stats``: one dict per rank, counted over all steps:

    - ``sends`` / ``recvs``: tensors the stage's ``hetcc::send``/``hetcc::recv`` ops moved, activations
      and gradients (a gradient is sent by ``recv``'s backward, received by ``send``'s);
      ``bytes_sent`` / ``bytes_received``: their sizes on the wire (a codec's payload where the edge
      has one: ``compile(..., compress=...)``).
    - ``grads_filled`` / ``grads_dropped``: gradients exchanged outside the ops so every peer's wait is
      matched: zeros sent for a received tensor autograd never differentiated, a gradient received and
      dropped for a sent tensor that needed none (``LinkTransport.settle_gradients``).
    - ``replayed``: forward sends and recvs of a recomputed forward (``PipelineMeta.recompute``), which
      move nothing: the recv returns what the first forward received, the send is skipped.
    - ``fused_triton`` / ``fused_interpreter`` / ``fused_eager``: fused-group forwards by backend:
      generated kernel on a GPU, generated kernel through ``TRITON_INTERPRET=1``, original ops.
    - ``backward_triton`` / ``backward_interpreter``: generated backward kernel launches;
      ``backward_recompute``: group backwards that differentiated the original ops instead.
    - ``cuda_graphs`` (a string): whether the stage's compute ran as CUDA graphs, or why not
      (``StageExecutor.cuda_graphs``); fused groups inside a graph count their launches while it is
      captured (warm-up included), not when it replays.
    - ``optimizer_state_bytes``: the optimizer state the rank holds at the end (on a stage whose replicas
      shard it, ZeRO-1, its share).
    - ``parameter_bytes``: the weights the rank holds (on a tensor-parallel stage, its parts of the split
      ones and the others whole).
    """

    losses: list[float] = field(default_factory=list)
    outputs: tuple = ()
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: list[dict[str, int | str]] = field(default_factory=list)
    first_step: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    eval_losses: list[tuple[int, float | None]] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checkpoint_dir: str | None = None
    metrics: str | None = None


def run_local(
    stages_or_dir: list[StageGraph] | Pipeline | str,
    inputs: Mapping[str, Any] | tuple | list | None = None,
    targets: torch.Tensor | None = None,
    loss_fn: Callable | None = None,
    steps: int = 1,
    schedule: str | None = None,
    microbatches: int | None = None,
    optimizer: Mapping | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    *,
    data: Any = None,
    eval_data: Any = None,
    eval_every: int = 0,
    eval_batches: int = 1,
    lr_schedule: Mapping | None = None,
    clip_grad_norm: float | None = None,
    seed: int = 0,
    log_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> RunResult:
    """Train ``steps`` steps of the pipeline with one local process per rank and return the result.

    ``data`` (a Dataset, DataLoader, iterable of global batches or a module-level factory returning one:
    ``hetcc.train.data``): step k trains its batch k. ``inputs`` instead: one global batch (a dict by
    input name, or positional in placeholder order, with ``targets`` for a ``loss_fn``) trained at every
    step, a check. ``loss_fn(output, target)`` must be picklable (a module-level function); without it
    the model's first output must be a scalar loss. ``optimizer``: e.g. ``{"name": "adamw", "lr": 3e-4,
    "weight_decay": 0.1}``; ``lr_schedule``: e.g. ``{"warmup_steps": 10, "decay": "cosine"}``
    (``hetcc.train.optim``); ``clip_grad_norm``: the global norm's limit. ``eval_data`` is evaluated
    (forward only, ``eval_batches`` batches) every ``eval_every`` steps. ``checkpoint_dir``: every stage
    checkpoints there every ``checkpoint_every`` steps and at the end, with the data position; with
    ``resume=True`` the run first loads the newest complete checkpoint there and runs ``steps`` more.
    ``log_dir`` (default ``checkpoint_dir``) gets ``metrics.jsonl``. ``schedule`` and ``microbatches``
    default to the pipeline's.
    """
    _check_picklable(loss_fn, data, eval_data)
    if data is not None and inputs is not None:
        raise HetccError("pass data= (a dataset, loader or batches) or inputs= (one batch), not both")
    settings = TrainSettings(
        steps, dict(optimizer) if optimizer is not None else None, dict(lr_schedule) if lr_schedule else None,
        clip_grad_norm, eval_every, eval_batches, os.fspath(checkpoint_dir) if checkpoint_dir is not None else None,
        checkpoint_every, resume, os.fspath(log_dir) if log_dir is not None else None, seed, progress,
    )  # fmt: skip
    check_settings(settings)
    with tempfile.TemporaryDirectory(prefix="hetcc_run_") as scratch:
        directory = _pipeline_folder(stages_or_dir, scratch, checkpoint_dir, schedule, microbatches)
        load_pipeline(directory)  # every file checked once, here; each rank then reads only its own stage
        outline = read_outline(directory)
        if data is None:
            data = _repeated(outline, inputs, targets, outline.meta.microbatches)
        if resume and ckpt.latest_complete_step(checkpoint_dir, len(outline.stages)) is None:
            raise HetccError(
                f"{checkpoint_dir} holds no complete checkpoint to resume from",
                hint="run without resume=True first, with checkpoint_dir= and checkpoint_every=",
            )
        if settings.optimizer is None and outline.meta.optimizer:
            settings = replace(settings, optimizer=dict(outline.meta.optimizer))
        _say_where_it_runs(outline)
        job = dict(directory=directory, data=data, eval_data=eval_data, loss_fn=loss_fn, settings=settings,
                   timeout_s=config.comm_timeout_s, port=_free_port(), results=scratch)  # fmt: skip
        reports, failures = spawn_ranks(len(outline.meta.placement), _worker, job)
        if failures:
            raise failure_error(failures)
        return _collect(reports, settings.checkpoint_dir)


def _repeated(outline: PipelineOutline, inputs, targets, microbatches: int) -> Repeated:
    """``inputs`` (and ``targets``) as the one global batch of every step, checked before any rank starts."""
    if inputs is None:
        raise HetccError("run_local needs data= (a dataset, loader or batches) or inputs= (one batch)")
    batch = _named_inputs(outline, inputs)
    _check_inputs_taken(outline, batch)
    if isinstance(targets, torch.Tensor):
        batch[TARGET_KEYS[0]] = targets
    _check_microbatch_shapes(outline, split_microbatches(batch, microbatches)[0])
    return Repeated(batch)


class Repeated:
    """One global batch at every step (an iterable without end that pickles to the spawned ranks)."""

    def __init__(self, batch: dict[str, Any]):
        self.batch = batch

    def __iter__(self):
        while True:
            yield self.batch


def _named_inputs(outline: PipelineOutline, inputs: Mapping[str, Any] | tuple | list) -> dict[str, Any]:
    """Model inputs by placeholder name; positional inputs follow the model's placeholder order."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    names = list(outline.meta.inputs)
    if not names:
        names = list(dict.fromkeys(name for stage in outline.stages for name in stage.inputs))
    if len(inputs) != len(names):
        raise PlanFormatError(
            f"got {len(inputs)} positional inputs for model inputs {names}",
            hint="pass inputs as a dict keyed by input name",
        )
    return dict(zip(names, inputs))


def _check_microbatch_shapes(outline: PipelineOutline, microbatch: dict[str, Any]) -> None:
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


def _check_inputs_taken(outline: PipelineOutline, inputs: Mapping[str, Any]) -> None:
    """A tensor input the model was not traced with would be ignored silently (say, ``labels`` given
    to a plan compiled without them, whose model then returns logits, not a loss): refuse it."""
    taken = set(outline.meta.inputs) | {n for stage in outline.stages for n in stage.inputs}
    unknown = sorted(k for k, v in inputs.items() if isinstance(v, torch.Tensor) and k not in taken)
    if unknown:
        raise HetccError(
            f"inputs {unknown} are not inputs of the compiled model (it takes {sorted(taken)}): the plan "
            "was compiled without them",
            hint=f"compile with {unknown} in example_kwargs (e.g. labels, so the model returns its loss), "
            "or leave them out here",
        )


def _pipeline_folder(stages_or_dir, scratch: str, checkpoint_dir, schedule, microbatches) -> str:
    """The folder the ranks load: the one given, else the pipeline saved into the checkpoint folder
    (which then holds what ``export`` and a resume need) or into scratch space, with ``schedule`` and
    ``microbatches`` when given."""
    if isinstance(stages_or_dir, (str, os.PathLike)):
        if schedule is not None or microbatches is not None:
            raise HetccError("a saved folder runs with its own schedule and microbatches")
        if checkpoint_dir is not None:
            ckpt.write_build_pointer(checkpoint_dir, stages_or_dir)
        return os.fspath(stages_or_dir)
    pipeline = stages_or_dir if isinstance(stages_or_dir, Pipeline) else Pipeline(list(stages_or_dir))
    stages, meta = pipeline.stages, _run_meta(pipeline.meta, schedule, microbatches)
    folder = os.path.join(checkpoint_dir if checkpoint_dir is not None else scratch, "pipeline")
    save_stages(stages, folder, meta)
    return folder


def _run_meta(meta: PipelineMeta, schedule: str | None, microbatches: int | None) -> PipelineMeta:
    """``meta`` with the schedule and microbatches given; a routing left at its default (replica 0) is
    made again for the new microbatch count, and a new schedule defers and warms up by its own rule (the
    plan's deferred weight gradients and warm-ups were chosen for the plan's schedule and M: a zb-h1 run
    of a 1F1B plan defers ZB-H1's)."""
    if (schedule or meta.schedule) not in MULTI_STAGE:  # the record checks their orders' own rules
        stage_actions(
            schedule or meta.schedule, 1, meta.microbatches if microbatches is None else microbatches
        )
    changes = {k: v for k, v in (("schedule", schedule), ("microbatches", microbatches)) if v is not None}
    rescheduled = schedule is not None and schedule != meta.schedule
    if rescheduled:
        changes["deferred"] = ()
    if rescheduled or microbatches not in (None, meta.microbatches):
        changes["warmup"] = ()
    if microbatches is not None and not any(any(row) for row in meta.routing):
        changes["routing"] = ()
    return replace(meta, **changes)


def _check_picklable(*values) -> None:
    """Spawned ranks receive the loss function and the data pickled: a lambda, a nested function or an
    open generator cannot travel."""
    for what, value in zip(("loss_fn", "data", "eval_data"), values):
        try:
            pickle.dumps(value)
        except Exception as error:  # noqa: BLE001 - pickle raises PicklingError, AttributeError, TypeError
            raise HetccError(
                f"{what} {short_repr(value)} cannot be sent to the spawned ranks: {type(error).__name__}: {error}",
                hint="define it with `def` at the top level of a module (not a lambda or a nested function); "
                "for data, pass a Dataset or a module-level function that returns the iterable",
            ) from None


def _say_where_it_runs(outline: PipelineOutline) -> None:
    """Once per run: a plan made for GPUs runs here on local CPU processes over gloo."""
    placement = outline.meta.placement
    if any(p.vendor.lower() in GPU_VENDORS for p in placement):
        kinds = {p.type or p.vendor for p in placement}
        print(
            f"hetcc.run_local: the plan is for {', '.join(sorted(kinds))} devices; every stage runs here as a "
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
        pipeline_rank = PipelineRank(
            job["directory"], rank, loss_fn=job["loss_fn"], timeout_s=job["timeout_s"]
        )
        result = train(pipeline_rank, job["data"], job["settings"], job["eval_data"])
        write_report(job["results"], rank, {"ok": True, **result})
    except Exception as error:  # noqa: BLE001 - reported to the parent with the traceback
        write_report(job["results"], rank, error_report(error))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(reports: list[dict], checkpoint_dir: str | None) -> RunResult:
    grads: dict[str, torch.Tensor] = {}
    for report in reports:
        for name, grad in report["grads"].items():
            grads.setdefault(name, grad)
    lead = next(report for report in reports if report["records"])  # the reporting rank
    outputs = {m: out for report in reports for m, out in report["outputs"].items()}
    return RunResult(
        losses=list(lead["losses"]), outputs=_concat_outputs([outputs[m] for m in sorted(outputs)]), grads=grads,
        stats=[dict(report["stats"]) for report in reports], first_step=lead["first_step"],
        records=lead["records"], eval_losses=lead["eval_losses"], summary=lead["summary"], notes=lead["notes"],
        checkpoint_dir=checkpoint_dir, metrics=lead["metrics"],
    )  # fmt: skip


def _concat_outputs(per_microbatch: list[tuple]) -> tuple:
    columns = zip(*per_microbatch)
    return tuple(
        (torch.stack(col) if col[0].dim() == 0 else torch.cat(col))
        if isinstance(col[0], torch.Tensor)
        else col[0]
        for col in columns
    )
