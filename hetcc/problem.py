"""From an analysed graph and a cluster to the solver's numbers-only ``PartitionProblem``.

State bytes per block = parameters × (1 weight + 1 gradient + optimizer states) when training. A tied
parameter (GPT-2's wte/lm_head) is charged to every block that uses it, because every stage that runs
one of those blocks holds a copy (it over-counts only when the same stage holds both users).
"""

from __future__ import annotations

from hetcc.analysis import Analysis
from hetcc.cluster import Cluster
from hetcc.errors import HetccError
from hetcc.passes.cost import block_times
from hetcc.passes.partition import PartitionProblem, ProblemDevice

# Optimizer states per parameter, in units of the parameter's own bytes.
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "none": 0}


def state_multiplier(training: bool, optimizer: str) -> int:
    """Bytes held per parameter byte: the weight, its gradient and the optimizer's states."""
    if not training:
        return 1
    try:
        return 2 + OPTIMIZER_STATES[optimizer.lower()]
    except KeyError:
        raise HetccError(
            f"unknown optimizer {optimizer!r} for memory planning",
            hint=f"use one of {', '.join(OPTIMIZER_STATES)}",
        ) from None


def build_problem(
    analysis: Analysis,
    cluster: Cluster,
    *,
    microbatches: int,
    schedule: str,
    training: bool,
    optimizer: str,
) -> PartitionProblem:
    """The partition problem for ``analysis`` (costed with ``passes.cost``) on ``cluster``."""
    chain = analysis.blocks
    type_names = [t.name for t in cluster.types]
    fwd, bwd = block_times(analysis.graph, [b.nodes for b in chain], type_names)
    multiplier = state_multiplier(training, optimizer)
    params = [float(b.param_bytes) for b in chain]
    index = {b.name: i for i, b in enumerate(chain)}
    for tied in analysis.tied_params:
        for name in tied.blocks[1:]:  # the first user's block already counts it
            params[index[name]] += tied.bytes
    devices = [
        ProblemDevice(d.name, d.type.name, float(cluster.usable_memory_bytes(d)), d.node)
        for d in cluster.devices
    ]
    return PartitionProblem(
        blocks=[b.name for b in chain],
        fwd_s=fwd,
        bwd_s=bwd,
        state_bytes=[p * multiplier for p in params],
        act_bytes=[float(b.act_bytes) if training else 0.0 for b in chain],
        cut_bytes=[float(b.cut_bytes) for b in chain[:-1]],
        devices=devices,
        bandwidth_bps=cluster.bandwidth_matrix_bps(),
        latency_s=cluster.latency_matrix_s(),
        microbatches=microbatches,
        schedule=schedule,
        training=training,
    )
