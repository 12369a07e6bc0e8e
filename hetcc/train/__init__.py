"""Training a compiled pipeline: the per-rank API, the built-in loop, data, metrics and checkpoints, on top
of the runtime's execution (``hetcc.runtime``: transport, ops, executor, process groups).

    rank.py      PipelineRank: this process's stage, step / evaluate / clip_grad_norm_ / save / load
    loop.py      the built-in loop on it (run_local, hetcc run, hetcc.launch), TrainSettings
    local.py     run_local: one spawned process per rank, watched
    data.py      datasets, loaders and iterables as each rank's share of global batch k
    tokens.py    the on-disk token dataset; text.py prepare_text, which writes one
    optim.py     optimizer from settings, weight-decay groups, warmup + decay schedule
    metrics.py   per-step figures, metrics.jsonl / TensorBoard, measured vs simulated
    checkpoint.py, export.py, replan.py   checkpoints, the trained weights as one state dict, re-planning
    options.py, sources.py   the command line's training options and --data
"""

from __future__ import annotations

import importlib

# Imported on first use, so the command line's option definitions (options.py) load without torch.
_EXPORTS = {
    "LRSchedule": "hetcc.train.optim",
    "param_groups": "hetcc.train.optim",
    "PipelineRank": "hetcc.train.rank",
    "TokenDataset": "hetcc.train.tokens",
    "prepare_text": "hetcc.train.text",
    "global_batches": "hetcc.train.data",
    "RunResult": "hetcc.train.local",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetcc.train' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
