"""memory: parameter bytes and saved-activation bytes per node.

Saved activations are measured, not guessed: the graph runs once on FakeTensors with autograd on, and
``torch.autograd.graph.saved_tensors_hooks`` sees exactly which tensors each node's backward keeps.
A storage saved by several nodes (``x`` feeding q, k and v) is charged once, to the first; parameters
that backward saves are weights, already charged as ``param_bytes``, so they are not activations.

Attention is measured as a GPU trains it: ``scaled_dot_product_attention`` runs as torch's
memory-efficient kernel (flash keeps the same set, less the mask), which keeps q, k, v, the mask as an
additive bias, the output and the log-sum-exp, never the S x S probabilities. Left to dispatch, a
meta-device model (how large models are planned) or a CPU run with dropout takes the math path, which
keeps those probabilities: 8x the attention's activations at 1024 tokens and 8 heads, more beyond.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from hetcc.ir import annotate, to_number
from hetcc.passes.fake_run import FakeInterpreter, call_key, has_traced_values


class _SavedTensorMeter(FakeInterpreter):
    def __init__(self, gm: torch.fx.GraphModule, training: bool):
        super().__init__(gm, requires_grad=training)
        self._seen_storages: set[StorageWeakRef] = set()
        self._param_storages: set[StorageWeakRef] = set()

    def fetch_attr(self, target: str):
        value = super().fetch_attr(target)
        if isinstance(value, torch.Tensor):
            self._param_storages.add(StorageWeakRef(value.untyped_storage()))
        return value

    def run_node(self, node: torch.fx.Node):
        saved = []

        def pack(tensor: torch.Tensor):
            ref = StorageWeakRef(tensor.untyped_storage())
            if ref not in self._seen_storages and ref not in self._param_storages:
                self._seen_storages.add(ref)
                saved.append(to_number(tensor.untyped_storage().nbytes()))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            if node.op == "call_function" and node.target in _AS_TRAINED:
                args, kwargs = self.fetch_args_kwargs_from_env(node)
                result = _AS_TRAINED[node.target](*args, **kwargs)
            else:
                result = super().run_node(node)
        if node.op != "get_attr":  # the get_attr node's own record is set in memory() below
            annotate(node, act_bytes=sum(saved, 0))
        return result


def memory(gm: torch.fx.GraphModule, *, training: bool = True) -> torch.fx.GraphModule:
    """Annotate parameter bytes (on get_attr / call_module nodes) and saved-activation bytes."""
    if has_traced_values(gm):
        _CallMeter(gm, training).measure()
    else:
        _SavedTensorMeter(gm, training).run_fake()
    seen: set[int] = set()
    for node in gm.graph.nodes:
        annotate(node, param_bytes=_param_bytes(gm, node, seen))
    return gm


def _param_bytes(gm: torch.fx.GraphModule, node: torch.fx.Node, seen: set[int]) -> int:
    """Bytes of the parameters/buffers a node holds, each tensor counted once (tied weights too)."""
    if node.op == "get_attr":
        tensors = [operator.attrgetter(node.target)(gm)]
    elif node.op == "call_module":
        module = gm.get_submodule(node.target)
        tensors = [*module.parameters(), *module.buffers()]
    else:
        return 0
    total = 0
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


class _CallMeter:
    """What ``_SavedTensorMeter`` measures, each distinct call run once.

    A call is its op, its arguments' shapes, dtypes and whether they require grad, and its constants; a
    transformer's repeated layers are one layer's calls. A call is run on stand-ins of its arguments
    (their traced ``meta["val"]``) under autograd with ``saved_tensors_hooks``, and what it saves, and
    what its outputs are, is recorded by where it lives: in an argument's storage, the output's, or a
    new one. Every node then charges those storages, its own arguments' and outputs', each storage once
    in graph order, as running the graph would (an op that returns its input, a no-op ``dropout`` say,
    passes that input's storage on).
    """

    def __init__(self, gm: torch.fx.GraphModule, training: bool):
        self.gm, self.training = gm, training
        self.fake_mode = FakeInterpreter(gm).fake_mode
        self.grad: dict[torch.fx.Node, object] = {}  # node -> requires_grad of its value (nested like it)
        self.storage: dict[torch.fx.Node, object] = {}  # node -> (storage ref, bytes) per tensor (nested)
        self.seen: set[StorageWeakRef] = set()
        self.params: set[StorageWeakRef] = set()
        self.calls: dict[tuple, tuple[list[tuple], object, object]] = {}  # -> (saved, outputs, output grad)

    def measure(self) -> None:
        for node in self.gm.graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder":
                self.grad[node], self.storage[node] = _grad_of(value), _storages(value)
            elif node.op == "get_attr":
                real = operator.attrgetter(node.target)(self.gm)
                floating = isinstance(real, torch.Tensor) and real.is_floating_point()
                self.grad[node] = self.training and floating and real.requires_grad
                self.storage[node] = _storages(value)
                if isinstance(value, torch.Tensor):
                    self.params.add(self.storage[node][0])
            elif node.op == "call_function":
                annotate(node, act_bytes=self._charge(node, value))

    def _charge(self, node: torch.fx.Node, value) -> object:
        values = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
        grads = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: self.grad[a])
        stores = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: self.storage[a])
        key = (node.target, call_key(values, grads))
        if key not in self.calls:
            self.calls[key] = self._run(node, values, grads)
        saved, outputs, self.grad[node] = self.calls[key]
        own = _storages(value)
        self.storage[node] = _placed(own, outputs, stores)
        total = 0
        for place in saved:
            if place[0] == "new":
                total += place[1]
                continue
            ref, size = _at(stores, place[1]) if place[0] == "arg" else _at(self.storage[node], place[1])
            if ref not in self.seen and ref not in self.params:
                self.seen.add(ref)
                total += size
        return total

    def _run(self, node: torch.fx.Node, values, grads) -> tuple[list[tuple], list[tuple], object]:
        """Run one call on stand-ins of its arguments: where each tensor its backward keeps lives, and
        which outputs are (views of) an argument."""
        inputs = _stand_ins(values, grads)
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor):
            saved.append(tensor)
            return tensor

        with self.fake_mode, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = _AS_TRAINED.get(node.target, node.target)(*inputs[0], **inputs[1])
        known = {StorageWeakRef(t.untyped_storage()): ("out", path) for path, t in _tensors(result)}
        arguments = {StorageWeakRef(t.untyped_storage()): ("arg", path) for path, t in _tensors(inputs)}
        known.update(arguments)
        places, placed = [], set()
        for tensor in saved:
            ref = StorageWeakRef(tensor.untyped_storage())
            if ref not in placed:
                placed.add(ref)
                places.append(known.get(ref) or ("new", to_number(tensor.untyped_storage().nbytes())))
        outputs = [(path, arguments.get(StorageWeakRef(t.untyped_storage()))) for path, t in _tensors(result)]
        return places, outputs, _grad_of(result)


def _fused_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``scaled_dot_product_attention`` as torch's memory-efficient kernel runs it (a boolean mask
    becomes an additive bias in the query's dtype, as on CUDA and ROCm); what the kernel cannot take
    (grouped heads, not 4-D) runs as traced."""
    if enable_gqa or query.dim() != 4 or key.dim() != 4 or key.shape[1] != query.shape[1]:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(
            attn_mask.logical_not(), float("-inf")
        )
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
    )
    return out[0]


_AS_TRAINED = {torch.ops.aten.scaled_dot_product_attention.default: _fused_attention}


def _storages(value) -> object:
    """(storage ref, storage bytes) of each tensor in ``value``, nested as it is."""
    if isinstance(value, torch.Tensor):
        return StorageWeakRef(value.untyped_storage()), to_number(value.untyped_storage().nbytes())
    if isinstance(value, (list, tuple)):
        return [_storages(v) for v in value]
    return None


def _placed(own, outputs: list[tuple], stores) -> object:
    """The node's storages: its own, except outputs that are (views of) an argument, which live in it."""
    for path, argument in outputs:
        if argument is not None and path:
            _at(own, path[:-1])[path[-1]] = _at(stores, argument[1])
        elif argument is not None:
            own = _at(stores, argument[1])
    return own


def _stand_ins(values, grads):
    """A call's inputs standing for its traced arguments: a tensor that requires grad becomes a non-leaf
    copy (in-place ops stay legal), the others detached aliases of the traced value."""
    if isinstance(values, torch.Tensor):
        return values.detach().requires_grad_(True).clone() if grads is True else values.detach()
    if isinstance(values, (list, tuple)):
        return type(values)(_stand_ins(v, g) for v, g in zip(values, grads, strict=True))
    if isinstance(values, dict):
        return {k: _stand_ins(v, grads[k]) for k, v in values.items()}
    return values


def _grad_of(value) -> object:
    """Whether a value requires grad, nested as the value is."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return tuple(_grad_of(v) for v in value)
    return False


def _tensors(value, path: tuple = ()):
    """(path, tensor) for every tensor inside nested lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, (*path, i))
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _tensors(item, (*path, k))


def _at(value, path: tuple):
    for step in path:
        value = value[step]
    return value
