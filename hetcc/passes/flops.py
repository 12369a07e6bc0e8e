"""flops: forward/backward FLOPs and bytes moved per node.

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` run around each node on FakeTensors, plus
the formulas torch lacks (CPU flash attention). Bytes (read + written) come from the rule table below:
views move nothing, gathers move what they gather, everything else reads its inputs and writes its
outputs. An op with no entry takes the named ``io`` fallback and says so in the node's notes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula, sdpa_flop_count

from hetcc.ir import annotate, info, nbytes, to_number
from hetcc.passes.fake_run import FakeInterpreter

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
    "view",
    "_unsafe_view",
    "reshape",
    "permute",
    "transpose",
    "t",
    "expand",
    "unsqueeze",
    "squeeze",
    "select",
    "slice",
    "alias",
    "detach",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "as_strided",
    "flatten",
    "unflatten",
    "view_as",
    "expand_as",
    "narrow",
    "movedim",
    "lift_fresh_copy",
    "_assert_tensor_metadata",
    "sym_size",
    "sym_numel",
    "sym_stride",
    "_assert_scalar",
    "dropout",  # identity at inference; in training the mask is priced by the memory pass
)
_IO_OPS = (
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "exp",
    "log",
    "tanh",
    "sigmoid",
    "relu",
    "gelu",
    "silu",
    "pow",
    "rsqrt",
    "sqrt",
    "where",
    "masked_fill",
    "clone",
    "contiguous",
    "_to_copy",
    "to",
    "type_as",
    "abs",
    "mean",
    "sum",
    "amax",
    "max",
    "min",
    "var",
    "var_mean",
    "softmax",
    "_softmax",
    "log_softmax",
    "_log_softmax",
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "batch_norm",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit",
    "cat",
    "stack",
    "cumsum",
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "matmul",
    "linear",
    "convolution",
    "conv1d",
    "conv2d",
    "scaled_dot_product_attention",
    "arange",
    "full",
    "zeros",
    "ones",
    "ones_like",
    "zeros_like",
    "full_like",
    "new_ones",
    "new_zeros",
    "triu",
    "tril",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "cos",
    "sin",
    "reciprocal",
    "erf",
    "hardtanh",
    "max_pool2d",
    "avg_pool2d",
    "adaptive_avg_pool2d",
    "cross_entropy_loss",
    "nll_loss_forward",
    "nll_loss",
    "scalar_tensor",
    "bitwise_not",
    "logical_not",
    "cross_entropy",
    "mse_loss",
    "clamp",
    "rsub",
    "floor_divide",
    "any",
    "all",
    "index",
    "gather",
)

BYTE_RULES: dict[str, Callable[[torch.fx.Node], object]] = {
    **{f"aten.{name}": _zero for name in _VIEW_OPS},
    **{f"aten.{name}": _io for name in _IO_OPS},
    "aten.embedding": _gather,
    "aten.index_select": _gather,
    "_operator.getitem": _zero,
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


class _FlopCounter(FakeInterpreter):
    def run_node(self, node: torch.fx.Node):
        if node.op not in ("call_function", "call_method", "call_module"):
            return super().run_node(node)
        with FlopCounterMode(display=False) as counter:
            result = super().run_node(node)
        fwd = to_number(counter.get_total_flops())
        notes = info(node).notes
        ratio = BACKWARD_FLOP_RATIO.get(op_key(node))
        if ratio is None and fwd != 0:
            ratio, notes = 2.0, notes + ("bwd-flops=2x-fallback",)
        moved, fallback = node_bytes(node)
        if fallback:
            notes = notes + (fallback,)
        annotate(node, fwd_flops=fwd, bwd_flops=(ratio or 0) * fwd, bytes=moved, notes=notes)
        return result


def flops(gm: torch.fx.GraphModule, ctx=None) -> torch.fx.GraphModule:
    """Annotate every node with forward/backward FLOPs and bytes read + written."""
    _FlopCounter(gm).run_fake()
    return gm
