"""hetcc: compile one PyTorch model into unequal pipeline stages for a cluster of unequal devices.

Where each step lives is mapped in ``hetcc/README.md``. The public names below are imported on first
use, so ``import hetcc.cli`` (``hetcc --help``, an argument error) does not wait for torch.
"""

from __future__ import annotations

import importlib

from hetcc.errors import (
    AnalysisError,
    ClusterError,
    HetccError,
    InfeasiblePlanError,
    PlanFormatError,
    RuntimeFailure,
    TraceError,
)

_EXPORTS = {
    "Analysis": "hetcc.api",
    "Compiled": "hetcc.api",
    "analyze": "hetcc.api",
    "compile": "hetcc.api",
    "replan": "hetcc.api",
    "run_local": "hetcc.api",
    "Calibration": "hetcc.hardware.calibration",
    "apply_to_cluster": "hetcc.hardware.calibration",
    "Cluster": "hetcc.hardware.cluster",
    "Device": "hetcc.hardware.cluster",
    "Link": "hetcc.hardware.cluster",
    "calibrate": "hetcc.hardware.measure",
    "DeviceType": "hetcc.hardware.presets",
    "get_preset": "hetcc.hardware.presets",
    "trace": "hetcc.passes.trace",
    "Plan": "hetcc.plan",
    "PlanStage": "hetcc.plan",
    "export": "hetcc.train.export",
}
_SUBMODULES = ("api", "config", "ir", "train", "report", "runtime", "solver", "hardware", "passes", "kernels")

__all__ = [
    *_EXPORTS, "ir", "config", "train",
    "AnalysisError", "ClusterError", "HetccError", "InfeasiblePlanError", "PlanFormatError", "RuntimeFailure",
    "TraceError",
]  # fmt: skip
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"hetcc.{name}")
    else:
        raise AttributeError(f"module 'hetcc' has no attribute {name!r}")
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})
