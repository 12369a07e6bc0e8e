"""Small real models for tests: Hugging Face architectures built from configs, random weights."""

from __future__ import annotations

import copy

import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hetcc.train.optim import param_groups


def gpt2(n_layer: int = 2, n_embd: int = 64, n_head: int = 2, vocab: int = 128, **kw) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
        **kw,
    )
    return GPT2LMHeadModel(config)


def llama(
    layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 128
) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def bert(layers: int = 2, hidden: int = 64, heads: int = 2, vocab: int = 128, **kw) -> BertModel:
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        vocab_size=vocab,
        max_position_embeddings=128,
        **kw,
    )
    return BertModel(config)


class MLP(torch.nn.Module):
    """Linear(8, 16) -> relu -> Linear(16, 4): small enough to check every number by hand."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def token_ids(batch: int, seq: int, vocab: int = 128, device: str | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    return ids.to(device) if device else ids


def lm_kwargs(ids: torch.Tensor) -> dict:
    return {"input_ids": ids, "use_cache": False}


def tiny_gpt2_factory():
    """``pkg.module:factory`` form for CLI tests: (model, example kwargs) for one step's batch."""
    with torch.device("meta"):
        model = gpt2(n_layer=4, n_embd=128, n_head=4, vocab=512)
        ids = token_ids(8, 32, vocab=512, device="meta")
    return model, lm_kwargs(ids)


def trainable_gpt2_factory():
    """A tiny GPT-2 with real weights and labels (the model returns its loss), for `hetcc run`."""
    model = gpt2(n_layer=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(4, 16)
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}


def assert_chain_in_compute_order(gm: torch.fx.GraphModule) -> list[str]:
    """Every block is one contiguous run of compute nodes, and every node reads only its own or an
    earlier block: any contiguous split of the chain is a pipeline that sends only forward. Returns
    the blocks in the order their compute runs."""
    from hetcc.ir import info

    order, seen = [], set()
    for node in gm.graph.nodes:
        block = info(node).block
        if node.op in ("call_function", "call_module", "call_method"):
            if block != (order[-1] if order else None):
                assert block not in seen, f"block {block} is not contiguous"
                order.append(block)
                seen.add(block)
    position = {name: i for i, name in enumerate(order)}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_module", "call_method"):
            for arg in node.all_input_nodes:
                if arg.op not in ("get_attr", "placeholder"):
                    assert position[info(arg).block] <= position[info(node).block]
    return order


def refuse_active_dropout(model: torch.nn.Module) -> None:
    """A pipeline's ranks draw their own dropout masks (rank r from seed + r) and eager draws others, so
    with dropout active their losses differ by about the dropout's effect (~0.1-1% for a random GPT-2),
    which reads like a numerical bug of the runtime: compare deterministic models only (``*_pdrop=0.0``
    or ``model.eval()``)."""
    active = [
        name or "<root>"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.training and module.p > 0
    ]
    if active:
        raise ValueError(
            f"eager reference of a model with active dropout ({', '.join(active[:3])}"
            f"{', ...' if len(active) > 3 else ''}): no pipeline run can match it; build the model with "
            "dropout 0 (e.g. gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)) or call model.eval()"
        )


def eager_training(
    model, inputs: dict, targets, loss_fn, steps: int, microbatches: int, optimizer: dict, autocast=None
):
    """The eager reference of a pipeline run, in one process: each step runs the microbatches one after
    the other (train-mode BatchNorm sees the same batches), backward of ``loss / microbatches``, then
    the optimizer (``{"name": "sgd" | "adam" | "adamw", **options}``, with the built-in loop's
    weight-decay groups). ``loss_fn(output, target)``, or the model's
    own ``.loss``. Returns the mean microbatch loss per step and the last step's gradients under every
    parameter name (a tied weight under each of its names; parameters the loss misses have none).

    The model must be deterministic: refuses one with active dropout (``refuse_active_dropout``).
    ``autocast`` (a dtype): forwards run under ``torch.autocast("cpu", autocast)``, as mixed precision
    runs them; backward and the optimizer step stay outside it."""
    refuse_active_dropout(model)
    model = copy.deepcopy(model)
    options = dict(optimizer)
    named = list({id(p): (n, p) for n, p in model.named_parameters()}.values())
    groups = param_groups(named, options.get("weight_decay", 0.0))  # the built-in loop's groups
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[options.pop("name")](
        groups, **options
    )
    chunks = [
        {k: v.chunk(microbatches)[i] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        for i in range(microbatches)
    ]
    target_chunks = targets.chunk(microbatches) if targets is not None else [None] * microbatches
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        step = []
        for chunk, target in zip(chunks, target_chunks):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = model(**chunk)
            loss = out.loss if loss_fn is None else loss_fn(out, target)
            (loss / microbatches).backward()
            step.append(loss.detach())
        losses.append(float(torch.stack(step).mean()))
        grads = {
            n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None
        }
        opt.step()
    return losses, grads
