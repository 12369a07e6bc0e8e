"""Does ``microbatches="auto"`` keep the count its own compile would? For each model and cluster: the
search's figure for every count against the plan that compiling at that count pinned makes (equal when
the search prices the graph that runs, fusion included), and auto's plan against the best pinned one.

Usage: python benchmarks/microbatch_agreement.py [--models gpt2_small gpt2_medium] [--batch 32 --seq 1024]
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

CLUSTERS = ("mixed_a100_t4", "mixed_nvidia_amd", "three_nodes_h100_v100_mi250x")


def _fused(compiled) -> int:
    return sum(1 for node in compiled.graph.graph.nodes if "fusion_group" in node.name)


def agreement(model_name: str, cluster: str, batch: int, seq: int) -> bool:
    model, inputs = getattr(models, model_name)(batch=batch, seq=seq)
    path = ROOT / "examples" / "clusters" / f"{cluster}.yaml"
    start = time.perf_counter()
    auto = hetcc.compile(model, path, example_kwargs=inputs)
    auto_s = time.perf_counter() - start
    tried = dict(auto.plan.microbatch_search)
    print(f"\n{model_name} batch {batch} x {seq} on {cluster}: auto chose M={auto.plan.microbatches} "
          f"({auto.plan.step_time_s * 1e3:.2f} ms, compiled in {auto_s:.1f} s)")  # fmt: skip
    print(f"{'M':>4} {'search ms':>10} {'pinned plan ms':>15} {'ratio':>8} {'fused nodes':>12}")
    pinned = {}
    for m in sorted(tried):
        if tried[m] == float("inf"):
            print(f"{m:>4} {'no fit':>10}")
            continue
        compiled = hetcc.compile(model, path, example_kwargs=inputs, microbatches=m)
        pinned[m] = compiled.plan.step_time_s
        ratio = tried[m] / pinned[m]
        print(f"{m:>4} {tried[m] * 1e3:>10.2f} {pinned[m] * 1e3:>15.2f} {ratio:>8.4f} {_fused(compiled):>12}")
    best = min(pinned.values())
    chosen = auto.plan.microbatches
    kept_equal = abs(tried[chosen] / auto.plan.step_time_s - 1) < 1e-9
    # A one-row microbatch traces to a slightly different graph (export specialises size 1): its search
    # figure is the symbolic trace's, and compile prices it again from its own trace if it is kept.
    wider = [abs(tried[m] / s - 1) for m, s in pinned.items() if batch // m > 1]
    print(
        f"auto / best pinned: {auto.plan.step_time_s / best:.6f}; search = plan for the kept M: {kept_equal}; "
        f"largest search / pinned deviation over counts of 2+ rows: {max(wider, default=0.0):.1e}"
    )
    return kept_equal and max(wider, default=0.0) < 1e-9 and auto.plan.step_time_s <= best * (1 + 1e-9)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["gpt2_small", "gpt2_medium"])
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    results = [agreement(m, c, args.batch, args.seq) for m in args.models for c in args.clusters]
    print(
        f"\n{sum(results)} of {len(results)} cases: auto no slower than the best pinned count, search = plan"
    )
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
