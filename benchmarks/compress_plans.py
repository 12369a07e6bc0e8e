"""Plans with codecs on slow links: GPT-2 medium (batch 32 x 1024, fp32, Adam, 1F1B) on the 4x A100 +
4x T4 cluster with its inter-node Ethernet at 1 Gb/s and at 25 Gb/s, and on two nodes of 4x T4 joined by
1 Gb/s, planned with ``compress="off"`` and ``compress="auto"`` (int8 activations / bf16 gradients at
most), microbatches chosen by the search.

    python benchmarks/compress_plans.py [--bandwidths 1,25]

Prints per bandwidth: both plans' simulated steps and their ratio, the layout, each cut's codecs and
bytes before and after, and the plan's compress notes (where a codec pays and where it does not).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hetcc  # noqa: E402
from examples.models import gpt2_medium  # noqa: E402

CLUSTER = Path(__file__).resolve().parents[1] / "examples/clusters/mixed_a100_t4.yaml"
TWO_T4_NODES = """
name: two-t4-nodes
memory_reserve: 0.1
nodes:
  - name: node0
    intra_link: {kind: pcie, bandwidth: 32 GB/s, latency: 5 us}
    devices: [{type: T4, count: 4, memory: 15 GiB}]
  - name: node1
    intra_link: {kind: pcie, bandwidth: 32 GB/s, latency: 5 us}
    devices: [{type: T4, count: 4, memory: 15 GiB}]
inter_node_link: {kind: ethernet, bandwidth: 1 Gb/s, latency: 20 us}
"""


def _layout(plan) -> str:
    return " -> ".join(f"{len(s.devices)}x {s.device_type} [{len(s.blocks)}]" for s in plan.stages)


def _cuts(plan) -> list[str]:
    lines = []
    for s in plan.stages[:-1]:
        act, grad, act_wire, grad_wire = (b / 2**20 for b in s.wire_bytes)
        lines.append(f"    cut {s.index} -> {s.index + 1} ({'/'.join(s.codecs)}): {act:.2f} + {grad:.2f} MiB -> "
                     f"{act_wire:.2f} + {grad_wire:.2f} MiB per microbatch")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidths", default="1,25", help="inter-node Gb/s, comma-separated")
    args = parser.parse_args()
    model, batch = gpt2_medium(batch=32, seq=1024)
    text = CLUSTER.read_text()
    cases = [(f"4x A100 + 4x T4, inter-node {b:g} Gb/s", text.replace("bandwidth: 25 Gb/s", f"bandwidth: {b:g} Gb/s"))
             for b in (float(b) for b in args.bandwidths.split(","))]  # fmt: skip
    cases.append(("two nodes of 4x T4, inter-node 1 Gb/s", TWO_T4_NODES))
    for label, cluster_text in cases:
        compare(model, batch, label, cluster_text)


def compare(model, batch, label: str, cluster_text: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        cluster = Path(folder) / "cluster.yaml"
        cluster.write_text(cluster_text)
        plans, seconds = {}, {}
        for compress in ("off", "auto"):
            started = time.perf_counter()
            plans[compress] = hetcc.compile(
                model, cluster, example_kwargs=batch, compress=compress, schedule="1f1b"
            ).plan
            seconds[compress] = time.perf_counter() - started
    off, auto = plans["off"], plans["auto"]
    print(f"GPT-2 medium, batch 32 x 1024, fp32, {label}")
    for name, plan in plans.items():
        print(f"  compress={name:<4} M={plan.microbatches:<3} simulated {plan.step_time_s * 1e3:9.1f} ms, "
              f"bound {plan.lower_bound_s * 1e3:.1f} ms, compile {seconds[name]:.0f} s: {_layout(plan)}")  # fmt: skip
    print(
        f"  off / auto: {off.step_time_s / auto.step_time_s:.2f}x; off / auto's bound (no plan, codecs or "
        f"not, beats it): {off.step_time_s / auto.lower_bound_s:.2f}x"
    )
    print("\n".join(_cuts(auto)))
    print("\n".join(f"    {n}" for n in auto.notes if n.startswith("compress")))


if __name__ == "__main__":
    main()
