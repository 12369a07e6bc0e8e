"""The ``hetcc`` command (mirrors the API): the plan commands ``compile``, ``explain``, ``simulate``,
``report``, ``replan`` and ``calibrate`` here, the training commands ``run``, ``launch``, ``export`` and
``prepare-text`` in ``hetcc.cli.train``; ``main`` runs one (``python -m hetcc.cli`` too).

A model reaches the CLI as ``pkg.module:factory`` or ``path/to/file.py:factory``: a function taking no
arguments and returning ``(model, example_inputs)``, where ``example_inputs`` is a tuple (positional) or a
dict (keyword arguments) holding one step's batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from hetcc.cli import train as cli_train
from hetcc.errors import HetccError
from hetcc.plan import PRECISIONS
from hetcc.solver.schedules import PIPELINE_SCHEDULES

FACTORY_FORM = "pkg.module:factory or path/to/file.py:factory"  # as hetcc.train.sources reads it


def _load_factory(spec: str):
    """Import the factory named by ``spec``, call it, and check what it returns."""
    from hetcc.train.sources import import_attribute

    factory = import_attribute(spec, "model", returns="model, example_inputs")
    try:
        result = factory()
    except Exception as exc:
        raise HetccError(
            f"model factory {spec!r} raised {type(exc).__name__}: {exc}",
            hint="call the factory in Python to see the full traceback",
        ) from exc
    return _check_factory_result(spec, result)


def _check_factory_result(spec: str, result):
    import torch

    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        got = type(result).__name__ if not isinstance(result, tuple) else f"a tuple of {len(result)}"
        raise HetccError(
            f"model factory {spec!r} returned {got}, not (model, example_inputs)",
            hint="return a torch.nn.Module and one step's batch: a tuple of tensors or a dict of inputs",
        )
    model, example = result
    if isinstance(example, torch.Tensor):
        example = (example,)
    if isinstance(example, (tuple, list)):
        return model, (tuple(example), None)
    if isinstance(example, dict):
        return model, ((), example)
    raise HetccError(
        f"model factory {spec!r} returned example inputs of type {type(example).__name__}",
        hint="return a tuple of positional inputs or a dict of keyword inputs",
    )


def _compile(args: argparse.Namespace) -> None:
    import torch

    import hetcc
    from hetcc.report import write_report

    _check_out_folder(args.out)
    model, (inputs, kwargs) = _load_factory(args.model)
    out = Path(args.out)
    compiled = hetcc.compile(
        model, args.cluster, example_inputs=inputs, example_kwargs=kwargs, microbatches=args.microbatches,
        schedule=args.schedule, training=not args.inference, optimizer=args.optimizer, dump_dir=out / "ir",
        precision=args.precision, recompute={"auto": "auto", "always": True, "never": False}[args.recompute],
        replicate=not args.no_replicate, compress=args.compress, shard=args.shard,
        tensor_parallel=args.tensor_parallel,
    )  # fmt: skip
    if any(p.is_meta for p in model.parameters()):  # planned without weights: nothing to run yet
        compiled.save_plan(out)
        note = "plan only (the model is on the meta device; build it with weights to save stages)"
    else:
        tensors = {k: v for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor)}
        compiled.save(out, inputs=tensors or None)
        note = "plan, stage code, weights and kernels; run it with `hetcc run` or hetcc.launch"
    report = write_report(out, compiled.cluster)
    print(compiled.explain())
    print(f"\nwritten to {out}/: {note}\nreport: {report} (open it in a browser)")


def _explain(args: argparse.Namespace) -> None:
    from hetcc.plan import read_plan

    print(read_plan(args.build).explain())


def _simulate(args: argparse.Namespace) -> None:
    from hetcc.plan import recorded_warmup
    from hetcc.report import load, simulated_trace, write_trace
    from hetcc.solver.grid import format_grid

    saved = load(args.build)
    if saved.simulation is None:
        raise HetccError(f"cannot replay the plan in {args.build}: {saved.simulation_error}")
    result, problem = saved.simulation, saved.problem
    formula = saved.plan.objective_s if not math.isnan(saved.plan.objective_s) else saved.plan.step_time_s
    print(f"simulated step {result.step_time_s * 1e3:.2f} ms (the search's formula: {formula * 1e3:.2f} ms)")
    devices = [", ".join(s.devices) for s in saved.stages]
    for k, (busy, bubble) in enumerate(zip(result.busy_s, result.bubble_fraction)):
        print(f"  stage {k} on {devices[k]}: busy {busy * 1e3:.2f} ms, bubble {bubble:.0%}")
    microbatches, replicas = problem.microbatches, len(saved.stages[0].devices)
    if saved.plan.chunks > 1 and replicas > 1:  # the pipeline replicated whole: each replica its own rounds
        microbatches = len(range(0, microbatches, replicas))
        print(f"replica 0 of {replicas}, its {microbatches} microbatches numbered 0..{microbatches - 1}:")
    print(
        format_grid(
            saved.plan.schedule,
            saved.plan.ranks,
            microbatches,
            training=problem.training,
            comm=False,
            recompute=[s.recompute for s in saved.stages],
            deferred=[s.deferred for s in saved.stages],
            warmup=recorded_warmup(saved.stages),
            chunks=saved.plan.chunks,
        )  # fmt: skip
    )
    if args.trace:
        path = write_trace(simulated_trace(result, saved.rows), args.trace)
        print(f"trace: {path} (open in https://ui.perfetto.dev or chrome://tracing)")


def _report(args: argparse.Namespace) -> None:
    from hetcc.report import write_report

    print(f"report: {write_report(args.build)}")


def _calibrate(args: argparse.Namespace) -> None:
    from hetcc.hardware.measure import calibrate

    out = Path(args.out or f"build/calibration-{args.device.replace(':', '')}.yaml")
    if out.suffix.lower() not in (".yaml", ".yml", ".json") or out.is_dir():
        raise HetccError(f"--out {out}: a calibration file must end in .yaml, .yml or .json")
    _check_out_folder(str(out.parent))  # before measuring, which takes a while
    calibration = calibrate(args.device, dtypes=tuple(args.dtypes), quick=args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    calibration.save(out)
    print(calibration.describe())
    print(
        f"written to {out}\nto use it, add to a cluster file:  calibration: {out.resolve()}\n"
        "(a relative `calibration:` path is read relative to the cluster file, not to this folder)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetcc", description="Compile PyTorch models for heterogeneous clusters"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_compile(commands)
    for name, run, text in (
        ("explain", _explain, "print a build's plan table"),
        (
            "simulate",
            _simulate,
            "replay a plan's schedule event by event: step time, bubbles, rank x step grid",
        ),
        ("report", _report, "write DIR/report.html: the plan, cluster, memory and schedule as one page"),
    ):
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("build", help="build folder written by `hetcc compile --out`")
        if name == "simulate":
            sub.add_argument("--trace", metavar="OUT.json", help="also write the simulated step as "
                             "Chrome trace / Perfetto JSON (one row per stage, microseconds)")  # fmt: skip
        sub.set_defaults(run=run)
    cli_train.add_run(commands)
    cli_train.add_launch_and_export(commands)
    _add_replan(commands)
    cli_train.add_prepare_text(commands)
    text = "measure this machine's device and write a calibration file"
    calibrate_cmd = commands.add_parser("calibrate", help=text, description=text)
    calibrate_cmd.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    calibrate_cmd.add_argument("--out", default=None,
                               help="where to write it (default build/calibration-<device>.yaml)")  # fmt: skip
    calibrate_cmd.add_argument(
        "--dtypes", nargs="+", default=["fp32"], help="matmul dtypes to time (default fp32)"
    )
    calibrate_cmd.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    calibrate_cmd.set_defaults(run=_calibrate)
    return parser


def _add_replan(commands) -> None:
    text = "plan the same model for a changed cluster and move a checkpoint into the new stages"
    replan_cmd = commands.add_parser("replan", help=text, description=text)
    replan_cmd.add_argument(
        "source", help="build folder with checkpoints/, a checkpoint folder or a step-<n> folder"
    )
    replan_cmd.add_argument("--model", required=True, help=f"the factory compiled before ({FACTORY_FORM})")
    replan_cmd.add_argument("--cluster", required=True, help="the cluster left (YAML/JSON file)")
    replan_cmd.add_argument(
        "--out", required=True, help="the new build folder (its checkpoints/ holds the moved state)"
    )
    replan_cmd.set_defaults(run=_replan)


def _replan(args: argparse.Namespace) -> None:
    import hetcc

    model, (inputs, kwargs) = _load_factory(args.model)
    compiled = hetcc.replan(args.source, args.cluster, model, inputs, kwargs, out=args.out)
    print(compiled.explain())
    print(
        f"\nwritten to {args.out}/; go on with `hetcc run {args.out} --resume` or `hetcc launch {args.out} --resume ...`"
    )


def _add_compile(commands) -> None:
    text = "plan a model over a cluster; write the build folder and report.html"
    compile_cmd = commands.add_parser("compile", help=text, description=text)
    compile_cmd.add_argument(
        "model", help=f"{FACTORY_FORM}: a function returning (model, example_inputs), where "
        "example_inputs is one training step's batch (a tuple of tensors or a dict of keyword inputs)",
    )  # fmt: skip
    compile_cmd.add_argument(
        "--cluster", required=True, help="cluster YAML/JSON file (see examples/clusters/)"
    )
    compile_cmd.add_argument("--out", required=True, help="build folder to write (created if missing)")
    compile_cmd.add_argument("--microbatches", type=_microbatches, default="auto", metavar="M",
                             help="split each step's batch into M equal microbatches along dim 0, or 'auto': "
                             "try every divisor of the batch from one trace and keep the fastest (default auto)")  # fmt: skip
    compile_cmd.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32",
                             help="training precision, priced at each device's peak for it (default fp32)")  # fmt: skip
    compile_cmd.add_argument("--recompute", choices=("auto", "always", "never"), default="auto",
                             help="recompute stage activations in backward: where memory needs it, in every "
                             "stage, or never (default auto)")  # fmt: skip
    compile_cmd.add_argument(
        "--no-replicate", action="store_true", help="one device per stage (no replicated stages)"
    )
    compile_cmd.add_argument("--schedule", choices=(*PIPELINE_SCHEDULES, "auto"), default="auto",
                             help="pipeline schedule: 1f1b holds fewer activations, gpipe runs all "
                             "forwards first, zb-h1 defers weight gradients into 1F1B's bubbles, zb-h2 "
                             "also warms up with more forwards, interleaved-1f1b runs 2-4 stages per device "
                             "of the best 1F1B pipeline (its bubble over that count), zbv lays that pipeline "
                             "in a V of two stages per device, auto plans all but "
                             "gpipe and keeps the fastest (default auto)")  # fmt: skip
    compile_cmd.add_argument("--shard", type=lambda t: t if t == "auto" else int(t), choices=("auto", 0, 1),
                             default="auto", help="ZeRO-1 of replicated stages (optimizer state split over the "
                             "replicas): auto where it pays (default), 1 always, 0 never")  # fmt: skip
    compile_cmd.add_argument("--tensor-parallel", type=_tensor_parallel, default=False, metavar="{off,auto,T}",
                             help="stages on groups of T like devices of one node, each holding 1/T of the "
                             "weights (Megatron-style): off (default), auto (2, 4 and 8 priced, the fastest "
                             "simulated kept per device type) or a degree T")  # fmt: skip
    compile_cmd.add_argument("--compress", type=_compress, default="off",
                             help="codecs on the wire between stages: off (default), auto (per cut where "
                             "it shortens the step, no lossier than int8 activations / bf16 gradients), or "
                             "a JSON object of pins, e.g. '{\"inter-node\": [\"int8\", \"bf16\"]}'")  # fmt: skip
    compile_cmd.add_argument("--optimizer", default="adam",
                             help="optimizer whose state the memory plan counts: adam, adamw, sgd, "
                             "sgd_momentum or none (default adam)")  # fmt: skip
    compile_cmd.add_argument("--inference", action="store_true", help="plan forward only (no gradients)")
    compile_cmd.set_defaults(run=_compile)


def _tensor_parallel(text: str) -> bool | int | str:
    if text in ("off", "auto"):
        return "auto" if text == "auto" else False
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected off, auto or a degree (an integer), got {text!r}"
        ) from None


def _compress(text: str) -> str | dict:
    if text in ("off", "auto"):
        return text
    try:
        pins = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f"expected off, auto or a JSON object, got {text!r}: {error}"
        ) from None
    if not isinstance(pins, dict):
        raise argparse.ArgumentTypeError(f"expected off, auto or a JSON object, got {text!r}")
    return pins


def _microbatches(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a failure prints one error line and its hint (a traceback only with HETCC_DEBUG)."""
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except HetccError as exc:
        if _debug():
            traceback.print_exc()
        print(f"hetcc: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - unchecked input or a bug: still one line, not a traceback
        if _debug():
            raise
        message = " ".join(str(exc).split())[:300]
        print(
            f"hetcc: error: {type(exc).__name__}: {message}\n  hint: set HETCC_DEBUG=1 to see the traceback; "
            "if the input was valid, please report it",
            file=sys.stderr,
        )
        return 1
    return 0


def _debug() -> bool:
    """HETCC_DEBUG set to a level of 1 or more (now, or when hetcc.config was read)."""
    from hetcc import config

    return config.debug >= 1 or os.environ.get("HETCC_DEBUG", "0").strip() not in ("", "0")


def _check_out_folder(out: str, what: str = "--out") -> None:
    """``out`` names a folder that exists or can be made (not a file, not under one)."""
    path = Path(out)
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise HetccError(f"{what} {out}: {blocking} is a file, not a folder", hint="give a folder path")
