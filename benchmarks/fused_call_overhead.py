"""What a fused group's call costs the host, and whether a stage with fusion forced on keeps up with
the same stage unfused, on this machine's CPU (Triton's interpreter off: fused groups run their ops).

Measured in one run, interleaved, best of several repeats (this machine is noisy):
- one group of two ops (8 x 64), forward and forward + backward: the ops called directly, the call a
  fused node makes (``hetcc.kernels.launch.fused``), and the custom op tracers see
  (``torch.ops.hetcc.fusion_group``, what fused nodes called before the launcher); the overhead is
  the call's time minus the ops';
- the launcher's own host time on the Triton path (the cached launch and its autograd function), with
  the kernel launch itself replaced by nothing: what a GPU's host pays on top of Triton's launch;
- a GPT-NeoX-like stage (2 layers) forward + backward, compiled with every fusible group fused
  (``HETCC_FUSE=all``) against fusion off, and the fused stage calling the custom op instead.

    python benchmarks/fused_call_overhead.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the eager fallback inside, as a CPU without Triton runs it

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hetcc  # noqa: E402
from hetcc.kernels import execute, launch  # noqa: E402
from hetcc.kernels import group as g  # noqa: E402
from hetcc.kernels.cache import TRITON  # noqa: E402
from hetcc.kernels.op import register_group  # noqa: E402
from hetcc.passes.codegen import compute_module  # noqa: E402


def best_of(calls: dict, number: int, repeats: int = 15) -> dict[str, float]:
    """Seconds per call of each of ``calls``, timed in turn ``repeats`` times; the fastest repeat."""
    for call in calls.values():
        for _ in range(max(3, number // 20)):
            call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(number):
                call()
            seconds[name].append((time.perf_counter() - start) / number)
    return {name: min(times) for name, times in seconds.items()}


def two_op_group() -> g.FusionGroup:
    spec = g.TensorSpec("x", (8, 64), torch.float32, flat=True, broadcast=False, param=False)
    instrs = (
        g.Instr("mul", (("in", 0), ("const", 2.0)), torch.float32, "mul = x * 2.0"),
        g.Instr("tanh", (("tmp", 0),), torch.float32, "tanh = tanh(mul)"),
    )
    key = g.structural_key("pointwise", (spec,), instrs, (1,), "generated")
    name = g.group_name(instrs, key)
    group = g.FusionGroup(name, "pointwise", (8, 64), (spec,), instrs, (1,), ("tanh",), "generated", "cpu")
    register_group(group)
    return group


def call_overhead() -> None:
    group = two_op_group()
    x, grad = torch.randn(8, 64, requires_grad=True), torch.ones(8, 64)
    calls = {
        "ops": lambda: [torch.tanh(x * 2.0)],
        "launcher": lambda: launch.fused([x], group.name),
        "custom op": lambda: torch.ops.hetcc.fusion_group([x], group.name),
    }
    forward = best_of(calls, 2000)
    both = best_of({k: (lambda c=c: torch.autograd.backward(c(), [grad])) for k, c in calls.items()}, 1000)
    print("one fused group (2 ops, 8 x 64), eager fallback inside; overhead = call - ops")
    for name in ("launcher", "custom op"):
        print(
            f"  {name:9s}: forward {forward[name] * 1e6:6.1f} us (overhead {(forward[name] - forward['ops']) * 1e6:5.1f}),"
            f" forward + backward {both[name] * 1e6:6.1f} us (overhead {(both[name] - both['ops']) * 1e6:5.1f})"
        )
    print(
        f"  ops      : forward {forward['ops'] * 1e6:6.1f} us, forward + backward {both['ops'] * 1e6:6.1f} us"
    )


def launcher_host_time() -> None:
    """The launcher's Python on the Triton path, the launch itself stubbed out."""
    group = two_op_group()
    x, grad = torch.randn(8, 64, requires_grad=True), torch.ones(8, 64)
    saved = launch.choose_backend, execute.compiled, execute.launch_kernel, execute.run_backward
    launch.choose_backend = lambda device_type: (TRITON, "stub")
    execute.compiled = lambda typed: type("Stub", (), {"forward": None, "backward": None})()
    execute.launch_kernel = lambda kernel, where, args, stat: None
    execute.run_backward = lambda typed, inputs, grads: [torch.empty_like(inputs[0])]
    launch.forget_calls()
    try:
        forward = best_of({"launcher": lambda: launch.fused([x], group.name)}, 2000)["launcher"]
        both = best_of(
            {"launcher": lambda: torch.autograd.backward(launch.fused([x], group.name), [grad])}, 1000
        )
    finally:
        launch.choose_backend, execute.compiled, execute.launch_kernel, execute.run_backward = saved
        launch.forget_calls()
    print(
        f"launcher on the Triton path, launch stubbed: forward {forward * 1e6:.1f} us,"
        f" forward + backward {both['launcher'] * 1e6:.1f} us (host time besides Triton's own launch)"
    )


def neox_stage(fuse: str, hidden: int, seq: int):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                           num_attention_heads=4, vocab_size=256, max_position_embeddings=seq,
                           hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    ids = torch.randint(0, 256, (4, seq))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    with hetcc.config.patch(fuse=fuse):
        compiled = hetcc.compile(GPTNeoXForCausalLM(config), ROOT / "examples/clusters/cpu4.yaml",
                                 example_kwargs=inputs, microbatches=1, replicate=False)  # fmt: skip
    (stage,) = compiled.stages
    return compute_module(stage), (ids, ids)


def stage_ratio(hidden: int, seq: int) -> None:
    unfused, args = neox_stage("off", hidden, seq)
    fused, _ = neox_stage("all", hidden, seq)
    groups = [n for n in fused.graph.nodes if n.target is launch.fused]
    custom = compute_module_with_custom_op(fused)

    def step(module):
        return lambda: module(*args)[0].backward()

    times = best_of({"unfused": step(unfused), "fused": step(fused), "custom op": step(custom)}, 10, 9)
    print(
        f"GPT-NeoX-like stage, 2 layers, hidden {hidden}, 4 x {seq} tokens, {len(groups)} fused groups:"
        f" unfused {times['unfused'] * 1e3:.2f} ms, fused {times['fused'] * 1e3:.2f} ms"
        f" ({times['fused'] / times['unfused']:.3f}x), fused through the custom op {times['custom op'] * 1e3:.2f} ms"
        f" ({times['custom op'] / times['unfused']:.3f}x)"
    )


def compute_module_with_custom_op(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module`` with its fused nodes calling ``torch.ops.hetcc.fusion_group`` (the previous path)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    for node in graph.find_nodes(op="call_function", target=launch.fused):
        node.target = torch.ops.hetcc.fusion_group.default
    return torch.fx.GraphModule(module, graph)


if __name__ == "__main__":
    torch.set_num_threads(1)
    call_overhead()
    launcher_host_time()
    for hidden, seq in ((64, 16), (256, 128)):
        stage_ratio(hidden, seq)
