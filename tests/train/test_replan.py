"""Re-plan on a changed cluster: a run on three devices loses one, the same model is planned for the
two left, the checkpoint moves into the new stages, and training goes on as eager training would."""

from __future__ import annotations

import copy

import pytest
from models import eager_training, gpt2, token_ids

import hetcc

ADAM = {"name": "adamw", "lr": 0.01, "weight_decay": 0.1}  # two groups: biases and norms without decay


def _cpus(count: int) -> hetcc.Cluster:
    return hetcc.Cluster.from_spec(
        {"nodes": [{"name": "host", "intra_link": {"kind": "loopback", "bandwidth": "5 GB/s"},
                    "devices": [{"type": "cpu", "count": count, "memory": "2 GiB"}]}]}
    )  # fmt: skip


@pytest.mark.slow
def test_three_stages_become_two_and_training_continues_like_eager(tmp_path):
    model = gpt2(n_layer=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(4, 16)
    example = {"input_ids": ids, "labels": ids, "use_cache": False}
    batch = {"input_ids": ids, "labels": ids}
    compiled = hetcc.compile(
        copy.deepcopy(model), _cpus(3), example_kwargs=example, microbatches=4, replicate=False
    )
    assert len(compiled.stages) == 3
    first = hetcc.run_local(compiled, batch, steps=2, optimizer=ADAM, checkpoint_dir=tmp_path / "ckpt")

    # no replicate=False here: the old build's is kept
    replanned = hetcc.replan(tmp_path / "ckpt", _cpus(2), copy.deepcopy(model), example_kwargs=example,
                             out=tmp_path / "two")  # fmt: skip
    assert len(replanned.stages) == 2
    second = hetcc.run_local(tmp_path / "two", batch, steps=2, optimizer=ADAM,
                             checkpoint_dir=tmp_path / "two" / "checkpoints", resume=True)  # fmt: skip

    want, _ = eager_training(model, example, None, None, 4, 2, ADAM)
    got = first.losses + second.losses
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


def test_replan_keeps_the_old_builds_precision_and_plan_space_unless_told(tmp_path):
    from hetcc.api.replanning import plan_space_options
    from hetcc.errors import PlanFormatError
    from hetcc.hardware.schema import Where
    from hetcc.runtime.contract import PipelineMeta, PlanSpace, read_meta

    space = PlanSpace(replicate=False, recompute=True, shard=1, tensor_parallel="auto")
    meta = PipelineMeta(1, precision="bf16-mixed", plan_space=space)
    assert plan_space_options(meta) == {
        "precision": "bf16-mixed",
        "replicate": False,
        "recompute": True,
        "shard": 1,
        "tensor_parallel": "auto",
    }
    default = plan_space_options(PipelineMeta(1))
    assert default == {
        "precision": "fp32", "replicate": True, "recompute": "auto", "shard": "auto", "tensor_parallel": False
    }  # fmt: skip
    where = Where(str(tmp_path / "pipeline.json"), error=PlanFormatError).at("meta")
    assert plan_space_options(read_meta({}, 1, where, version=1)) == default  # an older build
    bad_spaces = ({"replicate": 1}, {"recompute": 1}, {"tensor_parallel": 1}, {"tensor_parallel": True})
    for bad in ({"precision": ["fp32"]}, *({"plan_space": space} for space in bad_spaces)):
        with pytest.raises(PlanFormatError, match=r"pipeline.json: meta\.(precision|plan_space)"):
            read_meta(bad, 1, where, version=1)


def test_a_checkpoint_whose_stages_wrote_their_ranks_names_whole_is_read_by_each_stages_own():
    """Before each stage of a rank of several stages kept its own parameters' names, every stage's file
    held the names of the whole rank: the stage's own are taken, in order; a tied weight both stages
    hold leaves no way to tell its two copies apart, and is refused with the file named."""
    from hetcc.errors import PlanFormatError
    from hetcc.train.replan import _own_names

    rank = ["embed.weight", "norm.weight", "head.weight"]  # stages 0 (embed) and 5 (norm, head) on one rank
    assert _own_names(rank, ["norm.weight", "head.weight"], 2, ("ckpt", 5, 3)) == [
        "norm.weight",
        "head.weight",
    ]
    tied = ["embed.weight", "norm.weight", "embed.weight"]
    with pytest.raises(PlanFormatError, match=r"step-00000003: the optimizer state of stage 0 does not say"):
        _own_names(tied, ["embed.weight"], 1, ("ckpt", 0, 3))
