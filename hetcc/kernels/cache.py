"""Where a FusionGroup runs (Triton or its original ops) and its compile-once kernel cache.

Triton is imported lazily, on the first kernel compile, so ``import hetcc`` stays fast and works where
Triton is absent (macOS): there every group falls back to its original ops. On CPU the generated kernel
runs only when ``TRITON_INTERPRET=1`` is set, and was set when Triton was first imported (Triton builds
its own library for the interpreter at import); whether a kernel was compiled interpreted is part of the
cache key.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from hetcc.kernels.group import FusionGroup
from hetcc.kernels.source import kernel_source

TRITON = "triton"
FALLBACK = "eager-fallback"


@functools.cache
def triton_installed() -> bool:
    """Whether ``import triton`` can succeed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """Whether generated kernels can run on CPU tensors through Triton's interpreter."""
    requested = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return requested and triton_installed() and _imported_for_interpreter()


def _imported_for_interpreter() -> bool:
    # Triton jit-decorates its own library (tl.sigmoid, tl.max ...) at import, under the environment
    # of that moment; kernels interpreted later can call those only if it said TRITON_INTERPRET=1.
    language = sys.modules.get("triton.language")
    return language is None or type(language.sigmoid).__name__ == "InterpretedFunction"


def choose_backend(device_type: str) -> tuple[str, str]:
    """(backend, reason) for tensors on ``device_type``: what runs and why, as printed in dumps."""
    if not triton_installed():
        return FALLBACK, "Triton is not installed"
    if device_type == "cuda":
        return TRITON, "CUDA/ROCm device"
    if device_type != "cpu":
        return FALLBACK, f"no Triton backend for device type {device_type!r}"
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):  # read once: every fused call on a CPU asks
        return FALLBACK, "CPU without TRITON_INTERPRET=1"
    if _imported_for_interpreter():
        return TRITON, "CPU through TRITON_INTERPRET=1"
    return FALLBACK, "CPU: TRITON_INTERPRET=1 was set after Triton was imported"


def describe_backend(device_type: str) -> str:
    """E.g. ``backend=eager-fallback (CPU without TRITON_INTERPRET=1)``."""
    backend, reason = choose_backend(device_type)
    return f"backend={backend} ({reason})"


@dataclass(frozen=True)
class CompiledKernels:
    """The jitted kernels of one group and the file their source was loaded from."""

    forward: Any
    backward: Any | None
    path: Path


_CACHE: dict[str, CompiledKernels] = {}


def cache_key(group: FusionGroup) -> str:
    """The group's name hashes everything its source depends on (ops, constants, dtypes, layouts,
    rank, backward mode, codegen version and codegen knobs: see ``group.structural_key``); whether
    Triton interprets is the one thing added here. Cheap: it runs on every call."""
    return f"{group.name}{'-interpreted' if interpreter_enabled() else ''}"


def compiled(group: FusionGroup) -> CompiledKernels:
    """Compile the group's kernels once per process and key; later calls return the cached ones."""
    key = cache_key(group)
    if key not in _CACHE:
        _CACHE[key] = _load(group, key)
    return _CACHE[key]


def cache_size() -> int:
    return len(_CACHE)


@functools.cache
def _kernel_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="hetcc_kernels_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _load(group: FusionGroup, key: str) -> CompiledKernels:
    # Triton's jit reads the kernel's source through inspect, so the module must live in a real file.
    path = _kernel_dir() / f"{key.replace('-', '_')}.py"
    path.write_text(kernel_source(group))
    spec = importlib.util.spec_from_file_location(f"hetcc_kernels.{path.stem}", path)
    module: ModuleType = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    backward = getattr(module, f"{group.name}_bwd", None)
    return CompiledKernels(getattr(module, f"{group.name}_fwd"), backward, path)
