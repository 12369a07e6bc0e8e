"""hetcc: compile one PyTorch model into unequal pipeline stages for a cluster of unequal devices."""

from hetcc import config, ir
from hetcc.analysis import Analysis, analyze
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
from hetcc.presets import DeviceType, get_preset
from hetcc.trace import trace

__all__ = [
    "Analysis",
    "Cluster",
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
