"""The files of a saved pipeline folder, read as untrusted: ``pipeline.json`` checked against its
schema and for consistency (``read_document``), file names kept inside the folder (``folder_file``),
safetensors headers checked against the file before any tensor memory is taken (``read_tensors``), and
checksums (``file_sha256``). ``hetcc.runtime.store`` and ``hetcc.train.checkpoint`` read through these."""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import safetensors.torch
import torch

from hetcc.errors import PlanFormatError
from hetcc.hardware.schema import (
    Choice,
    Count,
    Flag,
    ListOf,
    Record,
    Table,
    Text,
    Where,
    check_path,
    load_file,
    short_repr,
)
from hetcc.runtime.contract import READABLE_VERSIONS, RECOMPILE, read_meta
from hetcc.wire import CODECS

FORMAT = "hetcc-pipeline"
MAX_JSON_BYTES = 256 * 2**20  # pipeline.json or one stage's graph.json (a 70B model's is a few MB)
MAX_HEADER_BYTES = 16 * 2**20  # a safetensors header: names, dtypes, shapes and offsets of the tensors


def _dim(value: object, where: Where) -> int | str:
    """A dimension: a size, or a symbolic one's name (dynamic shapes)."""
    return value if isinstance(value, str) and value else Count(minimum=0)(value, where)


def _dtype(value: object, where: Where) -> str:
    """A dtype's name (``float32``): one of torch's public dtypes."""
    if not (
        isinstance(value, str)
        and not value.startswith("_")
        and isinstance(getattr(torch, value, None), torch.dtype)
    ):
        where.fail(f"unknown dtype {short_repr(value)}")
    return value


def _member(value: object, where: Where) -> tuple[int, str]:
    """A tied group's member: [stage index, parameter name]."""
    if not isinstance(value, list) or len(value) != 2:
        where.fail(f"expected [stage index, name]; got {short_repr(value)}")
    return Count(minimum=0)(value[0], where.at(0)), Text()(value[1], where.at(1))


_INDEX = Count(minimum=0)
_SHAPE = ListOf(_dim)
_NAMES = Table(None, Text(), "name to name")
_EDGE = Record(
    {"tag": _INDEX, "src": _INDEX, "dst": _INDEX, "value": Text(), "shape": _SHAPE, "dtype": _dtype,
     "requires_grad": Flag(), "codec": Choice(tuple(CODECS), "codec"), "grad_codec": Choice(tuple(CODECS), "codec")},
    required=("tag", "src", "dst", "value", "shape", "dtype"),
)  # fmt: skip
_EDGE_FIELDS = ("src", "dst", "value", "shape", "dtype", "requires_grad", "codec", "grad_codec")
_TENSOR = Record({"dtype": Text(), "shape": ListOf(_INDEX)}, required=("dtype", "shape"))


def _split(value: object, where: Where) -> tuple[int, int]:
    """How a weight of a tensor-parallel stage is split: [dim, blocks]."""
    if not isinstance(value, list) or len(value) != 2:
        where.fail(f"expected [dim, blocks]; got {short_repr(value)}")
    return Count(minimum=0)(value[0], where.at(0)), Count(minimum=1)(value[1], where.at(1))


_TENSOR_PARALLEL = Record(
    {"degree": Count(minimum=2), "params": Table(None, _split, "weight to [dim, blocks]")},
    required=("degree", "params"),
)
_STAGE = Record(
    {
        "index": _INDEX, "inputs": ListOf(Text()), "recvs": ListOf(_EDGE), "sends": ListOf(_EDGE),
        "peers": ListOf(_INDEX), "num_outputs": _INDEX, "input_shapes": Table(None, _SHAPE, "input to shape"),
        "input_dtypes": Table(None, Text(), "input to dtype"),
        "param_names": _NAMES, "aliases": _NAMES, "frozen": ListOf(Text()), "training": Flag(),
        "graph": Text(), "weights": Text(), "source": Text(), "weights_sha256": Text(), "tensors": Table(None, _TENSOR, "tensor to dtype and shape"),
        "tensor": _TENSOR_PARALLEL,
    },
    required=("index", "inputs", "recvs", "sends", "num_outputs", "param_names", "aliases", "graph", "weights"),
    open=True,
)  # fmt: skip
_PIPELINE = Record(
    {"format": Text(), "version": Count(), "num_stages": Count(), "meta": lambda value, where: value,
     "tied": ListOf(Record({"name": Text(), "members": ListOf(_member)}, required=("name", "members"))),
     "stages": ListOf(_STAGE, nonempty=True)},
    required=("format", "version", "num_stages", "tied", "stages"),
    open=True,
)  # fmt: skip


def _check_edge_pairs(stages: list[dict[str, Any]], where: Where) -> None:
    """The sender's and the receiver's record of each edge agree (shape, dtype, gradient, codecs): a
    gradient carries no header, so a disagreement would only show as a wrong-sized message mid-run."""
    sent = {
        edge["tag"]: (k, i, edge) for k, stage in enumerate(stages) for i, edge in enumerate(stage["sends"])
    }
    for k, stage in enumerate(stages):
        for i, edge in enumerate(stage["recvs"]):
            if edge["tag"] not in sent:
                where.at("stages", k, "recvs", i).fail(f"no stage sends tag {edge['tag']}")
            src, j, partner = sent[edge["tag"]]
            differ = sorted(key for key in _EDGE_FIELDS if edge.get(key) != partner.get(key))
            if differ:
                where.at("stages", k, "recvs", i).fail(
                    f"tag {edge['tag']}: its {', '.join(differ)} differ from stage {src}'s send (sends[{j}])"
                )


def read_document(directory: str) -> dict[str, Any]:
    """pipeline.json, checked: its format and version, every field's type, and that the stages, edges
    and tied groups agree with one another. Its ``meta`` is a ``PipelineMeta`` (``contract.read_meta``)."""
    check_path(directory, "pipeline folder", error=PlanFormatError)
    path = os.path.join(directory, "pipeline.json")
    data = load_file(
        path, "pipeline file", error=PlanFormatError, max_bytes=MAX_JSON_BYTES, suffixes=(".json",)
    )
    versions = " or ".join(f"v{v}" for v in READABLE_VERSIONS)
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or data.get("version") not in READABLE_VERSIONS
    ):
        raise PlanFormatError(f"{directory}/pipeline.json: not a {FORMAT} {versions} file", hint=RECOMPILE)
    where = Where(path, error=PlanFormatError, hint=RECOMPILE)
    if data["version"] >= 2 and "meta" not in data:
        where.fail("missing required key 'meta'", RECOMPILE)
    document = _PIPELINE(data, where)
    count = document["num_stages"]
    if count != len(document["stages"]):
        where.at("num_stages").fail(f"{count} stages, but the stages list has {len(document['stages'])}")
    for k, stage in enumerate(document["stages"]):
        at = where.at("stages", k)
        if stage["index"] != k:
            at.at("index").fail(f"stage {k} of the list says it is stage {stage['index']}")
        for kind, edges in (("recvs", stage["recvs"]), ("sends", stage["sends"])):
            for i, edge in enumerate(edges):
                if max(edge["src"], edge["dst"]) >= count or edge["src" if kind == "sends" else "dst"] != k:
                    at.at(kind, i).fail(
                        f"edge {edge['src']} -> {edge['dst']} does not fit stage {k} of {count}"
                    )
        if any(peer >= count for peer in stage.get("peers", [])):
            at.at("peers").fail(f"a peer beyond the {count} stages")
    _check_edge_pairs(document["stages"], where)
    for i, group in enumerate(document["tied"]):
        if any(stage >= count for stage, _ in group["members"]):
            where.at("tied", i).fail(f"a member in a stage beyond the {count} stages")
    document["meta"] = read_meta(document.get("meta", {}), count, where.at("meta"), document["version"])
    return document


def folder_file(directory: str, name: str, what: str) -> str:
    """``directory/name``, refused unless it stays inside ``directory`` (no ``..``, absolute paths or
    links leading out)."""
    if "\0" in name:
        raise PlanFormatError(
            f"{directory}/pipeline.json: the {what} path {short_repr(name)} is not a file path"
        )
    path = os.path.join(directory, name)
    root = os.path.realpath(directory)
    if os.path.isabs(name) or os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise PlanFormatError(
            f"{directory}/pipeline.json: the {what} path {short_repr(name)} leads outside the folder",
            hint="a saved pipeline names only files inside its own folder",
        )
    return path


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_HEADER_ENTRY = Record(
    {"dtype": Choice(tuple(_SAFETENSORS_DTYPES), "safetensors dtype"), "shape": ListOf(_INDEX),
     "data_offsets": ListOf(_INDEX)},
    required=("dtype", "shape", "data_offsets"),
)  # fmt: skip


def read_tensors(path: str, expected: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, after checking its header: within limits, every tensor's
    bytes inside the file, and (given ``expected``: name -> {dtype, shape}, or name -> None for any)
    exactly the tensors expected, of their dtypes and shapes."""
    header = _safetensors_header(path)
    if expected is not None:
        missing, extra = sorted(set(expected) - set(header)), sorted(set(header) - set(expected))
        if missing or extra:
            raise PlanFormatError(
                f"{path}: {'lacks ' + short_repr(missing) if missing else ''}"
                f"{'; ' if missing and extra else ''}{'holds unexpected ' + short_repr(extra) if extra else ''}",
                hint="save the pipeline again",
            )
        for name, want in expected.items():
            dtype, shape = header[name]
            if want is not None and (
                str(dtype).removeprefix("torch.") != want["dtype"] or shape != want["shape"]
            ):
                raise PlanFormatError(
                    f"{path}: tensor {name!r} is {str(dtype).removeprefix('torch.')}{shape}; the stage needs "
                    f"{want['dtype']}{want['shape']}", hint="save the pipeline again",
                )  # fmt: skip
    try:
        return safetensors.torch.load_file(path)
    except Exception as error:  # noqa: BLE001 - safetensors' own checks, in its words
        raise PlanFormatError(f"{path}: not a readable safetensors file: {str(error)[:200]}") from None


def file_sha256(path: str) -> str:
    """The hex sha256 of a file's bytes (PlanFormatError naming it if it cannot be read)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(2**24):
                digest.update(chunk)
    except OSError as error:
        raise PlanFormatError(
            f"{path}: cannot read it: {error.strerror or error}", hint="save the pipeline again"
        ) from None
    return digest.hexdigest()


def _safetensors_header(path: str) -> dict[str, tuple[torch.dtype, list[int]]]:
    """Name -> (dtype, shape) from a safetensors header, checked against the file's size."""
    check_path(path, "weights file", error=PlanFormatError)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = int.from_bytes(f.read(8), "little") if size >= 8 else None
            if length is None or length > min(MAX_HEADER_BYTES, size - 8):
                reason = "shorter than a header" if length is None else f"a header of {length} bytes"
                raise PlanFormatError(
                    f"{path}: {reason} in a file of {size} bytes: not a safetensors file, or cut short"
                )
            text = f.read(length)
        header = json.loads(text)
    except OSError as error:
        raise PlanFormatError(
            f"{path}: cannot read it: {error.strerror or error}", hint="save the pipeline again"
        ) from None
    except (ValueError, RecursionError) as error:
        raise PlanFormatError(f"{path}: the safetensors header is not JSON: {str(error)[:100]}") from None
    where = Where(path, error=PlanFormatError)
    if not isinstance(header, dict):
        where.fail("the safetensors header is not a mapping")
    tensors = {}
    data_bytes = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        entry = _HEADER_ENTRY(entry, where.at(name))
        dtype, shape, offsets = _SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        nbytes = math.prod(shape) * dtype.itemsize
        if (
            len(offsets) != 2
            or not offsets[0] <= offsets[1] <= data_bytes
            or offsets[1] - offsets[0] != nbytes
        ):
            where.at(name).fail(
                f"its bytes {offsets} do not fit {nbytes} bytes in a file of {data_bytes}: cut short or corrupt"
            )
        tensors[name] = (dtype, shape)
    return tensors
