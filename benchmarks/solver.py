"""Plan quality and solve time of the partition solver on synthetic transformer chains.

For chains of 24..192 blocks over 8..64 devices of six types (spread over nodes of four, linked by
25 Gb/s Ethernet between nodes, one device type per node), print the solve time, the predicted step time, its speedup over the
uniform / parameters / flops baselines (inf when a baseline overflows memory) and the gap to the
lower bound. Run: ``python benchmarks/solver.py [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from hetcc.solver.baselines import baselines
from hetcc.solver.problem import PartitionProblem, ProblemDevice
from hetcc.solver.solve import solve

# (type, relative speed on matmul-heavy blocks, on memory-bound blocks, usable GiB)
DEVICE_TYPES = [
    ("H100", 3.0, 2.4, 76.0),
    ("A100-80GB", 1.0, 1.0, 76.0),
    ("A100-40GB", 1.0, 1.0, 36.0),
    ("MI250X", 1.2, 1.3, 60.0),
    ("RTX4090", 0.55, 0.5, 22.0),
    ("L4", 0.2, 0.15, 22.0),
]
GIB = 2.0**30


def synthetic_problem(
    num_blocks: int, num_devices: int, seed: int = 0, microbatches: int = 16
) -> PartitionProblem:
    """A GPT-like chain (embedding, layers alternating attention/MLP-sized, head) on a mixed cluster."""
    rng = random.Random(seed)
    kinds = ["embed"] + [("attn", "mlp")[i % 2] for i in range(num_blocks - 2)] + ["head"]
    base_s = {"embed": 0.004, "attn": 0.010, "mlp": 0.014, "head": 0.012}
    state = {"embed": 6.0, "attn": 2.0, "mlp": 4.0, "head": 6.0}  # GiB of params + grads + Adam state
    devices, fwd, bwd = [], {}, {}
    for d in range(num_devices):
        name, _, _, mem = DEVICE_TYPES[(d // 4) % len(DEVICE_TYPES)]  # nodes of four identical cards
        devices.append(ProblemDevice(f"gpu{d}", name, mem * GIB, f"node{d // 4}"))
    for name, matmul_speed, memory_speed, _ in DEVICE_TYPES:
        speed = {
            "embed": memory_speed,
            "attn": (matmul_speed + memory_speed) / 2,
            "mlp": matmul_speed,
            "head": matmul_speed,
        }
        fwd[name] = [base_s[k] * rng.uniform(0.9, 1.1) / speed[k] for k in kinds]
        bwd[name] = [2 * f for f in fwd[name]]
    bandwidth = [[_bandwidth(a, b) for b in devices] for a in devices]
    latency = [[0.0 if a is b else (5e-6 if a.node == b.node else 3e-5) for b in devices] for a in devices]
    return PartitionProblem(
        blocks=[f"{k}{i}" for i, k in enumerate(kinds)],
        fwd_s=fwd,
        bwd_s=bwd,
        state_bytes=[state[k] * GIB * 48 / num_blocks for k in kinds],
        act_bytes=[0.25 * GIB * 48 / num_blocks for _ in kinds],
        cut_bytes=[16e6 * rng.choice([1, 1, 1, 2]) for _ in kinds[:-1]],
        devices=devices,
        bandwidth_bps=bandwidth,
        latency_s=latency,
        microbatches=microbatches,
    )


def _bandwidth(a: ProblemDevice, b: ProblemDevice) -> float:
    if a is b:
        return math.inf
    return 200e9 if a.node == b.node else 25e9 / 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    args = parser.parse_args()
    sizes = [(24, 8), (48, 16)] if args.quick else [(n, d) for n in (24, 48, 96, 192) for d in (8, 16, 64)]
    print(
        f"{'blocks':>6} {'devs':>4} {'solve_s':>8} {'step_s':>8} {'K':>3} {'exact':>5} {'seqs':>5} "
        f"{'vs_uniform':>10} {'vs_params':>9} {'vs_flops':>8} {'gap':>6}"
    )
    for num_blocks, num_devices in sizes:
        problem = synthetic_problem(num_blocks, num_devices)
        start = time.perf_counter()
        plan = solve(problem)
        elapsed = time.perf_counter() - start
        ratios = {name: base.step_time_s / plan.step_time_s for name, base in baselines(problem).items()}
        print(
            f"{num_blocks:>6} {num_devices:>4} {elapsed:>8.3f} {plan.step_time_s:>8.3f} {len(plan.stages):>3} "
            f"{plan.exact!s:>5} {plan.orders_searched:>5} {ratios['uniform']:>10.2f} {ratios['parameters']:>9.2f} "
            f"{ratios['flops']:>8.2f} {plan.gap:>6.2f}"
        )


if __name__ == "__main__":
    main()
