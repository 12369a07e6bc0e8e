"""Measure a local device so the cost model prices nodes at real speeds instead of datasheet guesses.

``calibrate()`` times these on one device of this host: matmuls (FLOP/s per dtype of the GEMMs a
training step runs: forward, input- and weight-gradient layouts, square and wide), and the same by
size, aligned and not (a curve: small GEMMs reach far less than large ones), scaled dot-product
attention forward and backward, memory-bound pointwise ops (bytes read + written per second) and an
add on 1-element tensors (the per-kernel overhead). Each figure is a median over repeated calls after a
warm-up, so one slow call (a page fault, a neighbour's burst) does not move it. The result is a ``Calibration``
(``hetcc.hardware.calibration``): saved per machine as YAML/JSON, and turned into a calibrated
``DeviceType`` by ``apply`` or a calibrated ``Cluster`` by ``apply_to_cluster``.

torch is imported only when measuring, so reading calibration files needs no torch.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import pathlib
import platform
import re
import socket
from collections.abc import Callable, Sequence
from typing import Any

from hetcc.errors import ClusterError
from hetcc.hardware.calibration import Calibration, apply, apply_to_cluster
from hetcc.hardware.presets import PRESETS, flops_key, type_key
from hetcc.hardware.timed import (
    PLANS,
    TORCH_DTYPES,
    CalibrationPlan,
    attention_curves,
    forward_backward_s,
    gemm_curves,
    kernel_overhead_s,
    stream_bandwidth_bps,
)

__all__ = ["Calibration", "apply", "apply_to_cluster", "calibrate", "preset_for_device_name"]

log = logging.getLogger(__name__)

HOST_CHAIN_LAYERS = 16  # repeats of the four ops in the chain ``_host_op_s`` times


def _host_op_s(torch: Any, dev: Any, plan: CalibrationPlan, sync: Callable[[], None]) -> dict[str, float]:
    """Host seconds per graph op, forward and backward, where the device work is negligible: an fx
    GraphModule of HOST_CHAIN_LAYERS x (linear, layer norm, tanh, residual add), a transformer's op
    mix, on 8 x 64 tensors, run the way a stage runs (Python graph code, the dispatcher, autograd),
    so what is timed is the host."""
    import torch.fx

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(HOST_CHAIN_LAYERS))
            self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(64) for _ in range(HOST_CHAIN_LAYERS))

        def forward(self, x):
            for linear, norm in zip(self.layers, self.norms):
                x = x + torch.tanh(norm(linear(x)))
            return x.sum()

    leaves = torch.fx.Tracer()
    leaves.is_leaf_module = lambda module, name: False  # the functional ops, as an exported graph has them
    module = torch.fx.GraphModule(Chain(), leaves.trace(Chain())).to(dev)
    ops = sum(node.op in ("call_function", "call_method") for node in module.graph.nodes)
    x = torch.randn(8, 64, device=dev, requires_grad=True)
    forward_s, backward_s = forward_backward_s(
        lambda: module(x), lambda y: y.backward(), sync, plan.overhead_budget_s
    )
    return {"host_op_s": forward_s / ops, "host_backward_op_s": backward_s / ops}


def _host_fused_op_s(
    torch: Any, dev: Any, plan: CalibrationPlan, sync: Callable[[], None]
) -> dict[str, float]:
    """Host seconds of one fused-group call (``hetcc.kernels.launch.fused``, what a stage's fused node
    calls: its cached launch, then the Triton launch; on a CPU without Triton the group's ops),
    forward and backward, on an 8 x 64 group of two ops whose kernels take next to nothing."""
    from hetcc.kernels import group as g
    from hetcc.kernels.launch import fused
    from hetcc.kernels.op import register_group

    spec = g.TensorSpec("x", (8, 64), torch.float32, flat=True, broadcast=False, param=False)
    instrs = (
        g.Instr("mul", (("in", 0), ("const", 2.0)), torch.float32, "mul = x * 2.0"),
        g.Instr("tanh", (("tmp", 0),), torch.float32, "tanh = tanh(mul)"),
    )
    key = g.structural_key("pointwise", (spec,), instrs, (1,), "generated")
    group = g.FusionGroup(
        g.group_name(instrs, key),
        "pointwise",
        (8, 64),
        (spec,),
        instrs,
        (1,),
        ("tanh",),
        "generated",
        dev.type,
    )
    register_group(group)
    x = torch.randn(8, 64, device=dev, requires_grad=True)
    grad = torch.ones(8, 64, device=dev)
    forward_s, backward_s = forward_backward_s(
        lambda: fused([x], group.name),
        lambda y: torch.autograd.backward(y, [grad]),
        sync,
        plan.overhead_budget_s,
    )
    return {"host_fused_op_s": forward_s, "host_fused_backward_op_s": backward_s}


def calibrate(
    device: str = "cpu",
    *,
    dtypes: Sequence[str] = ("fp32",),
    quick: bool = False,
    type_name: str | None = None,
) -> Calibration:
    """Measure matmul FLOP/s per dtype (and by size, and attention's), streaming bandwidth and
    per-kernel overhead of one device.

    ``device`` is a torch device string ("cpu", "cuda", "cuda:1"; ROCm GPUs are "cuda" too).
    ``dtypes`` are peak keys or torch dtype names ("fp32", "bf16", "fp16"; "tf32" on CUDA).
    ``quick`` shrinks the work to about a second per dtype on a CPU (coarser figures, for tests).
    ``type_name`` names the device type the figures are for; by default "cpu" on a CPU and the
    preset closest to the GPU's name and memory. CPU figures depend on ``torch.get_num_threads()``,
    which is recorded: calibrate with the thread count the pipeline stages will run with.
    """
    torch = _torch()
    dev, kind = _device(torch, device)
    keys = _dtype_keys(dtypes, kind)
    plan = PLANS[(kind, quick)]
    sync = (lambda: torch.cuda.synchronize(dev)) if kind == "cuda" else (lambda: None)
    device_name, name = _identify(torch, dev, kind, type_name)
    matmul_flops, curves = {}, {}
    for key in keys:
        matmul_flops[key], by_class = gemm_curves(torch, dev, key, plan, sync)
        for op_class, points in (by_class | attention_curves(torch, dev, key, plan, sync)).items():
            curves.setdefault(op_class, {})[key] = points
    calibration = Calibration(
        device_type=name,
        device_name=device_name,
        host=socket.gethostname(),
        torch_version=str(torch.__version__),  # a str subclass that YAML cannot write
        threads=torch.get_num_threads(),
        matmul_flops=matmul_flops,
        flops_by_size=curves,
        memory_bandwidth_bps=stream_bandwidth_bps(torch, dev, plan, sync),
        kernel_overhead_s=kernel_overhead_s(torch, dev, plan, sync),
        **(
            _host_op_s(torch, dev, plan, sync) | _host_fused_op_s(torch, dev, plan, sync)
            if kind == "cuda"
            else {}
        ),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    log.info("%s", calibration.describe())
    return calibration


# ---- what is being measured ----------------------------------------------------------------------
def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ClusterError("calibration needs torch", hint="pip install torch") from None
    return torch


def _device(torch: Any, device: str) -> tuple[Any, str]:
    """The torch device and its kind ("cpu" or "cuda"); errors say what exists here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ClusterError(
            f"calibrate: cannot read device {device!r}: {error}", hint='use "cpu" or "cuda:0"'
        ) from None
    if dev.type == "cpu":
        return dev, "cpu"
    if dev.type != "cuda":
        raise ClusterError(
            f"calibrate: device type {dev.type!r} is not supported", hint='use "cpu" or "cuda"'
        )
    if not torch.cuda.is_available():
        raise ClusterError(
            f"calibrate: {device!r} asked for, but torch sees no CUDA/ROCm GPU", hint='use "cpu"'
        )
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index >= torch.cuda.device_count():
        raise ClusterError(f"calibrate: no {dev}; this host has {torch.cuda.device_count()} GPU(s)")
    return dev, "cuda"


def _dtype_keys(dtypes: Sequence[str], kind: str) -> list[str]:
    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    keys = list(dict.fromkeys(flops_key(d) for d in dtypes))
    for key in keys:
        if key not in TORCH_DTYPES:
            raise ClusterError(
                f"calibrate: cannot time {key} matmuls", hint="measure fp32, bf16, fp16 or tf32"
            )
        if key == "tf32" and kind != "cuda":
            raise ClusterError("calibrate: tf32 is a GPU tensor-core mode; a CPU has no tf32 matmul")
    if not keys:
        raise ClusterError("calibrate: dtypes is empty", hint='e.g. dtypes=("fp32", "bf16")')
    return keys


def _identify(torch: Any, dev: Any, kind: str, type_name: str | None) -> tuple[str, str]:
    """(what the hardware calls itself, the device type name the figures are filed under)."""
    if kind == "cpu":
        return _cpu_model(), type_name or "cpu"
    device_name = torch.cuda.get_device_name(dev)
    if type_name:
        return device_name, type_name
    memory_bytes = torch.cuda.get_device_properties(dev).total_memory
    preset = preset_for_device_name(device_name, memory_bytes)
    if preset is None:
        log.warning("no preset matches GPU %r; filing its calibration under that name", device_name)
    return device_name, preset or device_name


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def preset_for_device_name(device_name: str, memory_bytes: int | None = None) -> str | None:
    """The preset a GPU's reported name denotes ("NVIDIA A100-SXM4-80GB" -> "A100-80GB"), or None.

    A preset matches when its model (name less memory size and form factor: "A100", "MI250X",
    "RTX4090") equals a word or two adjacent words of the name; among several (A100 40 vs 80 GB,
    MI250X package vs one GCD) the one with the closest memory size wins.
    """
    words = [w for w in re.split(r"[^a-z0-9]+", device_name.lower()) if w]
    phrases = set(words) | {a + b for a, b in zip(words, words[1:])}
    candidates = [t for t in PRESETS.values() if t.vendor != "cpu" and _model_key(t.name) in phrases]
    if not candidates:
        return None
    if memory_bytes:
        candidates.sort(key=lambda t: abs(math.log(t.memory_bytes / memory_bytes)))
    return candidates[0].name


def _model_key(preset_name: str) -> str:
    return type_key(re.sub(r"-(\d+GB|SXM|GCD)$", "", preset_name))
