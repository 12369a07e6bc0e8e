"""The ``hetcc`` command: ``compile``, ``explain``, ``simulate``, ``run``, ``calibrate`` (mirrors the API).

A model reaches the CLI as ``pkg.module:factory``: a function returning ``(model, example_inputs)``,
where ``example_inputs`` is a tuple (positional) or a dict (keyword arguments) holding one step's batch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from hetcc.errors import HetccError


def _load_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise HetccError(f"model {spec!r} is not of the form pkg.module:factory")
    sys.path.insert(0, str(Path.cwd()))
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise HetccError(f"cannot load model factory {spec!r}: {exc}") from exc
    model, example = factory()
    return model, (example, None) if isinstance(example, (tuple, list)) else ((), example)


def _compile(args: argparse.Namespace) -> None:
    import torch

    import hetcc

    model, (inputs, kwargs) = _load_factory(args.model)
    out = Path(args.out)
    compiled = hetcc.compile(
        model, args.cluster, example_inputs=inputs, example_kwargs=kwargs, microbatches=args.microbatches,
        schedule=args.schedule, training=not args.inference, optimizer=args.optimizer, dump_dir=out / "ir",
    )  # fmt: skip
    if any(p.is_meta for p in model.parameters()):  # planned without weights: nothing to run yet
        compiled.save_plan(out)
        note = "plan only (the model is on the meta device; build it with weights to save stages)"
    else:
        tensors = {k: v for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor)}
        compiled.save(out, inputs=tensors or None)
        note = "plan, stage code, weights and kernels; run it with `hetcc run` or hetcc.launch"
    print(compiled.explain())
    print(f"\nwritten to {out}/: {note}")


def _read_plan(folder: str):
    from hetcc.plan import Plan

    path = Path(folder) / "plan.json"
    if not path.exists():
        raise HetccError(f"{path} does not exist", hint="run `hetcc compile ... --out DIR` first")
    return Plan.from_json(path.read_text())


def _explain(args: argparse.Namespace) -> None:
    print(_read_plan(args.build).explain())


def _simulate(args: argparse.Namespace) -> None:
    from hetcc.solver.problem import PartitionProblem
    from hetcc.solver.schedules import format_grid
    from hetcc.solver.simulate import simulate

    plan = _read_plan(args.build)
    problem = PartitionProblem.from_json((Path(args.build) / "problem.json").read_text())
    names = [d.name for d in problem.devices]
    boundaries = [0]
    for stage in plan.stages:
        boundaries.append(boundaries[-1] + len(stage.blocks))
    devices = [names.index(s.device) for s in plan.stages]
    result = simulate(problem, boundaries, devices)
    print(
        f"simulated step {result.step_time_s * 1e3:.2f} ms (planner predicted {plan.step_time_s * 1e3:.2f} ms)"
    )
    for k, (busy, bubble) in enumerate(zip(result.busy_s, result.bubble_fraction)):
        print(f"  stage {k} on {plan.stages[k].device}: busy {busy * 1e3:.2f} ms, bubble {bubble:.0%}")
    print(
        format_grid(
            problem.schedule, len(plan.stages), problem.microbatches, training=problem.training, comm=False
        )
    )


def _run(args: argparse.Namespace) -> None:
    from hetcc.api import run_local
    from hetcc.launch import loss_function
    from hetcc.runtime.store import load_inputs

    inputs, targets = load_inputs(args.build)
    loss_fn = loss_function(args.loss)
    result = run_local(args.build, inputs, targets=targets, loss_fn=loss_fn, steps=args.steps)
    for step, loss in enumerate(result.losses):
        print(f"step {step} loss {loss:.6f}")


def _calibrate(args: argparse.Namespace) -> None:
    from hetcc.hardware.measure import calibrate

    calibration = calibrate(args.device, dtypes=tuple(args.dtypes), quick=args.quick)
    calibration.save(args.out)
    print(calibration.describe())
    print(f"written to {args.out}; name it in a cluster file as `calibration: {args.out}`")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetcc", description="Compile PyTorch models for heterogeneous clusters"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    compile_cmd = commands.add_parser(
        "compile", help="plan a model over a cluster and write the build folder"
    )
    compile_cmd.add_argument("model", help="pkg.module:factory returning (model, example_inputs)")
    compile_cmd.add_argument("--cluster", required=True, help="cluster YAML/JSON file")
    compile_cmd.add_argument("--out", required=True, help="build folder")
    compile_cmd.add_argument("--microbatches", type=int, default=8)
    compile_cmd.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    compile_cmd.add_argument("--optimizer", default="adam")
    compile_cmd.add_argument("--inference", action="store_true", help="plan forward only")
    compile_cmd.set_defaults(run=_compile)
    for name, run, text in (
        ("explain", _explain, "print a build's plan"),
        ("simulate", _simulate, "replay a plan"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("build", help="build folder written by `hetcc compile`")
        sub.set_defaults(run=run)
    run_cmd = commands.add_parser("run", help="train a saved build locally, one process per stage (gloo)")
    run_cmd.add_argument("build", help="build folder written by `hetcc compile` with weights")
    run_cmd.add_argument("--steps", type=int, default=1)
    run_cmd.add_argument("--loss", default=None, help="torch.nn.functional loss name (default: the model's)")
    run_cmd.set_defaults(run=_run)
    calibrate_cmd = commands.add_parser(
        "calibrate", help="measure this machine's device and write a calibration"
    )
    calibrate_cmd.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    calibrate_cmd.add_argument("--out", default="calibration.yaml")
    calibrate_cmd.add_argument("--dtypes", nargs="+", default=["fp32"], help="matmul dtypes to time")
    calibrate_cmd.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    calibrate_cmd.set_defaults(run=_calibrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except HetccError as exc:
        print(f"hetcc: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
