"""ZB-H1, ZB-H2, interleaved 1F1B and ZB-V against 1F1B, measured on CPU ranks and simulated.

A GPT-2 (random weights) is planned with 1F1B for two or more CPU devices calibrated on this machine,
then run through ``hetcc.run_local`` (one process per rank, gloo) under 1F1B, ZB-H1 and ZB-H2 (each
schedule's own warm-up and deferral) on that same split, and planned with ``schedule="interleaved-1f1b"``
(its own cuts, v stages on each of the same devices) and ``schedule="zbv"`` (its own cuts, two stages
per device in a V) and run too; the runs alternate, and each run's
step is the median after its warm-up steps. Prints each schedule's measured ratio to 1F1B (one run)
and each schedule's measured step against what the simulator predicts for its plan. The devices are
calibrated on this machine, and their link is measured between two gloo processes: a small message's
one-way time as its latency, and what a large one adds per byte as its bandwidth.

    python benchmarks/schedules_measured.py                      # 2 ranks (this machine has 2 cores)
    python benchmarks/schedules_measured.py --ranks 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hetcc  # noqa: E402
from hetcc.solver.simulate import simulate  # noqa: E402
from hetcc.train.local import run_local  # noqa: E402

SCHEDULES = ("1f1b", "zb-h1", "zb-h2")  # run on the 1F1B plan's split
OWN_SPLIT = ("interleaved-1f1b", "zbv")  # each planned with its own cuts


def _cluster(ranks: int, calibration, link: dict[str, str]) -> hetcc.Cluster:
    spec = {"nodes": [{"name": "host", "intra_link": {"kind": "loopback", **link},
                       "devices": [{"type": "cpu", "count": ranks}]}]}  # fmt: skip
    return hetcc.apply_to_cluster(hetcc.Cluster.from_spec(spec), [calibration])


def _ping(rank: int, port: int, sizes: list[int], rounds: int, out) -> None:
    """Two gloo processes pass a tensor of each size back and forth; rank 0 puts each size's median
    one-way seconds in ``out``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for size in sizes:
        buffer, times = torch.zeros(size // 4), []
        for _ in range(rounds):
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            times.append((time.perf_counter() - start) / 2)
        if rank == 0:
            out[size] = statistics.median(times)
    dist.destroy_process_group()


def measured_link(small: int = 4096, large: int = 1 << 20, rounds: int = 50) -> dict[str, str]:
    """The loopback link between two local gloo processes as a cluster file's link: its latency is a
    small message's one-way time, its bandwidth what a large one adds per byte."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.Manager().dict()
    mp.start_processes(_ping, args=(port, [small, large], rounds, out), nprocs=2, start_method="spawn")
    latency = out[small]
    bandwidth = (large - small) / max(out[large] - latency, 1e-9)
    return {"bandwidth": f"{bandwidth / 1e9:.4f} GB/s", "latency": f"{latency * 1e6:.1f} us"}


def _model(layers: int, hidden: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=4, vocab_size=512, n_positions=256, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def _step_s(result, warmup: int) -> float:
    times = [record["step_s"] for record in result.records][warmup:]
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each schedule, interleaved")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    calibration = hetcc.calibrate("cpu")
    model = _model(args.layers, args.hidden)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    link = measured_link()
    print(
        f"loopback link measured between two gloo processes: {link['bandwidth']}, {link['latency']} a message"
    )
    cluster = _cluster(args.ranks, calibration, link)
    compiled = hetcc.compile(model, cluster, example_kwargs=inputs, microbatches=args.microbatches,
                             schedule="1f1b", replicate=False)  # fmt: skip
    own = {
        name: hetcc.compile(
            model, cluster, example_kwargs=inputs, microbatches=args.microbatches, schedule=name
        )
        for name in OWN_SPLIT
    }
    plan, problem, solution = compiled.plan, compiled.problem, compiled.solution
    print(plan.explain(), *(c.plan.explain() for c in own.values()), sep="\n\n")
    simulated = {
        name: simulate(replace(problem, schedule=name), solution.boundaries, solution.groups, solution.recompute,
                       events=False).step_time_s
        for name in SCHEDULES
    }  # fmt: skip
    simulated.update({name: c.plan.step_time_s for name, c in own.items()})
    every = (*SCHEDULES, *OWN_SPLIT)
    measured: dict[str, list[float]] = {name: [] for name in every}
    for _ in range(args.rounds):
        for name in every:
            pipeline, schedule = (own[name].pipeline, None) if name in own else (compiled.pipeline, name)
            result = run_local(pipeline, inputs, steps=args.steps, schedule=schedule,
                               optimizer={"name": "sgd", "lr": 1e-3})  # fmt: skip
            measured[name].append(_step_s(result, warmup=2))
    step = {name: min(times) for name, times in measured.items()}
    print(
        f"\n{args.ranks} CPU ranks, {len(plan.stages)} stages, M = {args.microbatches}, the 1F1B plan's split "
        f"({', '.join(f'{name}: {len(c.plan.stages)} stages' for name, c in own.items())}, their own):"
    )
    for name in every:
        error = step[name] / simulated[name] - 1
        print(f"  {name:16s} measured {step[name] * 1e3:8.2f} ms (runs: "
              f"{', '.join(f'{t * 1e3:.2f}' for t in measured[name])}), simulated {simulated[name] * 1e3:8.2f} ms "
              f"({error:+.1%})")  # fmt: skip
    for name in every[1:]:
        print(
            f"  {name} / 1f1b: measured {step[name] / step['1f1b']:.3f}x, "
            f"simulated {simulated[name] / simulated['1f1b']:.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
