"""One short GPU session, each part against its target, with a summary table at the end.

    python benchmarks/gpu_fast.py 2>&1 | tee $OUT/gpu_fast.txt   # one CUDA GPU: ~4-5 min on an H200
    python benchmarks/gpu_fast.py --device cpu --layers 2 --hidden 64 --seq 64 --batch 4   # a dry run

1. ``hetcc.calibrate`` (fp32 + bf16) beside the preset; the plans below use it.
2. GPT-2 planned on 4 devices of this GPU's type; each stage's compute module forward + backward on one
   microbatch, one stage at a time (``cost_fidelity.one_pass``), fp32 and bf16-mixed: (a) fusion all +
   hetcc's own CUDA graphs (``GraphedStage`` per stage, captured by ``begin_step``), (b) fusion all,
   (c) fusion off, (d) the fusion-off stages under ``torch.compile``, (e) the eager HF model.
3. Each distinct fused call of those stages alone, on the inputs a real forward gives it, replayed in a
   CUDA graph over input copies 4x the L2 size: its share of the calibrated streaming bandwidth.
4. Two ranks on this one GPU over gloo (NCCL refuses two ranks on one device), 1F1B, fusion all,
   HETCC_CUDA_GRAPHS=on: the measured step against the plan's simulated one; each rank's counters.
Each part is guarded (a failure prints ``FAILED <part>: <error>``); none starts past ``--budget-s``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.fx as fx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_fidelity import one_pass  # noqa: E402  (benchmarks/ is on sys.path)
from gpu_stages import _eager  # noqa: E402

import hetcc  # noqa: E402
from hetcc.hardware.measure import preset_for_device_name  # noqa: E402
from hetcc.hardware.presets import HOST_FIELDS, get_preset  # noqa: E402
from hetcc.kernels.launch import fused  # noqa: E402
from hetcc.passes.codegen import compute_module  # noqa: E402
from hetcc.runtime import supervisor  # noqa: E402
from hetcc.runtime.cudagraphs import GraphedStage, graphs_for_stage  # noqa: E402
from hetcc.runtime.groups import Links  # noqa: E402
from hetcc.runtime.precision import forward_context  # noqa: E402
from hetcc.runtime.segments import plan_segments  # noqa: E402
from hetcc.train.local import Repeated, _collect, _free_port  # noqa: E402
from hetcc.train.loop import TrainSettings, train  # noqa: E402
from hetcc.train.rank import PipelineRank  # noqa: E402

LOSS_TOLERANCE = {"fp32": 1e-4, "bf16-mixed": 2e-2, "fp16-mixed": 2e-2}  # relative to the eager loss
COMPILE_NEED_S = 60.0  # a cold torch.compile of four GPT-2 stages, forward and backward
REPLAYS = 5  # part 3: replays of each call's graph, timed together


@dataclass
class Session:
    """What the parts share: the model and batch, the calibration, the builds, the clock, the targets."""

    args: argparse.Namespace
    device: torch.device
    type_name: str
    model: torch.nn.Module
    ids: torch.Tensor
    start: float = field(default_factory=time.monotonic)
    rows: list[tuple] = field(default_factory=list)  # (part, target, value, goal, met: bool or None)
    calibration: hetcc.Calibration | None = None
    builds: dict[tuple, object] = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def allows(self, what: str, need_s: float) -> bool:
        """Whether ``what`` (about ``need_s`` long) fits in the budget; if not, say it is skipped."""
        used = time.monotonic() - self.start
        if used + need_s < self.args.budget_s:
            return True
        print(f"skipped {what}: the time budget is spent ({used:.0f} of {self.args.budget_s:.0f} s used)")
        return False

    def add(self, part: str, target: str, value: str, goal: str, met: bool | None) -> None:
        """A target's row, judged on the GPU only (a CPU dry run's figures mean nothing)."""
        self.rows.append((part, target, value, goal, met if self.on_gpu else None))

    def build(self, precision: str, fuse: str, devices: int):
        """``hetcc.compile`` for ``devices`` devices of this type (calibrated once part 1 ran), memoized."""
        key = (precision, fuse, devices)
        if key not in self.builds:
            start, inputs = time.perf_counter(), {"input_ids": self.ids, "labels": self.ids}
            cluster = _cluster(self.type_name, devices, [self.calibration] if self.calibration else [])
            with hetcc.config.patch(fuse=fuse):
                self.builds[key] = hetcc.compile(
                    self.model, cluster, example_kwargs=inputs | {"use_cache": False},
                    microbatches=self.args.microbatches, precision=precision, replicate=False, schedule="1f1b",
                )  # fmt: skip
            took = time.perf_counter() - start
            print(f"# compiled {precision}, fusion {fuse}, {devices} devices ({took:.1f} s)")
        return self.builds[key]

    def microbatch(self) -> dict:
        ids = self.ids[: self.args.batch // self.args.microbatches].to(self.device)
        return {"input_ids": ids, "labels": ids, "use_cache": False}


def _cluster(type_name: str, count: int, calibrations) -> hetcc.Cluster:
    link = {"kind": "nvlink", "bandwidth": "450 GB/s", "latency": "3 us"}
    node = {"name": "node0", "intra_link": link, "devices": [{"type": type_name, "count": count}]}
    spec = {"nodes": [node]}
    return hetcc.apply_to_cluster(hetcc.Cluster.from_spec(spec), list(calibrations))


def failed(part: str, error: BaseException) -> None:
    """One line for the failure and the last frames it passed (no traceback dump)."""
    print(f"FAILED {part}: {type(error).__name__}: {(str(error) or '-').splitlines()[0][:300]}", flush=True)
    for frame in traceback.extract_tb(error.__traceback__)[-3:]:
        print(f"    at {Path(frame.filename).name}:{frame.lineno} in {frame.name}")


# ---- part 1: calibration -------------------------------------------------------------------------
def part_calibrate(s: Session) -> None:
    print("\n## part 1: hetcc.calibrate", flush=True)
    if not s.on_gpu:
        print(hetcc.calibrate("cpu", quick=True).describe())
        print("skipped on cpu: host_* figures are measured on CUDA devices only; the plans use the preset")
        return s.add("1 calibration", "host per fused call fwd/bwd", "n/a", "info", None)
    start = time.perf_counter()
    s.calibration = cal = hetcc.calibrate(str(s.device), dtypes=("fp32", "bf16"), type_name=s.type_name)
    print(f"calibrated in {time.perf_counter() - start:.1f} s\n{cal.describe()}")
    preset = get_preset(s.type_name)
    print(f"  {'figure':<26}{'measured':>12}{'preset ' + s.type_name:>18}")
    for name in HOST_FIELDS:
        value = getattr(cal, name)
        shown = "-" if value is None else f"{value * 1e6:.1f} us"
        print(f"  {name:<26}{shown:>12}{getattr(preset, name) * 1e6:>15.1f} us")
    fwd, bwd = cal.host_fused_op_s or 0.0, cal.host_fused_backward_op_s or 0.0
    was = f"preset {preset.host_fused_op_s * 1e6:.0f}/{preset.host_fused_backward_op_s * 1e6:.0f}"
    s.add("1 calibration", "host per fused call fwd/bwd", f"{fwd * 1e6:.0f}/{bwd * 1e6:.0f} us", was, None)


# ---- part 2: GPT-2 stages, one at a time ---------------------------------------------------------
VARIANTS = {"a": ("fusion all + CUDA graphs", "all"), "b": ("fusion all", "all"), "c": ("fusion off", "off"),
            "d": ("torch.compile, fusion off", "off")}  # fmt: skip


class Variant(NamedTuple):
    total_s: float
    loss: float
    errors: list[float]  # per stage: predicted / measured - 1


def stage_callables(key: str, stages, device: torch.device, precision: str, microbatch: dict):
    """(what ``one_pass`` calls per stage, the precision it runs them under) for variant ``key``."""
    modules = [compute_module(stage, device).to(device) for stage in stages]
    if key == "d":
        return [torch.compile(m) for m in modules], precision
    if key != "a":
        return modules, precision
    staged = [_graphed_stage(m, device, precision) for m in modules]
    calls = [_slot0(graphs, m, device, precision) for (graphs, _), m in zip(staged, modules)]
    one_pass(stages, calls, microbatch, device, "fp32")  # records slot 0's inputs; autocast is in the calls
    for graphs, _ in staged:
        if graphs is not None and device.type == "cuda":
            graphs.begin_step([])  # mode "on": capture what the pass recorded
    print(
        "    graphs: hetcc's own, graphs_for_stage(mode='on') per stage, captured by GraphedStage.begin_step"
    )
    for k, (graphs, why) in enumerate(staged):
        print(f"    stage {k} graphs: {graphs.reason if graphs is not None else why}")
    if device.type != "cuda":
        print("    skipped on cpu: capture (CUDA graphs need CUDA); the split segments ran uncaptured")
    return calls, "fp32"


def _graphed_stage(module, device: torch.device, precision: str):
    """hetcc's ``GraphedStage`` as the executor makes it (mode "on"); on a CPU the same split, uncaptured."""
    if device.type == "cuda":
        return graphs_for_stage(module, device, precision, recompute=False, mode="on")
    plan = plan_segments(module.graph, device)
    return (GraphedStage(module, plan, device, precision, "on") if plan.segments else None), "off: no segment"


def _slot0(graphs, module, device: torch.device, precision: str):
    def call(*args):
        if graphs is None:
            with forward_context(precision, device):
                return module(*args)
        with graphs.context():
            return graphs(0, *args)

    return call


def run_variant(s: Session, key: str, precision: str, microbatch: dict) -> Variant:
    built = s.build(precision, VARIANTS[key][1], 4)
    calls, run_precision = stage_callables(key, built.stages, s.device, precision, microbatch)
    samples, losses = [[] for _ in built.stages], []
    for _ in range(s.args.repeats + 1):  # the first round warms up (kernel builds, torch.compile)
        elapsed, loss = one_pass(built.stages, calls, microbatch, s.device, run_precision)
        losses.append(loss)
        for k, seconds in enumerate(elapsed):
            samples[k].append(seconds)
    per_stage = [statistics.median(times[1:]) for times in samples]
    errors = [stage.compute_s / m - 1 for stage, m in zip(built.plan.stages, per_stage)]
    print(f"({key}) {VARIANTS[key][0]}: sum of stages {sum(per_stage) * 1e3:.3f} ms, loss {losses[0]:.6f}")
    for st, m, e in zip(built.plan.stages, per_stage, errors):
        print(f"    stage {st.index}: {st.compute_s * 1e3:.3f} ms predicted, {m * 1e3:.3f} measured, {e:+.1%}")  # fmt: skip
    return Variant(sum(per_stage), losses[0], errors)


def part_stages(s: Session, precision: str) -> None:
    print(f"\n## part 2: GPT-2 stages one at a time, {precision}", flush=True)
    microbatch = s.microbatch()
    for fuse in ("all", "off"):
        s.build(precision, fuse, 4)  # while the model is on the CPU
    eager_loss, eager_s = _eager(s.model.to(s.device), microbatch, s.device, precision, s.args.repeats)
    s.model.to("cpu")
    print(f"(e) eager HF model: {eager_s * 1e3:.3f} ms forward + backward, loss {eager_loss:.6f}")
    measured: dict[str, Variant] = {}
    for key in VARIANTS:
        if s.allows(f"part 2 {precision} ({key})", COMPILE_NEED_S if key == "d" else 5.0):
            try:
                measured[key] = run_variant(s, key, precision, microbatch)
            except Exception as error:  # noqa: BLE001 - a report: say what failed and go on
                failed(f"part 2 {precision} ({key})", error)
            torch.cuda.empty_cache()  # a no-op without CUDA
    stage_report(s, precision, measured, eager_s, eager_loss)


def stage_report(s: Session, precision: str, measured: dict[str, Variant], eager_s: float, eager_loss: float):
    """The variants side by side, and their targets."""
    part, graphed, compiled = f"2 stages {precision}", measured.get("a"), measured.get("d")
    rel_loss = {k: abs(v.loss - eager_loss) / abs(eager_loss) for k, v in measured.items()}
    print(f"{'variant':<32}{'sum ms':>10}{'/eager':>8}{'/compile':>10}{'worst stage':>13}{'loss diff':>11}")
    for key, v in measured.items():
        to_compile = f"{v.total_s / compiled.total_s:.2f}x" if compiled else "-"
        row = f"({key}) {VARIANTS[key][0]:<28}{v.total_s * 1e3:>10.3f}{v.total_s / eager_s:>7.2f}x"
        print(f"{row}{to_compile:>10}{max(v.errors, key=abs):>+13.1%}{rel_loss[key]:>11.1e}")
    print(f"(e) {'eager HF model':<28}{eager_s * 1e3:>10.3f}{1.0:>7.2f}x")
    if graphed:
        ratio = graphed.total_s / eager_s
        s.add(part, "(a) graphs vs eager", f"{ratio:.2f}x", "<= 0.80x", ratio <= 0.8)
    if graphed and compiled:
        ratio = graphed.total_s / compiled.total_s
        s.add(part, "(a) graphs vs torch.compile", f"{ratio:.2f}x", "<= 1.00x", ratio <= 1.0)
    for key in [k for k in "abc" if k in measured]:
        worst = max(measured[key].errors, key=abs)
        s.add(part, f"({key}) stage predicted/measured, worst", f"{worst:+.1%}", "within 10%", abs(worst) < 0.1)  # fmt: skip
    if rel_loss:
        worst, tolerance = max(rel_loss.values()), LOSS_TOLERANCE[precision]
        s.add(part, "loss vs eager, worst variant", f"{worst:.1e}", f"<= {tolerance:.0e}", worst <= tolerance)


# ---- part 3: fused calls' bandwidth --------------------------------------------------------------
class _FusedCalls(fx.Interpreter):
    """Runs a stage module, keeping the inputs of each fused call: one per group and input signature."""

    def __init__(self, module: fx.GraphModule, seen: dict):
        super().__init__(module)
        self.seen = seen

    def call_function(self, target, args, kwargs):
        if target is fused:
            inputs, name = args
            signature = tuple((x.dtype, tuple(x.shape), x.stride()) for x in inputs)
            self.seen.setdefault((name, signature), list(inputs))
        return super().call_function(target, args, kwargs)


def fused_calls(stages, device: torch.device, precision: str, microbatch: dict) -> dict:
    """(group name, input signature) -> real inputs, from one forward through every stage in turn."""
    seen, values = {}, {}
    with torch.no_grad(), forward_context(precision, device):
        for stage in stages:
            module = compute_module(stage, device).to(device)
            args = [values[e.tag] for e in stage.recvs]
            out = _FusedCalls(module, seen).run(*(microbatch[n] for n in stage.inputs), *args)
            values.update({e.tag: o for e, o in zip(stage.sends, out)})
    return seen


def _nbytes(x: torch.Tensor) -> int:
    """Bytes a kernel moves for ``x``: its elements, or its storage where it is broadcast (stride 0)."""
    return min(x.numel() * x.element_size(), x.untyped_storage().nbytes())


def _copy(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)


def call_ms(name: str, inputs: list, device: torch.device, precision: str) -> tuple[float, int]:
    """(device ms per call of fused group ``name``, bytes it moves): a CUDA graph of calls rotating over
    input copies 4x the L2 size, so no call reads what an earlier one left in L2."""

    def run(xs):
        with forward_context(precision, device):  # a launch is specialized per autocast state
            return fused(xs, name)

    with torch.no_grad():
        moved = sum(map(_nbytes, inputs)) + sum(map(_nbytes, run(inputs)))  # builds launch and kernel
        l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        count = min(200, max(20, math.ceil(4 * l2_bytes / moved)))
        copies = [[_copy(x) for x in inputs] for _ in range(count)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kept = [run(xs) for xs in copies]  # noqa: F841 - every call writes outputs of its own
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / (REPLAYS * count), moved


def part_kernels(s: Session) -> None:
    print("\n## part 3: each fused call alone, share of streaming bandwidth", flush=True)
    cal = s.calibration
    peak = cal.memory_bandwidth_bps if cal else get_preset(s.type_name).achievable_bandwidth_bps
    print(f"streaming bandwidth {peak / 1e12:.2f} TB/s ({'calibrated' if cal else 'preset'}); a call is its "
          "kernel plus any copy of a broadcast or strided flat input it makes")  # fmt: skip
    shares = []
    for precision in s.args.precisions:
        if not s.allows(f"part 3 {precision}", 5.0):
            break
        calls = fused_calls(s.build(precision, "all", 4).stages, s.device, precision, s.microbatch())
        print(f"{precision}: {len(calls)} distinct fused calls (group x input signature)")
        for (name, signature), inputs in calls.items():
            dtypes = ",".join(str(d).removeprefix("torch.") for d, _, _ in signature)
            line = f"  {name:<42} {signature[0][1]!s:<17} {dtypes:<34}"
            if not s.on_gpu:
                print(f"{line} {sum(map(_nbytes, inputs)) / 1e6:9.3f} MB read")
                continue
            ms, moved = call_ms(name, inputs, s.device, precision)
            share = moved / (ms * 1e-3) / peak
            shares.append((share, f"{precision} {name} {signature[0][1]}"))
            print(f"{line} {moved / 1e6:7.2f} MB {ms * 1e3:7.2f} us {moved / ms / 1e6:5.0f} GB/s {share:.1%}")
        torch.cuda.empty_cache()
    if not s.on_gpu:
        print("skipped on cpu: timing the calls (Triton kernels replayed in a CUDA graph need a GPU)")
        return s.add("3 fused kernels", "median share of streaming BW", "n/a", ">= 80%", None)
    values, worst = sorted(v for v, _ in shares), min(shares)
    median, meeting = statistics.median(values), sum(v >= 0.8 for v in values)
    print(f"share of streaming bandwidth: min {values[0]:.1%}, median {median:.1%}, max {values[-1]:.1%}")
    print(f"worst: {worst[1]}; {meeting} of {len(values)} calls >= 80%")
    s.add("3 fused kernels", "median share of streaming BW", f"{median:.1%}", ">= 80%", median >= 0.8)
    s.add("3 fused kernels", "worst call's share", f"{values[0]:.1%}", ">= 80%", values[0] >= 0.8)


# ---- part 4: two ranks on this one GPU -----------------------------------------------------------
class _GlooRank(PipelineRank):
    """A rank whose links all run over gloo (through host memory): NCCL refuses two ranks on one GPU."""

    def _links(self, timeout_s):
        tied = [self.layout.holders(group.stages) for group in self.stage.tied]
        vendors = ["cpu"] * self.layout.num_ranks
        return Links(vendors, tied, timeout_s, self.device, replica_ranks=self.layout.replica_groups())


def _rank_worker(rank: int, world: int, job: dict, beats) -> None:
    """One spawned rank (as ``run_local``'s, but on ``job["device"]``): the built-in training loop."""
    supervisor.start_heartbeat(beats, rank)
    try:
        timeout = datetime.timedelta(seconds=job["timeout_s"])
        address = f"tcp://127.0.0.1:{job['port']}"
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world, timeout=timeout)
        device = torch.device(job["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        pipeline_rank = _GlooRank(job["directory"], rank, device=device, timeout_s=job["timeout_s"])
        result = train(pipeline_rank, Repeated(job["batch"]), TrainSettings(job["steps"], job["optimizer"]))
        result.update(grads={}, outputs={})  # GPT-2's gradients and logits: gigabytes the report needs not
        supervisor.write_report(job["results"], rank, {"ok": True, **result})
    except Exception as error:  # noqa: BLE001 - reported to the parent
        supervisor.write_report(job["results"], rank, supervisor.error_report(error))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def part_two_ranks(s: Session) -> None:
    precision = s.args.run_precision
    print(f"\n## part 4: 2 ranks on one {s.device.type} device, gloo, {precision}, fusion all", flush=True)
    built = s.build(precision, "all", 2)
    torch.cuda.empty_cache()
    os.environ["HETCC_CUDA_GRAPHS"] = "on"  # read by the spawned ranks' hetcc.config
    with tempfile.TemporaryDirectory(prefix="gpu_fast_") as scratch:
        folder, meta = built.save(os.path.join(scratch, "pipeline")), built.pipeline.meta
        job = dict(directory=str(folder), results=scratch, port=_free_port(), steps=s.args.steps,
                   timeout_s=120.0, batch={"input_ids": s.ids, "labels": s.ids}, device="cuda:0" if s.on_gpu
                   else "cpu", optimizer=dict(meta.optimizer or {}) or None)  # fmt: skip
        start = time.monotonic()
        reports, failures = supervisor.spawn_ranks(2, _rank_worker, job)
        if failures:
            raise supervisor.failure_error(failures)
        result = _collect(reports, None)
    print(f"ranks ran in {time.monotonic() - start:.1f} s (spawn, load, kernel builds, capture, "
          f"{s.args.steps} steps); {meta.schedule}, {meta.microbatches} microbatches")  # fmt: skip
    run_report(s, built.plan, result)


def run_report(s: Session, plan, result) -> None:
    steps = [record["step_s"] for record in result.records]
    measured = statistics.median(steps[2:] if len(steps) > 2 else steps)  # after recording, capture
    ratio, serial = measured / plan.step_time_s, plan.microbatches * sum(st.compute_s for st in plan.stages)
    losses = f"loss {result.losses[0]:.4f} .. {result.losses[-1]:.4f}"
    print(f"step ms: {', '.join(f'{x * 1e3:.1f}' for x in steps)}; {losses}")
    print(f"measured step {measured * 1e3:.2f} ms (median of steps 3..{len(steps)}); plan simulated "
          f"{plan.step_time_s * 1e3:.2f} ms on 2 devices: {ratio:.2f}x")  # fmt: skip
    print(f"both stages' work on one device, serially ({plan.microbatches} x the stages' compute_s): "
          f"{serial * 1e3:.2f} ms: measured {measured / serial:.2f}x that")  # fmt: skip
    for line in result.summary:
        print(f"  runtime summary: {line}")
    for rank, stats in enumerate(result.stats):
        counters = ", ".join(f"{k} {v}" for k, v in stats.items() if k != "cuda_graphs" and v)
        print(f"  rank {rank}: cuda_graphs {stats.get('cuda_graphs')}\n          {counters}")
    on = all(str(stats.get("cuda_graphs", "")).startswith("on") for stats in result.stats)
    s.add("4 two ranks", "step vs plan's simulated", f"{ratio:.2f}x", "within 15%", abs(ratio - 1) <= 0.15)
    s.add("4 two ranks", "step vs one-device serial work", f"{measured / serial:.2f}x", "info", None)
    s.add("4 two ranks", "CUDA graphs on, every rank", "yes" if on else "no", "on", on)


# ---- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    for name, default in (("layers", 12), ("hidden", 768), ("seq", 1024), ("batch", 16), ("microbatches", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per variant (after one warm-up)")
    precisions = list(LOSS_TOLERANCE)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"], choices=precisions)
    parser.add_argument("--run-precision", default="fp32", choices=precisions, help="part 4's")
    parser.add_argument("--steps", type=int, default=6, help="part 4's training steps")
    parser.add_argument("--parts", nargs="+", type=int, default=[1, 2, 3, 4], choices=(1, 2, 3, 4))
    parser.add_argument("--type", help="device type to plan for (default: this GPU's preset)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="no part starts past this many seconds")
    return parser.parse_args(argv)


def start_session(args: argparse.Namespace) -> Session | None:
    device, type_name = torch.device(args.device), args.type or "H200"
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_fast: no CUDA device is available; nothing to measure (a dry run: --device cpu).")
        return None
    where = "a dry run on the CPU"
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        where = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory
        type_name = args.type or preset_for_device_name(where, memory) or type_name
    print(f"# {where}; torch {torch.__version__}; planned as {type_name}")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                        n_positions=max(1024, args.seq), **no_dropout)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator)
    return Session(args, device, type_name, GPT2LMHeadModel(config), ids)


def main(argv: list[str] | None = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # what was printed survives a kill at the time limit
    s = start_session(parse_args(argv))
    if s is None:
        return 0
    parts = [(1, "part 1 calibration", part_calibrate, (), 0.0)]
    parts += [(2, f"part 2 stages {p}", part_stages, (p,), 10.0) for p in s.args.precisions]
    parts += [(3, "part 3 fused kernels", part_kernels, (), 5.0)]
    parts += [(4, "part 4 two ranks", part_two_ranks, (), 45.0)]
    for number, name, run, extra, need_s in parts:
        if number not in s.args.parts:
            continue
        if not s.allows(name, need_s):
            s.add(name, "ran", "skipped", "budget", None)
            continue
        try:
            run(s, *extra)
        except Exception as error:  # noqa: BLE001 - a report: say what failed and go on
            failed(name, error)
            s.rows.append((name, "ran", "FAILED", "-", False))
    print(f"\n## summary ({time.monotonic() - s.start:.0f} s)")
    print(f"{'part':<22}{'target':<40}{'value':>10}  {'goal':<12}met")
    for part, target, value, goal, met in s.rows:
        verdict = "n/a" if met is None else "yes" if met else "NO"
        print(f"{part:<22}{target:<40}{value:>10}  {goal:<12}{verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
