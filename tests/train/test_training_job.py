"""A real training job through hetcc's path: a byte-level GPT-2 trained on the Python standard library's
own source (tokenised by ``hetcc prepare-text``'s code), on four CPU ranks: stage 0, stage 1 replicated
twice, stage 2 (holding the head tied to stage 0's embedding), with AdamW and weight-decay groups,
warmup + cosine, and clipping at 1.0, against the same loop in one eager process on the same batches.
Also: resume with a shuffling DataLoader after a killed run, and a bad batch stopping every rank."""

from __future__ import annotations

import copy
import dataclasses
import email
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import gpt2
from torch.utils.data import DataLoader

import hetcc
from hetcc.errors import RuntimeFailure
from hetcc.ir import info
from hetcc.passes.codegen import codegen
from hetcc.passes.comm import split_stages
from hetcc.runtime.executor import FAULT_ENV
from hetcc.runtime.placement import ranks_for
from hetcc.runtime.store import Pipeline, save_stages
from hetcc.train.checkpoint import latest_complete_step
from hetcc.train.data import global_batches
from hetcc.train.optim import LRSchedule, param_groups
from hetcc.train.text import prepare_text
from hetcc.train.tokens import TokenDataset

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
M, ROWS, SEQ, STEPS = 4, 2, 32, 300
OPTIMIZER = {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1}
SCHEDULE = {"warmup_steps": 30, "decay": "cosine"}
STAGE_OF_BLOCK = {"embed": 0, "transformer.h.0": 0, "transformer.h.1": 1, "head": 2}
REPLICAS = (1, 2, 1)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """The standard library's email package (a real text corpus on every machine), byte-level."""
    out = tmp_path_factory.mktemp("tokens") / "stdlib-email"
    prepare_text(Path(email.__file__).parent, out, pattern="**/*.py", max_bytes=300_000)
    return out


@pytest.fixture(scope="module")
def job():
    """A small GPT-2 and its pipeline: 3 stages, the middle one on 2 replicas, microbatches routed 0/1."""
    model = gpt2(n_layer=2, n_embd=32, n_head=2, vocab=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    eager = copy.deepcopy(model)
    ids = torch.zeros(M * ROWS, SEQ, dtype=torch.int64)
    with hetcc.config.patch(
        fuse="off"
    ):  # the kernels are tested elsewhere; the interpreter would be slow here
        compiled = hetcc.compile(model, "examples/clusters/cpu4.yaml",
                                 example_kwargs={"input_ids": ids, "labels": ids}, microbatches=M)  # fmt: skip
    gm = compiled.graph
    stage_of = {
        n.name: STAGE_OF_BLOCK[info(n).block] for n in gm.graph.nodes if info(n) is not None and info(n).block
    }
    stages = codegen(split_stages(gm, stage_of, len(REPLICAS)))
    meta = dataclasses.replace(  # the compiled run's settings; this split's ranks and routing
        compiled.pipeline.meta, num_stages=len(REPLICAS), optimizer={"name": "adamw"},
        placement=ranks_for(REPLICAS), routing=[[m % count for m in range(M)] for count in REPLICAS], recompute=(), shard=(), deferred=(), warmup=(),
    )  # fmt: skip
    assert stages[0].tied and {0, 2} <= set(stages[0].tied[0].stages)  # the embedding tied to the head
    return dataclasses.replace(compiled, pipeline=Pipeline(stages, meta)), eager


def eager_training(model, dataset, steps: int, clip: float = 1.0, schedule: dict = SCHEDULE):
    """The same job in one process: global batch k, microbatch losses / M, clip, AdamW, the schedule."""
    model = copy.deepcopy(model)
    named = list(dict((id(p), (n, p)) for n, p in model.named_parameters()).values())
    optimizer = torch.optim.AdamW(param_groups(named, OPTIMIZER["weight_decay"]), lr=OPTIMIZER["lr"])
    scheduler = LRSchedule.from_spec(schedule, total_steps=steps).scheduler(optimizer)
    losses, norms = [], []
    for _, batch in zip(range(steps), global_batches(dataset, M * ROWS)):
        optimizer.zero_grad()
        step = []
        for ids, labels in zip(batch["input_ids"].chunk(M), batch["labels"].chunk(M)):
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            (loss / M).backward()
            step.append(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        losses.append(float(torch.stack(step).mean()))
        optimizer.step()
        scheduler.step()
    return losses, norms


def test_a_300_step_job_on_real_text_trains_like_eager_with_replicas_ties_schedule_and_clipping(job, tokens):
    pipeline, eager = job
    dataset = TokenDataset(tokens, SEQ)
    result = hetcc.run_local(pipeline, data=dataset, steps=STEPS, optimizer=OPTIMIZER, lr_schedule=SCHEDULE,
                             clip_grad_norm=1.0)  # fmt: skip
    want, want_norms = eager_training(eager, dataset, STEPS)
    got = result.losses
    assert len(got) == STEPS
    for step in range(10):
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[:10], want[:10])
    drift = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    assert max(drift) <= 5e-3, f"drifted {max(drift):.2e} at step {drift.index(max(drift))}"
    print(f"\nlosses {got[0]:.4f} -> {got[-1]:.4f} (eager {want[0]:.4f} -> {want[-1]:.4f}); largest "
          f"relative drift {max(drift):.2e} at step {drift.index(max(drift))}")  # fmt: skip
    assert statistics.fmean(got[-20:]) < 0.6 * got[0]  # clearly learning: ln 256 = 5.5 -> well under 3.4
    norms = [record["grad_norm"] for record in result.records]
    assert abs(norms[0] - want_norms[0]) <= 1e-6 * want_norms[0]  # the global norm, every parameter once
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms[:10], want_norms[:10]))
    assert [record["lr"] for record in result.records[:3]] == pytest.approx([3e-3 / 31, 6e-3 / 31, 9e-3 / 31])
    assert {"step_s", "tokens_per_s", "samples_per_s"} <= set(result.records[-1])
    assert result.records[-1]["tokens_per_s"] == pytest.approx(M * ROWS * SEQ / result.records[-1]["step_s"])


def test_resume_with_a_shuffling_loader_continues_bit_for_bit(job, tokens, tmp_path, monkeypatch):
    pipeline, _ = job
    loader = DataLoader(TokenDataset(tokens, SEQ), batch_size=M * ROWS, shuffle=True, drop_last=True)
    options = {"optimizer": OPTIMIZER, "lr_schedule": {**SCHEDULE, "total_steps": 6}, "clip_grad_norm": 1.0}
    straight = hetcc.run_local(pipeline, data=loader, steps=6, **options)
    monkeypatch.setenv(FAULT_ENV, "1:3")  # rank 1 (the first replica of stage 1) dies as step 3 starts
    with pytest.raises(RuntimeFailure, match="rank 1"):
        hetcc.run_local(
            pipeline, data=loader, steps=6, checkpoint_dir=tmp_path, checkpoint_every=1, **options
        )
    monkeypatch.delenv(FAULT_ENV)
    resumed = hetcc.run_local(pipeline, data=loader, steps=6 - 3, checkpoint_dir=tmp_path, resume=True,
                              **options)  # fmt: skip
    assert resumed.first_step == 3 and resumed.notes[0].startswith("resumed at step 3")
    assert resumed.losses == straight.losses[3:]
    assert [r["grad_norm"] for r in resumed.records] == [r["grad_norm"] for r in straight.records[3:]]


def test_a_bad_batch_stops_every_rank_with_the_step_and_the_input_named(job, tmp_path):
    pipeline, _ = job
    good = {
        "input_ids": torch.zeros(M * ROWS, SEQ, dtype=torch.int64),
        "labels": torch.zeros(M * ROWS, SEQ, dtype=torch.int64),
    }
    bad = {**good, "labels": torch.zeros(M * ROWS, SEQ + 1, dtype=torch.int64)}
    with pytest.raises(RuntimeFailure) as failure:
        hetcc.run_local(
            pipeline, data=[good, good, bad], steps=3, checkpoint_dir=tmp_path, checkpoint_every=1
        )
    assert (
        "step 2: input 'labels' (microbatch 0) has shape (2, 33); the pipeline was compiled for (2, 32)"
        in str(failure.value)
    )
    assert latest_complete_step(tmp_path, 3) == 2  # the last completed step, intact


def test_the_example_loop_on_the_per_rank_api_trains_like_eager_under_torchrun(job, tokens, tmp_path):
    """examples/train_loop.py: a user's own loop (AdamW with decay groups, warmup + cosine through
    torch's LambdaLR, clipping by the global norm, evaluation, a checkpoint) on 4 torchrun ranks."""
    compiled, eager = job
    save_stages(compiled.pipeline.stages, str(tmp_path / "build"), compiled.pipeline.meta)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(sum(REPLICAS)),
               str(ROOT / "examples" / "train_loop.py"), str(tmp_path / "build"), str(tokens), "20"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    got = [float(line.split()[3]) for line in lines if line.startswith("step ")]
    want, norms = eager_training(
        eager, TokenDataset(tokens, SEQ), 20, schedule={"warmup_steps": 10, "decay": "cosine"}
    )
    assert len(got) == 20 and all(abs(g - w) <= 1e-5 * w for g, w in zip(got, want)), (got, want)
    got_norms = [float(line.split()[5]) for line in lines if line.startswith("step ")]
    assert all(abs(g - w) <= 1e-5 * w for g, w in zip(got_norms, norms))
    assert lines[-1].startswith("val loss ")
    assert latest_complete_step(tmp_path / "build" / "my-checkpoints", len(REPLICAS)) == 20


def test_settings_given_at_resume_win_over_the_checkpoints_and_the_run_says_so(job, tmp_path):
    """Resuming with lr=0 changes no weight (before: the checkpoint's lr silently won)."""
    compiled, _ = job
    batch = {
        "input_ids": torch.randint(0, 256, (M * ROWS, SEQ)),
        "labels": torch.randint(0, 256, (M * ROWS, SEQ)),
    }
    hetcc.run_local(compiled, batch, steps=2, optimizer=OPTIMIZER, checkpoint_dir=tmp_path)
    before = hetcc.export(tmp_path)
    resumed = hetcc.run_local(compiled, batch, steps=1, optimizer={**OPTIMIZER, "lr": 0.0}, checkpoint_dir=tmp_path,
                              resume=True)  # fmt: skip
    assert "optimizer lr: 0.003 in the checkpoint, 0.0 now" in resumed.notes
    after = hetcc.export(tmp_path)
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert resumed.checkpoint_dir == str(tmp_path) and resumed.metrics == str(tmp_path / "metrics.jsonl")


def test_an_inference_build_runs_forward_only_and_says_so(tmp_path):
    model = gpt2(n_layer=2, n_embd=32, n_head=2, vocab=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 256, (M * ROWS, SEQ))
    with hetcc.config.patch(fuse="off"):
        compiled = hetcc.compile(model, "examples/clusters/cpu4.yaml", example_kwargs={"input_ids": ids, "labels": ids},
                                 microbatches=M, training=False)  # fmt: skip
    compiled.save(tmp_path / "build")
    result = hetcc.run_local(str(tmp_path / "build"), {"input_ids": ids, "labels": ids}, steps=2,
                             optimizer=OPTIMIZER, checkpoint_dir=tmp_path / "ckpt")  # fmt: skip
    assert "compiled for inference" in result.notes[0]
    assert result.losses[0] == result.losses[1]  # nothing trained: the same batch gives the same loss
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss
    assert abs(result.losses[0] - float(want)) <= 1e-5 * float(want)
    assert all(record["grad_norm"] is None for record in result.records)
    saved = hetcc.export(tmp_path / "ckpt")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
