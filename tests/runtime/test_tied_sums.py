"""The step-end sum of a weight tied across two ranks (``hetcc.runtime.tied``): an exchange whose owner
sends its part back as its nonzero rows where that is smaller, both ranks ending with the same sum."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetcc.passes.comm import TiedGroup
from hetcc.runtime import tied
from hetcc.runtime.groups import Links

pytestmark = pytest.mark.slow

GROUP = TiedGroup("model.embed.weight", ((0, "embed"), (2, "head")))


def _parts(owner_rows: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the owner's part: only ``owner_rows`` nonzero, or every row; the other's: every row)."""
    generator = torch.Generator().manual_seed(0)
    other = torch.randn(8, 3, generator=generator)
    owner = torch.randn(8, 3, generator=generator)
    if owner_rows is not None:
        keep = torch.zeros(8, 1)
        keep[owner_rows] = 1.0
        owner = owner * keep
    return owner, other


def _rank(rank: int, store: str, owner_rows, answers) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        links = Links(["cpu", "cpu"], [[0, 1]], timeout_s=30.0)
        local = "embed" if rank == 0 else "head"
        module = torch.nn.Module()
        module.register_parameter(local, torch.nn.Parameter(torch.zeros(8, 3)))
        executor = SimpleNamespace(
            links=links, stage=SimpleNamespace(index=0 if rank == 0 else 2, tied=(GROUP,)), module=module
        )
        sent = []
        send = tied._send
        tied._send = lambda links, index, tensor, what: (
            sent.append(tuple(tensor.shape)) or send(links, index, tensor, what)
        )
        posted = tied.post_parts([executor])  # the owner's receive, before the step's actions
        module.get_parameter(local).grad = _parts(owner_rows)[rank].clone()
        tied.reduce_tied_grads([executor], posted)
        answers.put((rank, module.get_parameter(local).grad.tolist(), sent))  # no tensor: the process ends
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("owner_rows", [[1, 4], None, []], ids=["rows", "whole", "zeros"])
def test_two_holders_exchange_their_parts_and_end_with_the_same_sum(tmp_path, owner_rows):
    answers = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, (str(tmp_path / "store"), owner_rows, answers), nprocs=2, start_method="spawn")
    got = {rank: (torch.tensor(grad), sent) for rank, grad, sent in (answers.get() for _ in range(2))}
    owner, other = _parts(owner_rows)
    assert torch.equal(got[0][0], owner + other)
    assert torch.equal(got[1][0], got[0][0])  # bit for bit: each adds the other's part to its own
    if owner_rows is None:  # every row: the owner sends its part whole
        assert got[0][1] == [(1,), (8, 3)]
    elif owner_rows:  # a count, the rows' indices, their values
        assert got[0][1] == [(1,), (2,), (2, 3)]
    else:
        assert got[0][1] == [(1,)]
    assert got[1][1] == [(8, 3)]  # the other sends its part whole
