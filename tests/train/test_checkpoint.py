"""Checkpoints: atomic per-stage files with a checksummed manifest, bit-identical resume, and export of
the trained weights as one state dict the model loads."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from runtime_models import GPT2_RULES, export, stages_by_module, tiny_gpt2

import hetcc
from hetcc.errors import RuntimeFailure
from hetcc.passes.comm import split_stages
from hetcc.runtime.contract import PipelineMeta
from hetcc.runtime.executor import FAULT_ENV
from hetcc.runtime.placement import ranks_for
from hetcc.runtime.store import Pipeline, save_stages
from hetcc.train import checkpoint as ckpt
from hetcc.train.local import run_local

ADAM = {"name": "adam", "lr": 0.01}
CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight


def _trained_state(step: int = 3) -> dict:
    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(step):
        model.b(model.a(torch.randn(2, 4))).sum().backward()
        optimizer.step()
    return {"module": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "rng": ckpt.rng_state(torch.device("cpu")), "loss_scale": {"scale": 1024.0, "good_steps": 3}}  # fmt: skip


def test_a_checkpoint_round_trips_weights_optimizer_state_rng_and_step(tmp_path):
    state = _trained_state()
    ckpt.save_checkpoint(tmp_path, 0, 3, state)
    loaded = ckpt.load_checkpoint(tmp_path, 0, 3)
    assert loaded["step"] == 3 and torch.equal(loaded["rng"]["cpu"], state["rng"]["cpu"])
    assert loaded["loss_scale"] == {"scale": 1024.0, "good_steps": 3}
    assert set(loaded["module"]) == {"a.weight", "a.bias", "b.bias"}  # the tied weight once
    for name, tensor in loaded["module"].items():
        assert torch.equal(tensor, state["module"][name])
    restored = torch.optim.Adam(Tied().parameters(), lr=0.1)
    restored.load_state_dict(loaded["optimizer"])
    for index, entry in state["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(restored.state_dict()["state"][index][key], value)
    folder = ckpt.step_dir(tmp_path, 3)
    assert sorted(p.name for p in folder.iterdir()) == [
        "stage0.json",
        "stage0.manifest.json",
        "stage0.safetensors",
    ]
    manifest = json.loads((folder / "stage0.manifest.json").read_text())
    assert set(manifest["files"]) == {"stage0.json", "stage0.safetensors"}


def test_a_crash_mid_write_leaves_the_previous_checkpoint_in_use(tmp_path):
    for stage in (0, 1):
        ckpt.save_checkpoint(tmp_path, stage, 2, _trained_state(2))
        ckpt.save_checkpoint(tmp_path, stage, 4, _trained_state(4))
    assert ckpt.latest_complete_step(tmp_path, 2) == 4
    (ckpt.step_dir(tmp_path, 4) / "stage1.manifest.json").unlink()  # died before its manifest
    (ckpt.step_dir(tmp_path, 4) / ".stage1.safetensors.tmp-123").write_bytes(b"half a file")
    assert ckpt.latest_complete_step(tmp_path, 2) == 2
    assert ckpt.latest_stage_step(tmp_path, 0) == 4 and ckpt.latest_stage_step(tmp_path, 1) == 2
    weights = ckpt.step_dir(tmp_path, 4) / "stage0.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte: the checksum no longer matches
    weights.write_bytes(bytes(data))
    assert not ckpt.stage_is_complete(tmp_path, 0, 4)
    with pytest.raises(hetcc.PlanFormatError, match="checksums do not match"):
        ckpt.load_checkpoint(tmp_path, 0, 4)
    with pytest.raises(hetcc.PlanFormatError, match=r"no checkpoint of step 3 \(steps saved: 2, 4\)"):
        ckpt.load_checkpoint(tmp_path, 0, 3)  # a step pruned, or never saved


class DropoutMLP(torch.nn.Module):
    """Dropout on stage 1 draws from that rank's RNG: a resume is bit-identical only if it is restored."""

    def __init__(self):
        super().__init__()
        self.a, self.drop, self.b = torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x))))


def _replicated(stages):
    """Stage 1 on two replicas (ranks 1 and 2); microbatch 1 of each step runs on replica 1."""
    return Pipeline(
        stages, PipelineMeta(2, microbatches=2, placement=ranks_for([1, 2]), routing=[[0, 0], [0, 1]])
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one-rank-per-stage", "replicated"])
def test_resume_after_a_killed_rank_is_bit_identical_to_an_uninterrupted_run(tmp_path, monkeypatch, layout):
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    gm = export(DropoutMLP().train(), (x[:4],))
    stages = split_stages(gm, stages_by_module(gm, [("a", 0), ("drop", 1), ("b", 1)]), 2)
    pipeline, dying = (stages, 1) if layout == "one-rank-per-stage" else (_replicated(stages), 2)

    def run(folder, steps, **options):
        return run_local(
            pipeline, {"x": x}, y, F.mse_loss, steps=steps, microbatches=2, optimizer=ADAM,
            checkpoint_dir=tmp_path / folder, checkpoint_every=2, **options,
        )  # fmt: skip

    straight = run("straight", 4)
    monkeypatch.setenv(FAULT_ENV, f"{dying}:3")  # the rank dies at the start of its fourth step
    with pytest.raises(RuntimeFailure, match=f"rank {dying} exited with code 1"):
        run("interrupted", 4)
    monkeypatch.delenv(FAULT_ENV)
    assert ckpt.latest_complete_step(tmp_path / "interrupted", 2) == 2
    resumed = run("interrupted", 2, resume=True)
    assert resumed.losses == straight.losses[2:]
    assert ckpt.latest_complete_step(tmp_path / "interrupted", 2) == 4
    want, got = hetcc.export(tmp_path / "straight"), hetcc.export(tmp_path / "interrupted")
    assert set(got) == set(want) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert all(torch.equal(got[name], want[name]) for name in want)
    for stage in (0, 1):  # optimizer state too
        a = ckpt.load_checkpoint(tmp_path / "straight", stage, 4)["optimizer"]["state"]
        b = ckpt.load_checkpoint(tmp_path / "interrupted", stage, 4)["optimizer"]["state"]
        assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


def _gpt2_stages():
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    example = {"input_ids": ids[:2], "labels": ids[:2].clone(), "use_cache": False}
    gm = export(model, kwargs=example)
    return model, ids, split_stages(gm, stages_by_module(gm, GPT2_RULES), 3)


def _recorded(model) -> PipelineMeta:
    """The meta ``hetcc.compile`` saves: the keys of ``model.state_dict()`` that ``hetcc.export`` returns."""
    from hetcc.api import _state_dict_keys

    return PipelineMeta(3, state_dict=_state_dict_keys(model))


def test_export_of_a_build_folder_is_exactly_the_models_state_dict(tmp_path):
    model, _, stages = _gpt2_stages()
    save_stages(stages, str(tmp_path / "build"), _recorded(model))
    merged = hetcc.export(tmp_path / "build", tmp_path / "model.safetensors")
    written = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    for state in (merged, written):  # every name of the tied weight, in the file a copy for each
        assert set(state) == set(model.state_dict())
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        copy.deepcopy(model).load_state_dict(state)  # strict


def test_a_folder_without_the_recorded_keys_exports_a_tied_weight_once_in_the_file(tmp_path):
    """Older builds (and ``save_stages`` without meta): every tensor the stages hold, by model name."""
    model, _, stages = _gpt2_stages()
    save_stages(stages, str(tmp_path / "build"))
    merged = hetcc.export(tmp_path / "build", tmp_path / "model.safetensors")
    assert set(merged) == set(model.state_dict())
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())
    model.load_state_dict(merged)  # strict
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys, aliases = set(f.keys()), json.loads(f.metadata()["hetcc.aliases"])
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    assert aliases == {"lm_head.weight": "transformer.wte.weight"}


class Unused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_export_warns_of_state_dict_keys_no_stage_holds(tmp_path):
    model = Unused()
    compiled = hetcc.compile(model, CLUSTERS / "cpu4.yaml", (torch.randn(4, 4),), microbatches=1)
    folder = compiled.save(tmp_path / "build")
    with pytest.warns(UserWarning, match=r"no stage holds \['unused.weight', 'unused.bias'\]"):
        merged = hetcc.export(folder)
    assert set(merged) == {"used.weight", "used.bias"}


@pytest.mark.slow
def test_trained_weights_are_saved_at_the_end_and_export_loads_into_the_model(tmp_path):
    model, ids, stages = _gpt2_stages()
    run_local(
        Pipeline(stages, _recorded(model)), {"input_ids": ids, "labels": ids}, steps=1, microbatches=2,
        optimizer=ADAM, checkpoint_dir=tmp_path / "ckpt",
    )  # fmt: skip
    eager = copy.deepcopy(model)
    optimizer = torch.optim.Adam(eager.parameters(), lr=0.01)
    for chunk in ids.chunk(2):
        (eager(input_ids=chunk, labels=chunk, use_cache=False).loss / 2).backward()
    optimizer.step()
    exported = hetcc.export(tmp_path / "ckpt", tmp_path / "trained.safetensors")
    for state in (exported, safetensors.torch.load_file(str(tmp_path / "trained.safetensors"))):
        trained = copy.deepcopy(model)
        trained.load_state_dict(state)  # strict: exactly the model's keys
        for name, tensor in eager.state_dict().items():
            torch.testing.assert_close(trained.state_dict()[name], tensor, rtol=0, atol=1e-5, msg=name)
        assert trained.lm_head.weight is trained.transformer.wte.weight


def test_hetcc_export_on_the_command_line_writes_the_merged_state_dict(tmp_path, capsys):
    from hetcc import cli

    model, _, stages = _gpt2_stages()
    save_stages(stages, str(tmp_path / "build"), _recorded(model))
    assert cli.main(["export", str(tmp_path / "build"), str(tmp_path / "out.safetensors")]) == 0
    assert "by the model's parameter names" in capsys.readouterr().out
    model.load_state_dict(safetensors.torch.load_file(str(tmp_path / "out.safetensors")))  # strict


def test_each_stage_keeps_its_two_newest_complete_steps(tmp_path):
    for step in (2, 4, 6):
        for stage in (0, 1):
            ckpt.save_checkpoint(tmp_path, stage, step, _trained_state(1))
            ckpt.prune(tmp_path, stage)
    assert ckpt.saved_steps(tmp_path) == [6, 4]
    (ckpt.step_dir(tmp_path, 8)).mkdir()
    ckpt.save_checkpoint(tmp_path, 0, 8, _trained_state(1))  # stage 1 died before step 8
    ckpt.prune(tmp_path, 0)
    assert ckpt.latest_complete_step(tmp_path, 2) == 6  # still there for a resume
    assert (
        ckpt.latest_stage_step(tmp_path, 0) == 8 and not (ckpt.step_dir(tmp_path, 4) / "stage0.json").exists()
    )


def test_each_stage_of_a_rank_saves_its_own_parameters_names_and_the_rank_loads_them_back():
    """A rank running two stages (interleaved 1F1B, ZB-V) has one optimizer over both; each stage's file
    keeps its own parameters' state under their own names (what ``replan`` moves by), and the parts
    merge back into the rank's optimizer as it was."""
    from hetcc.train.optim import build_optimizer

    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    named = [(f"a.{n}", p) for n, p in first.named_parameters()] + [
        (f"b.{n}", p) for n, p in second.named_parameters()
    ]
    optimizer = build_optimizer({"name": "adamw", "lr": 0.1, "weight_decay": 0.1}, named)  # two groups
    second(first(torch.randn(3, 4))).sum().backward()
    optimizer.step()
    whole = optimizer.state_dict()
    every = [p for group in optimizer.param_groups for p in group["params"]]
    parts = []
    for module, prefix in ((first, "a."), (second, "b.")):
        mine = {id(p) for p in module.parameters()}
        positions = [i for i, p in enumerate(every) if id(p) in mine]
        part = ckpt.stage_optimizer_state(whole, positions)
        names = [n for group in part["param_groups"] for n in group["param_names"]]
        assert len(names) == len(positions) and all(n.startswith(prefix) for n in names), names
        for group in part["param_groups"]:  # each name beside its own state
            for index, name in zip(group["params"], group["param_names"]):
                shape = dict(named)[name].shape
                assert part["state"][index]["exp_avg"].shape == shape, name
        parts.append((part, positions))
    merged = ckpt.merged_optimizer_state(parts, optimizer)
    assert [g["param_names"] for g in merged["param_groups"]] == [
        g["param_names"] for g in whole["param_groups"]
    ]
    assert [g["params"] for g in merged["param_groups"]] == [g["params"] for g in whole["param_groups"]]
    for index, entry in whole["state"].items():
        assert torch.equal(merged["state"][index]["exp_avg"], entry["exp_avg"])
