"""What a rank of a saved pipeline loads and agrees on before it trains: its own stages' files
(``load_rank``), what it reads of each global batch (``rank_inputs``), and every rank's word that it
could load them (``agree_on_start``), so one that cannot start stops every rank at once."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hetcc.errors import HetccError, RuntimeFailure
from hetcc.passes.comm import StageGraph
from hetcc.runtime.layout import RankLayout
from hetcc.runtime.store import PipelineOutline, load_stage, read_outline
from hetcc.train.data import RankInputs

aten = torch.ops.aten


def agree_on_start(rank: int, failure: HetccError | None) -> None:
    """Every rank says whether it could load what it runs (a collective, before any process group of
    the pipeline is made): one that could not would leave its peers waiting for it until the timeout;
    instead every rank raises at once, naming the ranks that failed and why. The messages travel as
    bytes in a plain tensor all-reduce, and on a failure every rank leaves the process group together
    (ranks tearing it down at different times have ended in "terminate called without an active
    exception")."""
    causes = [
        f"rank {r}: {cause}"
        for r, cause in enumerate(
            _gather_texts(None if failure is None else f"{type(failure).__name__}: {failure}")
        )
        if cause is not None
    ]
    if not causes:
        return
    dist.barrier()
    dist.destroy_process_group()
    error = RuntimeFailure(
        "the pipeline cannot start: " + "; ".join(causes),
        hint="fix the files named (or save the pipeline again); every rank stopped before training",
    )
    raise error from failure


_TEXT_BYTES = 4096  # of each rank's start-up error that every rank sees


def _gather_texts(text: str | None) -> list[str | None]:
    """Every rank's ``text`` (None: nothing to say), by rank: each fills its own row of a byte tensor,
    and the sum of the rows is all of them."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    rows = torch.zeros(world, _TEXT_BYTES + 1, dtype=torch.uint8)
    if text is not None:
        data = text.encode()[:_TEXT_BYTES]
        rows[rank, 0] = 1
        rows[rank, 1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = rows.to(device)
    dist.all_reduce(rows)
    return [
        bytes(row[1:].cpu().tolist()).rstrip(b"\0").decode(errors="replace") if row[0] else None
        for row in rows
    ]


def load_rank(directory: str, rank: int) -> tuple[PipelineOutline, list[StageGraph]]:
    """What ``rank`` runs: the folder's outline (pipeline.json) and its own stages (one, or one per chunk
    under interleaved 1F1B and ZB-V), the only graphs and weights it reads (a damaged file of another stage fails
    that stage's ranks, not this one)."""
    outline = read_outline(directory)
    ranks = outline.meta.placement
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(ranks):
        raise HetccError(f"{directory}: no rank {rank!r}; the pipeline has ranks 0..{len(ranks) - 1}")
    return outline, [load_stage(directory, stage) for stage in ranks[rank].stages]


def rank_inputs(
    outline: PipelineOutline, layout: RankLayout, rank: int, loss_fn: bool, graphs: Sequence[StageGraph] = ()
) -> RankInputs:
    """What ``rank`` reads of each global batch (``hetcc.train.data.RankInputs``), from pipeline.json, and
    the embedding tables its input ids index in its stages' ``graphs``."""
    placement = layout.ranks[rank]
    stages = [outline.stages[k] for k in placement.stages]  # under interleaved 1F1B: what its chunks read
    model_inputs = tuple(dict.fromkeys(name for s in outline.stages for name in s.inputs))
    rows = next(
        (
            int(shape[0])
            for s in outline.stages
            for shape in s.input_shapes.values()
            if shape and isinstance(shape[0], int)
        ),
        1,
    )
    mine = tuple(
        m for m, replica in enumerate(layout.routing[placement.stage]) if replica == placement.replica
    )
    return RankInputs(
        tuple(dict.fromkeys(name for stage in stages for name in stage.inputs)), len(layout.routing[0]), rows,
        mine, {k: v for stage in stages for k, v in stage.input_shapes.items()},
        {k: v for stage in stages for k, v in stage.input_dtypes.items()}, model_inputs,
        target=any(stage.is_last for stage in stages) and loss_fn, tables=embedding_tables(graphs),
    )  # fmt: skip


# What an index may pass through, unchanged, on its way to an embedding table's rows.
_SAME_INDICES = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.flatten.using_ints, aten.clone.default, aten.contiguous.default,
})  # fmt: skip


def embedding_tables(stages: Sequence[StageGraph]) -> dict[str, tuple[int, str]]:
    """Model input -> (rows, name) of the smallest embedding table it indexes in ``stages``, as it comes
    (through views only): a token id at or past ``rows`` has no row there. An input changed on the way
    (T5's labels shifted into decoder ids) is not checked."""
    tables: dict[str, tuple[int, str]] = {}
    for stage in stages:
        for placeholder in stage.module.graph.find_nodes(op="placeholder"):
            for table in _tables_indexed(placeholder):
                rows = int(operator.attrgetter(table.target)(stage.module).shape[0])
                found = (rows, stage.param_names.get(table.target, table.target))
                tables[placeholder.target] = min(tables.get(placeholder.target, found), found)
    return tables


def _tables_indexed(placeholder: torch.fx.Node) -> list[torch.fx.Node]:
    """The weights (``get_attr`` nodes) of the embedding lookups whose indices are ``placeholder`` or a
    view of it (``_SAME_INDICES``)."""
    tables, frontier = [], [placeholder]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.target in _SAME_INDICES and user.args[0] is node:
                frontier.append(user)
            elif (
                user.target is aten.embedding.default
                and user.args[1] is node
                and user.args[0].op == "get_attr"
            ):
                tables.append(user.args[0])
    return tables
