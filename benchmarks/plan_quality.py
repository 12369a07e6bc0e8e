"""Plan quality: hetcc's plan vs the equal-split baselines and the lower bound, on real model shapes.

Default case (the partition issue's example): GPT-2 XL (48 layers) on 4x A100-80GB + 4x T4 in two nodes
joined by 25 Gb/s Ethernet. Prints the plan, each baseline's step time and hetcc's speedup over it, the
gap to the lower bound, and how far the event-driven simulator is from the planner's objective.

Usage: python benchmarks/plan_quality.py [--model gpt2_xl] [--cluster FILE] [--microbatches 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hetcc  # noqa: E402
from examples import models  # noqa: E402
from hetcc.solver.solve import solve  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gpt2_xl", help="a factory in examples/models.py")
    parser.add_argument("--cluster", default=str(ROOT / "examples/clusters/mixed_a100_t4.yaml"))
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    args = parser.parse_args()
    model, inputs = getattr(models, args.model)()
    start = time.perf_counter()
    compiled = hetcc.compile(
        model, args.cluster, example_kwargs=inputs, microbatches=args.microbatches, schedule=args.schedule
    )
    compile_s = time.perf_counter() - start
    plan = compiled.plan
    start = time.perf_counter()
    replay = solve(compiled.problem)  # the solver alone, on the problem compile built
    solve_s = time.perf_counter() - start
    print(plan.explain())
    print(f"\ncompile {compile_s:.1f} s (analysis {sum(compiled.analysis.timings_ms.values()) / 1e3:.1f} s)")
    problem = compiled.problem
    print(
        f"solve {solve_s:.2f} s for {len(problem.blocks)} blocks x {len(problem.devices)} devices "
        f"({'exact' if replay.exact else 'heuristic'} device-order search, {replay.orders_searched} orders)"
    )
    finite = {name: t for name, t in plan.baselines.items() if t != float("inf")}
    for name, seconds in plan.baselines.items():
        ratio = f"{seconds / plan.step_time_s:.2f}x" if name in finite else "n/a (does not fit)"
        print(f"  {name:<10} {seconds * 1e3:10.1f} ms   hetcc speedup {ratio}")
    if finite:
        best = min(finite, key=finite.get)
        print(f"speedup over the best baseline ({best}): {finite[best] / plan.step_time_s:.2f}x")
    print(f"gap to lower bound: {plan.gap:.1%}")
    error = abs(plan.simulated_step_s - plan.step_time_s) / plan.step_time_s
    print(
        f"simulator vs objective: {plan.simulated_step_s * 1e3:.1f} vs {plan.step_time_s * 1e3:.1f} ms ({error:.1%})"
    )


if __name__ == "__main__":
    main()
