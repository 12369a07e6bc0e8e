"""Run a saved pipeline folder on the ranks started by torchrun: ``python -m hetcc.launch DIR``.

    torchrun --standalone --nproc-per-node K -m hetcc.launch build/ --steps 10

Rank k runs stage k. Inputs (and targets) come from ``inputs.safetensors`` / ``targets.safetensors`` in
the folder; schedule, microbatches, optimizer and loss default to ``pipeline.json``'s ``meta``. The last
rank prints one ``step <i> loss <value>`` line per step (and writes them to ``--losses-out``); with
``--stats-out DIR`` every rank writes its counters (``RunResult.stats``) to ``DIR/stats_rank<k>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from hetcc import config
from hetcc.errors import HetccError, PlanFormatError
from hetcc.runtime.graph_json import resolve_function
from hetcc.runtime.groups import GPU_VENDORS, world_backend
from hetcc.runtime.local import run_rank
from hetcc.runtime.store import load_inputs, load_pipeline


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    pipeline = load_pipeline(args.directory)
    meta = pipeline.meta
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != len(pipeline.stages):
        raise PlanFormatError(
            f"{args.directory} has {len(pipeline.stages)} stages but WORLD_SIZE is {world}",
            hint=f"start torchrun with --nproc-per-node {len(pipeline.stages)} (times the node count)",
        )
    vendors = meta.get("vendors") or ["cpu"] * world
    rank = int(os.environ.get("RANK", "0"))
    device = _device(vendors[rank])
    timeout = datetime.timedelta(seconds=config.comm_timeout_s)
    dist.init_process_group(world_backend(vendors), timeout=timeout)
    try:
        inputs, targets = load_inputs(args.directory)
        result = run_rank(
            pipeline, rank, inputs, targets,
            steps=args.steps,
            schedule=args.schedule or meta.get("schedule", "1f1b"),
            microbatches=args.microbatches or int(meta.get("microbatches", 1)),
            loss_fn=loss_function(meta.get("loss")),
            optimizer=meta.get("optimizer"),
            device=device,
        )  # fmt: skip
    finally:
        dist.destroy_process_group()
    if args.stats_out:
        _write_json(os.path.join(args.stats_out, f"stats_rank{rank}.json"), result["stats"])
    if pipeline.stages[rank].is_last:
        for step, loss in enumerate(result["losses"]):
            print(f"step {step} loss {loss!r}", flush=True)
        if args.losses_out:
            _write_json(args.losses_out, result["losses"])
    return 0


def _write_json(path: str, value) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(value, f)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hetcc.launch", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="folder written by hetcc (pipeline.json, stage<k>.*)")
    parser.add_argument("--steps", type=int, default=1, help="training steps to run")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), help="default: pipeline.json meta")
    parser.add_argument("--microbatches", type=int, help="default: pipeline.json meta")
    parser.add_argument("--losses-out", help="last rank writes the per-step losses here as JSON")
    parser.add_argument("--stats-out", help="folder: every rank writes stats_rank<k>.json (RunResult.stats)")
    return parser


def loss_function(name: str | None):
    """``None``/``"model"``: the model returns its loss; else a function of torch.nn.functional by name."""
    if name in (None, "model"):
        return None
    return resolve_function(f"torch.nn.functional.{name}", "pipeline.json meta.loss")


def _device(vendor: str) -> torch.device:
    if vendor.lower() in GPU_VENDORS and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except HetccError as error:
        print(
            f"hetcc.launch rank {os.environ.get('RANK', '0')}: {type(error).__name__}: {error}",
            file=sys.stderr,
        )
        sys.exit(1)
