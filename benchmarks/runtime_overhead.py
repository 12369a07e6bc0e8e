"""Step time of hetcc's runtime vs torch.distributed.pipelining on the same split, and what hetcc's data
path adds.

Two ranks on gloo (CPU), same MLP, same schedule and microbatch count; each rank runs every runtime in
one process group, so startup costs are excluded. Prints per-step times and the ratios: hetcc against
pipelining (aim: <= 1.10x), and hetcc reading each step's batch through ``hetcc.train.data`` (a shuffled
map-style dataset, this rank's microbatches and inputs only) against the same steps on the same batches
split before the clock starts (aim: <= 1.05x).

    python benchmarks/runtime_overhead.py --schedule 1f1b --microbatches 4 --steps 30
    python benchmarks/runtime_overhead.py --schedule interleaved-1f1b --chunks 2   # 4 stages, 2 per rank
    python benchmarks/runtime_overhead.py --schedule zbv   # 4 stages in a V: rank 0 runs 0 and 3
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from hetcc.passes.comm import split_stages
from hetcc.runtime.contract import PipelineMeta
from hetcc.runtime.executor import StageExecutor, run_chunks
from hetcc.runtime.groups import Links
from hetcc.runtime.interop import pipelining_schedule
from hetcc.runtime.layout import RankLayout
from hetcc.runtime.placement import interleaved_ranks, ranks_for, zbv_ranks
from hetcc.runtime.store import load_stages, save_stages
from hetcc.solver.schedules import INTERLEAVED, ZBV
from hetcc.train.data import RankData, RankInputs


def build_mlp(width: int, depth: int) -> torch.nn.Sequential:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def split(width: int, depth: int, microbatch: int, num_stages: int, directory: str) -> None:
    """The MLP in ``num_stages`` stages of equal layer counts (2 ranks: one stage each, or ``--chunks``)."""
    torch.manual_seed(0)
    model = build_mlp(width, depth)
    gm = torch.export.export(model, (torch.randn(microbatch, width),), strict=False).module()
    compute = [n for n in gm.graph.nodes if n.op == "call_function"]
    stage_of = {n.name: i * num_stages // len(compute) for i, n in enumerate(compute)}
    save_stages(split_stages(gm, stage_of, num_stages), directory)


def hetcc_step(stages, rank, x, y, args, data_path: bool = False):
    """One training step of hetcc's executor and an SGD step on this rank, as a closure. Each step takes
    the next batch of a shuffled dataset of ``x, y`` rows: drawn through ``hetcc.train.data`` at the step
    (``data_path``: indices, this rank's items fetched and collated, checked), or split beforehand."""
    meta = PipelineMeta(len(stages), args.schedule, args.microbatches, placement=placement_for(args))
    layout = RankLayout.from_meta(meta)
    peers = [s.peers for s in stages]
    links = Links(["cpu", "cpu"], [], 60.0, channels=layout.channels(args.schedule, peers))
    executors = [StageExecutor(stages[k], links, args.microbatches, F.mse_loss, layout=layout)
                 for k in layout.ranks[rank].stages]  # fmt: skip
    optimizer = torch.optim.SGD([p for executor in executors for p in executor.params], lr=1e-3)
    actions = layout.actions(args.schedule, rank)
    name, rows = stages[0].inputs[0], x.shape[0] // args.microbatches
    first, last = stages[0].index in layout.ranks[rank].stages, stages[-1].index in layout.ranks[rank].stages
    needs = RankInputs(stages[0].inputs if first else (), args.microbatches, rows, tuple(range(args.microbatches)),
                       dict(stages[0].input_shapes) if first else {}, model_inputs=(name,), target=last)  # fmt: skip
    batches = RankData(torch.utils.data.TensorDataset(x.repeat(4, 1), y.repeat(4, 1)), needs)
    if not data_path:  # the same batches, split before the clock starts
        batches = itertools.cycle(
            [next(batches) for _ in range(4 * (args.warmup + args.steps * args.rounds))]
        )

    def step():
        batch = next(batches)
        run_chunks(executors, batch.inputs, batch.targets, actions)
        optimizer.step()

    return step


def pipelining_step(stages, rank, x, y, args):
    """One training step of torch.distributed.pipelining on this rank, as a closure."""
    schedule = pipelining_schedule(stages, rank, args.microbatches, args.schedule, F.mse_loss, ranks=2)
    held = schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]
    optimizer = torch.optim.SGD([p for stage in held for p in stage.submod.parameters()], lr=1e-3)
    indices = [stage.stage_index for stage in held]  # under ZB-V rank 0 holds the first and the last
    inputs = (x,) if 0 in indices else ()
    targets = {"target": y, "losses": []} if len(stages) - 1 in indices else {}

    def step():
        optimizer.zero_grad()
        schedule.step(*inputs, **targets)
        optimizer.step()

    return step


def stage_count(args) -> int:
    return 2 * args.chunks if args.schedule == INTERLEAVED else 4 if args.schedule == ZBV else 2


def placement_for(args):
    """Two ranks: one stage each, ``--chunks`` stages each under interleaved 1F1B, or a V of two each."""
    if args.schedule == ZBV:
        return zbv_ranks(2)
    return interleaved_ranks(2, args.chunks) if args.schedule == INTERLEAVED else ranks_for([1, 1])


def timed(step, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def worker(rank: int, port: int, directory: str, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.manual_seed(1)
    x = torch.randn(args.microbatch * args.microbatches, args.width)
    y = torch.randn_like(x)
    runners = {
        "hetcc": hetcc_step(load_stages(directory), rank, x, y, args),
        "pipelining": pipelining_step(load_stages(directory), rank, x, y, args),
        "hetcc+data": hetcc_step(load_stages(directory), rank, x, y, args, data_path=True),
    }
    results = {name: [] for name in runners}
    for step in runners.values():  # warm up both
        timed(step, args.warmup)
    for _ in range(args.rounds):  # alternate, so load on the machine hits both alike
        for name, step in runners.items():
            results[name] += timed(step, args.steps)
    if rank == 1:
        med = {k: statistics.median(v) for k, v in results.items()}
        print(
            f"schedule {args.schedule}, {stage_count(args)} stages, microbatches {args.microbatches}, "
            f"MLP {args.depth}x{args.width}, "
            f"microbatch {args.microbatch}, 2 ranks gloo, median of {args.rounds}x{args.steps} steps"
        )
        for name, seconds in med.items():
            print(f"  {name:<11} {seconds * 1e3:8.2f} ms/step")
        print(f"  ratio hetcc / pipelining: {med['hetcc'] / med['pipelining']:.3f}x")
        print(f"  ratio hetcc+data / hetcc (the data path's cost): {med['hetcc+data'] / med['hetcc']:.3f}x")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "zb-h1", INTERLEAVED, ZBV))
    parser.add_argument("--chunks", type=int, default=2, help="stages per rank under interleaved-1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per runtime")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        split(args.width, args.depth, args.microbatch, stage_count(args), directory)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.start_processes(worker, args=(port, directory, args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
