"""``PipelineRank``: this process's part of a compiled pipeline, for a training loop of one's own.

In the spirit of ``torch.distributed.pipelining``'s ``schedule.step(...)``: every rank runs the same loop,
and hetcc runs the schedule inside ``step``::

    rank = hetcc.train.PipelineRank.join("build/")          # under torchrun: this rank's stage, checked
    optimizer = torch.optim.AdamW(hetcc.train.param_groups(rank.named_parameters(), 0.1), lr=3e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))
    for batch in rank.data(dataset):                          # this rank's share of global batch k
        out = rank.step(batch)                                # forward + backward of its microbatches
        norm = rank.clip_grad_norm_(1.0)                      # the global norm, over every stage and replica
        optimizer.step(); scheduler.step()
        if rank.is_last: print(out.mean_loss)

After ``step`` each parameter holds its full-batch gradient (the mean over microbatches, summed over the
stage's replicas and over the holders of a tied weight), as after ``loss.backward()`` in eager PyTorch;
under fp16 loss scaling it is unscaled, and a step with an inf or nan on any rank leaves every gradient
``None`` (``out.skipped``), so ``optimizer.step()`` changes nothing. The loss is known on the last stage.
Collectives (``step``, ``clip_grad_norm_``, ``grad_norm``, ``evaluate``, ``save``, ``load``) must be
called by every rank, in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from hetcc import config
from hetcc.errors import HetccError, RuntimeFailure
from hetcc.runtime.executor import StageExecutor, StepResult, forward_chunks, run_chunks
from hetcc.runtime.groups import Links
from hetcc.runtime.layout import RankLayout
from hetcc.runtime.store import read_outline
from hetcc.runtime.torchrun import start_process_group
from hetcc.train import checkpoint as ckpt
from hetcc.train.data import RankBatch, RankData, share_of
from hetcc.train.optim import build_optimizer
from hetcc.train.startup import agree_on_start, load_rank, rank_inputs


@dataclass(frozen=True)
class Resumed:
    """What ``PipelineRank.load`` found: the step to continue from and what the loop saved with it."""

    step: int
    train: dict[str, Any]  # the loop's own record (data position, settings), as saved


class PipelineRank:
    """One rank of a compiled pipeline folder: its stage (or replica of it), under torch.distributed
    (already initialised; ``join`` initialises it under torchrun)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        rank: int,
        *,
        device: torch.device | str = "cpu",
        loss_fn: Callable | None = None,
        schedule: str | None = None,
        timeout_s: float | None = None,
        seed: int = 0,
    ):
        self.directory = os.fspath(directory)
        try:  # what this rank reads: pipeline.json and its own stage's files
            self.outline, self.stages = load_rank(self.directory, rank)
            meta = self.outline.meta
            self.microbatches, self.schedule = meta.microbatches, schedule or meta.schedule
            self.layout = RankLayout.from_meta(meta)
            failure = None
        except HetccError as error:
            failure = error
        agree_on_start(rank, failure)  # a rank that cannot start stops every rank, now, with its cause
        self.rank, self.placement = rank, self.layout.ranks[rank]
        self.device = torch.device(device)
        self.training = self.outline.meta.training  # False: compiled for inference
        self.owns_group = False
        self.substitute: dict | None = None  # under join: the device found in place of the planned one
        # the rank's own draws (dropout): runs repeat exactly; the parts of a tensor-parallel replica
        # draw alike, as they compute the replicated tensors alike
        torch.manual_seed(seed + rank - self.placement.tensor)
        self.links = self._links(timeout_s)
        self.executors = [  # one per stage it runs: several under interleaved 1F1B and ZB-V, by chunk
            StageExecutor(stage, self.links, self.microbatches, loss_fn, self.device, self.layout)
            for stage in self.stages
        ]
        self.loss_fn, self.steps_done = loss_fn, 0
        self.needs = rank_inputs(self.outline, self.layout, rank, loss_fn is not None, self.stages)

    @classmethod
    def join(
        cls,
        directory: str | os.PathLike,
        *,
        loss_fn: Callable | None = None,
        allow_substitute: bool = False,
        seed: int = 0,
    ) -> PipelineRank:
        """This process's rank of the job torchrun started: its rank from the placement, its planned
        device (checked against what it found), and the process group, then the rank itself."""
        outline = read_outline(os.fspath(directory))
        rank, device, substitute = start_process_group(os.fspath(directory), outline.meta, allow_substitute)
        joined = cls(directory, rank, device=device, loss_fn=loss_fn, seed=seed)
        joined.owns_group, joined.substitute = True, substitute
        return joined

    # ---------------------------------------------------------------------------------- what it is

    @property
    def world_size(self) -> int:
        return self.layout.num_ranks

    @property
    def stage_index(self) -> int:
        return self.placement.stage

    @property
    def replica(self) -> int:
        return self.placement.replica

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    @property
    def seq_len(self) -> int:
        """The sequence length the pipeline was traced with (``PipelineOutline.seq_len``)."""
        return self.outline.seq_len

    @property
    def part(self) -> int:
        """This rank's part of its replica (0 unless the stage is tensor parallel)."""
        return self.placement.tensor

    @property
    def reports(self) -> bool:
        """The one rank that reports a run's figures: the last stage's first replica's first part (it
        has the loss)."""
        return self.is_last and self.replica == 0 and self.part == 0

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's trainable parameters by the model's names, stage by stage: a tied weight once per
        stage holding it (two stages of one rank under interleaved 1F1B hold a copy each, which their
        equal gradients keep equal)."""
        seen: set[int] = set()
        named = []
        for executor in self.executors:
            names = executor.stage.param_names
            for local, param in executor.module.named_parameters():
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    named.append((names.get(local, local), param))
        return named

    def named_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient this rank holds, by the model's parameter names (``StageExecutor.named_grads``)."""
        return {name: grad for executor in self.executors for name, grad in executor.named_grads().items()}

    @property
    def cuda_graphs(self) -> str:
        """Whether its stages' forwards run as CUDA graphs, and why not (``StageExecutor.cuda_graphs``)."""
        return "; ".join(dict.fromkeys(executor.cuda_graphs for executor in self.executors))

    @property
    def parameter_bytes(self) -> int:
        """The weights this rank holds (on a tensor-parallel stage its parts of the split ones)."""
        return sum(p.numel() * p.element_size() for e in self.executors for p in e.module.parameters())

    def parameters(self) -> list[torch.nn.Parameter]:
        return [param for _, param in self.named_parameters()]

    @property
    def shards_optimizer(self) -> bool:
        """Whether the plan shards this stage's optimizer state over its replicas (ZeRO-1)."""
        return self.training and self.outline.meta.shard[self.stage_index] and self.links.replicas is not None

    def optimizer(self, spec: Mapping[str, Any] | None) -> torch.optim.Optimizer | None:
        """The optimizer ``spec`` names (``{"name": "adamw", "lr": ...}``: ``hetcc.train.optim``) over this
        rank's parameters; on a stage the plan shards, torch's ``ZeroRedundancyOptimizer`` over its
        replicas (each steps its share of the parameters and broadcasts them: same weights, 1/r of the
        state). A loop of one's own that builds a plain ``torch.optim`` optimizer keeps the state whole."""
        group = self.links.replicas[0] if self.shards_optimizer else None
        return build_optimizer(spec, self.named_parameters(), shard_group=group)

    # ---------------------------------------------------------------------------------- running

    def data(self, data: Any, *, seed: int = 0, position: int = 0) -> RankData:
        """This rank's share of each global batch of ``data`` (``hetcc.train.data``), from ``position``."""
        return RankData(data, self.needs, seed=seed, position=position)

    def step(self, batch: RankBatch | Mapping[str, Any], *, keep_outputs: bool = True) -> StepResult:
        """One training step: forward and backward of this rank's microbatches, gradients summed (see the
        module docstring). ``batch``: from ``data()``, or one global batch as a dict (this rank takes the
        inputs its stage reads; a batch without them fails here, naming the input). ``keep_outputs``
        False: the last stage keeps no outputs (they stay where they are, detached, until the next step
        otherwise)."""
        if not self.training:
            raise HetccError(
                f"{self.directory} was compiled for inference: it runs forward only",
                hint="call evaluate(batch), or compile without --inference / with training=True",
            )
        share = self._share(batch)
        actions = self.layout.actions(self.schedule, self.rank)
        result = run_chunks(
            self.executors,
            share.inputs,
            share.targets,
            actions,
            step=self.steps_done,
            keep_outputs=keep_outputs,
        )
        self.steps_done += 1
        return result

    def evaluate(self, batch: RankBatch | Mapping[str, Any]) -> StepResult:
        """Forward only, without gradients or dropout: ``mean_loss`` on the last stage (None when the
        model returns no loss), ``outputs`` per microbatch there."""
        share = self._share(batch)
        actions = self.layout.actions(self.schedule, self.rank, training=False)
        return forward_chunks(self.executors, share.inputs, share.targets, actions)

    def grad_norm(self, norm_type: float = 2.0) -> float:
        """The norm of the whole model's gradient, each parameter counted once (its first replica; a tied
        weight on the first stage holding it), as ``torch.nn.utils.clip_grad_norm_`` computes it."""
        norm_type = float(norm_type)
        norms = [torch.linalg.vector_norm(g.detach(), norm_type).double() for g in self._counted_grads()]
        inf = norm_type == float("inf")
        local = (
            (torch.stack(norms).max() if inf else torch.stack(norms).pow(norm_type).sum()) if norms else None
        )
        value = float(local) if local is not None else 0.0
        total = self.links.reduce_world(value, "max" if inf else "sum", "the gradient norm over every rank")
        return total if inf else total ** (1.0 / norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale every gradient so the global norm is at most ``max_norm`` (``clip_grad_norm_``'s rule);
        returns the norm before clipping, the same on every rank."""
        total = self.grad_norm(norm_type)
        coefficient = torch.clamp(max_norm / (torch.tensor(total, dtype=torch.float32) + 1e-6), max=1.0)
        grads = [p.grad for executor in self.executors for p in executor.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coefficient.to(grads[0].device))
        return total

    # ---------------------------------------------------------------------------------- state

    def save(self, directory: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
             train: Mapping[str, Any] | None = None) -> None:  # fmt: skip
        """Checkpoint this rank at ``steps_done`` (``hetcc.train.checkpoint``): replica 0 writes the
        stage (weights, optimizer state, loss scale, RNG, ``train``: the loop's JSON-able record), each
        stage it runs to its own files; another replica only its RNG; the parts of a tensor-parallel
        replica 0 first gather its weights and optimizer state whole to part 0, which writes them."""
        directory, step = os.fspath(directory), self.steps_done
        rng = ckpt.rng_state(self.device)
        if isinstance(optimizer, ZeroRedundancyOptimizer):  # every replica sends replica 0 its shard
            optimizer.consolidate_state_dict(to=0)
        if self.replica:
            if not self.part:
                ckpt.save_replica_rng(directory, self.stage_index, self.replica, step, rng)
            return
        whole = optimizer.state_dict() if optimizer else None
        for executor in self.executors:
            state = {**executor.state_dict(), "rng": rng, "train": dict(train or {})}
            if optimizer is not None and len(self.executors) > 1:  # each stage's files keep its own part
                mine = ckpt.stage_optimizer_state(whole, self._positions(optimizer, executor))
            else:
                mine = whole
            state["optimizer"] = (
                self._optimizer_state(mine, optimizer, executor, executor.whole) if mine else None
            )
            if not self.part:
                ckpt.save_checkpoint(directory, executor.stage.index, step, state)
                ckpt.prune(directory, executor.stage.index)

    def load(self, directory: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> Resumed:
        """Continue from the newest step every rank has complete (the ranks agree on it): weights, the
        optimizer's state (its hyper-parameters too: set the run's own after, see ``optim.apply_settings``),
        loss scale and RNG. Returns that step and the loop's record."""
        directory = os.fspath(directory)
        steps = [ckpt.latest_stage_step(directory, executor.stage.index) for executor in self.executors]
        mine = -1 if None in steps else min(steps)
        step = int(
            self.links.reduce_world(mine, "min", "the ranks' agreement on the checkpoint to resume from")
        )
        if step < 0:
            raise RuntimeFailure(
                f"{directory}: no complete checkpoint of every stage to resume from",
                hint="run with a checkpoint folder first; a step folder without a stage's manifest is incomplete",
            )
        states = [ckpt.load_checkpoint(directory, executor.stage.index, step) for executor in self.executors]
        for executor, state in zip(self.executors, states):
            executor.load_state_dict(state)
        if optimizer is not None and states[0].get("optimizer") is not None:
            parts = [
                (self._optimizer_state(state["optimizer"], optimizer, executor, executor.part_of),
                 self._positions(optimizer, executor))
                for executor, state in zip(self.executors, states)
            ]  # fmt: skip
            optimizer.load_state_dict(ckpt.merged_optimizer_state(parts, optimizer))
        rng = ckpt.load_replica_rng(directory, self.stage_index, self.replica, step) if self.replica else None
        ckpt.set_rng_state(rng or states[0]["rng"], self.device)
        self.steps_done = step
        return Resumed(step, dict(states[0].get("train") or {}))

    def close(self, *, finished: bool = True) -> None:
        """Leave the process group if ``join`` started it. ``finished`` (every rank got here): first wait
        for every rank, so none tears its connections down while a peer still uses them (ranks exiting
        at different times have ended in "terminate called without an active exception" under
        torchrun); after a failure the peers may be gone, so no wait."""
        if self.owns_group and dist.is_initialized():
            if finished:
                self.links.wait(dist.barrier(async_op=True), "every rank at the end of the run", None)
            dist.destroy_process_group()

    # ---------------------------------------------------------------------------------- inside

    def _links(self, timeout_s: float | None) -> Links:
        vendors = self.layout.vendors()
        if self.device.type == "cpu":  # a GPU plan checked on CPU ranks: every link is gloo
            vendors = ["cpu"] * self.layout.num_ranks
        tied_ranks = [self.layout.holders(group.stages) for group in self.stages[0].tied]
        timeout_s = config.comm_timeout_s if timeout_s is None else timeout_s
        return Links(
            vendors, tied_ranks, timeout_s, self.device,
            replica_ranks=self.layout.replica_groups(), tensor_ranks=self.layout.tensor_groups(),
            channels=self.layout.channels(self.schedule, [s.peers for s in self.outline.stages]),
        )  # fmt: skip

    def _share(self, batch: RankBatch | Mapping[str, Any]) -> RankBatch:
        if isinstance(batch, RankBatch):
            return batch
        if not self.needs.reads_data:
            return RankBatch(self.steps_done, {m: {} for m in self.needs.mine})
        return share_of(batch, replace(self.needs, model_inputs=()), self.steps_done)

    def _optimizer_state(
        self,
        state: dict,
        optimizer: torch.optim.Optimizer,
        executor: StageExecutor,
        convert: Callable[[str, torch.Tensor], torch.Tensor],
    ) -> dict:
        """One stage's optimizer state ``state`` (its parameters numbered in the optimizer's order) with
        every tensor shaped like its parameter passed through ``convert(local name, tensor)``: whole from
        this rank's parts (``StageExecutor.whole``) or back (``part_of``); unchanged unless the stage is
        tensor parallel."""
        if executor.stage.tensor is None:
            return state
        local = {id(p): name for name, p in executor.module.named_parameters(remove_duplicate=False)}
        every = [p for group in optimizer.param_groups for p in group["params"]]
        params = [every[index] for index in self._positions(optimizer, executor)]
        converted = {}
        for index, values in state["state"].items():
            name = local[id(params[index])]
            converted[index] = {
                key: convert(name, value) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                for key, value in values.items()
            }
        return {**state, "state": converted}

    @staticmethod
    def _positions(optimizer: torch.optim.Optimizer, executor: StageExecutor) -> list[int]:
        """Where ``executor``'s parameters are in ``optimizer``'s numbering (its state dict's), in order."""
        mine = {id(p) for p in executor.params}
        every = [p for group in optimizer.param_groups for p in group["params"]]
        return [index for index, param in enumerate(every) if id(param) in mine]

    def _counted_grads(self) -> list[torch.Tensor]:
        """The gradients this rank counts in the global norm: none on a replica other than the first; a
        tied weight only on the first stage that holds it; on a tensor-parallel replica's other parts
        only their parts of split weights (the others are the same on every part)."""
        if self.replica:
            return []
        grads = []
        for executor in self.executors:
            module, index = executor.module, executor.stage.index
            if self.part:
                named = (module.get_parameter(name).grad for name in executor.stage.tensor.sharded_params)
                grads += [grad for grad in named if grad is not None]
                continue
            not_mine = {
                id(module.get_parameter(local))
                for group in executor.stage.tied
                for stage, local in group.members
                if stage == index and min(group.stages) != index
            }
            grads += [p.grad for p in executor.params if p.grad is not None and id(p) not in not_mine]
        return grads
