"""Plans as wide as the cluster: replicated stages, recomputation, precision and microbatch search.

For GPT-2 medium (24 layers, hidden 1024, seq 1024, global batch 32, fp32, Adam, 1F1B) on two mixed
clusters, print hetcc's plan (``microbatches="auto"``, replicas and recomputation allowed), hetcc's best
pure pipeline (``replicate=False``) and the Metis-style peer plan of the issue expressed as replica
groups and simulated by hetcc's simulator at the peer's M = 8; an OPT-1.3B shape on the three-node
cluster under 1F1B and ``schedule="auto"`` (which tries interleaved 1F1B too); for each, what
``schedule="interleaved-1f1b"`` plans (``solver.interleave``: v = 2-4 chunks per device, on the pure
pipeline's devices or on groups of replicas). Then plan a Llama-2-70B-shaped model
(batch 64 x seq 4096, bf16-mixed, Adam) on 64 GPUs (32 H100, 16 MI250X, 16 A100-40GB), and time the
solver on a 96-block x 64-device synthetic chain. Every figure is a simulated step from the same run.

Run: ``python benchmarks/plan_space.py [--skip-llama]`` (the Llama part traces an 80-layer model twice
on the meta device: a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import hetcc  # noqa: E402
from examples.models import gpt2_medium, llama_70b, opt_1_3b  # noqa: E402
from hetcc.errors import InfeasiblePlanError  # noqa: E402
from hetcc.solver.interleave import solve_interleaved  # noqa: E402
from hetcc.solver.simulate import simulate  # noqa: E402
from hetcc.solver.solve import solve  # noqa: E402

CLUSTERS = ROOT / "examples" / "clusters"
# (cluster file, peer plan: boundaries over the 26 blocks, device-name prefix of each replica group)
PEERS = {
    "mixed_a100_t4.yaml": ([0, 22, 26], ["a100", "t4"]),
    "three_nodes_h100_v100_mi250x.yaml": ([0, 11, 16, 26], ["h100", "v100", "mi250x"]),
}


def _groups(problem, prefixes):
    return [tuple(i for i, d in enumerate(problem.devices) if d.name.startswith(p)) for p in prefixes]


def _plan_line(label: str, plan) -> str:
    groups = " -> ".join(f"{len(s.devices)}x {s.device_type} [{len(s.blocks)}]" for s in plan.stages)
    recompute = sum(s.recompute for s in plan.stages)
    return (
        f"  {label:<28} {plan.schedule:<5} M={plan.microbatches:<3} simulated {plan.step_time_s * 1e3:8.1f} ms   "
        f"{groups}{f'  ({recompute} recomputing)' if recompute else ''}"
    )


def _interleaved_line(problem) -> str:
    """What ``schedule="interleaved-1f1b"`` plans for ``problem`` (``solver.interleave.solve_interleaved``:
    the best pure pipeline's devices and, with replicas, groups of identical devices, each v tried)."""
    try:
        _, solution, note = solve_interleaved(problem, rerank=6)
    except InfeasiblePlanError as error:
        return f"  interleaved 1F1B: none ({str(error).splitlines()[0]})"
    return f"  interleaved 1F1B: {solution.simulated_s * 1e3:.1f} ms; {note.removeprefix('schedule: ')}"


def gpt2_clusters() -> None:
    model, batch = gpt2_medium(batch=32, seq=1024)
    for name, (bounds, prefixes) in PEERS.items():
        cluster = CLUSTERS / name
        print(f"GPT-2 medium, batch 32 x 1024, fp32, Adam, 1F1B on {name}")
        start = time.perf_counter()
        ours = hetcc.compile(model, cluster, example_kwargs=batch, schedule="1f1b")
        took = time.perf_counter() - start
        pure = hetcc.compile(model, cluster, example_kwargs=batch, replicate=False, schedule="1f1b")
        start = time.perf_counter()
        auto = hetcc.compile(model, cluster, example_kwargs=batch, schedule="auto")
        auto_took = time.perf_counter() - start
        at8 = hetcc.compile(model, cluster, example_kwargs=batch, microbatches=8, schedule="1f1b")
        peer_s = simulate(at8.problem, bounds, _groups(at8.problem, prefixes)).step_time_s
        print(_plan_line("hetcc", ours.plan) + f"   (compile {took:.0f} s)")
        print(_plan_line("hetcc, pure pipeline", pure.plan))
        print(
            _plan_line(f"hetcc, schedule auto: {auto.plan.schedule}", auto.plan)
            + f"   (compile {auto_took:.0f} s)"
        )
        print(
            f"  schedule auto vs the best 1F1B pure pipeline: {pure.plan.step_time_s / auto.plan.step_time_s:.2f}x "
            f"({1 - auto.plan.step_time_s / pure.plan.step_time_s:.0%} faster); bound {auto.plan.lower_bound_s * 1e3:.1f} ms"
        )
        print(
            f"  {'Metis-style peer plan':<28} M=8   simulated {peer_s * 1e3:8.1f} ms   {prefixes} cuts {bounds}"
        )
        print(
            f"  hetcc vs peer: {peer_s / ours.plan.step_time_s:.2f}x; vs its best pure pipeline: "
            f"{pure.plan.step_time_s / ours.plan.step_time_s:.2f}x ({1 - ours.plan.step_time_s / pure.plan.step_time_s:.0%} faster)"
        )
        print(_interleaved_line(ours.problem))
        tried = ", ".join(f"{m}: {s * 1e3:.0f}" for m, s in ours.plan.microbatch_search)
        print(f"  microbatch search (M: simulated ms): {tried}\n")


def opt_three_nodes() -> None:
    """The 24-layer OPT of the schedules issue (hidden 2048, batch 16 x 1024, fp32, Adam) on the three-node
    H100 / V100 / MI250X cluster, a case the tests do not use: 1F1B against schedule="auto"."""
    model, batch = opt_1_3b(batch=16, seq=1024)
    cluster = CLUSTERS / "three_nodes_h100_v100_mi250x.yaml"
    print("OPT, 24 layers, hidden 2048, batch 16 x 1024, fp32, Adam on three_nodes_h100_v100_mi250x.yaml")
    for schedule in ("1f1b", "auto"):
        start = time.perf_counter()
        compiled = hetcc.compile(model, cluster, example_kwargs=batch, schedule=schedule)
        took, plan = time.perf_counter() - start, compiled.plan
        print(_plan_line(f"hetcc, schedule {schedule}", plan) + f"   (compile {took:.0f} s)")
        print(f"  {'':<28} bound {plan.lower_bound_s * 1e3:.1f} ms, {plan.gap:.1%} above it; "
              f"warm-ups {[s.warmup for s in plan.stages]}")  # fmt: skip
    print(_interleaved_line(compiled.problem))
    print()


def llama_70b_run(schedule: str) -> None:
    model, batch = llama_70b(batch=64, seq=4096)
    cluster = CLUSTERS / "llama70b_64gpus.yaml"
    print(f"Llama-2-70B shape, batch 64 x 4096, bf16-mixed, Adam, schedule {schedule} on 32 H100 + 16 MI250X "
          "+ 16 A100-40GB")  # fmt: skip
    start = time.perf_counter()
    compiled = hetcc.compile(model, cluster, example_kwargs=batch, precision="bf16-mixed", schedule=schedule)
    took = time.perf_counter() - start
    plan = compiled.plan
    used = sum(len(s.devices) for s in plan.stages)
    print(_plan_line("hetcc", plan) + f"   (compile {took:.0f} s)")
    print(
        f"  {used} of 64 devices, {len(plan.stages)} stages, {sum(s.recompute for s in plan.stages)} recomputing; "
        f"simulated {plan.step_time_s:.2f} s, bound {plan.lower_bound_s:.2f} s, gap {plan.gap:.0%}"
    )
    start = time.perf_counter()
    solve(compiled.problem, rerank=6)
    print(
        f"  solve time for its {len(compiled.problem.blocks)} blocks x 64 devices: {time.perf_counter() - start:.2f} s\n"
    )


def solver_time() -> None:
    from solver import synthetic_problem

    problem = synthetic_problem(96, 64)
    problem.replicate = problem.recompute = True
    start = time.perf_counter()
    found = solve(problem, rerank=6)
    print(
        f"synthetic 96 blocks x 64 devices, replicas + recompute: solve {time.perf_counter() - start:.2f} s, "
        f"{len(found.stages)} stages, simulated {found.simulated_s:.3f} s, exact={found.exact}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-llama", action="store_true", help="leave out the 80-layer Llama plan")
    parser.add_argument("--llama-schedule", default="1f1b", help="the Llama plan's schedule (e.g. auto)")
    args = parser.parse_args()
    gpt2_clusters()
    opt_three_nodes()
    if not args.skip_llama:
        llama_70b_run(args.llama_schedule)
    solver_time()


if __name__ == "__main__":
    main()
