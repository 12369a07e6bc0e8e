"""Trace and analyse a Llama-2-70B-shaped model built on the meta device (no weights allocated).

Prints wall time per pass and the process's peak RSS. Usage: python benchmarks/trace_llama70b.py
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hetcc


def llama70b_config(layers: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    start = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(llama70b_config(args.layers))
        ids = torch.randint(0, 32000, (args.batch, args.seq))
    built_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    analysis = hetcc.analyze(model, example_kwargs={"input_ids": ids, "use_cache": False})
    analyze_s = time.perf_counter() - start
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    nodes = len(analysis.graph.graph.nodes)
    print(
        f"Llama-2-70B shape: {args.layers} layers, {params / 1e9:.1f} B params, batch {args.batch} x seq {args.seq}"
    )
    print(f"build on meta      {built_s:7.2f} s")
    print(
        f"analyze (total)    {analyze_s:7.2f} s   "
        + "  ".join(f"{k} {v / 1e3:.2f} s" for k, v in analysis.timings_ms.items())
    )
    print(f"graph              {nodes} nodes, {len(analysis.blocks)} blocks")
    print(
        f"forward            {analysis.total_flops() / 1e12:.1f} TFLOP  (2*params*tokens = "
        f"{2 * params * args.batch * args.seq / 1e12:.1f} TFLOP)"
    )
    print(f"peak RSS           {peak_rss_mb:.0f} MB")


if __name__ == "__main__":
    main()
