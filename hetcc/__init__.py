"""hetcc: compile one PyTorch model into unequal pipeline stages for a cluster of unequal devices."""

from hetcc import config, ir
from hetcc.analysis import Analysis, analyze
from hetcc.api import Compiled, compile, run_local
from hetcc.calibrate import calibrate
from hetcc.calibration import Calibration, apply_to_cluster
from hetcc.cluster import Cluster, Device, Link
from hetcc.errors import (
    AnalysisError,
    ClusterError,
    HetccError,
    InfeasiblePlanError,
    PlanFormatError,
    RuntimeFailure,
    TraceError,
)
from hetcc.plan import Plan, Stage
from hetcc.presets import DeviceType, get_preset
from hetcc.trace import trace

__all__ = [
    "Analysis",
    "Calibration",
    "Cluster",
    "apply_to_cluster",
    "calibrate",
    "Compiled",
    "Plan",
    "Stage",
    "compile",
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
