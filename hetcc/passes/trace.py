"""Front end: capture a model as an fx.GraphModule.

torch.export (non-strict) first; ``torch.fx.symbolic_trace`` plus fake shape propagation for modules that
export rejects. Either way the result is an *unlifted* GraphModule: parameters and buffers are
``get_attr`` nodes, every tensor node carries ``meta["val"]`` (a FakeTensor) and, from export,
``meta["nn_module_stack"]``. Meta-device models and FakeTensor inputs trace without real memory.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import hetcc as hetcc_package
from hetcc import config
from hetcc.errors import TraceError

log = logging.getLogger(__name__)

_FIXES = (
    "Hugging Face models: build with attn_implementation='eager' or 'sdpa'; a DynamicCache output "
    "cannot be traced (hetcc passes use_cache=False where forward() takes it; else pass it yourself)",
    "data-dependent Python control flow (if tensor.sum() > 0): use torch.cond or make it static",
    "inputs the model does not accept: check example_inputs / example_kwargs against forward()",
)


@dataclass
class Traced:
    """A captured model: the graph plus how it was captured and the symbols of its dynamic dims."""

    gm: torch.fx.GraphModule
    frontend: str  # "export" | "symbolic_trace"
    dim_symbols: dict[str, Any] = field(default_factory=dict)  # Dim name -> sympy symbol
    exported: torch.export.ExportedProgram | None = None


def trace(
    model: torch.nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
) -> Traced:
    """Capture ``model`` called as ``model(*example_inputs, **example_kwargs)`` (a Hugging Face model
    with ``use_cache=False`` added unless given: ``_without_cache``)."""
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"hetcc.trace expects a torch.nn.Module, got {type(model).__name__}")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs, dynamic_shapes = _without_cache(model, args, dict(example_kwargs or {}), dynamic_shapes)
    try:
        with warnings.catch_warnings(), _quiet_export():  # RNNs cache weights in a list export warns about
            warnings.filterwarnings("ignore", message=r"The tensor attributes .*_flat_weights")
            exported = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as export_error:  # noqa: BLE001 - reported with the fallback's error below
        log.info("torch.export failed (%s); trying torch.fx.symbolic_trace", export_error)
        return _symbolic_trace_or_raise(model, args, kwargs, dynamic_shapes, export_error)
    gm = exported.module()
    _drop_guard_calls(gm)
    return Traced(gm, "export", _dim_symbols(gm, args, kwargs, dynamic_shapes, model), exported)


def _without_cache(
    model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], dynamic_shapes: Any
) -> tuple[dict[str, Any], Any]:
    """The call's kwargs and dynamic shapes with ``use_cache=False`` added (and ``use_cache: None`` in a
    dict of dynamic shapes, which export wants for every argument given) where ``_returns_cache``: a
    positional ``dynamic_shapes`` leaves the call as given."""
    if not _returns_cache(model, args, kwargs) or isinstance(dynamic_shapes, (tuple, list)):
        return kwargs, dynamic_shapes
    shapes = {**dynamic_shapes, "use_cache": None} if isinstance(dynamic_shapes, dict) else dynamic_shapes
    return {**kwargs, "use_cache": False}, shapes


def _returns_cache(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether the call returns a KV cache (a DynamicCache, which export cannot capture) that training
    never reads: a transformers ``PreTrainedModel`` whose forward takes ``use_cache`` and a call that
    does not set it. transformers is not imported for this (such a model has imported it already)."""
    if not _is_transformers_model(model):
        return False
    try:
        signature = inspect.signature(model.forward)
        return (
            "use_cache" in signature.parameters
            and "use_cache" not in signature.bind_partial(*args, **kwargs).arguments
        )
    except (TypeError, ValueError):  # a call forward does not take: export says so in its words
        return False


def _is_transformers_model(model: torch.nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (without importing transformers: such a model has already)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


@contextlib.contextmanager
def without_stack_traces() -> Iterator[None]:
    """Traces made inside record no ``meta["stack_trace"]`` (the model's source line of each node): a
    fifth of an 80-layer export's time, and of no use to a graph that is only priced, never shown or
    run. The graphs hetcc compiles keep them: torch names that line when an op fails on a node."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Hold back what torch prints while export fails (a symbolic_shapes warning, the partial graph
    twice: ~20 lines before hetcc's own error). It is passed on when export succeeds, and shown with the
    error under HETCC_DEBUG=1."""
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level, held = shapes_log.level, io.StringIO()
    shapes_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException:
        if config.debug >= 1:
            sys.stderr.write(held.getvalue())
        raise
    else:
        sys.stderr.write(held.getvalue())
    finally:
        shapes_log.setLevel(level)


def _drop_guard_calls(gm: torch.fx.GraphModule) -> None:
    """Remove export's input-guard call (``_guards_fn``, hetcc re-runs graphs on fake and split inputs)
    and unused parameter reads (export leaves one per tied alias)."""
    for node in list(gm.graph.nodes):
        guard = node.op == "call_module" and node.target == "_guards_fn"
        if (guard or node.op == "get_attr") and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def drop_dtype_asserts(gm: torch.fx.GraphModule) -> None:
    """Remove export's ``aten._assert_tensor_metadata`` checks (its record of the traced dtypes): under
    mixed precision a matmul's output is half precision, which the recorded fp32 would reject."""
    check = torch.ops.aten._assert_tensor_metadata.default
    for node in list(gm.graph.find_nodes(op="call_function", target=check)):
        if not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def _symbolic_trace_or_raise(model, args, kwargs, dynamic_shapes, export_error) -> Traced:
    """The fallback for plain torch modules; it is not tried where it cannot apply (dynamic shapes, a
    whole transformers model, whose forward symbolic tracing cannot follow), so its error would only
    be a second, unrelated cause."""
    if dynamic_shapes is not None:
        raise _trace_error(model, export_error, None, "dynamic_shapes need torch.export")
    if _is_transformers_model(model):
        raise _trace_error(model, export_error, None)
    try:
        gm = torch.fx.symbolic_trace(model)
        _propagate_fake(gm, model, args, kwargs)
    except Exception as fx_error:  # noqa: BLE001
        raise _trace_error(model, export_error, fx_error) from fx_error
    return Traced(gm, "symbolic_trace")


def _propagate_fake(gm: torch.fx.GraphModule, model, args, kwargs) -> None:
    """Fill ``meta["val"]`` by running the graph on FakeTensors (no real memory is touched)."""
    flat_inputs = _bind_placeholders(gm, model, args, kwargs)
    mode = detect_fake_mode(flat_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = [
        mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in flat_inputs
    ]
    FakeTensorProp(gm, mode).propagate(*fake_inputs)


def _bind_placeholders(gm, model, args, kwargs) -> list:
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    return [bound.arguments.get(name) for name in names]


def _dim_symbols(gm, args, kwargs, dynamic_shapes, model) -> dict[str, Any]:
    """Map each ``torch.export.Dim`` name to the sympy symbol export gave it."""
    if dynamic_shapes is None:
        return {}
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    specs = dynamic_shapes if isinstance(dynamic_shapes, dict) else dict(zip(bound, dynamic_shapes))
    placeholders = {n.target: n for n in gm.graph.nodes if n.op == "placeholder"}
    symbols: dict[str, Any] = {}
    for input_name, dims in specs.items():
        node = placeholders.get(input_name)
        if node is None or not dims:
            continue
        shape = node.meta["val"].shape
        for axis, dim in dims.items() if isinstance(dims, dict) else enumerate(dims):
            size = shape[axis]
            if dim is not None and isinstance(size, torch.SymInt):
                symbols[getattr(dim, "__name__", str(dim))] = size.node.expr
    return symbols


def _trace_error(model, export_error, fx_error, extra: str | None = None) -> TraceError:
    name = type(model).__name__
    lines = [f"hetcc could not capture {name} as a graph."]
    lines.append(f"  torch.export: {_first_line(export_error)}{_user_frame(export_error)}")
    if _is_data_dependent(export_error):
        lines.append(f"  {_data_dependent_advice(model, _user_frame(export_error))}")
    if fx_error is not None:
        lines.append(
            f"  torch.fx.symbolic_trace: {_first_line(fx_error)}{_user_frame(fx_error, export_error)}"
        )
    if extra:
        lines.append(f"  {extra}")
    lines.append("  usual fixes:")
    lines.extend(f"    - {fix}" for fix in _FIXES)
    return TraceError("\n".join(lines), hint="fix the first cause above, or pass a submodule that traces")


def _is_data_dependent(error: BaseException) -> bool:
    text = f"{type(error).__name__} {error}"
    return "DataDependent" in text or "data-dependent" in text


def _data_dependent_advice(model, where: str) -> str:
    """What to do when a loop or branch depends on tensor values (the line is named above)."""
    experts = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if experts not in (None, "grouped_mm") or "expert" in where:
        return (
            "the mixture-of-experts layer loops over the experts the router picked, a number known only at "
            'run time: build the model with experts_implementation="grouped_mm" (one grouped matmul over '
            "all experts, which torch.export captures)"
        )
    return (
        "the model loops or branches on tensor values at the line above: make the loop bound static "
        "(a fixed count, a mask instead of a filtered list) or use torch.cond"
    )


def _first_line(error: BaseException, limit: int = 300) -> str:
    """The error's first line; a long one is cut after its last whole sentence (or word) that fits."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    if len(text) <= limit:
        return text
    cut = text[:limit]
    end = cut.rfind(". ")
    return cut[: end + 1] if end > limit // 3 else cut[: cut.rfind(" ")] + " ..."


def _user_frame(error: BaseException, reported: BaseException | None = None) -> str:
    """The innermost traceback frame outside torch, hetcc and the standard library: the model's line
    (in the user's code, or in the package that defines the model, e.g. transformers' modeling file).
    Chained causes are searched too (export re-raises some errors from inside its own handlers), up to
    ``reported``, an error whose line is already shown."""
    skipped = tuple(str(Path(m.__file__).resolve().parent) for m in (torch, hetcc_package))
    skipped += (str(Path(sysconfig.get_paths()["stdlib"]).resolve()),)
    seen: set[int] = {id(reported)}
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for frame in reversed(traceback.extract_tb(error.__traceback__)):
            path = str(Path(frame.filename).resolve()) if not frame.filename.startswith("<") else ""
            if path and not path.startswith(skipped):
                return f" (at {frame.filename}:{frame.lineno}: {frame.line})"
        error = error.__cause__ or error.__context__
    return ""
