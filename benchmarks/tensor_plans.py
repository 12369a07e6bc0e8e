"""Plans with tensor parallelism: GPT-2 medium (batch 32 x 1024, fp32, Adam) on the 4x A100 + 4x T4
cluster, and a Llama-2-70B shape (batch 64 x 4096, bf16-mixed, Adam) on 64 GPUs (32 H100, 16 MI250X,
16 A100-40GB in nodes of eight), each planned with ``tensor_parallel=False`` and ``"auto"``, beside the
Megatron-style baseline (tensor degree = GPUs per node, equal pipeline stages over nodes, data parallel
over the rest, 1F1B), all simulated by the same model; microbatches chosen by the search, the schedule
by simulation (``schedule="auto"``: 1f1b or zb-h1; ``--schedule`` pins one).

    python benchmarks/tensor_plans.py [--skip-llama | --only-llama] [--schedule 1f1b]

Prints per case: the simulated step, schedule and lower bound of each plan, its layout (each stage as replicas x
tensor degree, device type and [blocks]; "n * (...)" for n like stages in a row), the compile time with
its tensor_cost (pricing the degrees), partition and shard steps, and the plan's tensor notes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hetcc  # noqa: E402
from examples.models import gpt2_medium, llama_70b  # noqa: E402
from hetcc.solver.tensor import megatron_baseline  # noqa: E402

CLUSTERS = ROOT / "examples" / "clusters"


def _layout(plan) -> str:
    """Each stage as replicas x degree type [blocks], a run of like stages once with its count."""
    runs: list[list] = []
    for s in plan.stages:
        label = f"{len(s.devices) // s.tensor}x{s.tensor} {s.device_type} [{len(s.blocks)}]"
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    return " -> ".join(label if n == 1 else f"{n} * ({label})" for label, n in runs)


def _megatron_layout(problem) -> str:
    found = megatron_baseline(problem)
    if found is None:
        return "does not fit"
    solution, _, device_map = found

    def replica(unit: int) -> str:
        return f"{problem.devices[device_map[unit][0]].type}/tp{len(device_map[unit])}"

    return " -> ".join(
        f"{len(s.group)} replicas ({', '.join(map(replica, s.group))}) [{s.blocks[1] - s.blocks[0]}]"
        for s in solution.stages
    )


def run(title: str, model, batch: dict, cluster: Path, **options) -> None:
    print(title)
    plans = {}
    for tp in (False, "auto"):
        start = time.perf_counter()
        compiled = hetcc.compile(model, cluster, example_kwargs=batch, tensor_parallel=tp, **options)
        took = time.perf_counter() - start
        plan, steps_ms = compiled.plan, compiled.analysis.timings_ms
        plans[tp] = compiled
        steps = ("tensor_cost", "partition", "shard") if tp else ("partition",)
        priced = "".join(f", {name} {steps_ms[name] / 1e3:.1f} s" for name in steps if name in steps_ms)
        print(f"  tensor_parallel={tp!s:<6} M={plan.microbatches:<3} {plan.schedule:<5} simulated {plan.step_time_s * 1e3:9.1f} ms, "
              f"bound {plan.lower_bound_s * 1e3:9.1f} ms   (compile {took:.0f} s{priced})")  # fmt: skip
        print(f"    {_layout(plan)}")
    auto = plans["auto"].plan
    megatron = auto.baselines.get("megatron")
    off = plans[False].plan.step_time_s
    if megatron is not None:
        print(f"  {'megatron':<22} M={auto.microbatches:<3} simulated {megatron * 1e3:9.1f} ms")
        print(f"    {_megatron_layout(plans['auto'].problem)}")
        print(
            f"  auto vs off: {off / auto.step_time_s:.2f}x; auto vs megatron: {megatron / auto.step_time_s:.2f}x"
        )
    else:
        print("  megatron: no layout fits (tensor degree = GPUs per node, equal stages over the nodes)")
        print(f"  auto vs off: {off / auto.step_time_s:.2f}x")
    for note in auto.notes:
        if note.startswith(("tensor parallel", "schedule:")) or "tensor-parallel stages" in note:
            print(f"  note: {note}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--skip-llama", action="store_true", help="leave out the 80-layer Llama plans")
    which.add_argument("--only-llama", action="store_true", help="only the 80-layer Llama plans")
    parser.add_argument(
        "--schedule", default="auto", choices=["auto", "1f1b", "zb-h1"], help="pipeline schedule"
    )
    args = parser.parse_args()
    if not args.only_llama:
        model, batch = gpt2_medium(batch=32, seq=1024)
        run("GPT-2 medium, batch 32 x 1024, fp32, Adam on 4x A100-80GB + 4x T4", model, batch,
            CLUSTERS / "mixed_a100_t4.yaml", schedule=args.schedule)  # fmt: skip
    if not args.skip_llama:
        model, batch = llama_70b(batch=64, seq=4096)
        run("Llama-2-70B shape, batch 64 x 4096, bf16-mixed, Adam on 32 H100 + 16 MI250X + 16 A100-40GB",
            model, batch, CLUSTERS / "llama70b_64gpus.yaml", precision="bf16-mixed", schedule=args.schedule)  # fmt: skip


if __name__ == "__main__":
    main()
