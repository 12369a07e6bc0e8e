"""Small models, their traced graphs, stage mappings and eager references for the runtime tests."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from hetcc.sendrecv import LocalTransport, use_transport

_SLOW_CARDS_NODE = """  - name: node{k}
    intra_link: {{kind: nvlink, bandwidth: 300 GB/s, latency: 2 us}}
    devices: [{{type: Slow, count: {count}, memory: {memory}}}]
"""


def slow_cards(per_node: list[int], memory_bytes: int, inter_node: str = "") -> str:
    """A cluster file of cards with A100 memory bandwidth but 20 GFLOP/s (compute dominates, so plans
    replicate and split), ``per_node[k]`` of them on node k, each with ``memory_bytes`` usable, nodes
    joined by ``inter_node`` (e.g. "10 Mb/s")."""
    nodes = "".join(
        _SLOW_CARDS_NODE.format(k=k, count=n, memory=memory_bytes) for k, n in enumerate(per_node)
    )
    link = (
        f"inter_node_link: {{kind: ethernet, bandwidth: {inter_node}, latency: 20 us}}\n"
        if inter_node
        else ""
    )
    return (
        "name: slow-cards\nmemory_reserve: 0\ncustom_types:\n"
        "  - {name: Slow, base: A100-80GB, peak_flops: {fp32: 20 GFLOP/s}}\n"
        f"nodes:\n{nodes}{link}"
    )


class ResidualMLP(torch.nn.Module):
    """Three linear layers; the first layer's activation skips the second (a cut over two stages)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(h))) + h


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class GatedBody(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.register_buffer("mix", torch.eye(width).flip(0))  # a constant, not trained

    def forward(self, x):
        # float, from the input and a constant alone: no gradient crosses its edge; a matmul, so the
        # next stage receives it rather than recomputing it (passes.remat)
        mask = (x @ self.mix > 0).float()
        h = self.a(x * mask)
        gate = (h > 0).float()  # float, from a trainable value through a comparison
        return h, mask, gate


class GatedHead(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.b = torch.nn.Linear(width, width)

    def forward(self, h, mask, gate):
        return torch.where(gate > 0.5, self.b(h) * mask, 0.0)  # gate is only compared


class GatedMLP(torch.nn.Module):
    """Cut edges whose gradients autograd does not move by itself: ``gate`` is differentiable by the
    split's rule (a float computed from a trainable value), yet neither side ever differentiates it, and
    ``mask`` is not differentiable, yet the consumer's autograd computes a gradient for it."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.body, self.head = GatedBody(width), GatedHead(width)

    def forward(self, x):
        return self.head(*self.body(x))


class CrossedBody(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, 6)
        self.c = torch.nn.Linear(6, 4)

    def forward(self, x):
        a = torch.tanh(self.a(x))
        b = torch.tanh(self.b(a))
        return a, b, torch.tanh(self.c(b))


class CrossedHead(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.c = torch.nn.Linear(4, width)
        self.b = torch.nn.Linear(6, width)
        self.a = torch.nn.Linear(width, width)

    def forward(self, a, b, c):
        return (self.c(c) + self.b(b)) * self.a(a)  # c first, a last


class CrossedMLP(torch.nn.Module):
    """Three tensors cross one cut, each of its own shape: the body produces ``a, b, c`` in that order and
    the head uses them the other way round (``c`` first), so a stage pair whose sends and receives are
    not posted in one agreed order mixes them up where messages pair by order (nccl)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.body, self.head = CrossedBody(width), CrossedHead(width)

    def forward(self, x):
        return self.head(*self.body(x))


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def export(model, args=(), kwargs=None) -> torch.fx.GraphModule:
    return torch.export.export(model, args, kwargs or {}, strict=False).module()


def stages_by_module(gm: torch.fx.GraphModule, rules: list[tuple[str, int]]) -> dict[str, int]:
    """Map each call_function node to the stage of the first rule whose prefix its module path has;
    nodes of the root module (no path) stay unmapped, so the split's own rules place them."""
    mapping = {}
    for node in (n for n in gm.graph.nodes if n.op == "call_function"):
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        for prefix, stage in rules:
            if path and path.startswith(prefix):
                mapping[node.name] = stage
                break
    return mapping


MLP_RULES = [("a", 0), ("b", 1), ("c", 2)]
CNN_RULES = [("conv", 0), ("bn", 0), ("fc", 1)]
GATED_RULES = [("body", 0), ("head", 1)]
CROSSED_RULES = [("body", 0), ("head", 1)]
GPT2_RULES = [
    ("transformer.wte", 0), ("transformer.wpe", 0), ("transformer.drop", 0), ("transformer.h.0", 0),
    ("transformer.h.1", 1), ("transformer.ln_f", 2), ("lm_head", 2),
]  # fmt: skip


def planned_transfers(stages, microbatches: int, steps: int) -> list[dict[str, int]]:
    """Per rank, what the split's edges move when every transfer goes through the send/recv ops: each
    edge's tensor once per microbatch, and a differentiable edge's gradient once more, the other way."""
    per_edge = microbatches * steps
    planned = []
    for stage in stages:
        grads_out = [e for e in stage.recvs if e.requires_grad]
        grads_in = [e for e in stage.sends if e.requires_grad]
        sent = [*map(_wire_bytes, stage.sends), *map(_grad_bytes, grads_out)]
        received = [*map(_wire_bytes, stage.recvs), *map(_grad_bytes, grads_in)]
        planned.append({
            "sends": len(sent) * per_edge,
            "recvs": len(received) * per_edge,
            "bytes_sent": sum(sent) * per_edge,
            "bytes_received": sum(received) * per_edge,
        })  # fmt: skip
    return planned


def _wire_bytes(edge) -> int:
    """An edge's forward message: the tensor, or its codec's payload."""
    shape, dtype = edge.wire
    return math.prod(shape) * dtype.itemsize


def _grad_bytes(edge) -> int:
    shape, dtype = edge.grad_wire(edge.dtype)
    return math.prod(shape) * dtype.itemsize


def run_in_process(stages, inputs: dict, backward: bool = False):
    """All stages in one process through LocalTransport: forwards 0..K-1, then backwards K-1..0.

    With ``backward``, the last stage's first output is summed and differentiated."""
    transport = LocalTransport()
    with use_transport(transport):
        results = [stage.module(*(inputs[name] for name in stage.inputs)) for stage in stages]
        if backward:
            results[-1][0].sum().backward()
            for result in reversed(results[:-1]):
                torch.autograd.backward(list(result), [torch.ones(()) for _ in result])
    return results[-1]


def eager_reference(model, inputs: dict, targets, loss_fn, steps: int, microbatches: int, optimizer: dict):
    """Per step: mean loss over microbatches, grads after each backward, outputs of the last step."""
    model = copy.deepcopy(model)
    options = dict(optimizer)
    kind = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[options.pop("name")]
    opt = kind(model.parameters(), **options)
    chunks = [dict(zip(inputs, parts)) for parts in zip(*(v.chunk(microbatches) for v in inputs.values()))]
    target_chunks = targets.chunk(microbatches) if targets is not None else [None] * microbatches
    losses, grads, outputs = [], [], []
    for _ in range(steps):
        opt.zero_grad()
        step_losses, outputs = [], []
        for chunk, target in zip(chunks, target_chunks):
            out = model(**chunk)
            if loss_fn is None:
                loss, out = out.loss, out.logits
            else:
                loss = loss_fn(out, target)
            (loss / microbatches).backward()
            step_losses.append(loss.detach())
            outputs.append(out.detach())
        losses.append(float(torch.stack(step_losses).mean()))
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
    return losses, grads, torch.cat(outputs)


def mse(output, target):
    return F.mse_loss(output, target)


def mlp_batches(steps: int = 3) -> list[dict]:
    """``--data runtime_models:mlp_batches``: a new global batch of ResidualMLP inputs and targets per step."""
    generator = torch.Generator().manual_seed(7)
    return [{"x": torch.randn(4, 8, generator=generator), "targets": torch.randn(4, 8, generator=generator)}
            for _ in range(steps)]  # fmt: skip
