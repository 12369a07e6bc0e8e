"""Stage code: the readable ``stage<k>.py`` source, the module a rank executes, and a compute-only view.

A ``StageGraph.module`` holds ``hetcc.recv``/``hetcc.send`` ops where tensors arrive and leave; the
runtime executes that module (``module_for_device``), so ``stage<k>.py`` prints the program that runs.
``torch.distributed.pipelining`` instead moves tensors itself and wants the computation alone:
``compute_module`` turns every ``recv`` into an input and every ``send`` into an output (a decoded tensor
is the input, an encoded one's source the output: no codec). All of them share the stage's parameters.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from hetcc.passes.comm import CommEdge, StageGraph
from hetcc.passes.fuse import install_code_comments
from hetcc.sendrecv import ANCHOR_NAME, attach_anchor

_SEND = torch.ops.hetcc.send.default
_RECV = torch.ops.hetcc.recv.default
_ENCODE = torch.ops.hetcc.encode.default
_DECODE = torch.ops.hetcc.decode.default


def _is(node: fx.Node, op) -> bool:
    return node.op == "call_function" and node.target is op


def compute_module(stage: StageGraph, device: torch.device | str | None = None) -> fx.GraphModule:
    """``stage.module`` without communication.

    Signature: ``forward(*model_inputs, *received)`` in the order of ``stage.inputs`` then
    ``stage.recvs``; returns the sent tensors in the order of ``stage.sends`` (the model's flat
    outputs on the last stage). With ``device``, device constants that tracing baked into the graph
    (``to(device=cpu)``, factory ops) name that device instead; parameters stay where they are.
    """
    graph, env = fx.Graph(), {}
    sent: dict[fx.Node, fx.Node] = {}
    for node in stage.module.graph.nodes:
        if node.op == "get_attr" and node.target == ANCHOR_NAME:
            continue
        if _is(node, _RECV) and all(_is(user, _DECODE) for user in node.users) and node.users:
            continue  # the decoded tensor is the input
        if _is(node, _RECV) or _is(node, _DECODE):
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
        elif _is(node, _ENCODE):
            continue  # its send's source is the output
        elif _is(node, _SEND):
            sent[node] = env[node.kwargs.get("source") or node.args[0]]
        elif node.op == "output":
            graph.output(fx.map_arg(node.args[0], lambda n: sent.get(n) or env[n]))
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    if device is not None:
        _retarget_devices(graph, torch.device(device))
    return fx.GraphModule(stage.module, graph, class_name=f"Stage{stage.index}Compute")


def module_for_device(stage: StageGraph, device: torch.device | str) -> fx.GraphModule:
    """The module a rank on ``device`` executes: ``stage.module`` itself on CPU, elsewhere a copy of its
    graph whose traced device constants (``to(device=cpu)``, factory ops) name ``device``, with the same
    parameters and an anchor on ``device``. Moving the parameters is the caller's ``.to(device)``."""
    device = torch.device(device)
    if device.type == "cpu":
        return stage.module
    module = fx.GraphModule(stage.module, graph_for_device(stage, device), class_name=f"Stage{stage.index}")
    if hasattr(stage.module, ANCHOR_NAME):
        attach_anchor(module, device)
    return module


def graph_for_device(stage: StageGraph, device: torch.device) -> fx.Graph:
    """A copy of the stage's graph whose traced device constants name ``device``: what a rank on
    ``device`` runs (``module_for_device``)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(stage.module.graph, {}))
    _retarget_devices(graph, device)
    return graph


def _retarget_devices(graph: fx.Graph, device: torch.device) -> None:
    def swap(value):
        if isinstance(value, torch.device):
            return device
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        return value

    for node in graph.nodes:
        node.args = tuple(swap(a) for a in node.args)
        node.kwargs = {k: swap(v) for k, v in node.kwargs.items()}


def codegen(stages: list[StageGraph]) -> list[StageGraph]:
    """Make each stage's ``module.code`` the readable program it runs: fused groups print, above their
    call, the Triton kernel and backend they use and the ops they replaced."""
    for stage in stages:
        install_code_comments(stage.module)
    return stages


def stage_source(stage: StageGraph, *, recompute: bool = False, precision: str = "fp32") -> str:
    """Readable Python for one stage: a header of what it holds, receives and sends, then its code.
    ``recompute`` / ``precision``: how the runtime wraps the forward (one header line says so)."""
    lines = [f"# hetcc pipeline stage {stage.index} of {stage.num_stages} (generated; read-only)"]
    wraps = [f"torch.autocast({precision.removesuffix('-mixed')})"] if precision != "fp32" else []
    if recompute:
        wraps.append("torch.utils.checkpoint (recomputed in backward: recvs replayed, no re-send)")
    if wraps:
        lines.append(f"# forward runs under {' and '.join(wraps)}")
    split = stage.tensor.sharded_params if stage.tensor is not None else {}
    if stage.tensor is not None:
        lines.append(
            f"# tensor parallel: each replica is {stage.tensor.degree} ranks running this code, each with its "
            "part of the split weights; hetcc.all_reduce / all_gather / tensor_enter / tensor_slice / reduce_scatter / gather_enter run over them"
        )
    lines.append("# parameters:")
    for local, name in stage.param_names.items():
        param = stage.module.get_parameter(local)
        alias = "" if local == name else f"  (model name {name})"
        shard = split.get(local)
        part = (
            ""
            if shard is None
            else f", split along dim {shard.dim}" + (f" in {shard.blocks} blocks" if shard.blocks > 1 else "")
        )
        lines.append(f"#   {local}: {_spec(param.shape, param.dtype)}{alias}{part}")
    for group in stage.tied:
        if stage.index in group.stages:
            lines.append(f"# tied: {group.name} held by stages {list(group.stages)}; gradients summed")
    lines.extend(f"# model input: {name}" for name in stage.inputs)
    lines.extend(f"# receives: {_edge(edge, 'from', edge.src)}" for edge in stage.recvs)
    lines.extend(f"# sends: {_edge(edge, 'to', edge.dst)}" for edge in stage.sends)
    if stage.is_last:
        lines.append(f"# returns: the model's {stage.num_outputs} flat output(s)")
    return "\n".join(lines) + "\n" + stage.module.code.strip("\n").rstrip() + "\n"


def _spec(shape, dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def _edge(edge: CommEdge, direction: str, peer: int) -> str:
    coded = [
        f"{name} {kind}"
        for kind, name in (("forward", edge.codec), ("gradient", edge.grad_codec))
        if name != "none"
    ]
    via = f", {' and '.join(coded)} on the wire" if coded else ""
    return f"{edge.value} {_spec(edge.shape, edge.dtype)} {direction} stage {peer} (tag {edge.tag}{via})"
