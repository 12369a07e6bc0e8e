"""Cost-model fidelity: predicted vs measured forward+backward time per stage, on calibrated CPUs.

1. ``hetcc.calibrate("cpu")`` measures this host with one thread (what each local rank uses).
2. GPT-2 small (real weights) is compiled for 4 calibrated ``cpu`` devices.
3. Each stage's compute module runs forward then backward on one microbatch, one stage at a time in
   this process (no communication, no contention), median of several repeats.
Prints predicted and measured ms per stage and the relative error.

Usage: python benchmarks/cost_fidelity.py [--layers 12] [--batch 8] [--seq 128] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hetcc  # noqa: E402
from hetcc.passes.codegen import compute_module  # noqa: E402
from hetcc.runtime.precision import forward_context  # noqa: E402


def _cluster(calibration: hetcc.Calibration) -> hetcc.Cluster:
    spec = {
        "nodes": [{"name": "host", "intra_link": {"kind": "loopback", "bandwidth": "5 GB/s", "latency": "30 us"},
                   "devices": [{"type": "cpu", "count": 4, "memory": "8 GiB"}]}],
    }  # fmt: skip
    return hetcc.apply_to_cluster(hetcc.Cluster.from_spec(spec), [calibration])


def _time_stages(stages, inputs: dict, repeats: int) -> list[list[float]]:
    """Per stage, ``repeats`` samples of forward + backward seconds on one microbatch."""
    modules = [compute_module(stage) for stage in stages]
    samples: list[list[float]] = [[] for _ in stages]
    for _ in range(repeats + 1):  # the first round warms up
        elapsed, _ = one_pass(stages, modules, inputs)
        for k, seconds in enumerate(elapsed):
            samples[k].append(seconds)
    return [s[1:] for s in samples]


def one_pass(stages, modules, inputs: dict, device: torch.device | None = None, precision: str = "fp32"):
    """Forward through every stage's compute module, then backward, one stage at a time in this process
    (no communication) under ``precision``'s autocast: (per-stage seconds, the model's loss)."""
    device = device or torch.device("cpu")
    values, received, outputs, elapsed = {}, [], [], []
    for stage, module in zip(stages, modules):
        args = [values[e.tag].detach().requires_grad_(e.requires_grad) for e in stage.recvs]
        sync(device)
        start = time.perf_counter()
        with forward_context(precision, device):
            out = module(*(inputs[name] for name in stage.inputs), *args)
        sync(device)
        elapsed.append(time.perf_counter() - start)
        values.update({e.tag: o for e, o in zip(stage.sends, out)})
        received.append(dict(zip((e.tag for e in stage.recvs), args)))
        outputs.append(out)
    loss = outputs[-1][0]  # the model's loss
    for k in reversed(range(len(stages))):
        sync(device)
        start = time.perf_counter()
        if k == len(stages) - 1:
            loss.backward()
        else:
            pairs = [
                (o, received[e.dst][e.tag].grad)
                for e, o in zip(stages[k].sends, outputs[k])
                if e.requires_grad
            ]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        sync(device)
        elapsed[k] += time.perf_counter() - start
    return elapsed, float(loss.detach())


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (timings of asynchronous GPU work need it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    calibration = hetcc.calibrate("cpu")
    print(calibration.describe())
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, attn_implementation="eager", resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip
    ids = torch.randint(0, 50257, (args.batch, args.seq))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    compiled = hetcc.compile(
        model, _cluster(calibration), example_kwargs=inputs, microbatches=args.microbatches
    )
    print(compiled.explain())
    size = args.batch // args.microbatches
    microbatch = {"input_ids": ids[:size], "labels": ids[:size], "use_cache": False}
    samples = _time_stages(compiled.pipeline.stages, microbatch, args.repeats)
    print(f"\n{'stage':<6} {'blocks':<40} {'predicted ms':>12} {'measured ms':>12} {'error':>7}")
    worst = 0.0
    for stage, times in zip(compiled.plan.stages, samples):
        measured = statistics.median(times)
        error = stage.compute_s / measured - 1
        worst = max(worst, abs(error))
        blocks = stage.blocks[0] if len(stage.blocks) == 1 else f"{stage.blocks[0]} .. {stage.blocks[-1]}"
        print(
            f"{stage.index:<6} {blocks:<40} {stage.compute_s * 1e3:>12.2f} {measured * 1e3:>12.2f} {error:>+7.1%}"
        )
    print(f"worst per-stage error: {worst:.1%}")


if __name__ == "__main__":
    main()
