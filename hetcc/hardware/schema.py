"""The one schema layer of hetcc's YAML/JSON files (cluster and calibration files, saved pipelines).

A file format is declared as a ``Record``: a table of keys whose values are kinds (``Text``, ``Quantity``,
``Fraction``, ``Count``, ``Number``, ``Nullable``, ``Choice``, ``ListOf``, ``Table`` or another ``Record``; any
function ``(value, where) -> result`` is a kind too). Calling a format on a parsed file checks and converts it in
one walk. Every error names the file, the field path (``nodes[1].devices[0].memory``) and the reason,
for a misspelt name the closest valid one, and a hint of what to write.

``load_file`` parses the file first, strictly and within limits: at most ``max_bytes`` of UTF-8, nested at
most ``MAX_DEPTH`` deep, a YAML key given twice is an error (not the last one winning), and YAML aliases
(``*name``) are refused, so a few hundred bytes cannot expand into gigabytes. Errors are ``ClusterError``
unless a format says otherwise (``Where.error``: saved pipelines raise ``PlanFormatError``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import pathlib
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import yaml

from hetcc.errors import ClusterError, HetccError, did_you_mean
from hetcc.hardware.quantities import parse_quantity

MAX_FILE_BYTES = 4 * 2**20  # a hand-written file (cluster, calibration); saved pipelines pass their own
MAX_DEPTH = 100  # nesting of lists and mappings; hetcc's formats need fewer than 20 levels


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict, _REPR.maxlevel = 60, 60, 8, 8, 3


def short_repr(value: object) -> str:
    """``repr(value)`` abbreviated (long strings, lists, mappings), so no value can flood an error message."""
    text = _REPR.repr(value)
    return text if len(text) <= 120 else f"{text[:115]} ..."


@dataclass(frozen=True)
class Where:
    """A place in a file: the file's (or spec's) name and a field path in it, where errors are raised."""

    source: str
    path: str = ""
    error: type[HetccError] = ClusterError  # what ``fail`` raises
    hint: str | None = None  # the next step where a failure names none (say, "compile again")

    def at(self, *steps: str | int) -> Where:
        """The place ``steps`` below this one: a key (``.name``) or a list index (``[3]``)."""
        path = self.path
        for step in steps:
            path = f"{path}[{step}]" if isinstance(step, int) else f"{path}.{step}" if path else step
        return Where(self.source, path, self.error, self.hint)

    def fail(self, reason: str, hint: str | None = None) -> NoReturn:
        """Raise ``error`` reading ``<source>: <path>: <reason>``, with ``hint`` as the next step."""
        message = f"{self.source}: {self.path + ': ' if self.path else ''}{reason}"
        raise self.error(message, hint=hint or self.hint)

    @contextlib.contextmanager
    def blame(self) -> Iterator[None]:
        """Re-raise a HetccError from the block as one at this place, its hint kept."""
        try:
            yield
        except HetccError as error:
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
            where.fail(f"expected a {'' if self.empty else 'non-empty '}string; got {short_repr(value)}")
        return value


@dataclass(frozen=True)
class Quantity:
    """A number in ``unit`` or a string with a unit ("80 GiB", "25 Gb/s"): ``parse_quantity``'s rules."""

    unit: str

    def __call__(self, value: object, where: Where) -> float:
        with where.blame():
            return parse_quantity(value, self.unit)


def finite(value: object) -> bool:
    """A real number (an int or float, not a bool) with a finite float value: what every figure read
    from a file must be. An int too large for a float (10**400) is not one, and asking never raises."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class Fraction:
    """A number in (0, 1], a share reached (an efficiency); with ``zero``, in [0, 1), a share held back."""

    zero: bool = False

    def __call__(self, value: object, where: Where) -> float:
        if not (finite(value) and (0 <= value < 1 if self.zero else 0 < value <= 1)):
            where.fail(f"expected a number in {'[0, 1)' if self.zero else '(0, 1]'}; got {short_repr(value)}")
        return float(value)


@dataclass(frozen=True)
class Count:
    """An integer from ``minimum`` (1: positive) up to ``maximum``: how many devices, threads, a version,
    an index."""

    maximum: int | None = None
    minimum: int = 1

    def __call__(self, value: object, where: Where) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < self.minimum:
            what = "a positive integer" if self.minimum == 1 else f"an integer >= {self.minimum}"
            where.fail(f"expected {what}; got {short_repr(value)}")
        if self.maximum is not None and value > self.maximum:
            where.fail(f"{short_repr(value)} is more than hetcc handles here (at most {self.maximum})")
        return value


@dataclass(frozen=True)
class Number:
    """A finite number (not a bool) >= 0, or > 0 when ``positive``: a size, a time, a factor."""

    positive: bool = False

    def __call__(self, value: object, where: Where) -> float:
        if not (finite(value) and (value > 0 if self.positive else value >= 0)):
            where.fail(
                f"expected a finite number {'> 0' if self.positive else '>= 0'}; got {short_repr(value)}"
            )
        return value


@dataclass(frozen=True)
class Flag:
    """``true`` or ``false``, and nothing YAML or JSON might mean by it ("no", 0)."""

    def __call__(self, value: object, where: Where) -> bool:
        if not isinstance(value, bool):
            where.fail(f"expected true or false; got {short_repr(value)}")
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
            close = did_you_mean(value, self.options) if isinstance(value, str) else ""
            where.fail(f"unknown {self.what} {short_repr(value)}{close}",
                       hint=f"{self.what}s: {', '.join(self.options)}")  # fmt: skip
        return value


@dataclass(frozen=True)
class ListOf:
    """A list whose items ``item`` reads, each at ``<path>[i]``; ``nonempty`` rejects ``[]``."""

    item: Kind
    nonempty: bool = False

    def __call__(self, value: object, where: Where) -> list:
        if not isinstance(value, list) or (self.nonempty and not value):
            where.fail(f"expected a {'non-empty ' if self.nonempty else ''}list; got {short_repr(value)}")
        return [self.item(entry, where.at(i)) for i, entry in enumerate(value)]


@dataclass(frozen=True)
class Table:
    """A mapping from some of ``keys`` (any strings when None) to values one kind reads (dtype -> FLOP/s);
    ``what`` describes it."""

    keys: Sequence[str] | None
    value: Kind
    what: str
    nonempty: bool = False

    def __call__(self, value: object, where: Where) -> dict[str, Any]:
        if not isinstance(value, Mapping) or (self.nonempty and not value):
            where.fail(
                f"expected a mapping of {self.what}; got {short_repr(value)}",
                hint=f"keys: {', '.join(self.keys)}" if self.keys else None,
            )
        if self.keys is None:
            for key in value:
                if not isinstance(key, str):
                    where.fail(f"expected {self.what} with string keys; got key {short_repr(key)}")
        else:
            _check_keys(value, self.keys, where)
        return {key: self.value(entry, where.at(key)) for key, entry in value.items()}


@dataclass(frozen=True)
class Record:
    """A mapping with known keys, each read by its own kind, in the file's order; absent keys stay absent.

    ``required`` keys must be there; ``missing_hint`` says how to get a complete file. An ``open`` record
    keeps keys it does not know as they are (files other parts of hetcc add to, such as pipeline.json).
    """

    fields: Mapping[str, Kind]
    required: Sequence[str] = ()
    missing_hint: str | None = None
    open: bool = False

    def __call__(self, value: object, where: Where) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            where.fail(f"expected a mapping with keys {', '.join(self.fields)}; got {type(value).__name__}")
        if not self.open:
            _check_keys(value, list(self.fields), where)
        for key in self.required:
            if key not in value:
                where.fail(f"missing required key {key!r}", hint=self.missing_hint)
        return {key: self.fields[key](entry, where.at(key)) if key in self.fields else entry
                for key, entry in value.items()}  # fmt: skip


def _check_keys(mapping: Iterable[object], keys: Sequence[str], where: Where) -> None:
    """Fail at the first key not in ``keys``, naming the closest one and listing them all."""
    for key in mapping:
        if key not in keys:
            close = did_you_mean(key, keys) if isinstance(key, str) else ""
            where.at(key if isinstance(key, str) else short_repr(key)).fail(
                f"unknown key{close}", hint=f"valid keys: {', '.join(keys)}"
            )


# ---- parsing ---------------------------------------------------------------------------------------
class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last silently) and
    every alias (``*name``): hetcc's files never need one, and nested aliases expand exponentially."""

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None,
                None,
                "aliases (*name) are not allowed; write the value out",
                self.peek_event().start_mark,
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {short_repr(key)}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_file(
    path: str | pathlib.Path,
    what: str,
    *,
    error: type[HetccError] = ClusterError,
    max_bytes: int = MAX_FILE_BYTES,
    suffixes: Sequence[str] = (".yaml", ".yml", ".json"),
) -> object:
    """Parse a .yaml/.yml/.json file within the limits above; errors (``error``) name the file (``what``
    says which kind) and the line."""
    check_path(path, what, error=error)
    path = pathlib.Path(path)
    suffix = path.suffix.lower()
    if suffix not in suffixes:
        raise error(f"{path}: a {what} must end in {', '.join(suffixes[:-1])} or {suffixes[-1]}")
    text = read_text(path, what, error=error, max_bytes=max_bytes)
    try:
        data = json.loads(text) if suffix == ".json" else yaml.load(text, Loader=_StrictYamlLoader)  # noqa: S506
    except json.JSONDecodeError as exc:
        raise error(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or exc
        raise error(f"{path}: invalid YAML{where}: {str(problem)[:200]}") from None
    except RecursionError:
        raise error(f"{path}: nested more than {MAX_DEPTH} levels deep; not a {what}") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise error(f"{path}: cannot read the {what}: {str(exc)[:200]}") from None
    check_depth(data, Where(str(path), error=error))
    return data


def read_text(
    path: str | pathlib.Path,
    what: str,
    *,
    error: type[HetccError] = ClusterError,
    max_bytes: int = MAX_FILE_BYTES,
) -> str:
    """The UTF-8 text of a file of at most ``max_bytes``; errors (``error``) name the file."""
    raw = read_bytes(path, what, error=error, max_bytes=max_bytes)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: the {what} is not UTF-8 text (byte {exc.start})") from None


def read_bytes(
    path: str | pathlib.Path,
    what: str,
    *,
    error: type[HetccError] = ClusterError,
    max_bytes: int = MAX_FILE_BYTES,
) -> bytes:
    """The bytes of a file of at most ``max_bytes`` (read no further, so a device file cannot hang us)."""
    check_path(path, what, error=error)
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise error(f"{path}: the {what} is larger than {max_bytes} bytes; hetcc reads no {what} that large")
    return raw


def check_path(path: object, what: str, *, error: type[HetccError] = ClusterError) -> None:
    """Fail unless ``path`` is a str or os.PathLike without NUL characters (what the OS can open)."""
    text = str(path) if isinstance(path, (str, os.PathLike)) else None
    if text is None or "\0" in text:
        raise error(
            f"the {what} path {short_repr(path)} is not a file path",
            hint="give a str or os.PathLike path, without NUL characters",
        )


def check_depth(data: object, where: Where, limit: int = MAX_DEPTH) -> None:
    """Fail when lists/mappings in ``data`` nest deeper than ``limit`` (checked without recursion)."""
    pending = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, Mapping):
            children = list(value.values())
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            where.fail(f"nested more than {limit} levels deep")
        pending.extend((child, depth + 1) for child in children)
