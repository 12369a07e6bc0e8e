"""One GPU: hetcc's predicted stage times against measured ones, and its stages against eager PyTorch.

For a GPT-2 (12 layers, hidden 768 by default) compiled for four devices of this GPU's type, each
stage's compute module (its fused Triton kernels included) runs forward then backward on one
microbatch on this GPU, one stage at a time (no communication), median of several repeats; the
stages are chained in one process so the loss can be checked against the eager model on the same
GPU. Run once with the type's preset and once calibrated on this GPU (``hetcc.calibrate``), in fp32
and in bf16-mixed (autocast, as the runtime runs it).

    python benchmarks/gpu_stages.py                      # on a CUDA/ROCm machine
    python benchmarks/gpu_stages.py --layers 4 --seq 256 --device cpu   # a dry run of the script
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

from cost_fidelity import one_pass, sync  # noqa: E402  (benchmarks/ is on sys.path)

import hetcc  # noqa: E402
from hetcc.hardware.measure import preset_for_device_name  # noqa: E402
from hetcc.passes.codegen import compute_module  # noqa: E402
from hetcc.plan import PRECISIONS  # noqa: E402
from hetcc.runtime.precision import forward_context  # noqa: E402


def _cluster(type_name: str, calibrations=()) -> hetcc.Cluster:
    spec = {
        "nodes": [{"name": "node0", "intra_link": {"kind": "nvlink", "bandwidth": "450 GB/s", "latency": "3 us"},
                   "devices": [{"type": type_name, "count": 4}]}],
    }  # fmt: skip
    return hetcc.apply_to_cluster(hetcc.Cluster.from_spec(spec), list(calibrations))


def _eager(model, inputs: dict, device: torch.device, precision: str, repeats: int) -> tuple[float, float]:
    """(loss, median seconds of forward + backward) of the eager model on one microbatch."""
    samples, loss = [], None
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        with forward_context(precision, device):
            out = model(**inputs).loss
        out.backward()
        sync(device)
        samples.append(time.perf_counter() - start)
        loss = float(out.detach()) if loss is None else loss
    model.zero_grad(set_to_none=True)
    return loss, statistics.median(samples[1:])


def run(args, model, ids, device, type_name: str, calibrations, precision: str, fuse: bool) -> None:
    cpu_inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    start = time.perf_counter()
    with hetcc.config.patch(fuse="all" if fuse else "off"):
        compiled = hetcc.compile(
            model, _cluster(type_name, calibrations), example_kwargs=cpu_inputs,
            microbatches=args.microbatches, precision=precision, replicate=False, schedule="1f1b",
        )  # fmt: skip
    compile_s = time.perf_counter() - start
    size = args.batch // args.microbatches
    microbatch = {"input_ids": ids[:size].to(device), "labels": ids[:size].to(device), "use_cache": False}
    stages = compiled.pipeline.stages
    modules = [compute_module(stage, device).to(device) for stage in stages]
    samples = [[] for _ in stages]
    losses = []
    for _ in range(args.repeats + 1):  # the first round warms up (and compiles the Triton kernels)
        elapsed, loss = one_pass(stages, modules, microbatch, device, precision)
        losses.append(loss)
        for k, seconds in enumerate(elapsed):
            samples[k].append(seconds)
    eager, eager_s = _eager(model.to(device), microbatch, device, precision, args.repeats)
    model.to("cpu")
    label = f"{type_name} {'calibrated' if calibrations else 'preset'}, {precision}, fusion {'on' if fuse else 'off'}"
    print(f"\n## {label}: compile {compile_s:.1f} s; loss {losses[0]:.6f} (eager {eager:.6f})")
    print(f"{'stage':<6} {'blocks':<36} {'predicted ms':>12} {'measured ms':>12} {'error':>7}")
    errors = []
    for stage, times in zip(compiled.plan.stages, samples):
        measured = statistics.median(times[1:])
        errors.append(stage.compute_s / measured - 1)
        blocks = stage.blocks[0] if len(stage.blocks) == 1 else f"{stage.blocks[0]} .. {stage.blocks[-1]}"
        print(
            f"{stage.index:<6} {blocks:<36} {stage.compute_s * 1e3:>12.3f} {measured * 1e3:>12.3f} "
            f"{errors[-1]:>+7.1%}"
        )
    total_pred = sum(s.compute_s for s in compiled.plan.stages)
    total_meas = sum(statistics.median(t[1:]) for t in samples)
    print(
        f"sum of stages: predicted {total_pred * 1e3:.3f} ms, measured {total_meas * 1e3:.3f} ms "
        f"({total_pred / total_meas - 1:+.1%}); worst stage {max(errors, key=abs):+.1%}; "
        f"loss vs eager {abs(losses[0] - eager) / abs(eager):.2e} relative"
    )
    print(
        f"eager model, forward+backward of one microbatch: {eager_s * 1e3:.3f} ms (stages: {total_meas / eager_s:.2f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"], choices=list(PRECISIONS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--type", help="device type to plan for (default: this GPU's preset)")
    parser.add_argument("--no-calibrate", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_stages: no CUDA/ROCm device is available; nothing to measure.")
        return 0
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        type_name = args.type or preset_for_device_name(
            name, torch.cuda.get_device_properties(device).total_memory
        )
        print(f"# {name}; torch {torch.__version__}; planned as {type_name}")
    else:
        type_name = args.type or "A100-80GB"
        print(f"# dry run on the CPU, planned as {type_name}")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, n_positions=max(1024, args.seq))  # fmt: skip
    model = GPT2LMHeadModel(config)
    ids = torch.randint(
        0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)
    )
    calibrations = []
    if not args.no_calibrate and device.type == "cuda":
        start = time.perf_counter()
        dtypes = ("fp32", "bf16") if any(p != "fp32" for p in args.precisions) else ("fp32",)
        calibration = hetcc.calibrate(str(device), dtypes=dtypes, type_name=type_name)
        print(f"calibrated in {time.perf_counter() - start:.1f} s:\n{calibration.describe()}")
        calibrations.append(calibration)
    runs = [(precision, [], fuse) for precision in args.precisions for fuse in (True, False)]
    runs += [(precision, calibrations, True) for precision in args.precisions if calibrations]
    for precision, cal, fuse in runs:
        try:
            run(args, model, ids, device, type_name, cal, precision, fuse)
        except Exception as error:  # a report, not a test: say what failed and go on
            print(f"\n## {type_name} {precision}: FAILED {type(error).__name__}: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
