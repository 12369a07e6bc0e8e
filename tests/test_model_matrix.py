"""The model matrix: every architecture in ``model_zoo`` is analysed, planned on a mixed NVIDIA/AMD
cluster and trained through ``hetcc.run_local`` on local CPU ranks, equal to eager.

Each device of the cluster holds just over half of the model's training state, so every plan has at
least two stages, whatever the architecture. Checks per model:
- the block chain follows the computation (first and last block, contiguous, data only forward);
- forward FLOPs within 2% of ``FlopCounterMode`` on the eager model (plus, for grouped expert matmuls,
  the routed-token FLOPs it cannot count; recurrent layers against their matmuls counted by hand);
- two training steps (1F1B, Adam): loss within 1e-5 relative, every gradient within 1e-4;
- ``hetcc.export`` of the saved build, returned and written, has exactly the keys of the model's
  ``state_dict()`` (no non-persistent buffer, every name of a tied weight) and loads strictly.
And two architectures whose cuts meet what 1F1B does not, trained the same way: T5 under ZB-V (one
block per stage) and BERT with tensor degree 2 on two stages.
"""

from __future__ import annotations

import copy

import model_zoo
import pytest
import safetensors.torch
import torch
from model_zoo import CASES
from models import assert_chain_in_compute_order, eager_training
from torch.utils.flop_counter import FlopCounterMode

import hetcc
from hetcc.train.data import split_microbatches

pytestmark = pytest.mark.slow
MICROBATCHES = 2
ADAM = {"name": "adam", "lr": 1e-3}
STATE_PER_PARAM_BYTE = 4  # fp32 Adam: weights, gradients, two moments


def mixed_cluster(memory_bytes: int) -> hetcc.Cluster:
    """An A100 and a T4 on one node, an MI250X on another, each with ``memory_bytes``."""
    memory = f"{memory_bytes} B"
    return hetcc.Cluster.from_spec({
        "nodes": [
            {"name": "nv", "intra_link": {"kind": "pcie", "bandwidth": "32 GB/s", "latency": "5 us"},
             "devices": [{"type": "A100-80GB", "memory": memory}, {"type": "T4", "memory": memory}]},
            {"name": "amd", "intra_link": {"kind": "xgmi", "bandwidth": "100 GB/s", "latency": "5 us"},
             "devices": [{"type": "MI250X", "memory": memory}]},
        ],
        "inter_node_link": {"kind": "ethernet", "bandwidth": "25 Gb/s", "latency": "20 us"},
    })  # fmt: skip


def memory_for_two_stages(analysis) -> int:
    """Room for the largest block or 55% of the whole model, whichever is more (after the 10% reserve)."""
    needs = [STATE_PER_PARAM_BYTE * b.param_bytes + MICROBATCHES * b.act_bytes for b in analysis.blocks]
    return int(max(max(needs), 0.55 * sum(needs)) / 0.9 * 1.05)


def reference_flops(case) -> int:
    kwargs = split_microbatches(case.inputs, MICROBATCHES)[0]
    first = next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
    tokens = first.shape[:2].numel()
    if case.expected_flops is not None:
        return case.expected_flops(tokens)
    with FlopCounterMode(display=False) as counter:
        case.model(**kwargs)
    return counter.get_total_flops() + (case.uncounted_flops(tokens) if case.uncounted_flops else 0)


@pytest.fixture(scope="module", params=CASES, ids=lambda factory: factory.__name__)
def case(request):
    return request.param()


def test_analyse_plan_and_train_like_eager(case, tmp_path):
    microbatch = split_microbatches(case.inputs, MICROBATCHES)[0]
    analysis = hetcc.analyze(case.model, example_kwargs=microbatch)
    names = [b.name for b in analysis.blocks]
    assert names == assert_chain_in_compute_order(analysis.graph)
    assert (names[0], names[-1]) == (case.first_block, case.last_block), names
    flops, want = float(analysis.total_flops()), reference_flops(case)
    assert abs(flops - want) <= 0.02 * want, (flops, want)

    # shard=0: memory is sized for two stages, which ZeRO-1 on a replica group would spare (it has its own
    # tests); the matrix checks every architecture across a cut
    compiled = hetcc.compile(case.model, mixed_cluster(memory_for_two_stages(analysis)),
                             example_kwargs=case.inputs, microbatches=MICROBATCHES, schedule="1f1b",
                             optimizer="adam", shard=0)  # fmt: skip
    assert len(compiled.plan.stages) >= 2, compiled.explain()
    _check_export(case, compiled, tmp_path)
    _assert_trains_like_eager(case, compiled)


def pair_cluster(memory_bytes: int) -> hetcc.Cluster:
    """Two A100s on NVLink and two T4s on PCIe, each with ``memory_bytes``: tensor groups of two."""
    pair = lambda name, kind, link, bandwidth: {  # noqa: E731
        "name": name, "intra_link": {"kind": link, "bandwidth": bandwidth, "latency": "5 us"},
        "devices": [{"type": kind, "count": 2, "memory": f"{memory_bytes} B"}],
    }  # fmt: skip
    return hetcc.Cluster.from_spec({
        "nodes": [pair("nv", "A100-80GB", "nvlink", "300 GB/s"), pair("t4", "T4", "pcie", "16 GB/s")],
        "inter_node_link": {"kind": "ethernet", "bandwidth": "25 Gb/s", "latency": "20 us"},
    })  # fmt: skip


@pytest.mark.parametrize(
    ("name", "cluster", "options", "layout"),
    [
        # a block per stage: T5's position bias, made from a weight, is used in its stage and sent on
        ("t5", mixed_cluster, {"schedule": "zbv"}, lambda stages: len(stages) == 6),
        # post-norm: the second stage's first op is a column-parallel linear on what it received
        ("bert", pair_cluster, {"schedule": "zb-h1", "tensor_parallel": 2, "memory": 0.6},
         lambda stages: len(stages) == 2 and all(s.tensor == 2 for s in stages)),
    ],
    ids=["t5-zbv", "bert-tp2-zb-h1"],
)  # fmt: skip
def test_zero_bubble_and_tensor_parallel_stages_train_like_eager(name, cluster, options, layout):
    """Architectures whose cuts reach what the 1F1B matrix does not: a zero-bubble W of a weight-only value
    sent on, and a tensor-parallel stage entered by a received tensor."""
    case = getattr(model_zoo, name)()
    options = dict(options)
    analysis = hetcc.analyze(case.model, example_kwargs=split_microbatches(case.inputs, MICROBATCHES)[0])
    memory = int(memory_for_two_stages(analysis) * options.pop("memory", 1.0))
    compiled = hetcc.compile(case.model, cluster(memory), example_kwargs=case.inputs, microbatches=MICROBATCHES,
                             optimizer="adam", **options)  # fmt: skip
    assert layout(compiled.plan.stages), compiled.explain()
    _assert_trains_like_eager(case, compiled)


def _assert_trains_like_eager(case, compiled) -> None:
    """Two Adam steps: every loss within 1e-5 relative of eager's, every gradient within 1e-4."""
    result = hetcc.run_local(compiled, case.inputs, targets=case.targets, loss_fn=case.loss_fn, steps=2,
                             optimizer=ADAM)  # fmt: skip
    losses, grads = eager_training(case.model, case.inputs, case.targets, case.loss_fn, 2, MICROBATCHES, ADAM)
    for got, want_loss in zip(result.losses, losses, strict=True):
        assert abs(got - want_loss) <= 1e-5 * abs(want_loss), (result.losses, losses)
    aliases = {}
    for name, p in case.model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for names_of_one in aliases.values():  # every parameter's gradient, under one of its names
        if any(n in grads for n in names_of_one):
            assert any(n in result.grads for n in names_of_one), names_of_one
    for name, grad in result.grads.items():  # parameters the loss does not reach have no eager grad
        want_grad = grads.get(name, torch.zeros_like(grad))
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-4, msg=name)


def _check_export(case, compiled, tmp_path) -> None:
    """The build's weights (the model's own, untrained) come back under exactly the model's keys."""
    folder = compiled.save(tmp_path / "build")
    state = hetcc.export(folder, tmp_path / "model.safetensors")
    written = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    assert list(state) == list(case.model.state_dict())
    assert set(written) == set(case.model.state_dict())
    for loaded in (state, written):
        copy.deepcopy(case.model).load_state_dict(loaded)  # strict
        for key, tensor in case.model.state_dict().items():
            assert torch.equal(loaded[key], tensor), key
