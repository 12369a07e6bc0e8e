"""Cut a traced graph into pipeline stages and insert ``hetcc.send``/``hetcc.recv`` at every cut.

Input: an unlifted fx.GraphModule (``torch.export(...).module()`` or ``torch.fx.symbolic_trace``
with ``meta["val"]``/``meta["tensor_meta"]`` on tensor nodes), traced at *microbatch* size, and a
mapping node name -> stage. Rules, in the order they apply:

- ``get_attr`` and ``placeholder`` nodes have no stage; they follow their users. A parameter used by
  two stages (tied ``wte``/``lm_head``) is held by both and recorded as a ``TiedGroup``; the runtime
  sums its gradient over the holders after backward. A model input used by a later stage is a
  placeholder of that stage too (every rank reads its own slice of the inputs: no relay through
  stage 0, so labels and masks cost no transfer).
- ``getitem`` of a multi-output node stays with its producer; unmapped nodes take the latest stage of
  their inputs, or (for sources such as ``arange``) the earliest stage of their users; unmapped nodes
  with neither users nor staged inputs are dropped, and so is export's ``_guards_fn``.
- A tensor used by a later stage goes straight from its producer to each consuming stage (a skip
  connection over several stages is one direct edge, never relayed). A non-tensor (int, SymInt,
  shape) is recomputed in the consuming stage from what that stage holds, and so is a tensor computed
  cheaply from model inputs and constants alone (a mask, position ids, rotary tables:
  ``passes.remat``), which the block chain does not charge to any cut either; a stage keeps such a value
  only where one of its own nodes reads it.
- Only the last stage has the model's outputs; every other stage returns its send tokens.
- The tensors one stage sends another cross in ascending tag order, the order messages pair up in on the
  wire (nccl ignores tags): tags are numbered in the order the consuming stages first use the tensors, so
  a stage's recvs are in tag order as created, and each send goes right after its tensor, or right after
  the previous send to the same stage where that comes later (a consumer that uses its inputs in another
  order than they are made delays the producer's sends, never its own receives).
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from hetcc.errors import PlanFormatError, format_bytes
from hetcc.passes.remat import rematerialisable, trainable_values
from hetcc.passes.stage_assign import assign_stages, is_tensor
from hetcc.passes.tensor_layout import TensorLayout
from hetcc.sendrecv import ANCHOR_NAME, attach_anchor, gradient_wire, new_anchor
from hetcc.wire import NO_CODEC, get_codec

_METADATA_CHECK = torch.ops.aten._assert_tensor_metadata.default


@dataclass(frozen=True)
class CommEdge:
    """One tensor crossing a cut: ``value`` (node name in the original graph) from ``src`` to ``dst``."""

    tag: int
    src: int
    dst: int
    value: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = True  # a gradient flows back (the value depends on a trainable parameter)
    codec: str = NO_CODEC  # the activation's codec on the wire (``hetcc.wire``)
    grad_codec: str = NO_CODEC  # its gradient's

    @property
    def wire(self) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of what crosses forward: the tensor, or its codec's uint8 payload."""
        if self.codec == NO_CODEC:
            return self.shape, self.dtype
        return (get_codec(self.codec).payload_bytes(self.shape),), torch.uint8

    def grad_wire(self, dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the gradient on the wire, for a tensor that crossed as ``dtype``."""
        shape, dtype = gradient_wire(self.shape, dtype, self.grad_codec)
        return tuple(shape), dtype


@dataclass(frozen=True)
class TiedGroup:
    """A parameter held by several stages: ``name`` as in the model, ``members`` (stage, local name)."""

    name: str
    members: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted({stage for stage, _ in self.members}))


@dataclass
class StageGraph:
    """One pipeline stage: its graph with send/recv ops and what crosses its boundary."""

    index: int
    num_stages: int
    module: fx.GraphModule
    inputs: tuple[str, ...]  # model inputs (placeholders) this stage reads, in placeholder order
    recvs: tuple[CommEdge, ...]  # in the order the stage's graph receives them
    sends: tuple[CommEdge, ...]  # in the order of the stage's output tokens
    param_names: dict[str, str]  # local parameter name -> the model's (deduplicated) parameter name
    tied: tuple[TiedGroup, ...]  # every tied group of the pipeline (the same on all stages)
    num_outputs: int  # flat model outputs returned (last stage only; 0 elsewhere)
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # traced (microbatch) shapes
    input_dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # traced dtypes of tensor inputs
    # Tensor parallel (``passes.tensor_parallel``): the module is the graph each of the replica's t ranks
    # runs, holding the whole weights; each rank takes its part (``take_part``). None: not split.
    tensor: TensorLayout | None = None

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def peers(self) -> frozenset[int]:
        """The stages it receives from or sends to."""
        return frozenset(e.src for e in self.recvs) | frozenset(e.dst for e in self.sends)


def split_stages(
    gm: fx.GraphModule,
    stage_of: Mapping[str, int],
    num_stages: int,
    codecs: Sequence[tuple[str, str]] | None = None,
) -> list[StageGraph]:
    """Split ``gm`` into ``num_stages`` stage graphs following ``stage_of`` (node name -> stage).

    ``codecs``: per stage, the (activation, gradient) codecs of what it sends (``wire_codecs``)."""
    stages = assign_stages(gm, stage_of, num_stages)
    builders = [_StageBuilder(gm, k, num_stages) for k in range(num_stages)]
    trainable = trainable_values(gm)
    codecs = list(codecs) if codecs is not None else [(NO_CODEC, NO_CODEC)] * num_stages
    if len(codecs) != num_stages:
        raise PlanFormatError(f"{len(codecs)} codec pairs for {num_stages} stages", hint="give one per stage")
    cut = _Cut(builders, stages, trainable, rematerialisable(gm, trainable), codecs)
    for node in gm.graph.nodes:
        if node.op == "output":
            builders[-1].output(node, cut)
        elif node in stages:
            builders[stages[node]].emit(node, cut)
    tied = _tied_groups(gm, builders)
    return [builder.finish(tied) for builder in builders]


def format_stages(stages: list[StageGraph]) -> str:
    """One line per stage: its model inputs, recvs and sends, then each pair of stages' bytes per
    microbatch before and after its codecs (the ``comm`` step's dump)."""
    lines = []
    for stage in stages:
        recvs = ", ".join(f"tag {e.tag} {e.value} from {e.src}" for e in stage.recvs) or "none"
        sends = ", ".join(f"tag {e.tag} {e.value} to {e.dst}{_codec_text(e)}" for e in stage.sends) or "none"
        lines.append(f"stage {stage.index}: inputs {list(stage.inputs)}; recv {recvs}; send {sends}")
    for (src, dst), edges in _by_pair(stages).items():
        raw = sum(_nbytes(e.shape, e.dtype) for e in edges)
        grads = [e for e in edges if e.requires_grad]
        graw = sum(_nbytes(e.shape, e.dtype) for e in grads)
        lines.append(
            f"stage {src} -> {dst}: forward {format_bytes(raw)} -> {format_bytes(sum(_nbytes(*e.wire) for e in edges))}"
            f", gradients {format_bytes(graw)} -> {format_bytes(sum(_nbytes(*e.grad_wire(e.dtype)) for e in grads))}"
            " per microbatch"
        )
    return "\n".join(lines)


def _codec_text(edge: CommEdge) -> str:
    coded = [
        f"{kind} {name}" for kind, name in (("as", edge.codec), ("grad", edge.grad_codec)) if name != NO_CODEC
    ]
    return f" ({', '.join(coded)})" if coded else ""


def _by_pair(stages: list[StageGraph]) -> dict[tuple[int, int], list[CommEdge]]:
    pairs: dict[tuple[int, int], list[CommEdge]] = {}
    for stage in stages:
        for edge in stage.sends:
            pairs.setdefault((edge.src, edge.dst), []).append(edge)
    return pairs


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def wire_codecs(
    shape, dtype: torch.dtype, differentiable: bool, codec: str, grad_codec: str
) -> tuple[str, str]:
    """The (activation, gradient) codecs a ``shape`` x ``dtype`` tensor crosses with when its stage sends
    with ``codec`` / ``grad_codec``: none for a tensor no gradient flows through (a mask, a gate: a lossy
    codec would change what it selects, not only round it), else each where it applies
    (``Codec.applies``: floating point, large enough, smaller on the wire). The planner prices cuts by
    the same rule."""
    if not differentiable:
        return NO_CODEC, NO_CODEC
    return tuple(
        name if name != NO_CODEC and get_codec(name).applies(shape, dtype) else NO_CODEC
        for name in (codec, grad_codec)
    )


def _tensor_spec(node: fx.Node) -> tuple[tuple[int, ...], torch.dtype]:
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    if not all(isinstance(d, int) for d in val.shape):
        raise PlanFormatError(
            f"tensor {node.name!r} crosses a stage cut with a symbolic shape {tuple(val.shape)}",
            hint="trace with static shapes at microbatch size",
        )
    return tuple(int(d) for d in val.shape), val.dtype


def _static_shape(node: fx.Node) -> tuple[int, ...] | None:
    """The traced shape of a tensor placeholder, if known and static."""
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    shape = getattr(val, "shape", None)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(shape)


def _dtype(node: fx.Node) -> torch.dtype | None:
    """The traced dtype of a tensor placeholder, if known."""
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    dtype = getattr(val, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


class _Cut:
    """Creates the edges of the cut on demand: one send in the producer per (value, consumer stage)."""

    def __init__(
        self,
        builders: list[_StageBuilder],
        stages: dict[fx.Node, int],
        trainable: set[fx.Node],
        free: set[fx.Node],
        codecs: list[tuple[str, str]],
    ):
        self.builders, self.stage, self.trainable, self.free = builders, stages, trainable, free
        self.codecs, self.edges = codecs, {}

    def transfer(self, node: fx.Node, dst: int) -> CommEdge:
        key = (node, dst)
        if key not in self.edges:
            src = self.stage[node]
            if src > dst:
                raise PlanFormatError(f"{node.name!r} (stage {src}) is used by the earlier stage {dst}")
            shape, dtype = _tensor_spec(node)
            differentiable = node in self.trainable and (dtype.is_floating_point or dtype.is_complex)
            codec, grad_codec = wire_codecs(shape, dtype, differentiable, *self.codecs[src])
            edge = CommEdge(
                len(self.edges), src, dst, node.name, shape, dtype, differentiable, codec, grad_codec
            )
            self.edges[key] = edge
            self.builders[src].send(node, edge)
        return self.edges[key]


class _StageBuilder:
    """Accumulates one stage's graph, owned attributes and edges while nodes are emitted in order."""

    def __init__(self, gm: fx.GraphModule, index: int, num_stages: int):
        self.source, self.index, self.num_stages = gm, index, num_stages
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.originals: dict[str, object] = {}  # owned qualified name -> object in the source module
        self.recvs: list[CommEdge] = []
        self.sends: list[tuple[CommEdge, fx.Node]] = []
        self.encoded: dict[tuple[fx.Node, str], fx.Node] = {}  # (value, codec) -> its encode node
        self.anchor: fx.Node | None = None
        self.cut: _Cut | None = None
        self.num_outputs = 0

    def emit(self, node: fx.Node, cut: _Cut) -> None:
        self.cut = cut
        if node.op == "call_module":
            self._own(node.target)
        self.env[node] = self.graph.node_copy(node, self.value)

    def value(self, node: fx.Node) -> fx.Node:
        """This stage's node for ``node``: local, owned attribute, input, received or recomputed."""
        if node in self.env:
            return self.env[node]
        if node.op == "get_attr":
            self._own(node.target)
            new = self.graph.get_attr(node.target)
            new.meta = dict(node.meta)
        elif node.op == "placeholder":  # the target is the model's own input name ("input", not "input_1")
            new = self.graph.placeholder(node.target)
            new.meta = dict(node.meta)
        elif is_tensor(node) and node not in self.cut.free:
            new = self._recv(self.cut.transfer(node, self.index))
        else:
            if node.op == "call_module":
                self._own(node.target)
            new = self.graph.node_copy(
                node, self.value
            )  # recompute a non-tensor or a rematerialised constant
        self.env[node] = new
        return new

    def send(self, node: fx.Node, edge: CommEdge) -> None:
        """``send(value)``, or ``send(encode(value), source=value)`` where the edge has a codec."""
        value, (shape, dtype) = self.env[node], edge.wire
        kwargs = {"grad_codec": edge.grad_codec} if edge.grad_codec != NO_CODEC else {}
        sent = value
        if edge.codec != NO_CODEC:  # one encode per value and codec, whichever stages it goes to
            sent = self.encoded.get((value, edge.codec))
            if sent is None:
                with self.graph.inserting_after(value):
                    sent = self.graph.create_node(
                        "call_function", torch.ops.hetcc.encode.default, (value, edge.codec),
                        name=f"encode_{edge.value}",
                    )  # fmt: skip
                sent.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
                self.encoded[(value, edge.codec)] = sent
            kwargs = {"source": value, **kwargs}
        with self.graph.inserting_after(sent):
            token = self.graph.create_node(
                "call_function", torch.ops.hetcc.send.default, (sent, edge.dst, edge.tag, list(shape), dtype),
                kwargs, name=f"send_{edge.value}_to_{edge.dst}",
            )  # fmt: skip
        self.sends.append((edge, token))

    def _recv(self, edge: CommEdge) -> fx.Node:
        """``recv``, then ``decode`` where the edge has a codec (its backward sends the gradient)."""
        if self.anchor is None:
            self.anchor = self.graph.get_attr(ANCHOR_NAME)
        (shape, dtype), coded = edge.wire, edge.codec != NO_CODEC
        grad = {"grad_codec": edge.grad_codec} if edge.grad_codec != NO_CODEC and not coded else {}
        node = self.graph.create_node(
            "call_function", torch.ops.hetcc.recv.default, (self.anchor, edge.src, edge.tag, list(shape), dtype),
            grad, name=f"recv_{edge.value}",
        )  # fmt: skip
        node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
        self.recvs.append(edge)
        if not coded:
            return node
        args = (node, self.anchor, edge.codec, list(edge.shape), edge.dtype, edge.src, edge.tag)
        kwargs = {"grad_codec": edge.grad_codec} if edge.grad_codec != NO_CODEC else {}
        decoded = self.graph.create_node(
            "call_function", torch.ops.hetcc.decode.default, args, kwargs, name=f"decode_{edge.value}"
        )
        decoded.meta["val"] = torch.empty(edge.shape, dtype=edge.dtype, device="meta")
        return decoded

    def _drop_unread_constants(self) -> None:
        """Drop values computed from model inputs and constants alone (``passes.remat``) that nothing in
        this stage reads, and the checks of their metadata: their readers went to later stages, which
        recompute them (Llama's rotary tables on the embedding's stage). An op with an effect (an update of
        a buffer in place) stays."""
        free = {self.env[n] for n in self.cut.free if n in self.env} if self.cut is not None else set()
        for node in reversed(self.graph.nodes):
            if node.op != "call_function" or node.users or node not in free:
                continue
            if node.target is _METADATA_CHECK or not node.is_impure():  # a buffer's add_ has an effect
                self.graph.erase_node(node)

    def _own(self, qualname: str) -> None:
        self.originals.setdefault(qualname, operator.attrgetter(qualname)(self.source))

    def output(self, node: fx.Node, cut: _Cut) -> None:
        self.cut = cut
        leaves, _ = tree_flatten(node.args[0])
        outputs = [self.value(leaf) if isinstance(leaf, fx.Node) else leaf for leaf in leaves]
        self.num_outputs = len(outputs)
        self._outputs = outputs

    def finish(self, tied: tuple[TiedGroup, ...]) -> StageGraph:
        self._hoist_inputs()
        self._order_sends()
        sends = sorted(self.sends, key=lambda pair: pair[0].tag)
        result = tuple(self._outputs) if self.index == self.num_stages - 1 else tuple(t for _, t in sends)
        self.graph.output(result)
        self._drop_unread_constants()
        module = fx.GraphModule(self._owned_copies(), self.graph, class_name=f"Stage{self.index}")
        if self.anchor is not None:
            attach_anchor(module)
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        inputs = tuple(n.target for n in placeholders)
        shapes = {n.target: _static_shape(n) for n in placeholders if _static_shape(n) is not None}
        dtypes = {n.target: _dtype(n) for n in placeholders if _dtype(n) is not None}
        return StageGraph(
            self.index, self.num_stages, module, inputs, tuple(self.recvs), tuple(e for e, _ in sends),
            self._param_names(), tied, self.num_outputs, shapes, dtypes,
        )  # fmt: skip

    def _order_sends(self) -> None:
        """Sends to one stage in tag order: a send that comes before an earlier-tagged send to the same
        stage moves to right after it (see the module docstring)."""
        position = {node: i for i, node in enumerate(self.graph.nodes)}
        previous: dict[int, fx.Node] = {}  # destination stage -> its send with the highest tag so far
        for edge, token in sorted(self.sends, key=lambda pair: pair[0].tag):
            before = previous.get(edge.dst)
            if before is not None and position[before] > position[token]:
                before.append(token)
                position = {node: i for i, node in enumerate(self.graph.nodes)}
            previous[edge.dst] = token

    def _hoist_inputs(self) -> None:
        """Placeholders are created on first use; move them to the top in the model's input order."""
        order = {n.target: i for i, n in enumerate(self.source.graph.find_nodes(op="placeholder"))}
        inputs = sorted(self.graph.find_nodes(op="placeholder"), key=lambda n: order[n.target])
        for node in reversed(inputs):
            next(iter(self.graph.nodes)).prepend(node)

    def _owned_copies(self) -> dict[str, object]:
        """Deep copies of the owned attributes; one memo keeps aliases (tied weights) aliased."""
        memo: dict[int, object] = {}
        copies = {name: copy.deepcopy(obj, memo) for name, obj in self.originals.items()}
        if self.anchor is not None:
            copies[ANCHOR_NAME] = new_anchor()
        return copies

    def _param_names(self) -> dict[str, str]:
        canonical = {id(p): name for name, p in self.source.named_parameters()}
        return {local: canonical[id(p)] for local, p in self.owned_parameters()}

    def owned_parameters(self):
        for name, obj in self.originals.items():
            if isinstance(obj, torch.nn.Parameter):
                yield name, obj
            elif isinstance(obj, torch.nn.Module):
                for sub, p in obj.named_parameters(remove_duplicate=False):
                    yield f"{name}.{sub}", p


def _tied_groups(gm: fx.GraphModule, builders: list[_StageBuilder]) -> tuple[TiedGroup, ...]:
    """Parameters held by more than one stage, keyed by the model's parameter name."""
    canonical = {id(p): name for name, p in gm.named_parameters()}
    holders: dict[str, list[tuple[int, str]]] = {}
    for builder in builders:
        for local, param in builder.owned_parameters():
            holders.setdefault(canonical[id(param)], []).append((builder.index, local))
    return tuple(
        TiedGroup(name, tuple(members))
        for name, members in holders.items()
        if len({stage for stage, _ in members}) > 1
    )
