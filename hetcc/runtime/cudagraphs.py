"""CUDA graphs for a stage's compute: their capture and replay.

On a GPU the host issues a stage's many small ops more slowly than the GPU runs them; a CUDA graph
records the kernels of a run of ops once and replays them with one launch. ``runtime.segments`` finds the
maximal runs of compute between a stage's communication (``hetcc.recv``/``hetcc.send``) and the ops a
graph cannot hold; ``GraphedStage`` runs the stage with each run a call to
``torch.cuda.make_graphed_callables``, which captures the backward too, so autograd through the stage,
and the gradients its ops send back, work as before.

A replay reuses memory: a graph's outputs, the activations its backward keeps and the gradients it
returns live at fixed addresses that its next replay overwrites. A pipeline holds several microbatches
between their forward and backward, so each microbatch gets graphs of its own (its *slot*), captured at
the start of the second training step on the inputs the first step recorded (real shapes; no transfer
of this rank in flight), each in its own memory pool (autograd, not the capture order, decides in which
order independent segments run backward). Graphs per microbatch hold every microbatch's activations,
which a 1F1B plan does not budget, so ``auto`` captures only where the first step's measured memory
shows the device holds them all (``room_for_graphs``); ``on`` captures anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from hetcc.passes.codegen import graph_for_device
from hetcc.runtime.precision import autocast_dtype
from hetcc.runtime.segments import MIN_SEGMENT_OPS, SegmentPlan, plan_segments, split_at_segments
from hetcc.solver.schedules import Action


class SegmentCall(torch.nn.Module):
    """One segment as the split stage calls it: the CUDA graph captured for the current microbatch
    (``slot``) where there is one and the inputs are of the kind it was captured on, else the segment's
    own ops, recording the first inputs each slot runs on (for its capture)."""

    def __init__(self, compute: fx.GraphModule):
        super().__init__()
        self.compute, self.slot = compute, None
        self.samples: dict[int, tuple] = {}  # slot -> static copies of the inputs it first ran on
        self.kinds: dict[int, tuple[list, list]] = {}  # slot -> (_kinds of its inputs, of its outputs)
        self.graphed: dict[int, Callable] = {}  # slot -> graphed copy of ``compute``

    def forward(self, *args):
        graphed = self.graphed.get(self.slot)
        if graphed is not None and _kinds(args) == self.kinds[self.slot][0]:
            return _grad_as_recorded(graphed(*args), self.kinds[self.slot][1])
        outputs = self.compute(*args)
        if self.slot is not None and self.slot not in self.samples:
            self.samples[self.slot] = map_aggregate(args, _static_copy)
            self.kinds[self.slot] = (_kinds(args), _kinds(outputs))
        return outputs

    def capture(self, slot: int) -> None:
        """Graph a copy of the segment (the same parameters and buffers) on the inputs ``slot`` recorded."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.compute.graph, {}))
        copy = fx.GraphModule(self.compute, graph, class_name=type(self.compute).__name__).train(
            self.training
        )
        self.graphed[slot] = torch.cuda.make_graphed_callables(
            copy, self.samples[slot], allow_unused_input=True
        )

    def forget(self) -> None:
        """Drop the samples and graphs (and the memory they hold)."""
        self.samples, self.kinds, self.graphed = {}, {}, {}


def _static_copy(value: object) -> object:
    """A tensor's copy for a graph's static input (non-tensors stay, and capture then refuses them)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone().requires_grad_(value.requires_grad)


def _kinds(values: object) -> list:
    """What a graph fixes of its inputs and outputs: each tensor's shape, dtype, device, requires_grad."""
    kinds: list = []

    def kind(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return value.shape, value.dtype, value.device, value.requires_grad
        return value

    map_aggregate(values, lambda value: kinds.append(kind(value)))
    return kinds


def _grad_as_recorded(outputs: object, kinds: list) -> object:
    """A graph's outputs, detached where the segment's own ops gave none a gradient (a graph's autograd
    function marks every floating output), so later segments get inputs of the kind they recorded."""
    recorded = iter(kinds)

    def leaf(value: object) -> object:
        kind = next(recorded)
        return value.detach() if isinstance(value, torch.Tensor) and not kind[3] else value

    return map_aggregate(outputs, leaf)


def capture_context(precision: str, device: torch.device):
    """The forward's autocast (``precision.forward_context``) without its cache of cast weights, which
    ``make_graphed_callables`` refuses: a graph replays the casts instead."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype, cache_enabled=False)


@contextlib.contextmanager
def _buffers_kept(module: torch.nn.Module) -> Iterator[None]:
    """Capture runs each segment's forward several times (warm-up, capture): restore the buffers those
    runs update (train-mode BatchNorm statistics) afterwards."""
    saved = [(buffer, buffer.clone()) for buffer in module.buffers() if not buffer.requires_grad]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, before in saved:
                buffer.copy_(before)


def in_flight_peak(actions: Sequence[Action]) -> int:
    """The most microbatches between their forward and backward at once in ``actions``."""
    peak = held = 0
    for action in actions:
        held += {"F": 1, "B": -1}.get(action.kind, 0)
        peak = max(peak, held)
    return peak


class GraphedStage:
    """A stage module run with CUDA graphs per segment and microbatch: the first training step runs the
    segments' own ops and records their inputs, the next step captures them (``begin_step``), and later
    forwards replay them. ``reason`` says whether graphs are on, and why not where they are off."""

    def __init__(self, module: fx.GraphModule, plan: SegmentPlan, device: torch.device, precision: str,
                 mode: str):  # fmt: skip
        self.module, self.plan, self.device, self.precision, self.mode = module, plan, device, precision, mode
        self.split = split_at_segments(module, plan, SegmentCall)
        self.calls: list[SegmentCall] = [
            self.split.get_submodule(f"segment_{s.index}") for s in plan.segments
        ]
        self.captured: set[int] = set()
        self.active, self.checked = True, False
        self.first_step: int | None = None  # memory allocated when the first training step began
        self.reason = f"pending: {self._summary()}, captured at the second training step"

    def context(self):
        """What the stage's forward (and loss) runs in while graphs are on."""
        return capture_context(self.precision, self.device)

    def __call__(self, microbatch: int, *args):
        for call in self.calls:
            call.slot = microbatch
        return self.split(*args)

    def begin_step(self, actions: Sequence[Action]) -> None:
        """Before a training step: the first one measures the memory the stage's step takes; the next
        captures what the first recorded, under ``auto`` only where the device holds every microbatch's
        activations at once (``_room_for_graphs``). A capture that fails leaves the stage uncaptured,
        with the failure as the reason."""
        if not self.active:
            return
        if any(a.kind == "W" for a in actions):
            return self._off(uncaptured_reason(self.device.type, split=True))
        cuda = self.device.type == "cuda"
        if self.first_step is None:  # the first training step runs uncaptured and is measured
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            self.first_step = torch.cuda.memory_allocated(self.device) if cuda else 0
            return
        if self.mode == "auto" and not self.checked and cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            forwards, held = sum(a.kind == "F" for a in actions), in_flight_peak(actions)
            refusal = room_for_graphs(peak - self.first_step, peak, total, forwards, held)
            if refusal is not None:
                return self._off(f"{refusal} (HETCC_CUDA_GRAPHS=on captures anyway)")
        self.checked = True
        recorded = sorted(set(self.calls[0].samples) - self.captured)
        try:
            with _buffers_kept(self.module), self.context():
                for slot in recorded:
                    for call in self.calls:
                        call.capture(slot)
                    self.captured.add(slot)
        except Exception as error:  # noqa: BLE001 - any capture failure: run uncaptured, say why
            return self._off(f"capture failed: {type(error).__name__}: {(str(error) or '-').splitlines()[0]}")
        if self.captured:
            self.reason = f"on: {self._summary()} x {len(self.captured)} microbatches"

    def _summary(self) -> str:
        return f"{len(self.plan.segments)} segments ({sum(s.ops for s in self.plan.segments)} ops)"

    def _off(self, why: str) -> None:
        self.active, self.reason = False, f"off: {why}"
        for call in self.calls:
            call.forget()


def room_for_graphs(step_bytes: float, peak_bytes: float, device_bytes: float, forwards: int,
                    held: int) -> str | None:  # fmt: skip
    """Why a device cannot hold graphs for every microbatch of a step (None: it can). Graphs per
    microbatch keep each one's activations for good, where the schedule holds ``held`` of ``forwards``
    at once: the first step's peak (``peak_bytes``) grows by the activations of the others (each about
    the step's growth ``step_bytes`` / ``held``, and a tenth more for the graphs' static inputs), against
    90% of the device's memory."""
    per_microbatch = step_bytes / max(held, 1)
    need = peak_bytes + 1.1 * per_microbatch * max(forwards - held, 0)
    if need <= 0.9 * device_bytes:
        return None
    return (f"graphs for all {forwards} microbatches would need {need / 2**30:.1f} GiB of the device's "
            f"{device_bytes / 2**30:.1f} GiB (the schedule holds {held} at once)")  # fmt: skip


def uncaptured_reason(
    device_type: str, recompute: bool = False, split: bool = False, segments: Sequence | None = None
) -> str | None:
    """Why a stage runs uncaptured (None: nothing stops it): the one rule the runtime and the plan's
    note share. ``segments``: its ``plan_segments`` (None: not planned yet)."""
    if device_type != "cuda":
        return f"a {device_type} device (CUDA graphs need a CUDA device)"
    if recompute:
        return "the stage recomputes its forward in backward (torch.utils.checkpoint)"
    if split:
        return "the schedule splits the stage's backward (zero-bubble); a captured graph runs it whole"
    if segments is not None and not segments:
        return f"no run of {MIN_SEGMENT_OPS} or more ops between the stage's communication"
    return None


def graphs_for_stage(
    module: fx.GraphModule, device: torch.device, precision: str, *, recompute: bool, mode: str
) -> tuple[GraphedStage | None, str]:
    """The graphed form of a stage module on ``device`` (already there), or None and why graphs are
    off: ``mode`` off, not a CUDA device, a recomputed stage (``torch.utils.checkpoint`` runs its forward
    again in backward, outside any graph), or no run of compute long enough."""
    if mode == "off":
        return None, "off: config.cuda_graphs is off"
    plan = plan_segments(module.graph, device) if device.type == "cuda" and not recompute else None
    why = uncaptured_reason(device.type, recompute, segments=plan.segments if plan else ())
    if why is not None:
        return None, f"off: {why}"
    graphs = GraphedStage(module, plan, device, precision, mode)
    return graphs, graphs.reason


def graphs_note(
    stages: Sequence, on_gpu: Sequence[bool], recompute: Sequence[bool], mode: str, split: Sequence[bool] = ()
) -> str | None:
    """The plan's note on CUDA graphs for ``stages`` (``StageGraph``s; ``on_gpu`` / ``recompute`` /
    ``split``, its backward run as B and W, per stage): which stages the runtime will capture, with how
    many segments, and why the others run uncaptured. None where no stage runs on a GPU."""
    if not any(on_gpu):
        return None
    if mode == "off":
        return "cuda graphs: off (HETCC_CUDA_GRAPHS=off)"
    captured, uncaptured = [], []
    split = list(split) or [False] * len(stages)
    cuda = torch.device("cuda")
    for stage, gpu, recomputes, splits in zip(stages, on_gpu, recompute, split):
        segments = plan_segments(graph_for_device(stage, cuda), cuda).segments if gpu else None
        why = uncaptured_reason("cuda" if gpu else "cpu", recomputes, splits, segments)
        if why is None:
            captured.append(f"{stage.index} ({len(segments)} segment{'s' * (len(segments) != 1)})")
        else:
            uncaptured.append(f"stage {stage.index} uncaptured: {why}")
    when = "at the second step" + (
        " where the device holds every microbatch's graphs" if mode == "auto" else ""
    )
    parts = [f"stages {', '.join(captured)} captured {when}"] if captured else []
    return f"cuda graphs ({mode}): " + "; ".join(parts + uncaptured)
