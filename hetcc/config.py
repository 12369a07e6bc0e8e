"""hetcc's knobs in one typed module.

Each knob has a type, a one-line comment and an environment override read at import time; tests and
users change one for a block with ``with config.patch(debug=2): ...``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from hetcc.errors import HetccError, did_you_mean


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else default


# 0 silent; 1 print the plan/analysis summary; 2 also the IR after every pass; 3 also generated Triton.
debug: int = _env_int("HETCC_DEBUG", 0)
# Folder for numbered IR dumps after every pass (None: no dumps).
dump_dir: str | None = os.environ.get("HETCC_DUMP_DIR") or None
# Run hetcc.verify's invariant checks after each pass (always on in tests).
check: bool = bool(_env_int("HETCC_CHECK", 0))
# A block whose nodes' saved activations + parameter bytes exceed this is split into finer blocks.
max_block_bytes: float = float(os.environ.get("HETCC_MAX_BLOCK_BYTES", "inf"))
# Fuse pointwise chains (and a closing row reduction) into generated Triton kernels: "cost" (the
# default) fuses a group where one kernel call, its host time included, beats its ops on the device
# type of the stage that runs it; "all" fuses every group (to run the kernels where they do not pay,
# a CPU under TRITON_INTERPRET=1, say); "off" none. HETCC_FUSE=0 / 1 / 2 (or the names) set it.
FUSE_MODES = ("off", "cost", "all")


def _fuse_mode(value: str) -> str:
    named = {"0": "off", "1": "cost", "2": "all"}.get(value.strip(), value.strip().lower())
    return named if named in FUSE_MODES else "cost"


fuse: str = _fuse_mode(os.environ.get("HETCC_FUSE", "cost"))
# CUDA graphs for each stage's compute between its sends and receives (hetcc.runtime.cudagraphs): "auto"
# (the default) captures them on CUDA devices where that is safe and the first step's measured memory
# shows the device holds graphs for every microbatch, "on" wherever they can be captured, "off" never. HETCC_CUDA_GRAPHS=0 / 1: off / on.
CUDA_GRAPHS_MODES = ("off", "auto", "on")


def cuda_graphs_mode(value: str) -> str:
    """``value`` (an environment string or a patched knob) as one of ``CUDA_GRAPHS_MODES``; anything
    else is an error naming the choices, since a mistyped mode would silently change what runs."""
    mode = {"0": "off", "1": "on"}.get(str(value).strip(), str(value).strip().lower())
    if mode not in CUDA_GRAPHS_MODES:
        raise HetccError(
            f"HETCC_CUDA_GRAPHS / config.cuda_graphs is {value!r}, not a CUDA graphs mode"
            f"{did_you_mean(mode, CUDA_GRAPHS_MODES)}",
            hint=f"use one of {', '.join(CUDA_GRAPHS_MODES)} (0 and 1 mean off and on)",
        )
    return mode


cuda_graphs: str = cuda_graphs_mode(os.environ.get("HETCC_CUDA_GRAPHS", "auto"))
# Seconds a rank waits on any send/recv/collective before raising RuntimeFailure.
comm_timeout_s: float = float(os.environ.get("HETCC_COMM_TIMEOUT_S", "120"))
# Device orders searched exactly up to this many distinct orders; beyond it, heuristic + local search.
exact_order_limit: int = _env_int("HETCC_EXACT_ORDER_LIMIT", 5000)
# Processes that solve independent partition problems at once (tensor degrees, schedules) where they are
# large enough to pay (``hetcc.solver.parallel``): 0 one per CPU core, 1 none (one after another).
solver_workers: int = _env_int("HETCC_SOLVER_WORKERS", 0)


@contextlib.contextmanager
def patch(**changes: object) -> Iterator[None]:
    """Set knobs for the duration of a ``with`` block, then restore them."""
    module = globals()
    unknown = [k for k in changes if k not in module or k.startswith("_") or callable(module[k])]
    if unknown:
        raise AttributeError(f"hetcc.config has no knob(s) {unknown}")
    saved = {k: module[k] for k in changes}
    module.update(changes)
    try:
        yield
    finally:
        module.update(saved)
