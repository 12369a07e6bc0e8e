"""What a person looks at after compiling: ``report.html`` and Chrome-trace timelines of a step.

Both read only the folder ``hetcc compile`` writes (``plan.json``, ``problem.json``, ``cluster.json``),
so ``hetcc report DIR`` and ``hetcc simulate DIR --trace out.json`` work on any saved build.
"""

from hetcc.report.data import SavedPlan, load, simulate_plan
from hetcc.report.html import REPORT_FILE, render, write_report
from hetcc.report.timeline import chrome_trace, measured_trace, simulated_trace, write_trace

__all__ = [
    "REPORT_FILE", "SavedPlan", "chrome_trace", "load", "measured_trace", "render", "simulate_plan", "simulated_trace",
    "write_report", "write_trace",
]  # fmt: skip
