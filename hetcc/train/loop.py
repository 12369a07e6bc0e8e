"""The built-in training loop, written on ``PipelineRank``: what ``run_local``, ``hetcc run`` and
``hetcc.launch`` run on every rank.

Per step: the rank's share of global batch k (``hetcc.train.data``), ``step``, the global gradient norm
(clipped to ``clip_grad_norm`` when set), the optimizer (``hetcc.train.optim``: the build's optimizer
or the one given, weight-decay groups) and the learning-rate schedule; every ``eval_every`` steps a
forward-only pass over ``eval_batches`` batches of ``eval_data``; every ``checkpoint_every`` steps and at
the end a checkpoint holding the data position and the run's settings. The reporting rank (the last
stage's first replica) writes one record per step (``hetcc.train.metrics``) and, with ``progress``,
draws a progress bar. A build compiled for inference runs forward only: each step is an evaluation.

A resumed run takes the optimizer's state (moments) and the data position from the checkpoint and its
settings (learning rate, weight decay, schedule, clipping) from what it is given now, and says so.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hetcc.errors import HetccError
from hetcc.kernels import launch_stats, reset_launch_stats
from hetcc.sendrecv import reset_transfer_stats, transfer_stats
from hetcc.train.metrics import MetricsLog, RunFigures, summary_lines
from hetcc.train.optim import LRSchedule, apply_settings, build_optimizer, optimizer_state_bytes
from hetcc.train.rank import PipelineRank


@dataclass(frozen=True)
class TrainSettings:
    """One run of the built-in loop (JSON-able: a checkpoint records it, and a resume reports changes)."""

    steps: int
    optimizer: dict | None = None  # {"name": ..., "lr": ...}; None: the build's, with torch's defaults
    lr_schedule: dict | None = None  # LRSchedule's fields; None: constant
    clip_grad_norm: float | None = None
    eval_every: int = 0  # 0: no evaluation during the run
    eval_batches: int = 1
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only at the end (when checkpoint_dir is set)
    resume: bool = False
    log_dir: str | None = None  # metrics.jsonl (default: checkpoint_dir; None and no checkpoint: none)
    seed: int = 0  # the data order (shuffling, a sampler's seed)
    progress: bool = False


def train(rank: PipelineRank, data: Any, settings: TrainSettings, eval_data: Any = None) -> dict[str, Any]:
    """Run ``settings.steps`` steps on ``rank`` (every rank calls it); returns what ``RunResult`` takes
    from a rank: losses and records (reporting rank), gradients, counters, the summary."""
    optimizer = rank.optimizer(settings.optimizer) if rank.training else None
    first_step, position, notes = _resume(rank, optimizer, settings) if settings.resume else (0, 0, [])
    if not rank.training:
        notes.append(f"{rank.directory} was compiled for inference: each step is a forward-only evaluation, "
                     "and no weight changes")  # fmt: skip
    schedule = LRSchedule.from_spec(settings.lr_schedule, total_steps=first_step + settings.steps)
    scheduler = schedule.scheduler(optimizer, first_step) if optimizer is not None else None
    batches = rank.data(data, seed=settings.seed, position=position)
    figures, log = _figures(rank), _open_log(rank, settings)
    records, evals, step_times, busy, last = [], [], [], [], None
    reset_transfer_stats()
    reset_launch_stats()
    with _progress(rank.reports and settings.progress, settings.steps, first_step) as advance:
        for step in range(first_step, first_step + settings.steps):
            started, sent = time.perf_counter(), transfer_stats()["bytes_sent"]
            lr = optimizer.param_groups[0]["lr"] if optimizer is not None else None
            final = step == first_step + settings.steps - 1  # only its outputs are returned
            last, norm = _step(rank, next(batches), optimizer, scheduler, settings.clip_grad_norm, final)
            step_times.append(time.perf_counter() - started)
            busy.append(last.busy_s)
            record = {"step": step, "loss": last.mean_loss, "lr": lr, "grad_norm": norm,
                      **figures.step_record(step_times[-1]), "skipped": last.skipped,
                      "bytes_sent": transfer_stats()["bytes_sent"] - sent}  # this rank's, on the wire  # fmt: skip
            if settings.eval_every and (step + 1) % settings.eval_every == 0 and eval_data is not None:
                record["eval_loss"] = evaluate(rank, eval_data, settings.eval_batches, settings.seed)
                evals.append((step, record["eval_loss"]))
            if rank.reports:
                records.append(record)
                advance(record)
                if log is not None:
                    log.write(record)
            if _checkpoint_due(settings, rank.steps_done, step == first_step + settings.steps - 1):
                rank.save(settings.checkpoint_dir, optimizer, _record(settings, batches.position))
    if log is not None:
        log.close()
    return {
        "losses": [r["loss"] for r in records], "records": records, "eval_losses": evals, "first_step": first_step,
        "notes": notes, "outputs": _outputs_on_cpu(last),
        "grads": rank.named_grads(),
        "stats": {**transfer_stats(), **launch_stats(), "cuda_graphs": rank.cuda_graphs,
                  "optimizer_state_bytes": optimizer_state_bytes(optimizer),
                  "parameter_bytes": rank.parameter_bytes},
        "summary": _summary(rank, figures, step_times, busy), "metrics": str(log.path) if log is not None else None,
    }  # fmt: skip


def _outputs_on_cpu(last) -> dict[int, tuple]:
    """The last step's outputs per microbatch, copied to the host (what ``RunResult.outputs`` returns)."""
    if last is None:
        return {}
    host = lambda value: value.cpu() if isinstance(value, torch.Tensor) else value  # noqa: E731
    return {m: tuple(map(host, outputs)) for m, outputs in zip(last.microbatches, last.outputs)}


def _step(
    rank: PipelineRank, batch, optimizer, scheduler, clip: float | None, keep_outputs: bool
) -> tuple[Any, float | None]:
    """One step: forward and backward, the global gradient norm (clipped), the optimizer and the
    schedule; a build compiled for inference evaluates instead. Returns the step's result and norm."""
    if not rank.training:
        rank.steps_done += 1
        return rank.evaluate(batch), None
    result = rank.step(batch, keep_outputs=keep_outputs)
    norm = rank.clip_grad_norm_(clip) if clip else rank.grad_norm()
    if optimizer is not None:
        optimizer.step()
        scheduler.step()
    return result, norm


def evaluate(rank: PipelineRank, data: Any, batches: int, seed: int = 0) -> float | None:
    """The mean loss of the first ``batches`` global batches of ``data``, forward only (every rank)."""
    losses = [rank.evaluate(batch).mean_loss for _, batch in zip(range(batches), rank.data(data, seed=seed))]
    return statistics.fmean(losses) if losses and None not in losses else None


def _resume(rank: PipelineRank, optimizer, settings: TrainSettings) -> tuple[int, int, list[str]]:
    """Load the newest checkpoint; the run's settings win over the checkpoint's, and the notes say what
    it resumed with and what changed."""
    resumed = rank.load(settings.checkpoint_dir, optimizer)
    saved = resumed.train.get("settings") or {}
    changed = apply_settings(optimizer, settings.optimizer or {}) if optimizer is not None else {}
    notes = [f"resumed at step {resumed.step} from {settings.checkpoint_dir}"]
    notes += [
        f"optimizer {key}: {before!r} in the checkpoint, {now!r} now"
        for key, (before, now) in changed.items()
    ]
    for key in ("lr_schedule", "clip_grad_norm"):
        if key in saved and saved[key] != getattr(settings, key):
            notes.append(f"{key}: {saved[key]!r} in the checkpoint, {getattr(settings, key)!r} now")
    position = int((resumed.train.get("data") or {}).get("batches", resumed.step))
    return resumed.step, position, notes


def _record(settings: TrainSettings, position: int) -> dict[str, Any]:
    return {"data": {"batches": position, "seed": settings.seed}, "settings": asdict(settings)}


def _checkpoint_due(settings: TrainSettings, done: int, last: bool) -> bool:
    if settings.checkpoint_dir is None:
        return False
    return last or bool(settings.checkpoint_every and done % settings.checkpoint_every == 0)


def _figures(rank: PipelineRank) -> RunFigures:
    """Tokens and samples per global batch (from the traced first model input) and the plan's FLOPs."""
    needs = rank.needs
    tokens = needs.batch_rows * rank.seq_len
    types = [entry.type for entry in rank.outline.meta.placement]
    return RunFigures.of(rank.directory, rank.layout, types, rank.device.type == "cpu", tokens,
                         needs.batch_rows, rank.training)  # fmt: skip


def _open_log(rank: PipelineRank, settings: TrainSettings) -> MetricsLog | None:
    folder = settings.log_dir or settings.checkpoint_dir
    return MetricsLog(folder, settings.resume) if rank.reports and folder is not None else None


def _summary(
    rank: PipelineRank, figures: RunFigures, step_times: list[float], busy: list[float]
) -> list[str]:
    """Every rank's median busy time gathered once; the reporting rank writes the summary."""
    gathered = rank.links.gather_world(statistics.median(busy) if busy else 0.0, "the ranks' busy times")
    if not rank.reports:
        return []
    return summary_lines(figures, step_times, gathered)


@contextmanager
def _progress(enabled: bool, steps: int, first_step: int) -> Iterator:
    """A progress bar (``rich``) with the latest loss and throughput, on the reporting rank's stderr."""
    if not enabled:
        yield lambda record: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
               TextColumn("{task.fields[figures]}"))  # fmt: skip
    with Progress(*columns, console=_console(), transient=False) as bar:
        task = bar.add_task("train", total=steps, figures="")

        def advance(record: dict) -> None:
            loss = f"loss {record['loss']:.4f}" if record.get("loss") is not None else ""
            speed = f"{record['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in record else ""
            bar.update(task, advance=1, figures=f"step {record['step']} {loss} {speed}".strip())

        yield advance


def _console():
    from rich.console import Console

    return Console(file=sys.stderr)


def check_settings(settings: TrainSettings) -> None:
    """Wrong values fail before any process starts, naming the setting."""
    for name in ("steps",):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HetccError(f"{name} must be an integer >= 1, got {value!r}")
    for name in ("eval_every", "checkpoint_every"):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise HetccError(f"{name} must be an integer >= 0, got {value!r}")
    if settings.eval_batches < 1:
        raise HetccError(f"eval_batches must be an integer >= 1, got {settings.eval_batches!r}")
    clip = settings.clip_grad_norm
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
        raise HetccError(f"clip_grad_norm must be a positive number or None, got {clip!r}")
    if settings.resume and settings.checkpoint_dir is None:
        raise HetccError(
            "resume=True needs checkpoint_dir=", hint="pass the checkpoint_dir of the earlier run"
        )
    LRSchedule.from_spec(settings.lr_schedule, settings.steps)
    if settings.optimizer is not None:
        build_optimizer(settings.optimizer, [("probe", torch.nn.Parameter(torch.zeros(2, 2)))])
