"""hetcc: compile one PyTorch model into unequal pipeline stages for a cluster of unequal devices."""

from hetcc import config
from hetcc.errors import (
    AnalysisError,
    ClusterError,
    HetccError,
    InfeasiblePlanError,
    PlanFormatError,
    RuntimeFailure,
    TraceError,
)

__all__ = [
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
