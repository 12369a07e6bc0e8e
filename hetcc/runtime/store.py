"""Save a split pipeline to a folder and load it back, never unpickling or executing code from it.

Folder layout::

    pipeline.json           stage count, per-stage inputs / recvs / sends / peers, tied groups, and how
                            it runs (``meta``: hetcc.runtime.contract.PipelineMeta)
    stage<k>.py             readable source of stage k (for people; never read back)
    stage<k>.graph.json     stage k's graph (hetcc.runtime.graph_json)
    stage<k>.safetensors    stage k's parameters and persistent buffers (aliases stored once)
    inputs.safetensors      optional example inputs for ``hetcc.launch`` (targets.safetensors too)

Every file is read back through ``hetcc.runtime.files``, which checks it before use.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
import torch.fx as fx

from hetcc.errors import HetccError, PlanFormatError
from hetcc.hardware.schema import load_file, short_repr
from hetcc.kernels import FUSION_META_KEY, fused, load_groups, write_kernel
from hetcc.kernels.op import registered_group
from hetcc.passes.codegen import stage_source
from hetcc.passes.comm import CommEdge, StageGraph, TiedGroup
from hetcc.passes.tensor_layout import ParamShard, TensorLayout
from hetcc.runtime.contract import VERSION, PipelineMeta
from hetcc.runtime.files import (
    FORMAT,
    MAX_JSON_BYTES,
    file_sha256,
    folder_file,
    read_document,
    read_tensors,
)
from hetcc.runtime.graph_json import graph_from_json, graph_to_json
from hetcc.sendrecv import ANCHOR_NAME, attach_anchor, new_anchor
from hetcc.wire import NO_CODEC


@dataclass
class Pipeline:
    """Split stages plus how to run them (``meta``; None: one CPU rank per stage, the defaults)."""

    stages: list[StageGraph]
    meta: PipelineMeta | None = None

    def __post_init__(self):
        self.meta = self.meta if self.meta is not None else PipelineMeta(len(self.stages))
        if not isinstance(self.meta, PipelineMeta) or self.meta.num_stages != len(self.stages):
            raise HetccError(
                f"the pipeline has {len(self.stages)} stages, but its meta is {short_repr(self.meta)}",
                hint=f"pass a hetcc.runtime.contract.PipelineMeta({len(self.stages)}, ...), or none (the defaults)",
            )


def save_stages(
    stages: list[StageGraph],
    directory: str,
    meta: PipelineMeta | None = None,
    inputs: dict[str, torch.Tensor] | None = None,
    targets: torch.Tensor | None = None,
) -> str:
    """Write the pipeline folder (see the module docstring); returns the path of pipeline.json."""
    meta = Pipeline(stages, meta).meta  # checked against the stages; None: the defaults
    os.makedirs(directory, exist_ok=True)
    for stage in stages:
        _save_stage(stage, directory, meta)
    document = {
        "format": FORMAT,
        "version": VERSION,
        "num_stages": len(stages),
        "meta": meta.to_json(),
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
    return Pipeline(stages, document["meta"])


@dataclass(frozen=True)
class StageOutline:
    """What pipeline.json says of a stage besides its graph and weights: the model inputs it reads."""

    index: int
    num_stages: int
    inputs: tuple[str, ...]
    input_shapes: dict[str, tuple[int | str, ...]]  # traced (microbatch) shapes
    input_dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # traced dtypes (absent: unchecked)
    peers: frozenset[int] = frozenset()  # the stages it receives from or sends to (its checked edges)

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


@dataclass(frozen=True)
class PipelineOutline:
    """A saved pipeline as pipeline.json alone describes it: what a rank needs to know of the stages
    it does not run (their model inputs; the meta with placement and routing) without loading them."""

    stages: tuple[StageOutline, ...]
    meta: PipelineMeta

    @property
    def seq_len(self) -> int:
        """The sequence length the pipeline was traced with: dim 1 of its first two-dimensional input (a
        token folder's windows are that long); 0 when there is none."""
        shapes = (shape for stage in self.stages for shape in stage.input_shapes.values())
        return next((int(s[1]) for s in shapes if len(s) == 2 and isinstance(s[1], int)), 0)


def read_outline(directory: str) -> PipelineOutline:
    """The outline of a saved pipeline folder: pipeline.json is read and checked, nothing else."""
    document = read_document(directory)
    stages = tuple(
        StageOutline(
            entry["index"],
            document["num_stages"],
            tuple(entry["inputs"]),
            {name: tuple(shape) for name, shape in entry.get("input_shapes", {}).items()},
            _input_dtypes(entry),
            frozenset(e["src"] for e in entry["recvs"]) | frozenset(e["dst"] for e in entry["sends"]),
        )  # fmt: skip
        for entry in document["stages"]
    )
    return PipelineOutline(stages, document["meta"])


def load_stage(directory: str, index: int) -> StageGraph:
    """Stage ``index`` alone: only pipeline.json, the kernels and that stage's own graph and weights are
    read, so a damaged file of another stage does not fail it. Each rank loads its stage this way
    (``hetcc.train.startup.load_rank``); ``read_outline`` tells it what it needs of the others."""
    document = read_document(directory)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < document["num_stages"]:
        raise PlanFormatError(f"{directory}: no stage {index!r}; the pipeline has {document['num_stages']}")
    tied = tuple(TiedGroup(g["name"], tuple((s, n) for s, n in g["members"])) for g in document["tied"])
    load_groups(directory)
    return _load_stage(document["stages"][index], directory, document["num_stages"], tied)


def pipeline_meta(directory: str) -> PipelineMeta:
    """How a saved pipeline runs (schedule, microbatches, optimizer ...) without rebuilding its stages."""
    return read_document(directory)["meta"]


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
        "dtype": _dtype_name(edge.dtype),
        "requires_grad": edge.requires_grad,
        "codec": edge.codec,
        "grad_codec": edge.grad_codec,
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_json(name: str, what: str) -> torch.dtype:
    """A dtype pipeline.json names (``float32``); only torch's public dtypes are accepted."""
    dtype = getattr(torch, name, None) if not name.startswith("_") else None
    if not isinstance(dtype, torch.dtype):
        raise PlanFormatError(
            f"pipeline.json: {what} has unknown dtype {short_repr(name)}", hint="save the pipeline again"
        )
    return dtype


def _input_dtypes(entry: dict[str, Any]) -> dict[str, torch.dtype]:
    where = f"stage {entry['index']} input"
    return {
        name: _dtype_from_json(d, f"{where} {name!r}") for name, d in entry.get("input_dtypes", {}).items()
    }


def _edge_from_json(data: dict[str, Any]) -> CommEdge:
    dtype = _dtype_from_json(data["dtype"], f"edge {data['tag']}")
    codecs = [data.get(key, NO_CODEC) for key in ("codec", "grad_codec")]  # names checked by files.py
    return CommEdge(
        data["tag"], data["src"], data["dst"], data["value"], tuple(data["shape"]), dtype,
        data.get("requires_grad", True), *codecs,
    )  # fmt: skip


def _stage_entry(stage: StageGraph) -> dict[str, Any]:
    peers = sorted(stage.peers)
    return {
        "index": stage.index,
        "inputs": list(stage.inputs),
        "recvs": [_edge_json(e) for e in stage.recvs],
        "sends": [_edge_json(e) for e in stage.sends],
        "peers": peers,
        "num_outputs": stage.num_outputs,
        "input_shapes": {name: list(shape) for name, shape in stage.input_shapes.items()},
        "input_dtypes": {name: _dtype_name(dtype) for name, dtype in stage.input_dtypes.items()},
        "param_names": stage.param_names,
        "aliases": _aliases(stage.module),
        "frozen": [n for n, p in stage.module.named_parameters() if not p.requires_grad],
        "tensors": _tensor_records(stage.module),
        "training": stage.module.training,
        "graph": f"stage{stage.index}.graph.json",
        "weights": f"stage{stage.index}.safetensors",
        "source": f"stage{stage.index}.py",
        **({"tensor": _tensor_json(stage.tensor)} if stage.tensor is not None else {}),
    }


def _tensor_json(layout: TensorLayout) -> dict[str, Any]:
    """A tensor-parallel stage's degree and how each split weight is split (the weights file holds
    them whole; each rank takes its part when it loads the stage)."""
    return {
        "degree": layout.degree,
        "params": {name: [shard.dim, shard.blocks] for name, shard in layout.sharded_params.items()},
    }


def _tensor_layout(entry: dict, weights: dict[str, torch.Tensor], where: str) -> TensorLayout | None:
    """The entry's tensor-parallel layout, each split checked against its weight; None: not split."""
    record = entry.get("tensor")
    if record is None:
        return None
    degree, params = record["degree"], {}
    for name, (dim, blocks) in record["params"].items():
        shape = weights[name].shape if name in weights else None
        if shape is None or dim >= len(shape) or shape[dim] % (degree * blocks):
            raise PlanFormatError(
                f"{where}: weight {name!r} ({'absent' if shape is None else list(shape)}) cannot be split "
                f"along dim {dim} into {blocks} x {degree} equal parts",
                hint="save the pipeline again",
            )
        params[name] = ParamShard(dim, blocks)
    return TensorLayout(degree, params)


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


def _save_stage(stage: StageGraph, directory: str, meta: PipelineMeta) -> None:
    prefix = os.path.join(directory, f"stage{stage.index}")
    with open(f"{prefix}.py", "w") as f:
        f.write(stage_source(stage, recompute=meta.recompute[stage.index], precision=meta.precision))
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


def _fused_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [
        node
        for target in (fused, torch.ops.hetcc.fusion_group.default)
        for node in graph.find_nodes(op="call_function", target=target)
    ]


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
        for node in _fused_nodes(graph):
            node.target = fused  # a plan saved before the launcher existed named the custom op
            node.meta[FUSION_META_KEY] = registered_group(str(node.args[1]))  # so it can be saved again
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
        {name: tuple(shape) for name, shape in entry.get("input_shapes", {}).items()}, _input_dtypes(entry),
        _tensor_layout(entry, state, weights),
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
