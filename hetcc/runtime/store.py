"""Save a split pipeline to a folder and load it back, never unpickling or executing code from it.

Folder layout::

    pipeline.json           stage count, per-stage inputs / recvs / sends / peers, tied groups, run meta
    stage<k>.py             readable source of stage k (for people; never read back)
    stage<k>.graph.json     stage k's graph (hetcc.runtime.graph_json)
    stage<k>.safetensors    stage k's parameters and persistent buffers (aliases stored once)
    inputs.safetensors      optional example inputs for ``hetcc.launch`` (targets.safetensors too)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
import torch.fx as fx

from hetcc.errors import PlanFormatError
from hetcc.kernels import FUSION_META_KEY, load_groups, write_kernel
from hetcc.kernels.op import registered_group
from hetcc.passes.codegen import stage_source
from hetcc.passes.comm import CommEdge, StageGraph, TiedGroup
from hetcc.runtime.graph_json import graph_from_json, graph_to_json
from hetcc.runtime.ops import ANCHOR_NAME, attach_anchor, new_anchor

FORMAT = "hetcc-pipeline"
VERSION = 1


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
        _save_stage(stage, directory)
    document = {
        "format": FORMAT,
        "version": VERSION,
        "num_stages": len(stages),
        "meta": dict(meta or {}),
        "tied": [{"name": g.name, "members": [list(m) for m in g.members]} for g in stages[0].tied],
        "stages": [_stage_entry(stage) for stage in stages],
    }
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
    """Rebuild every stage of a folder written by ``save_stages``."""
    document = _read_json(os.path.join(directory, "pipeline.json"))
    if document.get("format") != FORMAT or document.get("version") != VERSION:
        raise PlanFormatError(
            f"{directory}/pipeline.json: not a {FORMAT} v{VERSION} file",
            hint="save the pipeline again with this version of hetcc",
        )
    tied = tuple(TiedGroup(g["name"], tuple((int(s), n) for s, n in g["members"])) for g in document["tied"])
    num_stages = document["num_stages"]
    load_groups(directory)  # fused kernels the stage graphs call (JSON descriptions, not code)
    stages = [_load_stage(entry, directory, num_stages, tied) for entry in document["stages"]]
    return Pipeline(stages, document.get("meta", {}))


def pipeline_meta(directory: str) -> dict[str, Any]:
    """How a saved pipeline runs (schedule, microbatches, optimizer ...) without rebuilding its stages."""
    return _read_json(os.path.join(directory, "pipeline.json")).get("meta", {})


def load_stages(directory: str) -> list[StageGraph]:
    """The stages of a saved pipeline folder."""
    return load_pipeline(directory).stages


def load_inputs(directory: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The inputs (and targets, if saved) written next to a pipeline by ``save_stages``."""
    path = os.path.join(directory, "inputs.safetensors")
    if not os.path.exists(path):
        raise PlanFormatError(f"{path} is missing", hint="pass inputs= to save_stages")
    inputs = safetensors.torch.load_file(path)
    target_path = os.path.join(directory, "targets.safetensors")
    targets = safetensors.torch.load_file(target_path)["targets"] if os.path.exists(target_path) else None
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
    dtype = getattr(torch, data["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise PlanFormatError(f"pipeline.json: edge {data.get('tag')} has unknown dtype {data['dtype']!r}")
    return CommEdge(
        int(data["tag"]), int(data["src"]), int(data["dst"]), data["value"], tuple(data["shape"]), dtype,
        bool(data.get("requires_grad", True)),
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
        "training": stage.module.training,
        "graph": f"stage{stage.index}.graph.json",
        "weights": f"stage{stage.index}.safetensors",
        "source": f"stage{stage.index}.py",
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


def _save_stage(stage: StageGraph, directory: str) -> None:
    prefix = os.path.join(directory, f"stage{stage.index}")
    with open(f"{prefix}.py", "w") as f:
        f.write(stage_source(stage))
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


def _load_stage(entry: dict, directory: str, num_stages: int, tied: tuple[TiedGroup, ...]) -> StageGraph:
    where = os.path.join(directory, entry["graph"])
    graph, layers = graph_from_json(_read_json(where), where)
    for node in graph.find_nodes(op="call_function", target=torch.ops.hetcc.fusion_group.default):
        node.meta[FUSION_META_KEY] = registered_group(node.args[1])  # so the stage can be saved again
    state = safetensors.torch.load_file(os.path.join(directory, entry["weights"]))
    root = _build_root(graph, layers, state, entry, where)
    module = fx.GraphModule(root, graph, class_name=f"Stage{entry['index']}")
    module.training = bool(entry.get("training", True))
    if graph.find_nodes(op="get_attr", target=ANCHOR_NAME):
        attach_anchor(module)
    return StageGraph(
        int(entry["index"]), num_stages, module, tuple(entry["inputs"]),
        tuple(_edge_from_json(e) for e in entry["recvs"]), tuple(_edge_from_json(e) for e in entry["sends"]),
        dict(entry["param_names"]), tied, int(entry["num_outputs"]),
        {name: tuple(shape) for name, shape in entry.get("input_shapes", {}).items()},
    )  # fmt: skip


def _build_root(graph: fx.Graph, layers: dict, state: dict, entry: dict, where: str) -> torch.nn.Module:
    """A module holding every attribute the graph names, weights from ``state``, aliases re-tied."""
    root = torch.nn.Module()
    for name, layer in layers.items():
        _set(root, name, layer)
    params, frozen = set(entry["param_names"]), set(entry.get("frozen", []))
    for node in graph.find_nodes(op="get_attr"):
        if node.target == ANCHOR_NAME or node.target in entry["aliases"] or _has(root, node.target):
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


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise PlanFormatError(f"cannot read {path}: {error}", hint="save the pipeline again") from error
