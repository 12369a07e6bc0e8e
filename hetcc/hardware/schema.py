"""The one schema layer of hetcc's hand-written YAML/JSON files (cluster files, calibration files).

A file format is declared as a ``Record``: a table of keys whose values are kinds (``Text``, ``Quantity``,
``Fraction``, ``Count``, ``Nullable``, ``Choice``, ``ListOf``, ``Table`` or another ``Record``; any
function ``(value, where) -> result`` is a kind too). Calling a format on a parsed file checks and converts it in
one walk. Every error names the file, the field path (``nodes[1].devices[0].memory``) and the reason,
for a misspelt name the closest valid one, and a hint of what to write.

``load_file`` parses the file first, strictly: a YAML key given twice is an error, not the last one winning.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import pathlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import yaml

from hetcc.errors import ClusterError, did_you_mean
from hetcc.hardware.quantities import parse_quantity


@dataclass(frozen=True)
class Where:
    """A place in a file: the file's (or spec's) name and a field path in it, where errors are raised."""

    source: str
    path: str = ""

    def at(self, *steps: str | int) -> Where:
        """The place ``steps`` below this one: a key (``.name``) or a list index (``[3]``)."""
        path = self.path
        for step in steps:
            path = f"{path}[{step}]" if isinstance(step, int) else f"{path}.{step}" if path else step
        return Where(self.source, path)

    def fail(self, reason: str, hint: str | None = None) -> NoReturn:
        """Raise a ClusterError reading ``<source>: <path>: <reason>``, with ``hint`` as the next step."""
        raise ClusterError(f"{self.source}: {self.path + ': ' if self.path else ''}{reason}", hint=hint)

    @contextlib.contextmanager
    def blame(self) -> Iterator[None]:
        """Re-raise a ClusterError from the block as one at this place, its hint kept."""
        try:
            yield
        except ClusterError as error:
            self.fail(str(error).partition("\n  hint: ")[0], error.hint)


Kind = Callable[[object, Where], Any]


@dataclass(frozen=True)
class Text:
    """A string, non-empty unless ``empty``. YAML reads an unquoted date as a date: it becomes ISO text."""

    empty: bool = False

    def __call__(self, value: object, where: Where) -> str:
        if isinstance(value, datetime.date):
            return value.isoformat()
        if not isinstance(value, str) or not (self.empty or value.strip()):
            where.fail(f"expected a {'' if self.empty else 'non-empty '}string; got {value!r}")
        return value


@dataclass(frozen=True)
class Quantity:
    """A number in ``unit`` or a string with a unit ("80 GiB", "25 Gb/s"): ``parse_quantity``'s rules."""

    unit: str

    def __call__(self, value: object, where: Where) -> float:
        with where.blame():
            return parse_quantity(value, self.unit)


@dataclass(frozen=True)
class Fraction:
    """A number in (0, 1], a share reached (an efficiency); with ``zero``, in [0, 1), a share held back."""

    zero: bool = False

    def __call__(self, value: object, where: Where) -> float:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and (0 <= value < 1 if self.zero else 0 < value <= 1)):
            where.fail(f"expected a number in {'[0, 1)' if self.zero else '(0, 1]'}; got {value!r}")
        return float(value)


@dataclass(frozen=True)
class Count:
    """A positive integer: how many devices, threads, or which file version."""

    def __call__(self, value: object, where: Where) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            where.fail(f"expected a positive integer; got {value!r}")
        return value


@dataclass(frozen=True)
class Nullable:
    """``null`` (None), or what ``kind`` reads: a field a writer leaves unset, like an unknown thread count."""

    kind: Kind

    def __call__(self, value: object, where: Where) -> Any:
        return None if value is None else self.kind(value, where)


@dataclass(frozen=True)
class Choice:
    """One of ``options``; ``what`` names it in messages ("link kind": "unknown link kind 'nvlnk'")."""

    options: Sequence[str]
    what: str

    def __call__(self, value: object, where: Where) -> str:
        if value not in self.options:
            where.fail(f"unknown {self.what} {value!r}{did_you_mean(value, self.options)}",
                       hint=f"{self.what}s: {', '.join(self.options)}")  # fmt: skip
        return value


@dataclass(frozen=True)
class ListOf:
    """A list whose items ``item`` reads, each at ``<path>[i]``; ``nonempty`` rejects ``[]``."""

    item: Kind
    nonempty: bool = False

    def __call__(self, value: object, where: Where) -> list:
        if not isinstance(value, list) or (self.nonempty and not value):
            where.fail(f"expected a {'non-empty ' if self.nonempty else ''}list; got {value!r}")
        return [self.item(entry, where.at(i)) for i, entry in enumerate(value)]


@dataclass(frozen=True)
class Table:
    """A mapping from some of ``keys`` to values one kind reads (dtype -> FLOP/s); ``what`` describes it."""

    keys: Sequence[str]
    value: Kind
    what: str
    nonempty: bool = False

    def __call__(self, value: object, where: Where) -> dict[str, Any]:
        if not isinstance(value, Mapping) or (self.nonempty and not value):
            where.fail(
                f"expected a mapping of {self.what}; got {value!r}", hint=f"keys: {', '.join(self.keys)}"
            )
        _check_keys(value, self.keys, where)
        return {key: self.value(entry, where.at(key)) for key, entry in value.items()}


@dataclass(frozen=True)
class Record:
    """A mapping with known keys, each read by its own kind, in the file's order; absent keys stay absent.

    ``required`` keys must be there; ``missing_hint`` says how to get a complete file.
    """

    fields: Mapping[str, Kind]
    required: Sequence[str] = ()
    missing_hint: str | None = None

    def __call__(self, value: object, where: Where) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            where.fail(f"expected a mapping with keys {', '.join(self.fields)}; got {type(value).__name__}")
        _check_keys(value, list(self.fields), where)
        for key in self.required:
            if key not in value:
                where.fail(f"missing required key {key!r}", hint=self.missing_hint)
        return {key: self.fields[key](entry, where.at(key)) for key, entry in value.items()}


def _check_keys(mapping: Iterable[object], keys: Sequence[str], where: Where) -> None:
    """Fail at the first key not in ``keys``, naming the closest one and listing them all."""
    for key in mapping:
        if key not in keys:
            where.at(str(key)).fail(
                f"unknown key{did_you_mean(key, keys)}", hint=f"valid keys: {', '.join(keys)}"
            )


# ---- parsing ---------------------------------------------------------------------------------------
class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_file(path: pathlib.Path, what: str) -> object:
    """Parse a .yaml/.yml/.json file; errors name the file (``what`` says which kind) and the line."""
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ClusterError(f"{path}: a {what} must end in .yaml, .yml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ClusterError(f"{path}: cannot read the {what}: {error.strerror or error}") from None
    try:
        return json.loads(text) if suffix == ".json" else yaml.load(text, Loader=_StrictYamlLoader)  # noqa: S506
    except json.JSONDecodeError as error:
        raise ClusterError(
            f"{path}: invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ClusterError(
            f"{path}: invalid YAML{where}: {getattr(error, 'problem', None) or error}"
        ) from None
