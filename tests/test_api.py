import dataclasses
import json
import math

import pytest
import torch
from models import eager_training, gpt2, lm_kwargs, token_ids

import hetcc
from hetcc.errors import HetccError, InfeasiblePlanError, PlanFormatError
from hetcc.ir import info
from hetcc.passes.codegen import stage_source
from hetcc.passes.schedule_search import RERANK
from hetcc.solver.problem import PartitionProblem
from hetcc.solver.schedules import splits_backward
from hetcc.solver.solve import solve


def _cluster(fast: str = "A100-80GB", slow: str = "T4", memory: str | None = None) -> hetcc.Cluster:
    slow_devices = {"type": slow, "count": 2, **({"memory": memory} if memory else {})}
    return hetcc.Cluster.from_spec({
        "nodes": [
            {"name": "n0", "intra_link": {"kind": "nvlink", "bandwidth": "300 GB/s"},
             "devices": [{"type": fast, "count": 2, **({"memory": memory} if memory else {})}]},
            {"name": "n1", "intra_link": {"kind": "pcie", "bandwidth": "32 GB/s"}, "devices": [slow_devices]},
        ],
        "inter_node_link": {"kind": "ethernet", "bandwidth": "25 Gb/s"},
    })  # fmt: skip


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("build")
    # Microbatches of 4 x 512 tokens: big enough that the GPUs' compute, not the host issuing ops, sets
    # the step (at 1 x 512 an A100 and a T4 would be equally host-bound, as they are in eager PyTorch).
    with torch.device("meta"):
        model = gpt2(n_layer=8, n_embd=512, n_head=8, vocab=1024)
        ids = token_ids(128, 512, vocab=1024, device="meta")
    result = hetcc.compile(model, _cluster(), example_kwargs=lm_kwargs(ids), microbatches=32, dump_dir=folder)
    return result, folder


def test_plan_covers_every_block_once_in_order_on_distinct_devices(compiled):
    result, _ = compiled
    plan = result.plan
    blocks = [b for s in plan.stages for b in s.blocks]
    assert blocks == [b.name for b in result.analysis.blocks]
    assert len({s.device for s in plan.stages}) == len(plan.stages)
    for stage in plan.stages:
        assert stage.peak_memory_bytes <= stage.device_memory_bytes
    stage_of = {n.name: info(n).stage for n in result.graph.graph.nodes if info(n).stage is not None}
    assert sorted(set(stage_of.values())) == list(range(len(plan.stages)))


def test_fast_devices_get_more_layers(compiled):
    plan = compiled[0].plan
    per_type = {}
    for stage in plan.stages:
        per_type.setdefault(stage.device_type, []).append(stage.fwd_flops)
    assert set(per_type) == {"A100-80GB", "T4"}  # the T4s are worth using, but for less work
    assert min(per_type["A100-80GB"]) > max(per_type["T4"])


def test_plan_beats_or_matches_every_baseline_and_respects_the_bound(compiled):
    plan = compiled[0].plan
    assert set(plan.baselines) == {"uniform", "parameters", "flops"}
    assert all(plan.step_time_s <= t * (1 + 1e-9) for t in plan.baselines.values())
    assert plan.lower_bound_s <= plan.step_time_s and plan.gap == pytest.approx(
        plan.step_time_s / plan.lower_bound_s - 1
    )
    assert abs(plan.simulated_step_s - plan.step_time_s) / plan.step_time_s < 0.10


def test_explain_has_a_row_per_stage_and_the_headline(compiled):
    plan = compiled[0].plan
    text = compiled[0].explain()
    assert all(f" {s.device}" in text for s in plan.stages)  # a replica group prints its first device
    assert f", {plan.precision}, " in text.splitlines()[0]  # the title says what precision was priced
    headline = next(line for line in text.splitlines() if line.startswith("simulated step"))
    assert "faster than uniform" in headline and "above the lower bound" in headline


def test_plan_and_problem_round_trip_through_json_exactly(compiled):
    result, _ = compiled
    assert hetcc.Plan.from_json(result.plan.to_json()) == result.plan
    replayed = PartitionProblem.from_json(result.problem.to_json())
    assert replayed == result.problem
    assert solve(replayed, rerank=RERANK).simulated_s == result.plan.step_time_s


def test_dump_folder_holds_every_pass_and_the_plan(compiled):
    _, folder = compiled
    names = {p.name for p in folder.iterdir()}
    assert {
        "05_cost.txt",
        "06_partition.txt",
        "07_fuse.txt",
        "plan.json",
        "problem.json",
        "04_blocks.txt",
        "08_comm.txt",
        "09_codegen.txt",
    } <= names
    assert "simulated step" in (folder / "06_partition.txt").read_text()
    result, _ = compiled
    for stage in result.stages:  # each stage's program, as the codegen step printed it
        source = (folder / f"stage{stage.index}.py").read_text()
        assert source == stage_source(stage) and source in (folder / "09_codegen.txt").read_text()
    kernels = list((folder / "kernels").glob("*.py"))  # the generated Triton source of each fused group
    assert kernels and "@triton.jit" in kernels[0].read_text()
    assert "hetcc_kernels_launch_fused(" in (folder / "07_fuse.txt").read_text()
    assert "# fusion candidates" in (folder / "05_cost.txt").read_text()  # each priced both ways


def test_memory_too_small_raises_an_error_naming_a_device_and_the_shortfall():
    with torch.device("meta"):
        model = gpt2(n_layer=4, n_embd=512, n_head=4, vocab=1024)
        ids = token_ids(8, 64, vocab=1024, device="meta")
    with pytest.raises(InfeasiblePlanError) as caught:
        hetcc.compile(model, _cluster(memory="40 MiB"), example_kwargs=lm_kwargs(ids), microbatches=4)
    message = str(caught.value)
    assert "MiB missing" in message and "device" in message and "microbatches" in message


@pytest.mark.slow
def test_a_hugging_face_model_trains_without_use_cache_in_its_example_inputs():
    """hetcc passes use_cache=False itself (a returned DynamicCache cannot be traced), also to the
    microbatch search's trace with a symbolic batch; the pipeline then runs on inputs without it."""
    model = gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(4, 16)
    inputs = {"input_ids": ids, "labels": ids}
    two_cpus = hetcc.Cluster.from_spec({
        "nodes": [{"name": "host", "intra_link": {"kind": "loopback", "bandwidth": "5 GB/s", "latency": "30 us"},
                   "devices": [{"type": "cpu", "count": 2, "memory": "1.5 MiB"}]}],
    })  # fmt: skip
    compiled = hetcc.compile(model, two_cpus, example_kwargs=inputs)
    assert len(compiled.plan.stages) == 2, compiled.explain()
    skipped = sum(
        note.count("M=") for note in compiled.plan.notes if note.startswith("microbatches: not planned")
    )
    assert len(compiled.plan.microbatch_search) + skipped == 3, compiled.plan.notes  # 1, 2, 4: symbolic trace
    sgd = {"name": "sgd", "lr": 0.1}
    result = hetcc.run_local(compiled, inputs, steps=2, optimizer=sgd)
    losses, _ = eager_training(model, inputs, None, None, 2, compiled.plan.microbatches, sgd)
    for got, want in zip(result.losses, losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (result.losses, losses)


def test_batch_must_divide_into_microbatches():
    with pytest.raises(HetccError, match="10 rows"):
        hetcc.compile(gpt2(), _cluster(), example_kwargs=lm_kwargs(token_ids(10, 8)), microbatches=4)


def test_unknown_optimizer_is_rejected_before_tracing():
    with pytest.raises(HetccError, match="unknown optimizer 'lamb'"):
        hetcc.compile(gpt2(), _cluster(), example_kwargs=lm_kwargs(token_ids(8, 8)), optimizer="lamb")


def test_inference_plans_hold_no_gradients_or_activations():
    with torch.device("meta"):
        model = gpt2(n_layer=4, n_embd=256, n_head=4, vocab=1024)
        ids = token_ids(8, 64, vocab=1024, device="meta")
    plan = hetcc.compile(
        model, _cluster(), example_kwargs=lm_kwargs(ids), microbatches=4, training=False
    ).plan
    assert all(
        s.memory.grads_bytes == 0 and s.memory.activations_bytes == 0 and s.bwd_s == 0 for s in plan.stages
    )
    assert not math.isnan(plan.simulated_step_s)
    assert dataclasses.replace(plan) == plan


def test_the_planner_prices_exactly_the_state_the_runtime_optimizer_keeps():
    from hetcc.errors import HetccError
    from hetcc.passes.partition import OPTIMIZERS, state_multiplier
    from hetcc.train.optim import build_optimizer

    for name, entry in OPTIMIZERS.items():
        param = torch.nn.Parameter(torch.ones(4))
        built = build_optimizer({"name": name, "lr": 0.1}, [("p", param)])
        assert (built is None) == (entry.torch_class is None), name
        if built is not None:
            param.grad = torch.ones(4)
            built.step()
            state = [t for t in built.state[param].values() if torch.is_tensor(t) and t.shape == param.shape]
            assert len(state) == entry.states, name  # per-parameter tensors the memory plan charges
        assert state_multiplier(True, name) == 2 + entry.states
    with pytest.raises(HetccError, match="unknown optimizer 'lion'"):
        build_optimizer({"name": "lion"}, [("p", torch.nn.Parameter(torch.ones(1)))])


def test_a_zb_h1_plan_saved_before_plans_held_deferrals_reads_with_zb_h1s(compiled):
    """Plans written before a stage recorded its deferred weight gradients ran ZB-H1's (the replicas before
    the stage; none where its backward runs whole): that is what reading one gives, and the table says."""
    plan = dataclasses.replace(compiled[0].plan, schedule="zb-h1")
    document = json.loads(plan.to_json())
    for stage in document["stages"]:
        del stage["deferred"]
    read = hetcc.Plan.from_json(json.dumps(document))
    replicas = [len(s.devices) // s.tensor for s in plan.stages]
    split = splits_backward("zb-h1", [s.recompute for s in plan.stages])
    expected = [sum(replicas[:k]) if split[k] else 0 for k in range(len(replicas))]
    assert [s.deferred for s in read.stages] == expected and any(expected)
    assert "W deferred" in read.explain()
    assert hetcc.Plan.from_json(plan.to_json()) == plan  # a plan that records them keeps its own


def test_a_plan_file_with_a_warm_up_the_ranks_cannot_run_is_refused(compiled):
    """Each stage's warm-up (forwards before its first backward) is what its ranks run: one below 1F1B's,
    above M or above the stage before's is named when the plan is read."""
    plan = compiled[0].plan
    document = json.loads(plan.to_json())
    assert [s["warmup"] for s in document["stages"]] == [s.warmup for s in plan.stages] and plan.stages[
        0
    ].warmup
    document["stages"][0]["warmup"] = plan.microbatches + 1
    with pytest.raises(PlanFormatError, match=r"plan field 'stages\[\*\].warmup': .*to \d+ \(M\)"):
        hetcc.Plan.from_json(json.dumps(document))
    document["stages"][0]["warmup"] = 2.5
    with pytest.raises(PlanFormatError, match="warm-up forwards"):
        hetcc.Plan.from_json(json.dumps(document))
