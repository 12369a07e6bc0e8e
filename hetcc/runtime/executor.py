"""Run one stage's part of a pipeline schedule on this rank.

The executor runs the stage's own module (``stage.module``, the program ``stage<k>.py`` prints), whose
``hetcc::send``/``hetcc::recv`` ops move tensors through this rank's ``LinkTransport``; it only
interprets the actions of ``hetcc.solver.schedules.stage_actions``:

- ``F m``: run the module on microbatch ``m``: its recvs block (with the timeout) and its sends start
  non-blocking. A non-last stage keeps the send tokens; the last stage computes the loss.
- ``B m``: autograd backward from the tokens (each with gradient 1), whose ops take the gradients of
  what was sent from the transport and hand it the gradients of what was received; the last stage
  starts from ``loss_m / M``, so gradients are the mean over microbatches: full-batch gradients when the
  loss is a mean over equal microbatches. Then the transport sends the gradients back, in the order the
  plan fixes, and receives those no op asked for (``LinkTransport.settle_gradients``). Under a split
  schedule (zb-h1) ``B m`` computes only the gradients of what the stage received, and
- ``W m`` its weight gradients, from what ``B m`` kept (``runtime.split_backward``); it moves nothing.

A tensor-parallel stage's replica runs on t ranks (``passes.tensor_parallel``): each takes its part of
the weights, and the graph's collectives run over the replica's ranks (``Links.tensor``); gradients,
weights and checkpoints leave the executor whole (``named_grads``, ``state_dict``), gathered from the
parts. A replicated stage runs on several ranks, each with the actions of the microbatches routed to it
(``RankLayout.actions``). After the last action the sends are waited for, the replicas' gradients are
summed (all-reduce over the stage's replicas), tied parameters' gradients are summed over every rank
holding them (all replicas of their stages; ``runtime.tied``): each parameter then holds its full-batch gradient, for
the caller's optimizer (``hetcc.train``). Under interleaved 1F1B a rank runs several stages, one
executor each over the rank's one ``Links``: ``run_chunks`` runs each action on its chunk's stage, then
the sums once for the rank (a tied weight two of its stages hold is summed on the rank first). The
layout's ``recompute`` runs the forward under
``torch.utils.checkpoint`` (the transport replays what was received), its ``precision`` under autocast,
with loss scaling agreed by every rank for fp16 (``runtime.precision``). ``forward_only`` runs the
forwards alone, without gradients or dropout: an evaluation, or a build compiled for inference.

On a CUDA device the training forwards run the stage's compute between its sends and receives as CUDA
graphs (``runtime.cudagraphs``; ``config.cuda_graphs``), captured at the second step from the shapes of
the first; ``cuda_graphs`` says whether they are on, and why not where they are off.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from hetcc import config
from hetcc.collectives import part_shape, use_tensor_group
from hetcc.errors import RuntimeFailure
from hetcc.passes.codegen import module_for_device
from hetcc.passes.comm import StageGraph
from hetcc.passes.tensor_layout import take_part
from hetcc.runtime.cudagraphs import graphs_for_stage
from hetcc.runtime.groups import Links
from hetcc.runtime.layout import RankLayout
from hetcc.runtime.precision import LossScaler, forward_context
from hetcc.runtime.recorder import ActionRecorder
from hetcc.runtime.split_backward import DeferredWeights, input_gradients, weight_gradients
from hetcc.runtime.tied import post_parts, reduce_tied_grads
from hetcc.runtime.transport import LinkTransport
from hetcc.sendrecv import ANCHOR_NAME, use_transport
from hetcc.solver.schedules import Action

# Fault injection for tests of failure handling: "RANK:STEP" makes that rank exit at that step.
FAULT_ENV = "HETCC_FAULT_EXIT_AT"


@dataclass
class StepResult:
    """What one training step produced on this rank (losses and outputs only on the last stage)."""

    losses: list[torch.Tensor] = field(default_factory=list)  # per microbatch this rank ran
    outputs: list[tuple] = field(default_factory=list)  # per microbatch: the model's flat outputs, detached
    microbatches: list[int] = field(default_factory=list)  # which microbatch each loss/output is
    mean_loss: float | None = None  # over all M microbatches, every replica's (last stage only)
    skipped: bool = False  # fp16: an inf/nan gradient on some rank; gradients dropped, no update
    busy_s: float = 0.0  # wall time of this rank's F/B actions (its compute and the waits inside them)


class StageExecutor:
    """One stage on one rank: runs F/B actions through the stage module and leaves each parameter with
    its full-batch gradient (summed over replicas and tied holders; unscaled under fp16). The optimizer
    is the caller's (``hetcc.train``)."""

    def __init__(
        self,
        stage: StageGraph,
        links: Links,
        microbatches: int,
        loss_fn: Callable | None = None,
        device: torch.device | str = "cpu",
        layout: RankLayout | None = None,
    ):
        self.stage, self.links, self.microbatches, self.loss_fn = stage, links, microbatches, loss_fn
        self.device = torch.device(device)
        self.module = module_for_device(stage, self.device).to(self.device)
        self.part = layout.ranks[links.rank].tensor if layout is not None else 0
        if stage.tensor is not None:
            take_part(self.module, stage.tensor, self.part)
        self.recompute = layout is not None and layout.recompute[stage.index]
        self.precision = layout.precision if layout is not None else "fp32"
        self.scaler = LossScaler(**layout.loss_scale) if self.precision == "fp16-mixed" else None
        self.transport = LinkTransport(
            links, stage, layout, mixed_precision=self.precision != "fp32", keep_received=self.recompute
        )
        self.params = _unique_parameters(self.module)
        self.roots: dict[int, list[torch.Tensor]] = {}  # microbatch -> where its backward starts
        self.deferred: dict[int, DeferredWeights | None] = {}  # microbatch -> what its W needs
        self.recorder = ActionRecorder(links.rank)
        self.graphs, self._graphs_off = graphs_for_stage(
            self.module, self.device, self.precision, recompute=self.recompute,
            mode=config.cuda_graphs_mode(config.cuda_graphs),
        )  # fmt: skip

    @property
    def cuda_graphs(self) -> str:
        """Whether the stage's training forwards run as CUDA graphs, and why not where they do not
        (``on: ...`` / ``pending: ...`` / ``off: ...``), for the run's per-rank record."""
        return self.graphs.reason if self.graphs is not None else self._graphs_off

    def run(self, inputs: Mapping[int, dict], targets: Mapping[int, object] | None, actions: list[Action],
            step: int = 0, *, keep_outputs: bool = True) -> StepResult:  # fmt: skip
        """Forward and backward of every microbatch of ``actions`` (``inputs[m]``: model input name ->
        value; ``targets[m]``: the loss function's target), then the gradient sums, so each parameter
        holds its full-batch gradient. Under fp16 loss scaling the gradients are unscaled; if any rank
        found an inf or nan, every rank drops its gradients (an optimizer step then changes nothing).
        ``keep_outputs``: the last stage keeps each microbatch's outputs (detached, where they are: a
        language model's logits are the largest tensors of a step) in ``outputs``."""
        return run_chunks([self], inputs, targets, actions, step, keep_outputs=keep_outputs)

    def forward_only(self, inputs: Mapping[int, dict], targets: Mapping[int, object] | None,
                     actions: list[Action]) -> StepResult:  # fmt: skip
        """Forwards of ``microbatches`` without gradients and without dropout (an evaluation); buffers a
        forward updates (train-mode BatchNorm statistics) are restored after it."""
        return forward_chunks([self], inputs, targets, actions)

    def act(self, action: Action, inputs: Mapping[int, dict], targets: Mapping[int, object] | None,
            result: StepResult, split: bool, keep_outputs: bool = True) -> None:  # fmt: skip
        """Run one action of a training step (``run_chunks``); ``split``: the schedule splits backwards."""
        m = self.transport.microbatch = action.microbatch
        with use_transport(self.transport), use_tensor_group(self.links.tensor):
            if action.kind == "F":
                target = targets[m] if targets is not None else None
                self._forward(m, inputs[m], target, result, keep_outputs)
            elif action.kind == "B":
                self._backward(m, split)
            else:
                self._weights(m)

    def named_grads(self) -> dict[str, torch.Tensor]:
        """Gradients keyed by the model's parameter names (a tied parameter once); whole, on every part
        of a tensor-parallel replica (a collective there)."""
        grads = {}
        for local, name in self.stage.param_names.items():
            grad = self.module.get_parameter(local).grad
            if grad is not None and name not in grads:
                grads[name] = self.whole(local, grad.detach()).cpu().clone()
        return grads

    def whole(self, local: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` (this rank's part of weight ``local``, or of its gradient or optimizer state) made
        whole from every part's; itself where the weight is not split (a collective on split ones)."""
        shard = self._split(local)
        if shard is None:
            return value
        gathered = self.links.tensor.all_gather(value.contiguous(), shard.dim)
        return shard.whole(list(gathered.chunk(self.stage.tensor.degree, dim=shard.dim)))

    def part_of(self, local: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``value``, a whole weight ``local`` (or its state): ``whole``'s inverse."""
        shard = self._split(local)
        return value if shard is None else shard.part(value, self.part, self.stage.tensor.degree)

    def _split(self, local: str):
        """How weight ``local`` is split over the replica's parts (``ParamShard``); None: held whole."""
        shard = self.stage.tensor.params.get(local) if self.stage.tensor is not None else None
        return shard if shard is not None and shard.dim is not None else None

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this stage's execution: weights (whole) and buffers, and the fp16
        loss scale (JSON-able values only besides the tensors)."""
        state = {"module": {k: self.whole(k, v) for k, v in self.module.state_dict().items()}}
        if self.scaler is not None:
            state["loss_scale"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from ``state_dict()``'s output: values are copied in place (tied names share one)."""
        parts = {k: self.part_of(k, v) for k, v in state["module"].items()}
        result = self.module.load_state_dict(parts, strict=False)
        own = self.module.state_dict(keep_vars=True)
        loaded = {id(own[name]) for name in state["module"] if name in own}
        missing = [name for name in result.missing_keys if id(own[name]) not in loaded]  # aliases are fine
        if result.unexpected_keys or missing:
            raise RuntimeFailure(
                f"stage {self.stage.index}: checkpoint does not fit the stage: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}",
                hint="resume with the pipeline the checkpoint was written by",
            )
        if self.scaler is not None and state.get("loss_scale"):
            self.scaler.load_state_dict(state["loss_scale"])

    def _forward(self, m: int, inputs: dict, target, result: StepResult, keep_outputs: bool = True) -> None:
        args = [_to(inputs[name], self.device) for name in self.stage.inputs]
        training = torch.is_grad_enabled()
        graphed = training and self.graphs is not None and self.graphs.active
        with self.graphs.context() if graphed else forward_context(self.precision, self.device):
            if self.recompute and training:  # keeps the inputs only; backward runs the forward again
                outputs = checkpoint(self.module, *args, use_reentrant=False)
            elif graphed:
                outputs = self.graphs(m, *args)
            else:
                outputs = self.module(*args)
            loss = self._loss(outputs, _to(target, self.device), training) if self.stage.is_last else None
        if self.stage.is_last:
            if keep_outputs:
                result.outputs.append(tuple(_detach(o) for o in outputs))
            result.microbatches.append(m)
        roots = outputs  # the send tokens of a non-last stage
        if loss is not None:
            # a copy: under CUDA graphs the loss is a graph's output, which its next replay overwrites
            result.losses.append(loss.detach().float().clone())
            scaled = self.scaler.scale_loss(loss) if self.scaler is not None else loss
            roots = (scaled / self.microbatches,)
        if training:
            self.roots[m] = [root for root in roots if root.requires_grad]

    def _backward(self, m: int, split: bool = False) -> None:
        """B: the whole backward, or under a split schedule the gradient of the stage's inputs (what the
        previous stage waits for), keeping what ``_weights`` needs (``runtime.split_backward``). A
        recomputing stage runs it whole (its W then does nothing): W would run its forward a third time,
        receiving again (``schedules.splits_backward``; ZB-V's order gives every stage a W)."""
        roots = self.roots.pop(m)
        self.transport.replaying = self.recompute  # a forward op running now is the recomputation
        buffers = _buffer_snapshot(self.module) if self.recompute else []
        anchor = getattr(self.module, ANCHOR_NAME, None)
        try:
            if roots and split and not self.recompute and anchor is not None:
                self.deferred[m] = input_gradients(roots, anchor, self.params)
            elif roots:
                torch.autograd.backward(roots, [torch.ones_like(root) for root in roots])
        finally:
            self.transport.replaying = False
        with torch.no_grad():
            for buffer, before in buffers:
                buffer.copy_(before)
        self.transport.forget(m)
        self.transport.settle_gradients()

    def _weights(self, m: int) -> None:
        """W: the weight gradients ``_backward`` deferred for microbatch ``m`` (none where it ran whole)."""
        deferred = self.deferred.pop(m, None)
        if deferred is not None:
            weight_gradients(deferred)

    def _loss(self, outputs: tuple, target, required: bool) -> torch.Tensor | None:
        """``loss_fn(output, target)``, else the model's first output if it is a scalar loss; training
        needs one, a forward-only run goes without."""
        if self.loss_fn is not None and (target is not None or required):
            return self.loss_fn(outputs[0] if len(outputs) == 1 else outputs, target)
        first = outputs[0] if outputs else None
        if isinstance(first, torch.Tensor) and first.dim() == 0 and first.is_floating_point():
            return first
        if not required:
            return None
        raise RuntimeFailure(
            "the model's first output is not a scalar loss and no loss_fn was given",
            hint="pass loss_fn= and targets= (e.g. torch.nn.functional.cross_entropy)",
        )

    def _reduce_replica_grads(self) -> None:
        """Sum the gradients of the stage's replicas, in one flat all-reduce; a parameter no replica
        reached keeps ``None`` (as in eager, so the optimizer skips it). Tied parameters are summed
        over all their holders in ``runtime.tied`` instead."""
        if self.links.replicas is None:
            return
        tied = {id(self.module.get_parameter(name)) for group in self.stage.tied for s, name in group.members
                if s == self.stage.index}  # fmt: skip
        params = [p for p in self.params if id(p) not in tied]
        if not params:  # every replica of the stage holds the same parameters: all return here
            return
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
            + [torch.tensor([float(p.grad is not None) for p in params], device=self.device)]
        )
        self.links.sum_over_replicas(flat, f"gradient sum over the replicas of stage {self.stage.index}")
        offset = 0
        for param, reached in zip(params, flat[-len(params) :].tolist()):
            grad = flat[offset : offset + param.numel()].view_as(param)
            param.grad = grad.clone() if reached else None
            offset += param.numel()

    def _mean_loss(self, losses: list[torch.Tensor], count: int) -> float | None:
        """The mean over ``count`` microbatches, whichever replica ran them (None: no loss, as a model
        that returns only outputs gives when run forward only)."""
        total = torch.stack(losses).sum().reshape(1) if losses else torch.zeros(1, device=self.device)
        self.links.sum_over_replicas(total, "loss sum over the replicas of the last stage")
        return float(total) / count


def run_chunks(executors: Sequence[StageExecutor], inputs: Mapping[int, dict],
               targets: Mapping[int, object] | None, actions: list[Action], step: int = 0, *,
               keep_outputs: bool = True) -> StepResult:  # fmt: skip
    """One training step of a rank's stages (``executors[c]``: its chunk c's; one stage but under
    interleaved 1F1B): each action runs on its chunk's stage, then the sends are waited for once, each
    stage's replicas sum its gradients, the holders of each tied weight sum its gradient, and under fp16
    every rank agrees once whether to skip the step (``StageExecutor.run``)."""
    first = executors[0]
    _maybe_inject_fault(first.links.rank, step)
    for chunk, executor in enumerate(executors):
        if executor.graphs is not None:  # before any transfer of the step: none is in flight on this rank
            executor.graphs.begin_step([action for action in actions if action.chunk == chunk])
        for param in executor.params:
            param.grad = None
    result, posted = StepResult(), post_parts(executors)
    split = any(action.kind == "W" for action in actions)  # a zero-bubble schedule splits the backward
    for action in actions:
        with first.recorder.record(action.kind, action.microbatch, result, action.chunk):
            executors[action.chunk].act(action, inputs, targets, result, split, keep_outputs)
    first.links.wait_sends()
    for executor in executors:
        executor._reduce_replica_grads()
    reduce_tied_grads(executors, posted)
    result.skipped = _unscale(executors)
    _mean_loss_of_last(executors, result)
    first.recorder.end_step()
    return result


def forward_chunks(executors: Sequence[StageExecutor], inputs: Mapping[int, dict],
                   targets: Mapping[int, object] | None, actions: list[Action]) -> StepResult:  # fmt: skip
    """The forwards of ``actions`` on a rank's stages (``StageExecutor.forward_only``)."""
    result, first = StepResult(), executors[0]
    buffers = [pair for executor in executors for pair in _buffer_snapshot(executor.module)]
    with torch.no_grad(), without_dropout():
        for action in (action for action in actions if action.kind == "F"):
            executor, m = executors[action.chunk], action.microbatch
            executor.transport.microbatch = m
            with use_transport(executor.transport), use_tensor_group(executor.links.tensor):
                with first.recorder.record("F", m, result, action.chunk):
                    executor._forward(m, inputs[m], targets[m] if targets is not None else None, result)
        first.links.wait_sends()
        for buffer, before in buffers:
            buffer.copy_(before)
    if _mean_loss_of_last(executors, result):  # a model without a loss gives none
        result.mean_loss = result.mean_loss if result.losses or not result.microbatches else None
    return result


def _mean_loss_of_last(executors: Sequence[StageExecutor], result: StepResult) -> bool:
    """Set the step's mean loss where this rank runs the last stage; whether it does."""
    last = next((executor for executor in executors if executor.stage.is_last), None)
    if last is not None:
        result.mean_loss = last._mean_loss(result.losses, last.microbatches)
    return last is not None


def _unscale(executors: Sequence[StageExecutor]) -> bool:
    """fp16: unscale the gradients; if any rank found an inf or nan (the ranks agree on it, once per
    step), drop them all, so the step changes nothing, and adjust the scales. Whether it is skipped."""
    scaled = [executor for executor in executors if executor.scaler is not None]
    if not scaled:
        return False
    found_inf = [executor.scaler.unscale(p.grad for p in executor.params) for executor in scaled]
    found = scaled[0].links.any_rank(any(found_inf), "the ranks' agreement on skipping an fp16 step")
    for executor in scaled:
        if found:
            for param in executor.params:
                param.grad = None
        executor.scaler.update(found)
    return found


class without_dropout(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch.no_grad
    """Dropout off for an evaluation: an exported graph records ``aten.dropout(x, p, train=True)``, and
    attention's ``dropout_p``, as the module ran when traced, whatever its mode now; under this mode the
    dropouts return their input, attention runs with ``dropout_p`` 0, and a tensor-parallel stage's
    part of a dropout mask (``hetcc::dropout_mask``) keeps everything."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return args[0]
        if func is _ATTENTION:
            if len(args) > _ATTENTION_P:
                args = (*args[:_ATTENTION_P], 0.0, *args[_ATTENTION_P + 1 :])
            kwargs = {**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs else kwargs
        if func is torch.ops.hetcc.dropout_mask.default:  # (like, whole shape, p, dim, degree): nothing drawn
            like, shape, _, dim, degree = args
            return like.new_ones(part_shape(shape, dim, degree))
        return func(*args, **kwargs)


_aten = torch.ops.aten
_DROPOUTS = {_aten.dropout.default, _aten.feature_dropout.default, _aten.alpha_dropout.default,
             _aten.feature_alpha_dropout.default}  # fmt: skip
_ATTENTION, _ATTENTION_P = _aten.scaled_dot_product_attention.default, 4  # dropout_p's position


def _buffer_snapshot(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each buffer with a copy of its value: a recomputed forward updates running statistics (train-mode
    BatchNorm) a second time, and restoring the copies after backward undoes that."""
    return [(buffer, buffer.clone()) for buffer in module.buffers() if not buffer.requires_grad]


def _unique_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))


def _to(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _detach(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


def _maybe_inject_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec and spec == f"{rank}:{step}":
        os._exit(1)
