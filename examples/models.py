"""Model factories for the CLI: ``hetcc compile examples.models:gpt2_tiny --cluster ... --out build``.

Each returns ``(model, example_inputs)`` for one training step's batch. Models are Hugging Face
architectures built from configs (random weights, nothing downloaded).

- ``gpt2_tiny`` / ``llama_tiny`` / ``gpt2_mini`` / ``gpt2_bytes`` have real (random) weights and labels:
  their build folder runs with ``hetcc run`` on local CPU processes in seconds (``gpt2_bytes`` reads bytes: train it
  on a token folder from ``hetcc prepare-text``).
- The others are built on the meta device, so planning a large model needs no memory for its weights;
  their build folder holds the plan only (``hetcc explain``, ``simulate`` and ``report`` work on it).
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no config notes above the plan table

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM  # noqa: E402


def _token_batch(vocab: int, batch: int, seq: int) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids, "use_cache": False}  # labels: the model returns its loss


def gpt2_tiny(batch: int = 8, seq: int = 32):
    """A 4-layer GPT-2 (hidden 64, vocab 512) with random weights: compiles and trains on CPU in seconds."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=512, n_positions=max(128, seq),
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config), _token_batch(config.vocab_size, batch, seq)


def gpt2_mini(batch: int = 16, seq: int = 64):
    """A 6-layer GPT-2 (hidden 128) with GPT-2's own 50257-word vocabulary and random weights: its
    embedding and head are most of its FLOPs and parameters, so a mixed cluster gives it a pipeline
    (the walkthrough's model); it still trains on CPU processes in seconds."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=6, n_embd=128, n_head=4, n_positions=max(128, seq),
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config), _token_batch(config.vocab_size, batch, seq)


def gpt2_bytes(batch: int = 16, seq: int = 64):
    """A 4-layer GPT-2 (hidden 64) over bytes (vocabulary 256), random weights: what `hetcc run --data`
    trains on a token folder from `hetcc prepare-text` (byte-level by default)."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=max(128, seq),
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config), _token_batch(config.vocab_size, batch, seq)


def llama_tiny(batch: int = 8, seq: int = 32):
    """A 4-layer Llama (hidden 64, grouped-query attention, vocab 512) with random weights."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=max(128, seq),
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config), _token_batch(config.vocab_size, batch, seq)


def _gpt2(layers: int, hidden: int, heads: int, batch: int, seq: int):
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=max(1024, seq))
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, {"input_ids": ids, "use_cache": False}


def gpt2_small(batch: int = 16, seq: int = 512):
    """GPT-2 (124 M): 12 layers, hidden 768."""
    return _gpt2(12, 768, 12, batch, seq)


def gpt2_medium(batch: int = 64, seq: int = 512):
    """GPT-2 medium (355 M): 24 layers, hidden 1024."""
    return _gpt2(24, 1024, 16, batch, seq)


def gpt2_xl(batch: int = 32, seq: int = 512):
    """GPT-2 XL (1.5 B): 48 layers, hidden 1600."""
    return _gpt2(48, 1600, 25, batch, seq)


def opt_1_3b(batch: int = 16, seq: int = 1024):
    """An OPT-1.3B-shaped model: 24 layers, hidden 2048, 32 heads, feed-forward 8192."""
    config = OPTConfig(
        hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32, word_embed_proj_dim=2048,
        max_position_embeddings=max(2048, seq),
    )  # fmt: skip
    with torch.device("meta"):
        model = OPTForCausalLM(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, {"input_ids": ids, "use_cache": False}


def _llama(config: LlamaConfig, batch: int, seq: int):
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, {"input_ids": ids, "use_cache": False}


def llama_7b(batch: int = 8, seq: int = 2048):
    """A Llama-2-7B-shaped model: 32 layers, hidden 4096."""
    config = LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=max(4096, seq),
    )  # fmt: skip
    return _llama(config, batch, seq)


def llama_70b(batch: int = 64, seq: int = 2048):
    """A Llama-2-70B-shaped model: 80 layers, hidden 8192, grouped-query attention (8 KV heads)."""
    config = LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=max(4096, seq),
    )  # fmt: skip
    return _llama(config, batch, seq)
