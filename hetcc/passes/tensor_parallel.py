"""tensor_parallel: one graph run by t devices, each holding a shard of its weights, with the collectives
it needs as explicit ops (``hetcc.collectives``).

Shardings are propagated through the graph, not matched by module names. Every tensor is replicated
(``R``, the same on every device) or sharded (``S(d)``: each device holds one of t equal parts along
dim d). The graph's inputs are replicated. Two rules are hetcc's own:

- **Matmuls with a weight** (``linear``, ``addmm``, ``mm``, ``matmul`` whose right operand is a parameter
  used once): a replicated input makes the matmul *column-parallel* (the weight, and its bias, split along
  the output features: the result is sharded along its last dim); an input sharded along the features it
  contracts makes it *row-parallel* (the weight split along the input features; the partial sums are
  all-reduced, then the bias is added). Megatron-LM's attention and MLP fall out: q/k/v and the first MLP
  matmul are column-parallel, heads split, the output projections row-parallel.
- **Sequence parallelism** (Megatron-LM's, on by default): a row-parallel matmul whose output is
  [..., sequence, features] reduce-scatters its partial sums along the sequence instead of all-reducing
  them, so what follows up to the next column-parallel matmul (the residual add, the norm, dropout) runs
  on 1/t of the tokens, by torch's rules; that matmul gathers the tokens back (``gather_enter``). The same
  bytes cross as with one all-reduce, and those ops compute and keep a t-th.
- **An embedding table** used once is split along its features: each device looks up its part of
  every row, and the rows are gathered whole.
- **A fused projection split afterwards** (GPT-2's ``c_attn``: one matmul for q, k and v, then
  ``split``): the weight is laid out so each device's part of every piece is contiguous (``blocks``: the
  output features are k pieces, each split t ways), so the split stays local.

What a stage sends (``hetcc::send``, ``hetcc::encode``) is gathered whole first. Every other op takes
torch's own sharding rules (``torch.distributed.tensor``'s propagator, run on specs
alone: no devices, no process group): views and reshapes are rewritten to the local shapes, elementwise
ops and attention keep the heads sharded, and what needs a whole tensor (a layer norm over a sharded
dim, a loss) gets it gathered first. A partial sum is reduced at once. An op with no rule takes its
inputs replicated; the plan's notes name the ops that gathered a sharded input this way. A dropout on a
sharded tensor keeps this device's part of a whole mask (``passes.tensor_random``). The result's
outputs are replicated.

Gradients: ``hetcc.collectives`` gives every op a backward that keeps a replicated tensor's gradient the
same on every device, so replicated weights (norms) need no synchronisation and sharded weights hold
their shard's gradient.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import fx
from torch.distributed.tensor import Partial, Replicate, Shard

from hetcc import collectives  # noqa: F401  (registers the hetcc:: collectives this pass inserts)
from hetcc.passes.fake_run import FakeInterpreter
from hetcc.passes.shapes import shapes
from hetcc.passes.tensor_layout import ParamShard, TensorLayout
from hetcc.passes.tensor_random import draws, sharded_draw, shards_draw
from hetcc.passes.tensor_rules import propagate

aten = torch.ops.aten
_MATMULS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_R = Replicate()


class _Relayout(Exception):
    """A fused projection must be laid out in ``blocks`` pieces: propagate again."""

    def __init__(self, origin: str, blocks: int):
        self.origin, self.blocks = origin, blocks


def tensor_parallel(
    gm: fx.GraphModule, degree: int, keep_whole: frozenset[str] = frozenset(), sequence: bool = True
) -> tuple[fx.GraphModule, TensorLayout]:
    """``gm`` rewritten for tensor degree ``degree``: the graph every device of the stage runs, and the
    layout. The returned module holds the whole weights (what is saved); each device runs it with its
    own parts (``tensor_layout.take_part``). Weights in ``keep_whole`` (tied to another stage's) stay whole.
    ``sequence``: sequence parallelism where a row-parallel output has a sequence dim dividing by t.
    Every node's ``meta["val"]`` and shape record are the local ones."""
    blocks: dict[str, int] = {}
    for _ in range(len(gm.graph.nodes)):
        try:
            out, layout = _Rewrite(gm, degree, blocks, keep_whole, sequence and degree > 1).run()
            break
        except _Relayout as relayout:
            blocks[relayout.origin] = relayout.blocks
    _LocalValues(out, layout).run_fake()
    shapes(out)
    return out, layout


class _LocalValues(FakeInterpreter):
    """Fills every node's ``meta["val"]`` with its value on one device (the weights' parts)."""

    def __init__(self, gm: fx.GraphModule, layout: TensorLayout):
        super().__init__(gm)
        self.layout = layout

    def fetch_attr(self, target: str):
        shard = self.layout.params.get(target)
        if shard is None or shard.dim is None:
            return super().fetch_attr(target)
        # A part is a contiguous t-th along its dim (``ParamShard.part``, whose copy of a fake weight
        # only costs time): a fake tensor of that shape, made in the graph's fake mode.
        whole = fx.Interpreter.fetch_attr(self, target)
        local = [size // self.layout.degree if d == shard.dim else size for d, size in enumerate(whole.shape)]
        return torch.empty(local, dtype=whole.dtype, device=whole.device)

    def run_node(self, node: fx.Node):
        result = super().run_node(node)
        if node.op != "output":
            node.meta["val"] = result
        return result


def _val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


@functools.lru_cache(maxsize=8)
def _mesh(degree: int):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", list(range(degree)), _init_backend=False, _rank=0)


class _Rewrite:
    def __init__(
        self, gm: fx.GraphModule, degree: int, blocks: dict[str, int], keep_whole: frozenset[str], sequence: bool
    ):  # fmt: skip
        self.gm, self.t, self.blocks = gm, degree, blocks
        self.keep_whole, self.sequence = keep_whole, sequence
        self.layout = TensorLayout(degree)
        self.place: dict[fx.Node, object] = {}  # old node -> placement of its value
        # nodes sharded along a column-parallel matmul's own output features: (that matmul, their number)
        self.origin: dict[fx.Node, tuple[str, int]] = {}
        self.graph = fx.Graph()
        self.env: dict[fx.Node, object] = {}
        self.memo: dict[tuple, fx.Node] = {}
        self.uses = {n: len(n.users) for n in gm.graph.nodes}
        self.grad = _needs_grad(gm)

    # ---------------------------------------------------------------------------------- driver
    def run(self) -> tuple[fx.GraphModule, TensorLayout]:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self._copy(node, _R)
            elif node.op == "get_attr":
                self._copy(node, _R)
                if isinstance(operator.attrgetter(node.target)(self.gm), torch.Tensor):
                    self.layout.params.setdefault(node.target, ParamShard(None))
            elif node.op == "output":
                self.graph.output(fx.map_arg(node.args[0], lambda a: self._arg(a, _R)))
            elif node.target is operator.getitem:
                self._getitem(node)
            elif getattr(node.target, "namespace", None) == "hetcc":  # send, encode: whole tensors cross
                tensors = [a for a in node.all_input_nodes if _val(a) is not None]
                self._copy(node, _tuple_like(node, _R), *self._mapped(node, dict.fromkeys(tensors, _R)))
            elif _val(node) is None and not isinstance(node.meta.get("val"), (tuple, list)):
                self._copy(node, _R)  # asserts, sizes: no tensor out
            elif node.target in _MATMULS and self._weight(node) is not None:
                self._matmul(node)
            elif node.target in _SPLITS and self._split(node):
                pass
            elif node.target is aten.embedding.default and self._embedding(node):
                pass
            else:
                self._propagate(node)
        return fx.GraphModule(self.gm, self.graph), self.layout

    def _copy(self, node: fx.Node, placement, args=None, kwargs=None) -> fx.Node:
        new = (
            self.graph.node_copy(node, lambda a: self.env[a])
            if args is None
            else self.graph.create_node(
                node.op, node.target, args, kwargs if kwargs is not None else {}, node.name
            )
        )
        new.meta = dict(node.meta)
        self.env[node] = new
        self.place[node] = placement
        return new

    def _arg(self, node: fx.Node, want) -> fx.Node:
        """``node``'s value as ``want`` (R or S(d)) for a user: the collective between, made once."""
        have = self.place[node]
        if _same(have, want):
            return self.env[node]
        key = (node, _name(want))
        if key not in self.memo:
            if isinstance(want, Replicate):  # S(d) -> R
                self.memo[key] = self._call("all_gather", self.env[node], have.dim, self.t)
            else:  # R (or another dim's S, gathered first) -> S(d)
                whole = self.env[node] if isinstance(have, Replicate) else self._arg(node, _R)
                self.memo[key] = self._call("tensor_slice", whole, want.dim, self.t)
        return self.memo[key]

    def _entered(self, node: fx.Node) -> fx.Node:
        """``node`` whole as the input of an op whose result is sharded, where a gradient flows back
        through it: a replicated one through ``tensor_enter``, a sharded one gathered by ``gather_enter``
        (each device's gradient is a partial sum: reduced, not sliced)."""
        have = self.place[node]
        if node not in self.grad:
            return self.env[node] if isinstance(have, Replicate) else self._arg(node, _R)
        key = (node, "enter")
        if key not in self.memo:
            if isinstance(have, Replicate):
                self.memo[key] = self._call("tensor_enter", self.env[node])
            else:
                self.memo[key] = self._call("gather_enter", self.env[node], have.dim, self.t)
        return self.memo[key]

    def _call(self, op: str, *args) -> fx.Node:
        """A ``hetcc.collectives`` op on ``args``."""
        return self.graph.call_function(getattr(torch.ops.hetcc, op).default, args)

    # -------------------------------------------------------------------------------- matmuls
    def _weight(self, node: fx.Node) -> tuple[fx.Node, int, int] | None:
        """(weight node, its output-feature dim, its input-feature dim) where ``node`` multiplies by a 2-d
        parameter used only here; None otherwise."""
        index = 1 if node.target in (aten.linear.default, aten.mm.default, aten.matmul.default) else 2
        weight = node.args[index] if len(node.args) > index else None
        value = _val(weight)
        if not self._owns(weight) or value is None or value.dim() != 2:
            return None
        return (weight, 0, 1) if node.target is aten.linear.default else (weight, 1, 0)

    def _matmul(self, node: fx.Node) -> None:
        weight, out_dim, in_dim = self._weight(node)
        bias_index = {aten.linear.default: 2, aten.addmm.default: 0}.get(node.target)
        bias = node.args[bias_index] if bias_index is not None and len(node.args) > bias_index else None
        x = node.args[0 if node.target is not aten.addmm.default else 1]
        have, w, last = self.place[x], _val(weight), _val(x).dim() - 1
        blocks = self.blocks.get(node.name, 1)
        if isinstance(have, Shard) and have.dim == last:  # row-parallel, rows in the input's layout
            source = self.origin.get(x)
            self.layout.params[weight.target] = ParamShard(
                in_dim, self.blocks.get(source[0], 1) if source else 1
            )
            partial = self._bare_matmul(node, self.env[x], self.env[weight])
            tokens = _val(node).dim() - 2
            if self.sequence and tokens >= 1 and _val(node).shape[tokens] % self.t == 0:
                out, placed = self._call("reduce_scatter", partial, tokens, self.t), Shard(tokens)
            else:
                out, placed = self._call("all_reduce", partial), _R
            if bias is not None:  # added to a part of the tokens, its gradient is a partial sum: entered
                whole = self._entered(bias) if isinstance(placed, Shard) else self._arg(bias, _R)
                out = self.graph.call_function(aten.add.Tensor, (out, whole))
            self.env[node], self.place[node] = out, placed
            return
        if w.shape[out_dim] % (self.t * blocks) or (bias is not None and not self._owns(bias)):
            self._propagate(node)
            return
        # column-parallel
        self.layout.params[weight.target] = ParamShard(out_dim, blocks)
        if bias is not None:
            self.layout.params[bias.target] = ParamShard(0, blocks)
            self.place[bias] = Shard(0)
        args = list(node.args)
        args[args.index(x)] = self._entered(x)
        self._copy(node, Shard(_val(node).dim() - 1), tuple(fx.map_arg(a, self._env_or) for a in args))
        self.origin[node] = (node.name, w.shape[out_dim])

    def _env_or(self, arg):
        return self.env[arg] if arg in self.env else arg

    def _bare_matmul(self, node: fx.Node, x: fx.Node, weight: fx.Node) -> fx.Node:
        """``x @ weight`` of ``node`` without its bias (``addmm``'s is ``mm``)."""
        op = aten.mm.default if node.target is aten.addmm.default else node.target
        return self.graph.call_function(op, (x, weight))

    def _embedding(self, node: fx.Node) -> bool:
        """An embedding table only this lookup uses is split along its features: each device looks up
        its part of every row, and the parts are gathered at once (what follows a lookup, a norm or a
        sum with positions, wants the rows whole). False where it cannot be."""
        table = node.args[0]
        value = _val(table)
        if not self._owns(table) or value is None or value.dim() != 2 or value.shape[1] % self.t:
            return False
        self.layout.params[table.target] = ParamShard(1)
        self.place[table] = Shard(1)
        last = _val(node).dim() - 1
        self.env[node] = self._call("all_gather", self._copy(node, Shard(last)), last, self.t)
        self.place[node] = _R
        return True

    # --------------------------------------------------------------------------------- splits
    def _split(self, node: fx.Node) -> bool:
        """A split along the sharded dim of a fused projection's output stays local; False where it is
        not that case (the general rules decide)."""
        x = node.args[0]
        have, value = self.place.get(x), _val(x)
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % value.dim()
        if not isinstance(have, Shard) or have.dim != dim or x not in self.origin:
            return False
        sizes = [p.shape[dim] for p in node.meta["val"]]
        if len(set(sizes)) != 1 or sizes[0] % self.t:
            return False
        origin = self.origin[x][0]
        if self.blocks.get(origin, 1) != len(sizes):
            raise _Relayout(origin, len(sizes))
        local = sizes[0] // self.t
        if node.target is aten.chunk.default:
            args = (self.env[x], len(sizes), dim)
        elif node.target is aten.split.Tensor:
            args = (self.env[x], local, dim)
        else:
            args = (self.env[x], [local] * len(sizes), dim)
        self._copy(node, tuple(Shard(dim) for _ in sizes), args)
        return True

    def _getitem(self, node: fx.Node) -> None:
        source, index = node.args
        placement = self.place[source]
        self._copy(node, placement[index] if isinstance(placement, tuple) else placement)

    # ---------------------------------------------------------------------- torch's own rules
    def _propagate(self, node: fx.Node) -> None:
        """Ask torch's sharding propagator; gather what it cannot use; reduce a partial result."""
        tensors = [a for a in node.all_input_nodes if _val(a) is not None]
        if all(_same(self.place[a], _R) for a in tensors):
            self._copy(node, _tuple_like(node, _R))
            return
        decided = propagate(node, {a: self.place[a] for a in tensors}, _mesh(self.t), self.t)
        drawn = decided is not None and draws(node) and any(isinstance(p, Shard) for p in _flat(decided[1]))
        if drawn and not shards_draw(node, decided[1]):
            decided = None  # its parts would draw alike (``passes.tensor_random``)
        if decided is None:  # no rule (or an uneven result): every input whole
            self.layout.gathered_ops.append(f"%{node.name} ({_op_name(node)})")
            self._copy(node, _tuple_like(node, _R), *self._mapped(node, {a: _R for a in tensors}))
            return
        wants, output, args, kwargs = decided
        sharded_out = any(isinstance(p, Shard) for p in _flat(output))
        mapped = {}
        for a in tensors:
            want = wants[a]
            if isinstance(want, Shard) and _same(self.place[a], _R) and self._owns(a):
                self.layout.params[a.target] = ParamShard(want.dim)  # the weight is stored split
                self.place[a] = want
            mapped[a] = want
        new_args, new_kwargs = self._mapped(node, mapped, args, kwargs, enter=sharded_out)
        if drawn:  # each device keeps its part of what the whole graph draws
            self.env[node] = sharded_draw(self.graph, node, output, new_args, new_kwargs, self.t)
            self.place[node] = output
            return
        partial = isinstance(output, Partial)
        new = self._copy(node, _R if partial else output, new_args, new_kwargs)
        if partial:
            self.env[node] = self._call("all_reduce", new)
        if isinstance(output, Shard):  # a fused projection's layout carries through ops that keep its dim
            size = _val(node).shape[output.dim]
            carried = [self.origin[a] for a in tensors if self.origin.get(a, (None, 0))[1] == size]
            if carried:
                self.origin[node] = carried[0]

    def _owns(self, node: fx.Node) -> bool:
        """Whether ``node`` is a weight only this op uses, which can be stored split instead."""
        return (
            isinstance(node, fx.Node)
            and node.op == "get_attr"
            and self.uses[node] == 1
            and node.target in self.layout.params
            and node.target not in self.keep_whole
        )

    def _mapped(self, node, wants, args=None, kwargs=None, enter=False):
        """``node``'s args with each tensor input in the placement the op wants (its replicated inputs
        through ``tensor_enter`` where its result is sharded), and the local non-tensor args."""

        def arg(a):
            if not isinstance(a, fx.Node):
                return a
            if a not in wants:
                return self.env[a]
            if enter and _same(wants[a], _R):
                return self._entered(a)
            return self._arg(a, wants[a])

        args = node.args if args is None else args
        kwargs = node.kwargs if kwargs is None else kwargs
        return fx.map_arg(tuple(args), arg), fx.map_arg(dict(kwargs), arg)


def _needs_grad(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes a gradient flows back to: the graph's floating inputs, its tensors that require grad (the
    parameters, and the anchor every ``hetcc.recv`` takes: a received tensor's gradient goes back to the
    stage before), and the floating values made from them."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        value = _val(node)
        if node.op == "placeholder" and value is not None and value.dtype.is_floating_point:
            found.add(node)
        elif node.op == "get_attr":
            attr = operator.attrgetter(node.target)(gm)
            if isinstance(attr, torch.Tensor) and attr.requires_grad:
                found.add(node)
        elif (
            node.op == "call_function"
            and (value is None or value.dtype.is_floating_point)
            and any(a in found for a in node.all_input_nodes)
        ):
            found.add(node)
    return found


def _same(a, b) -> bool:
    return _name(a) == _name(b)


def _name(placement) -> str:
    if isinstance(placement, tuple):
        return "(" + ", ".join(_name(p) for p in placement) + ")"
    return f"S({placement.dim})" if isinstance(placement, Shard) else "R"


def _flat(placement):
    return placement if isinstance(placement, tuple) else (placement,)


def _tuple_like(node: fx.Node, placement):
    value = node.meta.get("val")
    return tuple(placement for _ in value) if isinstance(value, (tuple, list)) else placement


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))
