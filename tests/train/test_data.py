"""The data path without processes: each rank's share of global batch k is the same rows of the batch
an eager loop reads as batch k, a resumed reader continues exactly, and a bad batch is named."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from hetcc.train.data import DataError, RankData, RankInputs, global_batches
from hetcc.train.optim import LRSchedule, apply_settings, build_optimizer, param_groups

M, ROWS, SEQ = 4, 2, 5


class Windows(Dataset):
    """Item i: {"input_ids": [i, i+1, ...], "labels": the same + 1000}: every row names its item."""

    def __init__(self, items: int = 40):
        self.items = items

    def __len__(self):
        return self.items

    def __getitem__(self, i):
        ids = torch.arange(i, i + SEQ)
        return {"input_ids": ids, "labels": ids + 1000}


def needs(names=("input_ids",), mine=tuple(range(M)), target=False, model_inputs=("input_ids", "labels")):
    shapes = {name: (ROWS, SEQ) for name in ("input_ids", "labels")}
    dtypes = {name: torch.int64 for name in ("input_ids", "labels")}
    return RankInputs(tuple(names), M, ROWS, tuple(mine), shapes, dtypes, model_inputs, target)


def loader() -> DataLoader:
    return DataLoader(Windows(), batch_size=M * ROWS, shuffle=True, drop_last=True)


@pytest.mark.parametrize("make", [Windows, loader], ids=["dataset", "shuffling-loader"])
def test_each_rank_reads_its_microbatches_of_the_batch_eager_reads(make):
    whole = [batch for _, batch in zip(range(12), global_batches(make(), M * ROWS, seed=3))]  # 2+ epochs
    first = RankData(make(), needs(["input_ids"], mine=(0, 2)), seed=3)
    last = RankData(make(), needs(["labels"], mine=(1, 3)), seed=3)
    for step, batch in enumerate(whole):
        a, b = next(first), next(last)
        assert a.step == b.step == step
        assert set(a.inputs) == {0, 2} and set(b.inputs) == {1, 3}
        for m in (0, 2):
            assert list(a.inputs[m]) == ["input_ids"]  # only what the stage reads
            assert torch.equal(a.inputs[m]["input_ids"], batch["input_ids"][m * ROWS : (m + 1) * ROWS])
        for m in (1, 3):
            assert torch.equal(b.inputs[m]["labels"], batch["labels"][m * ROWS : (m + 1) * ROWS])
    orders = [tuple(batch["input_ids"][:, 0].tolist()) for batch in whole]
    assert len(set(orders)) == len(orders)  # shuffled: no two batches alike, epochs differ
    assert sorted(i for order in orders[:5] for i in order) == list(range(40))  # one epoch: every item once


@pytest.mark.parametrize("make", [Windows, loader], ids=["dataset", "shuffling-loader"])
def test_a_reader_resumed_at_a_position_continues_as_if_it_had_not_stopped(make):
    straight = RankData(make(), needs(), seed=1)
    batches = [next(straight) for _ in range(9)]
    resumed = RankData(make(), needs(), seed=1, position=6)
    for want in batches[6:]:
        got = next(resumed)
        assert got.step == want.step
        assert all(torch.equal(got.inputs[m]["input_ids"], want.inputs[m]["input_ids"]) for m in range(M))
    assert resumed.state_dict() == {"batches": 9, "seed": 1}


def test_the_data_order_does_not_touch_the_ranks_own_random_state():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    reader = RankData(loader(), needs(), seed=0)  # the loader's sampler draws its seed from torch
    [next(reader) for _ in range(7)]
    assert torch.equal(torch.rand(3), expected)


def test_a_middle_stage_reads_nothing():
    class Exploding(Dataset):
        def __len__(self):
            return 100

        def __getitem__(self, i):
            raise AssertionError("a stage without inputs fetched an item")

    reader = RankData(Exploding(), needs(names=(), mine=(1,)))
    assert next(reader).inputs == {1: {}}


def test_an_iterable_of_batches_and_tuples_of_a_tensor_dataset():
    ids = torch.arange(3 * M * ROWS * SEQ).reshape(3 * M * ROWS, SEQ)
    batches = [{"input_ids": part, "labels": part} for part in ids.split(M * ROWS)]
    reader = RankData(batches, needs(["input_ids"]))
    assert torch.equal(next(reader).inputs[3]["input_ids"], ids[6:8])
    loader = DataLoader(TensorDataset(ids, ids + 1), batch_size=M * ROWS)
    pairs = RankData(loader, needs(["input_ids"], target=True, model_inputs=("input_ids",)))
    first = next(pairs)
    assert torch.equal(first.targets[1], first.inputs[1]["input_ids"] + 1)  # the second column: the target


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"input_ids": torch.zeros(8, SEQ, dtype=torch.int64)}, "step 0: the batch has no input 'labels'"),
        (
            {
                "input_ids": torch.zeros(10, SEQ, dtype=torch.int64),
                "labels": torch.zeros(10, SEQ, dtype=torch.int64),
            },
            r"step 0: input 'input_ids' has 10 rows .* global batches of 8 rows \(4 microbatches x 2\)",
        ),
        (
            {
                "input_ids": torch.zeros(8, 7, dtype=torch.int64),
                "labels": torch.zeros(8, 7, dtype=torch.int64),
            },
            r"step 0: input 'input_ids' \(microbatch 0\) has shape \(2, 7\); the pipeline was compiled for \(2, 5\)",
        ),
        (
            {"input_ids": torch.zeros(8, SEQ), "labels": torch.zeros(8, SEQ)},
            r"input 'input_ids' \(microbatch 0\) has dtype torch.float32; the pipeline was compiled for torch.int64",
        ),
        ([torch.zeros(8, SEQ)] * 5, "a batch must be a dict"),
    ],
    ids=["missing-key", "rows", "shape", "dtype", "not-a-dict"],
)
def test_a_bad_batch_is_named_with_the_step_the_input_and_what_was_expected(batch, match):
    with pytest.raises(DataError, match=match):
        next(RankData([batch], needs(["input_ids"])))


def test_an_exhausted_iterable_names_the_step():
    batch = {
        "input_ids": torch.zeros(8, SEQ, dtype=torch.int64),
        "labels": torch.zeros(8, SEQ, dtype=torch.int64),
    }
    reader = RankData(iter([batch, batch]), needs(["input_ids"]))
    next(reader), next(reader)
    with pytest.raises(DataError, match="step 2: the data ran out after 2 batches"):
        next(reader)


def test_a_loader_with_another_batch_size_is_refused():
    with pytest.raises(Exception, match="batch_size is 3; the pipeline was compiled for global batches of 8"):
        RankData(DataLoader(Windows(), batch_size=3), needs())


# ---------------------------------------------------------------------------------- optimizer, schedule


def test_warmup_then_cosine_reaches_the_floor_at_the_last_step():
    schedule = LRSchedule.from_spec(
        {"warmup_steps": 4, "decay": "cosine", "min_lr_ratio": 0.1}, total_steps=20
    )
    factors = [schedule.factor(step) for step in range(21)]
    assert factors[:4] == [0.2, 0.4, 0.6, 0.8]
    assert factors[4] == 1.0 and factors[20] == pytest.approx(0.1)
    assert factors[12] == pytest.approx(0.55)  # half way: the cosine's mid-point
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))


def test_a_resumed_scheduler_sets_the_learning_rate_of_its_step():
    param = torch.nn.Parameter(torch.zeros(2, 2))
    schedule = LRSchedule(warmup_steps=2, decay="linear", total_steps=10, min_lr_ratio=0.0)
    straight = torch.optim.SGD([param], lr=1.0)
    scheduler = schedule.scheduler(straight)
    for _ in range(6):
        straight.step()
        scheduler.step()
    resumed = torch.optim.SGD([param], lr=1.0)
    schedule.scheduler(resumed, step=6)
    assert (
        resumed.param_groups[0]["lr"] == pytest.approx(straight.param_groups[0]["lr"]) == pytest.approx(0.5)
    )


def test_weight_decay_skips_biases_and_norms_and_settings_given_at_resume_win():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    groups = param_groups(list(model.named_parameters()), 0.1)
    assert [[n for n, _ in g["params"]] for g in groups] == [["0.weight"], ["0.bias", "1.weight", "1.bias"]]
    optimizer = build_optimizer({"name": "adamw", "lr": 1e-3, "weight_decay": 0.1}, model.named_parameters())
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    changed = apply_settings(optimizer, {"name": "adamw", "lr": 0.0, "weight_decay": 0.2})
    assert changed == {"lr": (1e-3, 0.0), "weight_decay": (0.1, 0.2)}
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.2, 0.0]


def test_a_token_id_past_the_models_embedding_is_named_with_the_table():
    """Ids reach an embedding's rows through views only; one past the table fails as a DataError naming
    the table and its rows, before any rank runs an op (torch's own error is an IndexError in a stage)."""
    from types import SimpleNamespace

    from hetcc.train.startup import embedding_tables

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.kinds = torch.nn.Embedding(7, 4), torch.nn.Embedding(3, 4)

        def forward(self, input_ids, labels):
            return (self.wte(input_ids.view(-1, SEQ)) + self.kinds(labels % 3)).sum()

    example = (torch.zeros(ROWS, SEQ, dtype=torch.int64), torch.zeros(ROWS, SEQ, dtype=torch.int64))
    module = torch.export.export(Model(), example).module()
    names = {n.target: n.target.replace("_", ".") for n in module.graph.find_nodes(op="get_attr")}
    # labels pass through a remainder on their way to `kinds`: not the ids as they come, not checked
    tables = embedding_tables([SimpleNamespace(module=module, param_names=names)])
    assert tables == {"input_ids": (7, "wte.weight")}
    need = needs(["input_ids"])
    need = RankInputs(
        need.names, M, ROWS, need.mine, need.shapes, need.dtypes, need.model_inputs, tables=tables
    )
    good = {"input_ids": torch.randint(0, 7, (8, SEQ)), "labels": torch.zeros(8, SEQ, dtype=torch.int64)}
    assert next(RankData([good], need)).step == 0
    bad = {**good, "input_ids": torch.full((8, SEQ), 7)}
    with pytest.raises(DataError, match=r"input 'input_ids' \(microbatch 0\) holds token id 7; the model's "
                                        r"embedding 'wte.weight' has 7 rows \(ids 0..6\)"):  # fmt: skip
        next(RankData([bad], need))
