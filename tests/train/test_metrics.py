"""What a run reports, without processes: FLOP/s per device type from the plan, the measured step and
stages against the simulated ones, metrics.jsonl, and the progress bar."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from hetcc.plan import MemoryBreakdown, Plan, PlanStage
from hetcc.runtime.contract import PipelineMeta
from hetcc.runtime.layout import RankLayout
from hetcc.runtime.placement import ranks_for
from hetcc.train import loop
from hetcc.train.metrics import MetricsLog, RunFigures, run_lines, summary_lines

GFLOP = 1e9


def _stage(index: int, device_type: str, devices: tuple[str, ...], recompute: bool = False) -> PlanStage:
    return PlanStage(
        index=index, device=devices[0], device_type=device_type, blocks=(f"b{index}",), nodes=(), fwd_flops=GFLOP,
        bwd_flops=2 * GFLOP, fwd_s=1e-3, bwd_s=2e-3, compute_s=3e-3, comm_s=0.0, inflight=1,
        memory=MemoryBreakdown(1, 1, 1, 1), device_memory_bytes=1e9, bubble=0.25, devices=devices,
        recompute=recompute,
    )  # fmt: skip


@pytest.fixture
def build(tmp_path):
    """A plan: stage 0 on an A100 recomputing, stage 1 on two T4 replicas; 4 microbatches, 12 ms."""
    plan = Plan(
        stages=(_stage(0, "A100-80GB", ("a",), recompute=True), _stage(1, "T4", ("t0", "t1"))),
        step_time_s=0.012, lower_bound_s=0.01, gap=0.2, baselines={}, microbatches=4, schedule="1f1b",
        training=True,
    )  # fmt: skip
    (tmp_path / "plan.json").write_text(plan.to_json())
    meta = PipelineMeta(2, microbatches=4, placement=ranks_for([1, 2]), routing=[[0, 0, 0, 0], [0, 1, 0, 1]])
    return tmp_path, RankLayout.from_meta(meta)


def test_flops_per_device_type_count_microbatches_recompute_and_replicas(build):
    folder, layout = build
    figures = RunFigures.of(str(folder), layout, ["A100-80GB", "T4", "T4"], False, tokens=4096, samples=8,
                            training=True)  # fmt: skip
    recomputing, replica = 4 * (2 * 1 + 2), 2 * 3  # 4 microbatches, 2 forwards; 2 microbatches each
    assert [w.flops / GFLOP for w in figures.ranks] == [recomputing, replica, replica]
    record = figures.step_record(step_s=0.5)
    assert record["tokens_per_s"] == 8192 and record["samples_per_s"] == 16
    assert record["tflops/A100-80GB"] == pytest.approx(16 * GFLOP / 0.5 / 1e12)
    t4_peak = 8.1e12  # fp32, about
    assert record["util/T4"] == pytest.approx(12 * GFLOP / 0.5 / (2 * t4_peak), rel=0.05)
    on_cpu = RunFigures.of(str(folder), layout, ["A100-80GB", "T4", "T4"], True, 0, 8, True)
    assert set(on_cpu.by_type()) == {"cpu (planned A100-80GB)", "cpu (planned T4)"}


def test_the_summary_sets_measured_beside_simulated_per_stage(build):
    folder, layout = build
    figures = RunFigures.of(str(folder), layout, [None, None, None], False, 0, 8, True)
    lines = summary_lines(figures, [0.024, 0.026, 0.025], [0.010, 0.004, 0.006])
    assert lines[0] == "measured step 25.00 ms (median of 3 steps), plan simulated 12.00 ms: ratio 2.08x"
    assert lines[1] == "  stage 0 (1 x A100-80GB): busy 10.00 ms, simulated 9.00 ms: ratio 1.11x"
    assert lines[2] == "  stage 1 (2 x T4): busy 5.00 ms, simulated 9.00 ms: ratio 0.56x"


def test_a_plan_of_another_split_gives_no_figures_rather_than_wrong_ones(build):
    folder, _ = build
    three = RankLayout.from_meta(PipelineMeta(3, microbatches=4))
    assert RunFigures.of(str(folder), three, [], False, 0, 8, True).ranks == ()


def test_metrics_jsonl_is_replaced_by_a_new_run_and_appended_by_a_resumed_one(tmp_path):
    for resume, steps in ((False, [0, 1]), (False, [0]), (True, [1, 2])):
        log = MetricsLog(tmp_path, resume)
        for step in steps:
            log.write({"step": step, "loss": 1.0})
        log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]


def test_the_run_says_where_the_weights_and_metrics_went():
    result = {"notes": ["resumed at step 2 from ck"], "losses": [1.5], "first_step": 2, "eval_losses": [(2, 1.25)],
              "summary": ["measured step 1.00 ms"], "metrics": "ck/metrics.jsonl"}  # fmt: skip
    assert run_lines(result, "ck", "build") == [
        "resumed at step 2 from ck", "step 2 loss 1.5", "eval after step 2: loss 1.25", "measured step 1.00 ms",
        "trained weights: ck (`hetcc export build model.safetensors` merges them)", "metrics: ck/metrics.jsonl",
    ]  # fmt: skip


def test_the_progress_bar_shows_the_step_loss_and_throughput(monkeypatch):
    screen = io.StringIO()
    monkeypatch.setattr(loop, "_console", lambda: Console(file=screen, width=120, force_terminal=False))
    with loop._progress(True, steps=2, first_step=0) as advance:
        advance({"step": 0, "loss": 5.5, "tokens_per_s": 1234.0})
        advance({"step": 1, "loss": 4.25, "tokens_per_s": 1300.0})
    text = screen.getvalue()
    assert "2/2" in text and "step 1 loss 4.2500 1300 tok/s" in text


def test_every_number_of_a_record_goes_to_tensorboard_when_it_is_installed(tmp_path, monkeypatch):
    from hetcc.train import metrics

    scalars = []

    class Writer:  # what torch.utils.tensorboard.SummaryWriter is asked, without the tensorboard package
        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def close(self):
            scalars.append("closed")

    monkeypatch.setattr(metrics, "_tensorboard", lambda folder: Writer())
    log = MetricsLog(tmp_path, resume=False)
    log.write({"step": 3, "loss": 2.5, "lr": None, "tokens_per_s": 100.0, "skipped": False})
    log.close()
    assert scalars == [("loss", 2.5, 3), ("tokens_per_s", 100.0, 3), ("skipped", False, 3), "closed"]
