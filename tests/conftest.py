import os
import sys
import warnings
from pathlib import Path

import pytest

# Triton kernels run through its CPU interpreter in tests; this must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HETCC_CHECK", "1")  # hetcc.verify's invariant checks after every pass
# Every fusible group runs as a generated kernel, so the suite checks each against eager; on the CPU
# clusters most tests plan for, fusing by cost (the default) would fuse nothing. Tests of that choice
# set hetcc.config.fuse = "cost"; the README's commands run with the user's default.
os.environ.setdefault("HETCC_FUSE", "all")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "runtime"))  # runtime_models: tests above runtime/ use it


@pytest.fixture
def interpreter(monkeypatch):
    """Generated kernels run (through the interpreter), or the test skips saying why they cannot."""
    pytest.importorskip("triton", reason="Triton is not installed: fusion groups always fall back to eager")
    from hetcc.kernels import cache

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not cache.interpreter_enabled():
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set; set it before importing triton")
    with warnings.catch_warnings():
        # numpy inside the interpreter also evaluates masked-off lanes (e.g. rsqrt(0)); stores drop them.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
        yield


@pytest.fixture
def no_interpreter(monkeypatch):
    """CPU without the interpreter: fusion groups run their original ops."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
