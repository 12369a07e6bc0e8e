"""Random draws on sharded tensors in a tensor-parallel graph (``passes.tensor_parallel``).

The devices of a tensor-parallel replica share one random state: the runtime seeds them alike, so the
replicated tensors they compute (a dropout on the whole residual, say) agree. An op that draws on a
sharded tensor would therefore draw the same numbers for every part: each device's tokens of a
sequence-parallel residual dropped alike, every device's heads given one attention-dropout pattern.
Instead each device draws what the whole graph would draw and keeps its part:

- ``dropout(x, p, train=True)`` on a sharded ``x`` is ``x`` times this device's part of a mask for the
  whole tensor (``hetcc::dropout_mask``);
- attention with dropout (``scaled_dot_product_attention`` with ``dropout_p`` > 0) on split heads, tokens
  or batch runs attention as torch's math path does, its weights multiplied by this device's part of a
  mask over the whole [batch, heads, queries, keys]; it keeps the attention weights, as attention with
  dropout on a CPU does anyway;
- any other draw on a sharded tensor is refused a sharded rule (``shards_draw`` is False): the pass
  gives it its inputs whole and the plan's notes name it.

Megatron-LM seeds each device's draws in tensor-parallel regions apart instead (its RNG tracker). Drawing
the whole mask costs t times the random numbers, but one shared random state stays in step across the
parts, a recomputed forward (``torch.utils.checkpoint``, which restores that state) draws the same
masks, and on CPU the sharded graph drops exactly what the unsharded graph drops.
"""

from __future__ import annotations

import math

import torch
from torch import fx
from torch.distributed.tensor import Shard

from hetcc import collectives  # noqa: F401  (registers hetcc::dropout_mask)

aten = torch.ops.aten
_ATTENTION = aten.scaled_dot_product_attention.default


def draws(node: fx.Node) -> bool:
    """Whether running ``node`` draws random numbers (a dropout with p = 0 or train=False does not)."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    if node.target is aten.dropout.default:
        p, train = _arguments(node, node.args, node.kwargs)[1:3]
        return bool(train) and p > 0
    if node.target is _ATTENTION:
        return _arguments(node, node.args, node.kwargs)[4] > 0
    return True


def shards_draw(node: fx.Node, output) -> bool:
    """Whether ``sharded_draw`` can give ``node`` (which draws) the sharded result ``output``."""
    if node.target is aten.dropout.default:
        return isinstance(output, Shard)
    if node.target is _ATTENTION:  # the weights are split along a dim of the batch, heads or queries
        return isinstance(output, Shard) and output.dim < node.meta["val"].dim() - 1
    return False


def sharded_draw(graph: fx.Graph, node: fx.Node, output: Shard, args: tuple, kwargs: dict, degree: int):
    """The nodes computing this device's part ``output`` of ``node`` (which ``shards_draw``) from its
    local ``args``: the last one."""
    values = _arguments(node, args, kwargs)
    if node.target is aten.dropout.default:
        x, p = values[:2]
        whole = list(node.meta["val"].shape)
        mask = graph.call_function(torch.ops.hetcc.dropout_mask.default, (x, whole, p, output.dim, degree))
        return graph.call_function(aten.mul.Tensor, (x, mask))
    query, key, value, attn_mask, p, causal, scale, gqa = values
    whole = _arguments(node, node.args, node.kwargs)  # the nodes of the whole graph, with their values
    q, k = whole[0].meta["val"], whole[1].meta["val"]  # the weights are [..., queries, keys]
    weights = [*q.shape[:-1], k.shape[-2]]
    mask = graph.call_function(torch.ops.hetcc.dropout_mask.default, (query, weights, p, output.dim, degree))
    kind = whole[3].meta["val"].dtype if isinstance(whole[3], fx.Node) else None
    return _attention(graph, (query, key, value), (attn_mask, kind), causal, scale, gqa, mask, q, k)


def _attention(graph: fx.Graph, qkv, attn_mask, causal: bool, scale, gqa: bool, dropped, q, k) -> fx.Node:
    """Attention as torch's math path computes it, the weights multiplied by ``dropped`` (a scaled mask)
    before they meet the values. torch's own op for this (``_scaled_dot_product_attention_math``'s
    ``dropout_mask``) prints a warning, for testing only, on every process that runs it."""
    call = graph.call_function
    query, key, value = qkv
    if gqa and q.shape[-3] != k.shape[-3]:  # each key and value head serves a group of query heads
        repeats = q.shape[-3] // k.shape[-3]
        key, value = (call(aten.repeat_interleave.self_int, (t, repeats, -3)) for t in (key, value))
    scores = call(aten.matmul.default, (query, call(aten.transpose.int, (key, -2, -1))))
    scores = call(aten.mul.Tensor, (scores, scale if scale is not None else q.shape[-1] ** -0.5))
    mask, kind = attn_mask
    if causal:
        ones = call(aten.new_ones.default, (scores, [q.shape[-2], k.shape[-2]]), {"dtype": torch.bool})
        mask, kind = call(aten.tril.default, (ones,)), torch.bool
    if mask is not None and kind == torch.bool:
        scores = call(aten.masked_fill.Scalar, (scores, call(aten.logical_not.default, (mask,)), -math.inf))
    elif mask is not None:
        scores = call(aten.add.Tensor, (scores, mask))
    probabilities = call(aten._safe_softmax.default, (scores, -1))
    return call(aten.matmul.default, (call(aten.mul.Tensor, (probabilities, dropped)), value))


def _arguments(node: fx.Node, args: tuple, kwargs: dict) -> list:
    """The op's arguments in schema order, defaults filled in."""
    schema = node.target._schema.arguments
    return [args[i] if i < len(args) else kwargs.get(a.name, a.default_value) for i, a in enumerate(schema)]
