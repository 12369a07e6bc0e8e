"""The dump folder and debug printing shared by every step (``dump_dir=`` / ``HETCC_DUMP_DIR``,
``HETCC_DEBUG``). Files are numbered in pipeline order and start with ``# after <pass> (N ms)``."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from hetcc import config


class Dumper:
    """Writes ``NN_<name>`` after each step into one folder; prints the IR when ``debug >= 2``."""

    def __init__(self, dump_dir: str | Path | None = None):
        folder = dump_dir if dump_dir is not None else config.dump_dir
        self.folder = Path(folder) if folder else None
        self.index = 0
        self.timings_ms: dict[str, float] = {}
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def step(self, name: str, filename: str, render: Callable[[], str]) -> Iterator[None]:
        """Time the body, then dump ``render()`` as ``NN_<filename>``."""
        start = time.perf_counter()
        yield
        elapsed_ms = (time.perf_counter() - start) * 1e3
        self.timings_ms[name] = elapsed_ms
        if self.folder is None and config.debug < 2:
            self.index += 1
            return
        self.write(filename, f"# after {name} ({elapsed_ms:.0f} ms)\n{render()}\n", echo=config.debug >= 2)

    def write(self, filename: str, text: str, *, echo: bool = False, numbered: bool = True) -> Path | None:
        path = None
        if self.folder is not None:
            name = f"{self.index:02d}_{filename}" if numbered else filename
            path = self.folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        if numbered:
            self.index += 1
        if echo:
            print(text, file=sys.stderr)
        return path
