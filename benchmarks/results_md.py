"""``benchmarks/RESULTS.md`` from the numbers ``run_all.py`` measured."""

from __future__ import annotations

import math
import statistics


def render(results: dict, mode: str, machine: str, elapsed_s: float) -> str:
    plan, compile_rows = results["plan"], results["compile"]
    runtime, fidelity = results["runtime"], results["fidelity"]
    lines = [
        "# hetcc benchmark results",
        "",
        f"Written by `make bench` (`python benchmarks/run_all.py{' --full' if mode == 'full' else ''}`, "
        f"{mode} mode) in {elapsed_s / 60:.1f} min on {machine}.",
        "No GPU is involved: plan quality and the step times in it are hetcc's cost model for the named",
        "clusters; runtime overhead and cost-model fidelity are measured on this machine's CPU.",
        "",
        "## Headline",
        "",
        *_headline(plan, compile_rows, runtime, fidelity),
        "",
        *_plan_section(plan),
        "",
        *_compile_section(compile_rows),
        "",
        *_runtime_section(runtime),
        "",
        *_fidelity_section(fidelity),
        "",
    ]
    return "\n".join(lines)


def _headline(plan, compile_rows, runtime, fidelity) -> list[str]:
    solved = [r for r in plan if "error" not in r]
    speedups = [r["speedup"] for r in solved if math.isfinite(r["speedup"])]
    gaps = [r["gap"] for r in solved]
    out = []
    if speedups:
        out.append(
            f"- Plan quality: hetcc's step time is {statistics.median(speedups):.2f}x faster than the best "
            f"equal-split baseline (median of {len(speedups)} model x cluster cases; range "
            f"{min(speedups):.2f}x-{max(speedups):.2f}x); median gap to the lower bound {statistics.median(gaps):.1%}."
        )
    for row in compile_rows:
        out.append(
            f"- Compile time, {row['model']}: {row['compile_s']:.1f} s, {row['ratio']:.1f}x a bare torch.export "
            f"({row['export_s']:.1f} s) of the same model."
        )
    for schedule, result in runtime.items():
        out.append(
            f"- Runtime overhead ({schedule}): hetcc / torch.distributed.pipelining = {result['ratio']:.2f}x; "
            f"reading each step's batch through hetcc.train.data: {result.get('data_ratio', math.nan):.2f}x."
        )
    if math.isfinite(fidelity["worst"]):
        out.append(
            f"- Cost-model fidelity: worst per-stage error {fidelity['worst']:.0%} on calibrated CPU stages."
        )
    return out


def _plan_section(rows) -> list[str]:
    out = [
        "## Plan quality",
        "",
        'Step time per training step (16 microbatches, the schedule `schedule="auto"` kept) of hetcc\'s plan:',
        "the search's formula and the simulator's replay (what the plan reports), the bound on any",
        "plan's simulated step, and each baseline (simulated, 1F1B) on all devices in listed order (`inf`:",
        "does not fit).",
        "",
        "| model | cluster | stages / devices, schedule | formula ms | simulated ms | bound ms | gap | uniform ms | "
        "parameters ms | flops ms | vs best baseline |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['cluster']} | {r['error']} |" + " |" * 8)
            continue
        base = r["baselines_ms"]
        out.append(
            f"| {r['model']} | {r['cluster']} | {r['stages']} / {r['devices']}, {r.get('schedule', '1f1b')} | "
            f"{r['step_ms']:.1f} | "
            f"{r['simulated_ms']:.1f} | {r['bound_ms']:.1f} | {r['gap']:.1%} | "
            + " | ".join(_ms(base.get(k, math.nan)) for k in ("uniform", "parameters", "flops"))
            + (f" | {r['speedup']:.2f}x ({r['best']}) |" if r["best"] else " | no baseline fits |")
        )
    return out


def _compile_section(rows) -> list[str]:
    out = [
        "## Compile time",
        "",
        "Wall time of `hetcc.compile` (every pass, the solver and codegen; meta-device model, cluster",
        "`datacenter64`) against `torch.export.export(model, (), one_microbatch, strict=False)` of a fresh",
        "copy of the same model, measured in the same process one after the other.",
        "",
        "| model | graph nodes | torch.export s | hetcc.compile s | ratio | slowest passes (trace includes its own export) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        slowest = sorted(r["passes_ms"].items(), key=lambda kv: -kv[1])[:3]
        passes = ", ".join(f"{name} {ms / 1e3:.1f} s" for name, ms in slowest)
        out.append(
            f"| {r['model']} | {r['nodes']} | {r['export_s']:.1f} | {r['compile_s']:.1f} | {r['ratio']:.1f}x | {passes} |"
        )
    return out


def _runtime_section(runtime) -> list[str]:
    out = [
        "## Runtime overhead",
        "",
        "`benchmarks/runtime_overhead.py`: the same 2-stage MLP split run by hetcc's executor and by",
        "`torch.distributed.pipelining`, 2 ranks on gloo, alternating rounds, median step time; and hetcc",
        "drawing each step's batch through `hetcc.train.data` (a shuffled dataset, each rank its share) against",
        "the same batches split before the clock starts.",
        "",
        "| schedule | hetcc ms/step | pipelining ms/step | ratio | hetcc + data path ms/step | ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for schedule, r in runtime.items():
        ms = r["ms"]
        out.append(
            f"| {schedule} | {ms.get('hetcc', '-')} | {ms.get('pipelining', '-')} | {r['ratio']:.3f}x "
            f"| {ms.get('hetcc+data', '-')} | {r.get('data_ratio', math.nan):.3f}x |"
        )
    return out


def _fidelity_section(fidelity) -> list[str]:
    return [
        "## Cost-model fidelity",
        "",
        f"`benchmarks/cost_fidelity.py {' '.join(fidelity['args'])}`: this CPU is calibrated (`hetcc.calibrate`),",
        "GPT-2 is compiled for 4 such CPU devices, and each stage's forward + backward is timed alone.",
        "",
        "```",
        fidelity["table"],
        "```",
    ]


def _ms(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.1f}"
