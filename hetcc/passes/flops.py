"""flops: forward/backward FLOPs and bytes moved per node.

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` run around each node on FakeTensors, plus
the formulas torch lacks: CPU flash attention (registered with torch), and ``FLOP_RULES`` below for
recurrent layers (LSTM/GRU/RNN) and the grouped matmuls of mixture-of-experts layers, each of which
states what it assumed in the node's notes. Bytes (read + written) come from the rule table below:
views move nothing, gathers move what they gather, everything else reads its inputs and writes its
outputs. An op with no entry takes the named ``io`` fallback and says so in the node's notes;
``format_flops`` lists every guess once per op, with its count, under the annotated graph.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula, sdpa_flop_count

from hetcc import ir
from hetcc.ir import annotate, info, nbytes, to_number
from hetcc.passes.fake_run import FakeInterpreter, call_key, has_traced_values

log = logging.getLogger(__name__)
aten = torch.ops.aten


# ------------------------------------------------------------------------------- FLOP formulas


def _register_missing_formulas() -> None:
    """CPU sdpa dispatches to a flash kernel that FlopCounterMode has no formula for (torch 2.13)."""
    op = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or op.default in torch.utils.flop_counter.flop_registry:
        return

    @register_flop_formula(op)
    def _cpu_flash_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)


_register_missing_formulas()


# A rule prices one call from its (fake) arguments: (forward FLOPs, what it assumed). Matmuls only;
# the elementwise work around them is small and memory-bound, priced by the byte rules.
FlopRule = Callable[[tuple, dict, Any], tuple[Any, str]]


def _dims(tensor: torch.Tensor) -> list:
    return [to_number(size) for size in tensor.shape]


def _grouped_mm_flops(args: tuple, kwargs: dict, out: Any) -> tuple[Any, str]:
    """A grouped matmul (``torch._grouped_mm``, transformers' ``grouped_mm``): the jagged operand holds
    the rows routed to each expert, so its FLOPs are those of the routed tokens (tokens x top-k), the
    expected active compute, whatever the balance between experts."""
    a, b = args[0], args[1]
    (rows, inner), outer = _dims(a)[-2:], _dims(out)[-1]
    if a.dim() == 2 and b.dim() == 2:  # weight gradient: the inner dimension is the jagged one
        flop = 2 * rows * inner * outer
    else:  # 2-D x 3-D (routed rows x per-expert weights) or 3-D x 3-D (a batch of groups)
        flop = 2 * to_number(out.numel()) * inner
    groups = _dims(b)[0] if b.dim() == 3 else _dims(out)[0]
    routed = f"{rows} routed rows (tokens x top-k)" if a.dim() == 2 else f"{_dims(a)[0]}x{rows} rows"
    return flop, f"moe: {routed} x {inner} -> {outer} over {groups} experts, every routed row once"


def _recurrent_flops(gates: int) -> FlopRule:
    """``aten.lstm`` / ``gru`` / ``rnn_*``: at every time step each layer and direction multiplies its
    input and its hidden state by its weights (``gates`` stacked gate matrices). The weights are the
    op's list of 2-D tensors (the ``.input`` and packed ``.data`` overloads alike; hidden states are 3-D),
    so layers, directions and projections are all counted from their shapes. The first argument holds
    every (step, sequence) pair once, padded or packed."""

    def rule(args: tuple, kwargs: dict, out: Any) -> tuple[Any, str]:
        lists = [arg for arg in args if isinstance(arg, (list, tuple))]
        x = args[0]
        weights = [w for arg in lists for w in arg if isinstance(w, torch.Tensor) and w.dim() == 2]
        steps_x_batch = to_number(x.numel()) // _dims(x)[-1]
        flop = sum((2 * steps_x_batch * to_number(w.numel()) for w in weights), 0)
        return (
            flop,
            f"recurrent: {gates} gate(s) x {len(weights)} weight matrices x {steps_x_batch} steps*batch",
        )

    return rule


FLOP_RULES: dict[str, FlopRule] = {
    "aten._grouped_mm": _grouped_mm_flops,
    "aten.grouped_mm": _grouped_mm_flops,
    "transformers.grouped_mm_fallback": _grouped_mm_flops,
    "aten.lstm": _recurrent_flops(4),
    "aten.gru": _recurrent_flops(3),
    "aten.rnn_tanh": _recurrent_flops(1),
    "aten.rnn_relu": _recurrent_flops(1),
}

# Backward FLOPs as a multiple of forward: a matmul's backward is two matmuls (grad input, grad weight);
# flash attention's backward is 5 batched matmuls against the forward's 2 (torch's sdpa_backward formula).
BACKWARD_FLOP_RATIO: dict[str, float] = {
    "aten.mm": 2.0,
    "aten.addmm": 2.0,
    "aten.bmm": 2.0,
    "aten.baddbmm": 2.0,
    "aten.matmul": 2.0,
    "aten.linear": 2.0,
    "aten.convolution": 2.0,
    "aten.conv1d": 2.0,
    "aten.conv2d": 2.0,
    "aten.conv3d": 2.0,
    "aten.einsum": 2.0,
    "aten.scaled_dot_product_attention": 2.5,
    "aten._scaled_dot_product_flash_attention_for_cpu": 2.5,
    "aten._scaled_dot_product_flash_attention": 2.5,
    "aten._scaled_dot_product_efficient_attention": 2.5,
    "nn.Linear": 2.0,
    "nn.Conv1d": 2.0,
    "nn.Conv2d": 2.0,
    "nn.Conv3d": 2.0,
    "nn.Bilinear": 2.0,
    **{key: 2.0 for key in FLOP_RULES},  # grouped and recurrent matmuls: grad input + grad weight
}


# -------------------------------------------------------------------------------- byte rules


def _zero(node: torch.fx.Node) -> int:
    return 0


def _io(node: torch.fx.Node):
    """Read every tensor input once, write every output once."""
    reads = sum((nbytes(a.meta.get("val")) for a in node.all_input_nodes), 0)
    return reads + nbytes(node.meta.get("val"))


def _gather(node: torch.fx.Node):
    """embedding / index_select: read the indices and the gathered rows, write the rows."""
    indices = node.args[1]
    return nbytes(indices.meta.get("val")) + 2 * nbytes(node.meta.get("val"))


_VIEW_OPS = (
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze",
    "select", "slice", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind", "as_strided",
    "flatten", "unflatten", "view_as", "expand_as", "narrow", "movedim", "lift_fresh_copy",
    "_assert_tensor_metadata", "sym_size", "sym_numel", "sym_stride", "_assert_scalar",
    "dropout",  # identity at inference; in training the mask is priced by the memory pass
)  # fmt: skip
_IO_OPS = (
    "add", "sub", "mul", "div", "neg", "exp", "log", "tanh", "sigmoid", "relu", "gelu", "silu", "pow",
    "rsqrt", "sqrt", "where", "masked_fill", "clone", "contiguous", "_to_copy", "to", "type_as", "abs",
    "mean", "sum", "amax", "max", "min", "var", "var_mean", "softmax", "_softmax", "log_softmax",
    "_log_softmax", "layer_norm", "native_layer_norm", "group_norm", "batch_norm",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "cat", "stack", "cumsum", "mm",
    "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "conv1d", "conv2d",
    "scaled_dot_product_attention", "arange", "full", "zeros", "ones", "ones_like", "zeros_like",
    "full_like", "new_ones", "new_zeros", "triu", "tril", "eq", "ne", "lt", "le", "gt", "ge", "cos",
    "sin", "reciprocal", "erf", "hardtanh", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d",
    "cross_entropy_loss", "nll_loss_forward", "nll_loss", "scalar_tensor", "bitwise_not", "logical_not",
    "cross_entropy", "mse_loss", "clamp", "rsub", "floor_divide", "any", "all", "index", "gather",
    "topk", "sort", "histc", "index_put", "index_put_", "scatter", "scatter_add", "index_add", "diff",
    "pad", "empty_like", "__and__", "bitwise_and", "one_hot", "lstm", "gru", "rnn_tanh", "rnn_relu",
    "_grouped_mm", "grouped_mm",
    # in-place forms (export keeps a few, e.g. the router's top-k renormalisation ``div_``)
    "add_", "sub_", "mul_", "div_", "masked_fill_", "clamp_", "copy_", "fill_", "zero_",
)  # fmt: skip

BYTE_RULES: dict[str, Callable[[torch.fx.Node], object]] = {
    **{f"aten.{name}": _zero for name in _VIEW_OPS},
    **{f"aten.{name}": _io for name in _IO_OPS},
    "aten.embedding": _gather,
    "aten.index_select": _gather,
    "transformers.grouped_mm_fallback": _io,
    "_operator.getitem": _zero,
    # a tensor-parallel stage's collectives (``hetcc.collectives``) move bytes over links, not through
    # memory: ``passes.tensor_cost`` prices each as a ring on the node's link
    **{
        f"hetcc.{name}": _zero
        for name in (
            "all_reduce",
            "all_gather",
            "tensor_enter",
            "tensor_slice",
            "reduce_scatter",
            "gather_enter",
        )
    },
    # symbolic_trace graphs keep leaf modules as call_module nodes
    **{
        f"nn.{name}": _io
        for name in (
            "Linear",
            "Conv1d",
            "Conv2d",
            "Conv3d",
            "BatchNorm1d",
            "BatchNorm2d",
            "LayerNorm",
            "GroupNorm",
            "ReLU",
            "GELU",
            "SiLU",
            "Tanh",
            "Sigmoid",
            "Softmax",
            "MaxPool2d",
            "AvgPool2d",
            "AdaptiveAvgPool2d",
            "Embedding",
            "RMSNorm",
        )
    },
    "nn.Dropout": _zero,
    "nn.Identity": _zero,
    "nn.Flatten": _zero,
}


def op_key(node: torch.fx.Node) -> str:
    """``aten.addmm`` for OpOverloads, ``module.function`` for Python callables."""
    target = node.target
    if node.op == "call_method":  # x.view(...), x.relu(): method names match aten op names
        return f"aten.{target}"
    if node.op == "call_module":
        return f"nn.{type(node.graph.owning_module.get_submodule(target)).__name__}"
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target._qualified_op_name.replace('::', '.')}"
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', target)}".lstrip(".")


_warned: set[str] = set()


def node_bytes(node: torch.fx.Node):
    """Bytes read + written by ``node``, and the name of the fallback used (None when a rule exists)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return 0, None
    rule = BYTE_RULES.get(op_key(node))
    if rule is not None:
        return rule(node), None
    if op_key(node) not in _warned:
        _warned.add(op_key(node))
        log.info("hetcc: no byte rule for %s; using the io fallback (inputs + outputs)", op_key(node))
    return _io(node), "io-fallback"


# ----------------------------------------------------------------------------------- the pass


def _annotate(node: torch.fx.Node, fwd: Any, assumption: str | None) -> None:
    """Record a node's forward FLOPs (and what a rule assumed), its backward FLOPs and its bytes."""
    notes = info(node).notes + ((assumption,) if assumption else ())
    ratio = BACKWARD_FLOP_RATIO.get(op_key(node))
    if ratio is None and fwd != 0:
        ratio, notes = 2.0, notes + ("bwd-flops=2x-fallback",)
    moved, fallback = node_bytes(node)
    if fallback:
        notes = notes + (fallback,)
    annotate(node, fwd_flops=fwd, bwd_flops=(ratio or 0) * fwd, bytes=moved, notes=notes)


def _count(run: Callable[[], Any], node: torch.fx.Node, args: tuple, kwargs: dict) -> tuple[Any, str | None]:
    """(forward FLOPs, what a rule assumed) of one call: ``run()`` under ``FlopCounterMode``, or the
    node's ``FLOP_RULES`` entry (a composite op may decompose under the counter, or not: one formula)."""
    with FlopCounterMode(display=False) as counter:
        result = run()
    rule = FLOP_RULES.get(op_key(node))
    if rule is None:
        return to_number(counter.get_total_flops()), None
    return rule(args, kwargs, result[0] if isinstance(result, (tuple, list)) else result)


class _FlopCounter(FakeInterpreter):
    """Every node run on FakeTensors (graphs of modules and methods: ``symbolic_trace``'s)."""

    def run_node(self, node: torch.fx.Node):
        if node.op not in ("call_function", "call_method", "call_module"):
            return super().run_node(node)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        result = None

        def run():
            nonlocal result
            result = super(_FlopCounter, self).run_node(node)
            return result

        _annotate(node, *_count(run, node, args, kwargs))
        return result


def flops(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Annotate every node with forward/backward FLOPs and bytes read + written.

    A graph of aten calls whose every value carries its FakeTensor (``torch.export``'s) is counted
    call by call from those values, each distinct call (op, argument shapes, dtypes and constants)
    once: a transformer's repeated layers cost one layer. Other graphs run node by node."""
    if has_traced_values(gm):
        _count_calls(gm)
    else:
        _FlopCounter(gm).run_fake()
    return gm


# (op, call key) -> (forward FLOPs, assumption) of calls on concrete sizes, kept across graphs: the stages
# of one model, and its graph at each tensor degree, repeat the same calls. Cleared when full.
_COUNTED: dict[tuple, tuple[Any, str | None]] = {}
_COUNTED_MOST = 8192


def _count_calls(gm: torch.fx.GraphModule) -> None:
    fake_mode = FakeInterpreter(gm).fake_mode
    own: dict[tuple, tuple[Any, str | None]] = {}  # calls with symbolic sizes or opaque constants
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
        key = (node.target, call_key((args, kwargs)))
        counted = _COUNTED if _concrete(key) else own
        if key not in counted:
            if counted is _COUNTED and len(_COUNTED) >= _COUNTED_MOST:
                _COUNTED.clear()
            with fake_mode, torch.no_grad():
                counted[key] = _count(functools.partial(node.target, *args, **kwargs), node, args, kwargs)
        _annotate(node, *counted[key])


def _concrete(key: Any) -> bool:
    """Whether a call key (``fake_run.call_key``) names its call whatever the graph: every size a number,
    no symbolic value, no constant known only by identity."""
    if not isinstance(key, tuple) or not key:
        return True
    if key[0] in ("sym", "object"):
        return False
    if key[0] == "tensor":
        return all(d.isdigit() for d in key[1])
    return all(_concrete(part) for part in key)


def format_flops(gm: torch.fx.GraphModule) -> str:
    """The annotated graph, then each op priced by a guess or an assumption, once, with its count."""
    guesses: Counter[tuple[str, str]] = Counter()
    example: dict[tuple[str, str], str] = {}
    for node in gm.graph.nodes:
        for note in info(node).notes:
            key = (op_key(node), note.split(":")[0])
            guesses[key] += 1
            example.setdefault(key, note)
    lines = [ir.format(gm)]
    if guesses:
        lines.append(
            "\npriced by a rule of hetcc's own or a generic fallback, once per op (nodes; first case):"
        )
        lines.extend(
            f"  {op:<36} x{count:<4} {example[op, kind]}" for (op, kind), count in sorted(guesses.items())
        )
    return "\n".join(lines)
