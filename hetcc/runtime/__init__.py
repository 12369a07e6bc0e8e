"""hetcc's runtime: the transports the send/recv ops (``hetcc.sendrecv``) run through, process groups,
the schedule executor, placement, saved pipelines and the record of how they run (``PipelineMeta``).

Names are imported on first use, so that the command line, which reads ``hetcc.runtime.contract``
(no torch) for its training options, starts without waiting for torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Pipeline": "hetcc.runtime.store",
    "PipelineMeta": "hetcc.runtime.contract",
    "save_stages": "hetcc.runtime.store",
    "load_stages": "hetcc.runtime.store",
    "load_pipeline": "hetcc.runtime.store",
    "pipelining_schedule": "hetcc.runtime.interop",
    "link_backend": "hetcc.runtime.groups",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetcc.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
