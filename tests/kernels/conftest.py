"""Run generated Triton kernels on CPU through Triton's interpreter in this folder's tests.

``TRITON_INTERPRET=1`` must be set before Triton is first imported (Triton builds its own library for
the interpreter at import), hence at collection here. If something imported Triton earlier without it,
interpreter tests skip with that reason instead of silently testing the eager fallback.
"""

import os
import warnings

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


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
