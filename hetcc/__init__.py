"""hetcc: compile one PyTorch model into unequal pipeline stages for a cluster of unequal devices.

Where each step lives is mapped in ``hetcc/README.md``.
"""

from hetcc import config, ir
from hetcc.api import Analysis, Compiled, analyze, compile, replan, run_local
from hetcc.errors import (
    AnalysisError,
    ClusterError,
    HetccError,
    InfeasiblePlanError,
    PlanFormatError,
    RuntimeFailure,
    TraceError,
)
from hetcc.hardware.calibration import Calibration, apply_to_cluster
from hetcc.hardware.cluster import Cluster, Device, Link
from hetcc.hardware.measure import calibrate
from hetcc.hardware.presets import DeviceType, get_preset
from hetcc.passes.trace import trace
from hetcc.plan import Plan, PlanStage
from hetcc.train.export import export

__all__ = [
    "Analysis",
    "Calibration",
    "Cluster",
    "apply_to_cluster",
    "calibrate",
    "Compiled",
    "Plan",
    "PlanStage",
    "compile",
    "export",
    "replan",
    "run_local",
    "Device",
    "DeviceType",
    "Link",
    "get_preset",
    "analyze",
    "ir",
    "trace",
    "AnalysisError",
    "ClusterError",
    "HetccError",
    "InfeasiblePlanError",
    "PlanFormatError",
    "RuntimeFailure",
    "TraceError",
    "config",
]
__version__ = "0.1.0"
