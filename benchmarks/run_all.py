"""``make bench``: every headline benchmark in one run, written to ``benchmarks/RESULTS.md``.

1. Plan quality: hetcc's plan vs the equal-split baselines (uniform, parameters, flops) and the lower
   bound, for 3 models x 3 clusters (models on the meta device: planning needs no weights).
2. Compile time: ``hetcc.compile`` of GPT-2 small, GPT-2 XL and a Llama-2-70B shape, as a ratio to a
   bare ``torch.export.export`` of the same model and inputs, both measured in this run.
3. Runtime overhead: hetcc's executor vs ``torch.distributed.pipelining`` on the same 2-stage split
   (``benchmarks/runtime_overhead.py``).
4. Cost-model fidelity: predicted vs measured per-stage time on calibrated CPU "devices"
   (``benchmarks/cost_fidelity.py``).

``--quick`` (what ``make bench`` runs on a 2-core machine, ~10 minutes) uses smaller plan-quality
models, fewer timing repeats and a 4-layer GPT-2 for fidelity; ``--full`` the larger ones. Either way
the file says which mode and machine produced it.

Usage: python benchmarks/run_all.py [--full] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import hetcc  # noqa: E402
from benchmarks.results_md import render  # noqa: E402
from examples import models  # noqa: E402

CLUSTERS = ROOT / "examples" / "clusters"
PLAN_CLUSTERS = ("mixed_a100_t4", "mixed_nvidia_amd", "datacenter64")
PLAN_MODELS = {
    "quick": {"gpt2_medium": {}, "gpt2_xl": {}, "llama_7b": {"batch": 16, "seq": 512}},
    "full": {"gpt2_xl": {}, "llama_7b": {}, "llama_70b": {}},
}
COMPILE_MODELS = {"GPT-2 small": "gpt2_small", "GPT-2 XL": "gpt2_xl", "Llama-2-70B shape": "llama_70b"}
MICROBATCHES = 16


def plan_quality(mode: str) -> list[dict]:
    rows = []
    for model_name, kwargs in PLAN_MODELS[mode].items():
        for cluster in PLAN_CLUSTERS:
            model, inputs = getattr(models, model_name)(**kwargs)
            start = time.perf_counter()
            try:
                compiled = hetcc.compile(model, CLUSTERS / f"{cluster}.yaml", example_kwargs=inputs,
                                         microbatches=MICROBATCHES)  # fmt: skip
            except hetcc.HetccError as error:  # e.g. the model does not fit the cluster: say so in the table
                rows.append({"model": model_name, "cluster": cluster, "error": str(error).splitlines()[0]})
                print(f"plan quality {model_name} on {cluster}: {rows[-1]['error']}", flush=True)
                continue
            plan = compiled.plan
            finite = {k: v for k, v in plan.baselines.items() if math.isfinite(v)}
            best = min(finite, key=finite.get) if finite else None
            rows.append({
                "model": model_name, "cluster": cluster, "stages": len(plan.stages), "schedule": plan.schedule,
                "devices": len(compiled.problem.devices), "step_ms": plan.objective_s * 1e3,
                "simulated_ms": getattr(plan, "simulated_step_s", math.nan) * 1e3,
                "bound_ms": plan.lower_bound_s * 1e3, "gap": plan.gap,
                "baselines_ms": {k: v * 1e3 for k, v in plan.baselines.items()},
                "best": best, "speedup": finite[best] / plan.step_time_s if best else math.nan,
                "compile_s": time.perf_counter() - start,
            })  # fmt: skip
            print(f"plan quality {model_name} on {cluster}: {rows[-1]['speedup']:.2f}x vs {best}", flush=True)
            del compiled, model
            gc.collect()
    return rows


def compile_time() -> list[dict]:
    """hetcc.compile vs a bare torch.export of the same model on one microbatch (what compile traces)."""
    rows = []
    cluster = CLUSTERS / "datacenter64.yaml"  # 64 GPUs: room for the 70B shape's training state
    warm, warm_inputs = models.gpt2_tiny()  # torch.export's first call in a process pays its own start-up
    torch.export.export(warm, (), warm_inputs, strict=False)
    hetcc.compile(warm, CLUSTERS / "cpu4.yaml", example_kwargs=warm_inputs, microbatches=2)
    for label, factory in COMPILE_MODELS.items():
        model, inputs = getattr(models, factory)()
        first = {
            k: v[: v.shape[0] // MICROBATCHES] if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()
        }
        start = time.perf_counter()
        torch.export.export(model, (), first, strict=False)
        export_s = time.perf_counter() - start
        model, inputs = getattr(models, factory)()  # a fresh module: nothing cached by the export above
        start = time.perf_counter()
        compiled = hetcc.compile(model, cluster, example_kwargs=inputs, microbatches=MICROBATCHES)
        compile_s = time.perf_counter() - start
        passes = dict(compiled.analysis.timings_ms)
        rows.append({"model": label, "export_s": export_s, "compile_s": compile_s, "ratio": compile_s / export_s,
                     "nodes": len(compiled.graph.graph.nodes), "passes_ms": passes})  # fmt: skip
        print(f"compile time {label}: {compile_s:.1f} s vs export {export_s:.1f} s", flush=True)
        del compiled, model
        gc.collect()
    return rows


def run_script(name: str, args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], capture_output=True,
                          text=True, env=env, timeout=1800)  # fmt: skip
    if done.returncode != 0:
        return f"FAILED (exit {done.returncode}):\n{done.stderr[-2000:]}"
    return done.stdout


def runtime_overhead(mode: str) -> dict:
    steps = ["--steps", "5", "--rounds", "3"] if mode == "quick" else ["--steps", "10", "--rounds", "5"]
    out = {}
    for schedule in ("1f1b", "gpipe"):
        text = run_script("runtime_overhead.py", ["--schedule", schedule, *steps])
        ratio = re.search(r"ratio hetcc / pipelining: ([\d.]+)x", text)
        data = re.search(r"ratio hetcc\+data / hetcc [^:]*: ([\d.]+)x", text)
        times = dict(re.findall(r"^\s+(hetcc\+data|hetcc|pipelining)\s+([\d.]+) ms/step", text, flags=re.M))
        out[schedule] = {"ratio": float(ratio.group(1)) if ratio else math.nan, "ms": times, "text": text,
                         "data_ratio": float(data.group(1)) if data else math.nan}  # fmt: skip
        print(f"runtime overhead {schedule}: {out[schedule]['ratio']}", flush=True)
    return out


def cost_fidelity(mode: str) -> dict:
    args = ["--layers", "4", "--repeats", "3"] if mode == "quick" else ["--layers", "12", "--repeats", "5"]
    text = run_script("cost_fidelity.py", args)
    worst = re.search(r"worst per-stage error: ([\d.]+)%", text)
    table = text[text.find("stage  blocks") :] if "stage  blocks" in text else text[-1500:]
    print(f"cost fidelity: worst {worst.group(1) if worst else '?'}%", flush=True)
    return {"worst": float(worst.group(1)) / 100 if worst else math.nan, "table": table.strip(), "args": args}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--full", action="store_true", help="larger models and more repeats (slow on 2 cores)"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = parser.parse_args()
    mode = "full" if args.full else "quick"
    start = time.perf_counter()
    results = {
        "plan": plan_quality(mode), "compile": compile_time(), "runtime": runtime_overhead(mode),
        "fidelity": cost_fidelity(mode),
    }  # fmt: skip
    Path(args.out).write_text(render(results, mode, machine(), time.perf_counter() - start))
    print(f"written to {args.out}")


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )


if __name__ == "__main__":
    main()
