"""Trace and analyse a large model built on the meta device (no weights allocated).

Prints wall time per pass, the forward FLOPs beside the analytic count 2 x active parameters x tokens
+ attention, and the process's peak RSS. The models:
- ``llama-70b``: Llama-2-70B shape, 80 layers, hidden 8192, 69 B parameters;
- ``mixtral-8x7b``: 32 layers, hidden 4096, 8 experts top-2, intermediate 14336. Its expert matmuls are
  transformers' grouped custom op, which torch's FLOP counter cannot see; hetcc prices them as the
  routed tokens (tokens x top-k) times each expert's weights.

Usage: python benchmarks/trace_large.py [--model mixtral-8x7b] [--layers N] [--batch B] [--seq S]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

import hetcc


def llama_70b(layers: int) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
    ))  # fmt: skip


def mixtral_8x7b(layers: int) -> MixtralForCausalLM:
    return MixtralForCausalLM(MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=4096,
    ))  # fmt: skip


MODELS = {"llama-70b": (llama_70b, 80), "mixtral-8x7b": (mixtral_8x7b, 32)}


def active_parameters(model) -> int:
    """Parameters one token's forward multiplies by: all but the idle experts and the embedding (a
    gather, not a matmul)."""
    config = model.config
    active = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    experts, top_k = getattr(config, "num_local_experts", 1), getattr(config, "num_experts_per_tok", 1)
    per_expert = 3 * config.hidden_size * config.intermediate_size
    return active - (experts - top_k) * per_expert * config.num_hidden_layers


def analytic_forward_flops(model, batch: int, seq: int) -> float:
    """2 x active parameters x tokens + attention (QK^T and AV over the full square, as sdpa is counted)."""
    attention = model.config.num_hidden_layers * 2 * 2 * batch * seq * seq * model.config.hidden_size
    return 2 * active_parameters(model) * batch * seq + attention


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-70b")
    parser.add_argument("--layers", type=int, help="default: the real model's layer count")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    build, layers = MODELS[args.model]
    start = time.perf_counter()
    with torch.device("meta"):
        model = build(args.layers or layers)
        ids = torch.randint(0, 32000, (args.batch, args.seq))
    built_s = time.perf_counter() - start
    start = time.perf_counter()
    analysis = hetcc.analyze(model, example_kwargs={"input_ids": ids, "use_cache": False})
    analyze_s = time.perf_counter() - start
    params, active = sum(p.numel() for p in model.parameters()), active_parameters(model)
    got, want = float(analysis.total_flops()), analytic_forward_flops(model, args.batch, args.seq)
    passes = "  ".join(f"{k} {v / 1e3:.2f} s" for k, v in analysis.timings_ms.items())
    print(f"{args.model} shape: {model.config.num_hidden_layers} layers, {params / 1e9:.1f} B params "
          f"({active / 1e9:.1f} B active), batch {args.batch} x seq {args.seq}")  # fmt: skip
    print(f"build on meta      {built_s:7.2f} s")
    print(f"analyze (total)    {analyze_s:7.2f} s   {passes}")
    print(f"graph              {len(analysis.graph.graph.nodes)} nodes, {len(analysis.blocks)} blocks")
    print(f"forward            {got / 1e12:.2f} TFLOP  (2*active*tokens + attention = {want / 1e12:.2f} TFLOP, "
          f"ratio {got / want:.4f})")  # fmt: skip
    print(f"peak RSS           {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
