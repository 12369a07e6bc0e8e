"""Where the command line's data comes from: ``--data pkg.module:factory`` (or ``path/to/file.py:factory``),
a function with no arguments returning a Dataset, a DataLoader or an iterable of global batches, or
``--data FOLDER``, a token folder written by ``hetcc prepare-text`` (``TokenDataset`` windows as long as
the build's traced sequence). Each rank resolves the spec itself (``DataSpec`` is what travels), so a
factory in a file that is not an importable module works for spawned and torchrun ranks alike.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetcc.errors import HetccError, did_you_mean

FACTORY_FORM = "pkg.module:factory or path/to/file.py:factory"
RETURNS = "a Dataset, a DataLoader or an iterable of batches"


@dataclass(frozen=True)
class DataSpec:
    """``--data`` as given; calling it (in each rank) gives the data."""

    spec: str
    seq_len: int  # the build's traced sequence length (a token folder's window)
    split: str = "train"  # a token folder's split
    labels: str | None = "inputs"  # a token folder's labels ("inputs": the model shifts them itself)

    def __call__(self) -> Any:
        if is_token_folder(self.spec):
            from hetcc.train.tokens import TokenDataset

            return TokenDataset(self.spec, self.seq_len, split=self.split, labels=self.labels)
        factory = import_attribute(self.spec, "data", RETURNS)
        try:
            return factory()
        except HetccError:
            raise
        except Exception as error:
            raise HetccError(
                f"data factory {self.spec!r} raised {type(error).__name__}: {error}",
                hint="call the factory in Python to see the full traceback",
            ) from error


def is_token_folder(spec: str) -> bool:
    return Path(spec, "meta.json").is_file()


def check_spec(spec: str, what: str = "--data") -> None:
    """Fail at once, in the parent, on a spec that is neither a token folder nor a factory's name."""
    if is_token_folder(spec):
        return
    if Path(spec).is_dir():
        raise HetccError(
            f"{what} {spec}: the folder holds no meta.json, so it is not a token folder",
            hint="write one with `hetcc prepare-text TEXT_FOLDER OUT`, or name a factory: " + FACTORY_FORM,
        )
    import_attribute(spec, what, RETURNS)


def import_attribute(spec: str, what: str, returns: str = "..."):
    """The callable ``spec`` names (``pkg.module:name`` or ``path/to/file.py:name``); ``returns`` is what
    the hint says it should return."""
    source, _, name = spec.rpartition(":")
    if not source or not name:
        raise HetccError(f"{what} {spec!r} is not of the form {FACTORY_FORM}")
    module = import_source(source, spec, what)
    found = getattr(module, name, None)
    if not callable(found):
        raise HetccError(
            f"{source} has no function {name!r}",
            hint=f"define `def {name}(): return {returns}` there" + did_you_mean(name, dir(module)),
        )
    return found


def import_source(source: str, spec: str, what: str):
    """The module a factory lives in: a ``.py`` file by path, or a module importable from here."""
    is_file = source.endswith(".py") or "/" in source or "\\" in source
    path = Path(source).resolve()
    if is_file and not path.is_file():
        raise HetccError(f"{what} file {source} does not exist (from {spec!r})", hint=f"use {FACTORY_FORM}")
    folder = str(path.parent if is_file else Path.cwd())
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so its own imports resolve
    try:
        if not is_file:
            return importlib.import_module(source)
        name = f"_hetcc_factory_{path.stem}"
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # imported once per process
        module_spec.loader.exec_module(module)
        return module
    except ImportError as exc:
        raise HetccError(
            f"cannot import {source!r} for {what} {spec!r}: {exc}",
            hint=f"run from the folder that holds the package, or use {FACTORY_FORM}",
        ) from exc
    except Exception as exc:
        raise HetccError(f"importing {source} raised {type(exc).__name__}: {exc}") from exc
