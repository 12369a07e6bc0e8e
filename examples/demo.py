"""hetcc in a few minutes: plan GPT-2 medium over a mixed NVIDIA/AMD cluster, then train a scaled-down
copy of the same plan on local CPU processes and compare its loss with eager PyTorch.

Run from the repository root: ``make demo`` (or ``.venv/bin/python examples/demo.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no config notes between the demo's tables

import torch  # noqa: E402

import hetcc  # noqa: E402
from hetcc.ir import info  # noqa: E402
from hetcc.passes.codegen import codegen  # noqa: E402
from hetcc.passes.comm import split_stages  # noqa: E402
from hetcc.runtime.store import Pipeline  # noqa: E402

CLUSTER = Path(__file__).resolve().parent / "clusters" / "mixed_nvidia_amd.yaml"
OUT = Path("build/demo")
MICROBATCHES = 16
STEPS = 3
LR = 0.05


def main() -> None:
    from examples.models import gpt2_medium  # here, not at the top: the spawned ranks re-import this file

    start = time.perf_counter()
    cluster = hetcc.Cluster.from_file(CLUSTER)
    print("== cluster ==")
    print(cluster.describe())

    model, inputs = gpt2_medium(batch=64, seq=512)
    print(f"\n== GPT-2 medium (355 M params, meta device), {MICROBATCHES} microbatches of 4 x 512 tokens ==")
    compiled = hetcc.compile(model, cluster, example_kwargs=inputs, microbatches=MICROBATCHES, dump_dir=OUT)
    print(compiled.analysis.summary().split("\ncuts")[0])
    print("\n== plan (predicted step, lower bound, baselines) ==")
    print(compiled.explain())
    print(f"\nreport: {OUT / 'report.html'} (open it in a browser); IR after every pass: {OUT}/")
    print(f"planned in {time.perf_counter() - start:.0f} s")

    train_scaled_copy(compiled)
    print(f"\ndemo done in {time.perf_counter() - start:.0f} s")


def small_gpt2(layers: int):
    """GPT-2 with the same layer count (so the same block chain) but hidden 32 and random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def train_scaled_copy(planned) -> None:
    """Cut a small model exactly where the big plan cuts (block by block) and train it on CPU ranks."""
    layers = sum(name.startswith("transformer.h.") for s in planned.plan.stages for name in s.blocks)
    model = small_gpt2(layers)
    ids = torch.randint(0, 256, (MICROBATCHES, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    eager = copy.deepcopy(model)
    # the big plan's schedule, where it runs one stage per rank (the copy runs one rank per stage)
    schedule = planned.plan.schedule if planned.plan.chunks == 1 else "1f1b"
    small = hetcc.compile(model, CLUSTER, example_kwargs=batch, microbatches=MICROBATCHES, schedule=schedule)
    same_split = _same_split(small, planned.plan)
    stages = len(same_split.pipeline.stages)
    print(
        f"\n== the same {stages}-stage split (same blocks per stage) under {schedule}, GPT-2 with hidden 32, on "
        f"{stages} local CPU processes (one per stage; a replica group runs as one rank here) =="
    )
    started = time.perf_counter()
    result = hetcc.run_local(same_split, batch, steps=STEPS, optimizer={"name": "sgd", "lr": LR})
    print(f"({stages} processes started and trained {STEPS} steps in {time.perf_counter() - started:.0f} s)")
    print(f"{'step':>4} {'hetcc pipeline':>15} {'eager PyTorch':>14}")
    for step, (ours, reference) in enumerate(zip(result.losses, _eager_losses(eager, batch))):
        print(f"{step:>4} {ours:>15.6f} {reference:>14.6f}")


def _same_split(small, plan) -> object:
    """``small`` re-split so that every block runs in the stage the big plan gave it."""
    block_stage = {name: s.index for s in plan.stages for name in s.blocks}
    gm = small.graph
    stage_of = {
        n.name: block_stage[info(n).block] for n in gm.graph.nodes if info(n) is not None and info(n).block
    }
    stages = codegen(split_stages(gm, stage_of, len(plan.stages)))
    meta = dataclasses.replace(  # the small plan's settings, one CPU rank per stage of the big plan's split
        small.pipeline.meta, num_stages=len(plan.stages), placement=(), routing=(),
        recompute=[s.recompute for s in plan.stages], shard=(), deferred=(), warmup=(),  # the defaults here
    )  # fmt: skip
    return dataclasses.replace(small, pipeline=Pipeline(stages, meta))


def _eager_losses(model: torch.nn.Module, batch: dict) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    main()
