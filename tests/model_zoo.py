"""The model matrix: a dozen real architectures, each tiny, with one step's inputs and its loss.

Hugging Face models are built from configs with random weights (no downloads) and return their own
loss (``labels`` given); plain torch models take a module-level ``loss_fn`` (picklable, for the spawned
ranks). Dropout is off in the matrix so a pipeline run can equal eager exactly (``gpt2_dropout`` and
``opt_dropout``, outside it, have theirs on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from models import token_ids

BATCH, SEQ, VOCAB = 4, 16, 128


@dataclass
class Case:
    """One architecture: the model, one step's batch, and what its analysis must show."""

    name: str
    model: torch.nn.Module
    inputs: dict[str, Any]
    first_block: str
    last_block: str
    loss_fn: Any = None  # loss_fn(model output, target); None: the model's first output is its loss
    targets: torch.Tensor | None = None
    uncounted_flops: Any = None  # tokens -> FLOPs torch's counter misses (grouped expert matmuls)
    expected_flops: Any = None  # tokens -> forward FLOPs, where torch's counter cannot say (recurrent)
    notes: dict[str, str] = field(default_factory=dict)


def cross_entropy_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def _lm_inputs(ids: torch.Tensor, **extra) -> dict[str, Any]:
    return {"input_ids": ids, "labels": ids, "use_cache": False, **extra}


def _seeded(build):
    def factory(**options):
        torch.manual_seed(0)
        return build(**options)

    factory.__name__ = build.__name__
    return factory


@_seeded
def gpt2(dropout: float = 0.0) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=64, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return Case("gpt2", GPT2LMHeadModel(config), _lm_inputs(token_ids(BATCH, SEQ)), "embed", "head")


@_seeded
def llama() -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=0)  # fmt: skip
    return Case("llama", LlamaForCausalLM(config), _lm_inputs(token_ids(BATCH, SEQ)), "embed", "head")


@_seeded
def qwen2_tied() -> Case:
    """Tied input/output embeddings: export names the shared weight ``lm_head.weight``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return Case("qwen2-tied", Qwen2ForCausalLM(config), _lm_inputs(token_ids(BATCH, SEQ)), "embed", "head")


@_seeded
def bert() -> Case:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                        vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)  # fmt: skip
    ids = token_ids(BATCH, SEQ)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    return Case("bert", BertForMaskedLM(config), inputs, "embed", "head")


@_seeded
def opt(dropout: float = 0.0) -> Case:
    """``final_layer_norm`` comes before the layers in parameter order."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, ffn_dim=128, num_attention_heads=4,
                       max_position_embeddings=64, word_embed_proj_dim=64, dropout=dropout,
                       attention_dropout=dropout)  # fmt: skip
    return Case("opt", OPTForCausalLM(config), _lm_inputs(token_ids(BATCH, SEQ)), "embed", "head")


def gpt2_dropout() -> Case:
    """GPT-2 with its dropouts on (embeddings, residuals, attention: 0.1); not in ``CASES``."""
    return gpt2(dropout=0.1)


def opt_dropout() -> Case:
    """OPT with its dropouts on (residuals, attention: 0.1); not in ``CASES``."""
    return opt(dropout=0.1)


@_seeded
def t5() -> Case:
    """Encoder-decoder with one embedding shared by encoder, decoder and the tied head."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, dropout_rate=0.0, decoder_start_token_id=0)  # fmt: skip
    ids = token_ids(BATCH, SEQ)
    inputs = {"input_ids": ids, "decoder_input_ids": ids, "labels": ids, "use_cache": False}
    return Case("t5", T5ForConditionalGeneration(config), inputs, "embed", "head")


def _mixtral_config(**kw):
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=64, bos_token_id=0, eos_token_id=0, **kw)  # fmt: skip


@_seeded
def mixtral() -> Case:
    """Mixture of experts through transformers' default grouped matmul (a library custom op)."""
    from transformers import MixtralForCausalLM

    config = _mixtral_config()

    def expert_flops(tokens: int) -> int:  # gate+up and down projections of the top-k routed copies
        routed = tokens * config.num_experts_per_tok
        per_layer = 2 * routed * config.hidden_size * 3 * config.intermediate_size
        return per_layer * config.num_hidden_layers

    model = MixtralForCausalLM(config)
    return Case(
        "mixtral", model, _lm_inputs(token_ids(BATCH, SEQ)), "embed", "head", uncounted_flops=expert_flops
    )


class RecurrentLM(torch.nn.Module):
    """Embedding -> 2-layer LSTM -> GRU -> vocabulary projection."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.lstm = torch.nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.gru = torch.nn.GRU(hidden, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, ids):
        h, _ = self.lstm(self.embed(ids))
        h, _ = self.gru(h)
        return self.head(h)


@_seeded
def recurrent() -> Case:
    model = RecurrentLM()
    ids = token_ids(BATCH, SEQ)

    def recurrent_flops(tokens: int) -> int:
        """Eager CPU LSTMs run one fused kernel torch's counter cannot see: count the matmuls by hand.
        Per token: input and hidden state times 4 (LSTM) or 3 (GRU) gate matrices per layer; then the head."""
        hidden = 32
        gates = 4 * 2 + 3  # two LSTM layers, one GRU layer
        return 2 * tokens * (gates * hidden * 2 * hidden + hidden * VOCAB)

    return Case("lstm-gru", model, {"ids": ids}, "embed", "head", loss_fn=cross_entropy_loss, targets=ids,
                expected_flops=recurrent_flops)  # fmt: skip


@_seeded
def sequential() -> Case:
    """Blocks without parameters (ReLU, Dropout) between the linear layers."""
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Dropout(0.0),
        torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8),
    )  # fmt: skip
    x, y = torch.randn(BATCH * 2, 16), torch.randint(0, 8, (BATCH * 2,))
    return Case("sequential", model, {"input": x}, "0", "7", loss_fn=cross_entropy_loss, targets=y)


class ResNetBlock(torch.nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


@_seeded
def resnet() -> Case:
    """A small ResNet in train mode: BatchNorm statistics per microbatch, pooling without parameters."""
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        ResNetBlock(8), ResNetBlock(8), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10),
    ).train()  # fmt: skip
    x, y = torch.randn(BATCH, 3, 16, 16), torch.randint(0, 10, (BATCH,))
    return Case("resnet", model, {"input": x}, "0", "8", loss_fn=cross_entropy_loss, targets=y)


@_seeded
def vit() -> Case:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                       image_size=16, patch_size=4, num_channels=3, num_labels=10, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)  # fmt: skip
    inputs = {"pixel_values": torch.randn(BATCH, 3, 16, 16), "labels": torch.randint(0, 10, (BATCH,))}
    return Case("vit", ViTForImageClassification(config), inputs, "embed", "head")


@_seeded
def gpt_neox() -> Case:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                           bos_token_id=0, eos_token_id=0)  # fmt: skip
    return Case("gpt-neox", GPTNeoXForCausalLM(config), _lm_inputs(token_ids(BATCH, SEQ)), "embed", "head")


@_seeded
def bloom() -> Case:
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB, hidden_dropout=0.0,
                         attention_dropout=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return Case("bloom", BloomForCausalLM(config), _lm_inputs(token_ids(BATCH, SEQ)), "embed", "head")


CASES = [gpt2, llama, qwen2_tied, bert, opt, t5, mixtral, recurrent, sequential, resnet, vit, gpt_neox, bloom]
