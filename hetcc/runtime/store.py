"""Save a split pipeline to a folder and load it back, never unpickling or executing code from it.

Folder layout::

    pipeline.json           stage count, per-stage inputs / recvs / sends / peers, tied groups, run meta
    stage<k>.py             readable source of stage k (for people; never read back)
    stage<k>.graph.json     stage k's graph (hetcc.runtime.graph_json)
    stage<k>.safetensors    stage k's parameters and persistent buffers (aliases stored once)
    inputs.safetensors      optional example inputs for ``hetcc.launch`` (targets.safetensors too)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
import torch.fx as fx

from hetcc.errors import HetccError, PlanFormatError
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
from hetcc.kernels import FUSION_META_KEY, load_groups, write_kernel
from hetcc.kernels.op import registered_group
from hetcc.passes.codegen import stage_source
from hetcc.passes.comm import CommEdge, StageGraph, TiedGroup
from hetcc.runtime.graph_json import graph_from_json, graph_to_json
from hetcc.runtime.ops import ANCHOR_NAME, attach_anchor, new_anchor
from hetcc.solver.schedules import SCHEDULES

FORMAT = "hetcc-pipeline"
VERSION = 1
MAX_JSON_BYTES = 256 * 2**20  # pipeline.json or one stage's graph.json (a 70B model's is a few MB)
MAX_HEADER_BYTES = 16 * 2**20  # a safetensors header: names, dtypes, shapes and offsets of the tensors


@dataclass
class Pipeline:
    """Split stages plus how to run them (``meta``: schedule, microbatches, optimizer, vendors ...)."""

    stages: list[StageGraph]
    meta: dict[str, Any] = field(default_factory=dict)


def save_stages(
    stages: list[StageGraph],
    directory: str,
    meta: dict[str, Any] | None = None,
    inputs: dict[str, torch.Tensor] | None = None,
    targets: torch.Tensor | None = None,
) -> str:
    """Write the pipeline folder (see the module docstring); returns the path of pipeline.json."""
    os.makedirs(directory, exist_ok=True)
    for stage in stages:
        _save_stage(stage, directory, meta or {})
    document = {
        "format": FORMAT,
        "version": VERSION,
        "num_stages": len(stages),
        "meta": dict(meta or {}),
        "tied": [{"name": g.name, "members": [list(m) for m in g.members]} for g in stages[0].tied],
        "stages": [_stage_entry(stage) for stage in stages],
    }
    for entry in document["stages"]:  # checked when the folder is loaded: an edited weights file is refused
        entry["weights_sha256"] = file_sha256(os.path.join(directory, entry["weights"]))
    path = os.path.join(directory, "pipeline.json")
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
    if inputs:
        # cloned: safetensors refuses two names for one storage (e.g. input_ids passed again as labels)
        tensors = {k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        safetensors.torch.save_file(tensors, os.path.join(directory, "inputs.safetensors"))
    if targets is not None:
        safetensors.torch.save_file(
            {"targets": targets.contiguous()}, os.path.join(directory, "targets.safetensors")
        )
    return path


def load_pipeline(directory: str) -> Pipeline:
    """Rebuild every stage of a folder written by ``save_stages``; every file is checked before use."""
    document = read_document(directory)
    tied = tuple(TiedGroup(g["name"], tuple((s, n) for s, n in g["members"])) for g in document["tied"])
    num_stages = document["num_stages"]
    load_groups(directory)  # fused kernels the stage graphs call (JSON descriptions, not code)
    stages = [_load_stage(entry, directory, num_stages, tied) for entry in document["stages"]]
    return Pipeline(stages, document.get("meta", {}))


@dataclass(frozen=True)
class StageOutline:
    """What pipeline.json says of a stage besides its graph and weights: the model inputs it reads."""

    index: int
    num_stages: int
    inputs: tuple[str, ...]
    input_shapes: dict[str, tuple[int | str, ...]]  # traced (microbatch) shapes

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


@dataclass(frozen=True)
class PipelineOutline:
    """A saved pipeline as pipeline.json alone describes it: what a rank needs to know of the stages
    it does not run (their model inputs; the meta with placement and routing) without loading them."""

    stages: tuple[StageOutline, ...]
    meta: dict[str, Any] = field(default_factory=dict)


def read_outline(directory: str) -> PipelineOutline:
    """The outline of a saved pipeline folder: pipeline.json is read and checked, nothing else."""
    document = read_document(directory)
    stages = tuple(
        StageOutline(
            entry["index"],
            document["num_stages"],
            tuple(entry["inputs"]),
            {name: tuple(shape) for name, shape in entry.get("input_shapes", {}).items()},
        )  # fmt: skip
        for entry in document["stages"]
    )
    return PipelineOutline(stages, document.get("meta", {}))


def load_stage(directory: str, index: int) -> StageGraph:
    """Stage ``index`` alone: only pipeline.json, the kernels and that stage's own graph and weights are
    read, so a damaged file of another stage does not fail it. Each rank loads its stage this way
    (``runtime.local.load_rank``, ``hetcc.launch``); ``read_outline`` tells it what it needs of the others."""
    document = read_document(directory)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < document["num_stages"]:
        raise PlanFormatError(f"{directory}: no stage {index!r}; the pipeline has {document['num_stages']}")
    tied = tuple(TiedGroup(g["name"], tuple((s, n) for s, n in g["members"])) for g in document["tied"])
    load_groups(directory)
    return _load_stage(document["stages"][index], directory, document["num_stages"], tied)


def pipeline_meta(directory: str) -> dict[str, Any]:
    """How a saved pipeline runs (schedule, microbatches, optimizer ...) without rebuilding its stages."""
    return read_document(directory).get("meta", {})


def load_stages(directory: str) -> list[StageGraph]:
    """The stages of a saved pipeline folder."""
    return load_pipeline(directory).stages


def load_inputs(directory: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The inputs (and targets, if saved) written next to a pipeline by ``save_stages``."""
    path = os.path.join(directory, "inputs.safetensors")
    if not os.path.exists(path):
        raise PlanFormatError(f"{path} is missing", hint="pass inputs= to save_stages")
    inputs = read_tensors(path)
    target_path = os.path.join(directory, "targets.safetensors")
    targets = None
    if os.path.exists(target_path):
        targets = read_tensors(target_path, {"targets": None}).get("targets")
    return inputs, targets


def _edge_json(edge: CommEdge) -> dict[str, Any]:
    return {
        "tag": edge.tag,
        "src": edge.src,
        "dst": edge.dst,
        "value": edge.value,
        "shape": list(edge.shape),
        "dtype": str(edge.dtype).removeprefix("torch."),
        "requires_grad": edge.requires_grad,
    }


def _edge_from_json(data: dict[str, Any]) -> CommEdge:
    dtype = getattr(torch, data["dtype"], None) if not data["dtype"].startswith("_") else None
    if not isinstance(dtype, torch.dtype):
        raise PlanFormatError(
            f"pipeline.json: edge {data['tag']} has unknown dtype {short_repr(data['dtype'])}",
            hint="save the pipeline again",
        )
    return CommEdge(
        data["tag"], data["src"], data["dst"], data["value"], tuple(data["shape"]), dtype,
        data.get("requires_grad", True),
    )  # fmt: skip


def _stage_entry(stage: StageGraph) -> dict[str, Any]:
    peers = sorted({e.src for e in stage.recvs} | {e.dst for e in stage.sends})
    return {
        "index": stage.index,
        "inputs": list(stage.inputs),
        "recvs": [_edge_json(e) for e in stage.recvs],
        "sends": [_edge_json(e) for e in stage.sends],
        "peers": peers,
        "num_outputs": stage.num_outputs,
        "input_shapes": {name: list(shape) for name, shape in stage.input_shapes.items()},
        "param_names": stage.param_names,
        "aliases": _aliases(stage.module),
        "frozen": [n for n, p in stage.module.named_parameters() if not p.requires_grad],
        "tensors": _tensor_records(stage.module),
        "training": stage.module.training,
        "graph": f"stage{stage.index}.graph.json",
        "weights": f"stage{stage.index}.safetensors",
        "source": f"stage{stage.index}.py",
    }


def _tensor_records(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Name -> dtype and shape of each tensor the weights file holds (checked when it is read back)."""
    aliases = _aliases(module)
    return {
        name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        for name, t in module.state_dict().items()
        if name not in aliases
    }


def _aliases(module: torch.nn.Module) -> dict[str, str]:
    """Second and later names of a tensor held under several names -> its first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return aliases


def _save_stage(stage: StageGraph, directory: str, meta: dict[str, Any]) -> None:
    prefix = os.path.join(directory, f"stage{stage.index}")
    recompute = bool((meta.get("recompute") or [False] * stage.num_stages)[stage.index])
    with open(f"{prefix}.py", "w") as f:
        f.write(stage_source(stage, recompute=recompute, precision=meta.get("precision") or "fp32"))
    with open(f"{prefix}.graph.json", "w") as f:
        json.dump(graph_to_json(stage.module), f, indent=1)
    aliases = _aliases(stage.module)
    state = {
        k: v.detach().cpu().contiguous() for k, v in stage.module.state_dict().items() if k not in aliases
    }
    safetensors.torch.save_file(state, f"{prefix}.safetensors")
    for node in stage.module.graph.nodes:  # fused groups: readable Triton source + the group's JSON
        group = node.meta.get(FUSION_META_KEY)
        if group is not None:
            write_kernel(group, directory)


_BUILD_ERRORS = (AttributeError, KeyError, TypeError, ValueError, RuntimeError, IndexError)


def _load_stage(entry: dict, directory: str, num_stages: int, tied: tuple[TiedGroup, ...]) -> StageGraph:
    where = folder_file(directory, entry["graph"], "graph")
    graph, layers = graph_from_json(load_file(where, "stage graph", error=PlanFormatError,
                                              max_bytes=MAX_JSON_BYTES, suffixes=(".json",)), where)  # fmt: skip
    weights = folder_file(directory, entry["weights"], "weights")
    if "weights_sha256" in entry and file_sha256(weights) != entry["weights_sha256"]:
        raise PlanFormatError(
            f"{weights}: its sha256 differs from the one pipeline.json recorded: the file changed after it was saved",
            hint="save the pipeline again, or restore the file",
        )
    state = read_tensors(weights, entry.get("tensors"))
    try:
        for node in graph.find_nodes(op="call_function", target=torch.ops.hetcc.fusion_group.default):
            # so the stage can be saved again
            node.meta[FUSION_META_KEY] = registered_group(str(node.args[1]))
        root = _build_root(graph, layers, state, entry, weights)
        module = fx.GraphModule(root, graph, class_name=f"Stage{entry['index']}")
    except HetccError:
        raise
    except _BUILD_ERRORS as error:  # fx's or torch.nn's words on a graph hetcc did not write
        raise PlanFormatError(
            f"{where}: cannot build the stage: {type(error).__name__}: {str(error)[:200]}",
            hint="save the pipeline again",
        ) from None
    module.training = entry.get("training", True)
    if graph.find_nodes(op="get_attr", target=ANCHOR_NAME):
        attach_anchor(module)
    return StageGraph(
        entry["index"], num_stages, module, tuple(entry["inputs"]),
        tuple(_edge_from_json(e) for e in entry["recvs"]), tuple(_edge_from_json(e) for e in entry["sends"]),
        dict(entry["param_names"]), tied, entry["num_outputs"],
        {name: tuple(shape) for name, shape in entry.get("input_shapes", {}).items()},
    )  # fmt: skip


def _build_root(graph: fx.Graph, layers: dict, state: dict, entry: dict, where: str) -> torch.nn.Module:
    """A module holding every attribute the graph names, weights from ``state``, aliases re-tied."""
    root = torch.nn.Module()
    aliases = entry["aliases"]
    for name, layer in layers.items():  # built on the meta device: check the weights, then take memory
        for key, tensor in layer.state_dict(keep_vars=True).items():
            full = f"{name}.{key}"
            if full not in aliases and full in state and state[full].shape != tensor.shape:
                raise PlanFormatError(
                    f"{where}: tensor {full!r} has shape {list(state[full].shape)}; layer {name!r} needs "
                    f"{list(tensor.shape)}", hint="save the pipeline again",
                )  # fmt: skip
        _set(root, name, layer.to_empty(device="cpu"))
    used = {n.target for n in graph.find_nodes(op="get_attr")} | set(aliases.values())
    used |= {f"{name}.{key}" for name, layer in layers.items() for key in layer.state_dict()}
    extra = sorted(set(state) - used)
    if extra:
        raise PlanFormatError(
            f"{where}: holds tensors the stage does not use: {short_repr(extra)}",
            hint="save the pipeline again",
        )
    params, frozen = set(entry["param_names"]), set(entry.get("frozen", []))
    for node in graph.find_nodes(op="get_attr"):
        if node.target == ANCHOR_NAME or node.target in aliases or _has(root, node.target):
            continue
        if node.target not in state:
            raise PlanFormatError(f"{where}: weights file lacks {node.target!r}", hint="re-save the pipeline")
        tensor = state[node.target]
        if node.target in params:
            tensor = torch.nn.Parameter(tensor, requires_grad=node.target not in frozen)
        _set(root, node.target, tensor)
    missing = root.load_state_dict(state, strict=False).missing_keys
    for alias, name in entry["aliases"].items():
        _set(root, alias, _get(root, name))
    unexplained = sorted(set(missing) - set(entry["aliases"]))
    if unexplained:
        raise PlanFormatError(f"{where}: weights file lacks {unexplained[:5]}", hint="re-save the pipeline")
    if graph.find_nodes(op="get_attr", target=ANCHOR_NAME):
        root.register_buffer(ANCHOR_NAME, new_anchor(), persistent=False)
    return root


def _set(root: torch.nn.Module, qualname: str, value) -> None:
    *path, leaf = qualname.split(".")
    owner = root
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    if isinstance(value, (torch.nn.Module, torch.nn.Parameter)):
        setattr(owner, leaf, value)
    else:
        owner.register_buffer(leaf, value)


def _get(root: torch.nn.Module, qualname: str):
    obj = root
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _has(root: torch.nn.Module, qualname: str) -> bool:
    try:
        _get(root, qualname)
    except AttributeError:
        return False
    return True


# ---- checking what a folder holds ------------------------------------------------------------------
def _dim(value: object, where: Where) -> int | str:
    """A dimension: a size, or a symbolic one's name (dynamic shapes)."""
    return value if isinstance(value, str) and value else Count(minimum=0)(value, where)


def _member(value: object, where: Where) -> tuple[int, str]:
    """A tied group's member: [stage index, parameter name]."""
    if not isinstance(value, list) or len(value) != 2:
        where.fail(f"expected [stage index, name]; got {short_repr(value)}")
    return Count(minimum=0)(value[0], where.at(0)), Text()(value[1], where.at(1))


_INDEX = Count(minimum=0)
_SHAPE = ListOf(_dim)
_NAMES = Table(None, Text(), "name to name")
_EDGE = Record(
    {"tag": _INDEX, "src": _INDEX, "dst": _INDEX, "value": Text(), "shape": _SHAPE, "dtype": Text(),
     "requires_grad": Flag()},
    required=("tag", "src", "dst", "value", "shape", "dtype"),
)  # fmt: skip
_TENSOR = Record({"dtype": Text(), "shape": ListOf(_INDEX)}, required=("dtype", "shape"))
_STAGE = Record(
    {
        "index": _INDEX, "inputs": ListOf(Text()), "recvs": ListOf(_EDGE), "sends": ListOf(_EDGE),
        "peers": ListOf(_INDEX), "num_outputs": _INDEX, "input_shapes": Table(None, _SHAPE, "input to shape"),
        "param_names": _NAMES, "aliases": _NAMES, "frozen": ListOf(Text()), "training": Flag(),
        "graph": Text(), "weights": Text(), "source": Text(), "weights_sha256": Text(), "tensors": Table(None, _TENSOR, "tensor to dtype and shape"),
    },
    required=("index", "inputs", "recvs", "sends", "num_outputs", "param_names", "aliases", "graph", "weights"),
    open=True,
)  # fmt: skip
_META = Record(
    {"schedule": Choice(SCHEDULES, "schedule"), "microbatches": Count(), "loss": Text(),
     "optimizer": Record({"name": Text()}, required=("name",), open=True), "vendors": ListOf(Text())},
    open=True,
)  # fmt: skip
_PIPELINE = Record(
    {"format": Text(), "version": Count(), "num_stages": Count(), "meta": _META,
     "tied": ListOf(Record({"name": Text(), "members": ListOf(_member)}, required=("name", "members"))),
     "stages": ListOf(_STAGE, nonempty=True)},
    required=("format", "version", "num_stages", "tied", "stages"),
    open=True,
)  # fmt: skip


def read_document(directory: str) -> dict[str, Any]:
    """pipeline.json, checked: its format and version, every field's type, and that the stages, edges
    and tied groups agree with one another."""
    check_path(directory, "pipeline folder", error=PlanFormatError)
    path = os.path.join(directory, "pipeline.json")
    data = load_file(
        path, "pipeline file", error=PlanFormatError, max_bytes=MAX_JSON_BYTES, suffixes=(".json",)
    )
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise PlanFormatError(
            f"{directory}/pipeline.json: not a {FORMAT} v{VERSION} file",
            hint="save the pipeline again with this version of hetcc",
        )
    where = Where(path, error=PlanFormatError)
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
    for i, group in enumerate(document["tied"]):
        if any(stage >= count for stage, _ in group["members"]):
            where.at("tied", i).fail(f"a member in a stage beyond the {count} stages")
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
