"""The training commands of ``hetcc``: ``run``, ``launch``, ``export`` and ``prepare-text``, each with its
options. ``hetcc.cli`` lists them with the plan commands; nothing here imports torch before a command
runs, so ``hetcc --help`` starts at once."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hetcc.errors import HetccError
from hetcc.train.options import add_train_options, passthrough


def add_run(commands) -> None:
    text = "train a saved build locally, one process per stage (gloo, on CPU)"
    run_cmd = commands.add_parser("run", help=text, description=text)
    run_cmd.add_argument("build", help="build folder written by `hetcc compile` from a model with weights")
    run_cmd.add_argument("--steps", type=_positive, default=1, help="training steps to run (default 1)")
    run_cmd.add_argument("--loss", default=None, help="torch.nn.functional loss name (default: the model's)")
    run_cmd.add_argument("--trace", metavar="OUT.json", help="also write the measured steps as "
                         "Chrome trace / Perfetto JSON (one row per stage, microseconds)")  # fmt: skip
    add_train_options(run_cmd)
    run_cmd.set_defaults(run=_run)


def add_launch_and_export(commands) -> None:
    text = "print the torchrun command of every node that puts each stage on its planned device"
    launch_cmd = commands.add_parser("launch", help=text, description=text)
    launch_cmd.add_argument("build", help="build folder written by `hetcc compile --out`")
    launch_cmd.add_argument("--rdzv-endpoint", required=True, metavar="HOST:PORT",
                            help="node 0's address and a free port, reachable from every node")  # fmt: skip
    launch_cmd.add_argument("--node", type=int, metavar="N", help="run node N's command here instead")
    launch_cmd.add_argument("--steps", type=_positive, default=1, help="training steps to run (default 1)")
    launch_cmd.add_argument("--allow-substitute", action="store_true",
                            help="let a rank run on another device than the plan's (it says so)")  # fmt: skip
    add_train_options(launch_cmd)
    launch_cmd.set_defaults(run=_launch)
    text = "merge a build's or a checkpoint's stages into one safetensors state dict of the model"
    export_cmd = commands.add_parser("export", help=text, description=text)
    export_cmd.add_argument("source", help="build folder, checkpoint folder or one step-<n> folder")
    export_cmd.add_argument("out", help="the .safetensors file to write")
    export_cmd.set_defaults(run=_export)


def add_prepare_text(commands) -> None:
    text = "tokenise a folder of text files into train.bin, val.bin and meta.json for TokenDataset"
    prepare_cmd = commands.add_parser("prepare-text", help=text, description=text)
    prepare_cmd.add_argument("folder", help="folder of text files, read recursively (binary files, hidden "
                             "folders and __pycache__ are skipped)")  # fmt: skip
    prepare_cmd.add_argument("out", help="token folder to write (new or empty; created if missing)")
    prepare_cmd.add_argument("--tokenizer", metavar="NAME", help="a transformers tokenizer already on this "
                             "machine, by cached name or folder (nothing is downloaded; default: bytes)")  # fmt: skip
    prepare_cmd.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                             help="share of tokens, from the end, kept for validation (default 0.05)")  # fmt: skip
    prepare_cmd.add_argument("--pattern", default="**/*", metavar="GLOB",
                             help="which files under FOLDER to read (default **/*)")  # fmt: skip
    prepare_cmd.add_argument("--max-bytes", type=int, metavar="N",
                             help="stop before the first file that would take the text read past N bytes")  # fmt: skip
    prepare_cmd.add_argument("--force", action="store_true", help="replace an earlier token folder at OUT")
    prepare_cmd.set_defaults(run=_prepare_text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _run(args: argparse.Namespace) -> None:
    build = Path(args.build)
    if not build.is_dir():
        raise HetccError(
            f"{build} does not exist or is not a folder", hint="pass the --out folder of `hetcc compile`"
        )
    if not (build / "pipeline.json").exists():
        what = "a plan only" if (build / "plan.json").exists() else "no compiled pipeline"
        raise HetccError(
            f"{build} holds {what}: nothing to run",
            hint="compile a factory whose model has weights, e.g. `hetcc compile examples.models:gpt2_tiny "
            "--cluster examples/clusters/cpu4.yaml --out build`",
        )
    import tempfile

    from hetcc.launch import example_batch, loss_function
    from hetcc.runtime.recorder import TRACE_DIR_ENV
    from hetcc.runtime.store import read_outline
    from hetcc.train.local import run_local
    from hetcc.train.metrics import run_lines
    from hetcc.train.options import settings

    outline = read_outline(str(build))
    run, data, eval_data = settings(args, str(build), outline.meta, outline.seq_len, sys.stderr.isatty())
    loss_fn = loss_function(args.loss or outline.meta.loss)
    with tempfile.TemporaryDirectory(prefix="hetcc-trace-") as scratch:
        if args.trace:
            os.environ[TRACE_DIR_ENV] = scratch  # the spawned ranks inherit it
        try:
            result = run_local(
                str(build), loss_fn=loss_fn, steps=run.steps, optimizer=run.optimizer,
                checkpoint_dir=run.checkpoint_dir, checkpoint_every=run.checkpoint_every, resume=run.resume,
                data=data if data is not None else example_batch(str(build)), eval_data=eval_data,
                eval_every=run.eval_every, eval_batches=run.eval_batches, lr_schedule=run.lr_schedule,
                clip_grad_norm=run.clip_grad_norm, seed=run.seed, log_dir=run.log_dir, progress=run.progress,
            )  # fmt: skip
        finally:
            os.environ.pop(TRACE_DIR_ENV, None)
        for line in run_lines(vars(result), run.checkpoint_dir, str(build)):
            print(line)
        if args.trace:
            _write_measured_trace(build, scratch, args.trace)


def _write_measured_trace(build: Path, scratch: str, out: str) -> None:
    from hetcc.report import measured_trace, write_trace
    from hetcc.runtime.store import pipeline_meta

    placement = pipeline_meta(str(build)).placement
    ranks = [(p.stages, p.replica, p.device or f"rank {p.rank}") for p in placement]
    path = write_trace(measured_trace(scratch, ranks), out)
    print(f"trace: {path} (measured on this machine; open in https://ui.perfetto.dev or chrome://tracing)")


def _launch(args: argparse.Namespace) -> None:
    from hetcc.launch import launch_node

    words = ["--steps", str(args.steps), *passthrough(args)] + ["--allow-substitute"] * args.allow_substitute
    code = launch_node(args.build, args.rdzv_endpoint, args.node, words)
    if code:
        raise HetccError(
            f"torchrun on node {args.node} exited with code {code}", hint="see the ranks' errors above"
        )


def _export(args: argparse.Namespace) -> None:
    import hetcc

    state = hetcc.export(args.source, args.out)
    print(f"written {args.out}: {len(state)} tensors by the model's parameter names (model.load_state_dict)")


def _prepare_text(args: argparse.Namespace) -> None:
    import json

    from hetcc.train.text import prepare_text

    summary = prepare_text(
        args.folder, args.out, tokenizer=args.tokenizer, pattern=args.pattern,
        val_fraction=args.val_fraction, max_bytes=args.max_bytes, overwrite=args.force,
    )  # fmt: skip
    print(f"written {summary.describe()}")
    print(f"train on it with `hetcc run BUILD --data {args.out}`, or in Python "
          f"hetcc.train.TokenDataset({json.dumps(args.out)}, seq_len=...)")  # fmt: skip
