"""Every user-facing failure is a HetccError: it names what is at fault and what to do next."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """'; did you mean X?' for the closest choice, or '' when nothing is close (for error messages)."""
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


def format_bytes(nbytes: float) -> str:
    """A size as people read it, binary units (for messages and tables): "248 GiB", "1.5 MiB", "512 B"."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{value:.0f} B"
    return f"{value:.3g} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"


class HetccError(Exception):
    """Base class of hetcc's errors. ``hint`` is the next step a user can take."""

    def __init__(self, message: str, *, hint: str | None = None):
        self.message, self.hint = message, hint  # the message without its hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


class ClusterError(HetccError):
    """A cluster file or spec is invalid (names the file, the device or field, and why)."""


class TraceError(HetccError):
    """The model could not be captured as a graph by any front end."""


class AnalysisError(HetccError):
    """A pass could not annotate a node (names the node and the op)."""


class InfeasiblePlanError(HetccError):
    """No partition fits the devices' memory (names the tightest stage and what is missing)."""


class RuntimeFailure(HetccError):
    """A rank failed, timed out or lost its peer while running a compiled pipeline."""


class PlanFormatError(HetccError):
    """A saved plan or problem file is malformed or from an incompatible version."""
