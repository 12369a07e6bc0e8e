"""Faults under run_local surface first cause first, within the timeout plus a constant, whatever `steps` is.

The faults are made by the last rank's loss function (it runs only there), at its third call: the
first step (two microbatches) completes, then the rank stops, is killed, or raises. The runs ask for
100,000 steps: before the supervisor, a stopped rank blocked ``run_local`` for a deadline that grew with
the steps. Bootstrap mistakes (a lambda loss, a script without the ``__main__`` guard, inputs the plan
was compiled without) are explained with the fix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from runtime_models import MLP_RULES, ResidualMLP, export, stages_by_module

import hetcc
from hetcc import config
from hetcc.errors import HetccError, RuntimeFailure
from hetcc.passes.comm import split_stages
from hetcc.runtime.contract import PipelineMeta
from hetcc.runtime.placement import RankPlacement
from hetcc.runtime.store import Pipeline
from hetcc.train.local import run_local

TIMEOUT_S = 20.0
SLACK_S = 60.0  # spawning three ranks on a loaded 2-core machine, the stale-heartbeat wait and the grace
MANY_STEPS = 100_000
_calls = 0


def _after_first_step(action):
    def loss(output, target):
        global _calls
        _calls += 1
        if _calls == 3:
            action()
        return F.mse_loss(output, target)

    return loss


def stop_loss(output, target):
    return _after_first_step(lambda: os.kill(os.getpid(), signal.SIGSTOP))(output, target)


def kill_loss(output, target):
    return _after_first_step(lambda: os.kill(os.getpid(), signal.SIGKILL))(output, target)


def _raise():
    raise ValueError("this loss is broken")


def raising_loss(output, target):
    return _after_first_step(_raise)(output, target)


def _three_stage_mlp():
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    gm = export(ResidualMLP(), (x[:4],))
    return split_stages(gm, stages_by_module(gm, MLP_RULES), 3), x, y


def _failing_run(loss_fn, stages=None):
    default, x, y = _three_stage_mlp()
    start = time.monotonic()
    with config.patch(comm_timeout_s=TIMEOUT_S), pytest.raises(RuntimeFailure) as failure:
        run_local(stages or default, {"x": x}, y, loss_fn, steps=MANY_STEPS, microbatches=2)
    return failure.value, time.monotonic() - start


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_within_the_timeout_and_is_named_first():
    error, elapsed = _failing_run(stop_loss)
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed
    first = error.failures[0]
    assert first.rank == 2 and "stopped responding" in first.message and "SIGSTOP" in first.message, error
    assert {f.rank for f in error.failures} == {0, 1, 2}
    assert str(error).index("rank 2 stopped") < str(error).index("rank 0")


@pytest.mark.slow
def test_a_killed_rank_is_reported_killed_and_first():
    error, elapsed = _failing_run(kill_loss)
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed
    first = error.failures[0]
    assert first.rank == 2 and "killed by SIGKILL (exit code -9)" in first.message, error
    assert "deadline" not in str(error)
    assert [f.after_s for f in error.failures] == sorted(f.after_s for f in error.failures)


@pytest.mark.slow
def test_a_raising_loss_comes_first_with_its_own_exception(capsys):
    stages, _, _ = _three_stage_mlp()
    placement = [RankPlacement(k, k, 0, "nvidia", type="A100-80GB") for k in range(3)]
    gpu_plan = Pipeline(stages, PipelineMeta(3, placement=placement))
    error, elapsed = _failing_run(raising_loss, gpu_plan)
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed
    assert error.failures[0].rank == 2
    assert error.failures[0].message == "rank 2: ValueError: this loss is broken"
    assert "where rank 2 failed" in str(error) and "_raise" in str(error)
    # friction 1 of issue 12: a GPU plan runs on local CPU ranks, and says so once (not per rank)
    assert capsys.readouterr().err.count("every stage runs here as a local CPU process over gloo") == 1


def test_a_lambda_loss_is_refused_before_any_rank_starts():
    stages, x, y = _three_stage_mlp()
    with pytest.raises(HetccError, match="not a lambda") as failure:
        run_local(stages, {"x": x}, y, lambda out, target: F.mse_loss(out, target), microbatches=2)
    assert "cannot be sent to the spawned ranks" in str(failure.value)


def test_inputs_no_stage_takes_are_refused_up_front():
    stages, x, y = _three_stage_mlp()
    with pytest.raises(HetccError, match=r"inputs \['labels'\] are not inputs of the compiled model"):
        run_local(stages, {"x": x, "labels": y}, y, F.mse_loss, microbatches=2)


def test_labels_the_plan_was_compiled_without_are_named_before_any_rank_starts():
    """Issue 12, friction 3: the README's snippet compiled without labels and ran with them."""
    from models import gpt2, token_ids

    model, ids = gpt2(n_layer=1, n_embd=32), token_ids(4, 8)
    cluster = hetcc.Cluster.from_spec(
        {"nodes": [{"name": "host", "intra_link": {"kind": "loopback", "bandwidth": "5 GB/s"},
                    "devices": [{"type": "cpu", "count": 2, "memory": "2 GiB"}]}]}
    )  # fmt: skip
    compiled = hetcc.compile(
        model, cluster, example_kwargs={"input_ids": ids, "use_cache": False}, microbatches=2
    )
    start = time.monotonic()
    with pytest.raises(HetccError, match="labels") as failure:
        hetcc.run_local(compiled, {"input_ids": ids, "labels": ids}, steps=1)
    assert "compile with ['labels'] in example_kwargs" in str(failure.value)
    assert time.monotonic() - start < 5  # refused in the caller: no rank was spawned


@pytest.mark.slow
def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    """Issue 12, friction 4: spawned ranks re-import the script; the error says what to change."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parents[1])]!r}
            import torch
            import torch.nn.functional as F
            from test_faults import _three_stage_mlp
            from hetcc.train.local import run_local

            stages, x, y = _three_stage_mlp()
            run_local(stages, {{"x": x}}, y, F.mse_loss, microbatches=2)  # no __main__ guard
            """
        )
    )
    env = {**os.environ, "HETCC_COMM_TIMEOUT_S": "20", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode != 0
    assert "before its stage started" in done.stderr, done.stderr[-3000:]
    assert 'put that under `if __name__ == "__main__":`' in done.stderr
    assert str(script) in done.stderr
