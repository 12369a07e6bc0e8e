"""The checks a ``PartitionProblem`` passes before the solver trusts it (``PartitionProblem.validate``,
and ``from_json`` on every file read): types, lengths and ranges, field by field.
"""

from __future__ import annotations

import math
from collections import Counter

from hetcc.errors import PlanFormatError
from hetcc.solver.schedules import SCHEDULES, ZBV


def _check_tied(problem, n: int) -> None:
    if problem.tied_blocks is None and problem.tied_bytes is None:
        return
    if not isinstance(problem.tied_blocks, list) or not isinstance(problem.tied_bytes, list):
        raise _fail("tied_blocks", "tied_blocks and tied_bytes must both be lists", "give both, or neither")
    _check_vector("tied_bytes", problem.tied_bytes, len(problem.tied_blocks))
    for users in problem.tied_blocks:
        if not isinstance(users, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < n for b in users
        ):
            raise _fail(
                "tied_blocks", f"{users!r} is not a list of block indices in 0..{n - 1}", "fix the list"
            )
    if problem.tied_grad_bytes is not None:
        if not isinstance(problem.tied_grad_bytes, list) or len(problem.tied_grad_bytes) != len(
            problem.tied_blocks
        ):
            raise _fail(
                "tied_grad_bytes", "needs one list per tied weight", "give one per tied_blocks entry, or none"
            )
        for k, (users, grads) in enumerate(zip(problem.tied_blocks, problem.tied_grad_bytes)):
            _check_vector(f"tied_grad_bytes[{k}]", grads, len(users))


def _check_cut_tensors(problem, n: int) -> None:
    if problem.cut_tensors is None:
        return
    if not isinstance(problem.cut_tensors, list):
        raise _fail(
            "cut_tensors", "must be a list", "[producer, [consumers], bytes, gradient bytes] per tensor"
        )
    for entry in problem.cut_tensors:
        ok = isinstance(entry, list) and len(entry) == 4
        if ok:
            producer, consumers, nbytes, grad = entry
            ok = (
                _index(producer, n)
                and isinstance(consumers, list)
                and bool(consumers)
                and all(_index(c, n) and c > producer for c in consumers)
                and all(isinstance(v, (int, float)) and 0 <= v < math.inf for v in (nbytes, grad))
            )
        if not ok:
            raise _fail(
                "cut_tensors",
                f"{entry!r} is not [producer block, [later consumer blocks], bytes, gradient bytes]",
                "fix the entry",
            )


CODEC_LINKS = ("all", "intra-node", "inter-node")
_CODEC_FIELDS = ("name", "gradient", "cut_bytes", "coded_bytes", "calls", "encode_s_per_byte",
                 "decode_s_per_byte", "call_s", "tensor_bytes", "tensor_coded", "links", "cuts")  # fmt: skip


def _check_codecs(problem, n: int) -> None:
    """``codecs``: ``WireCodec`` rows, one per name, direction and place (links, cuts), each costed per cut (and per cut
    tensor when ``cut_tensors`` is given) and on every device type of the cluster."""
    if problem.codecs is None:
        return
    if not isinstance(problem.codecs, list):
        raise _fail("codecs", "must be a list of WireCodec rows", "one row per codec and direction, or null")
    seen = set()
    for k, row in enumerate(problem.codecs):
        if not all(hasattr(row, name) for name in _CODEC_FIELDS):
            raise _fail("codecs", f"entry {k} is not a WireCodec: {row!r}", "build rows with WireCodec(...)")
        at = f"codecs[{k}]"
        if not isinstance(row.name, str) or not row.name or not isinstance(row.gradient, bool):
            raise _fail(at, "name must be a non-empty string and gradient a boolean", "see WireCodec")
        if row.links not in CODEC_LINKS:
            raise _fail(f"{at}.links", f"unknown value {row.links!r}", f"use one of {', '.join(CODEC_LINKS)}")
        _check_vector(f"{at}.cut_bytes", row.cut_bytes, n - 1)
        _check_vector(f"{at}.coded_bytes", row.coded_bytes, n - 1)
        _check_vector(f"{at}.calls", row.calls, n - 1)
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in row.calls):
            raise _fail(f"{at}.calls", "must count tensors (integers)", "one count per cut")
        _check_flags(f"{at}.cuts", row.cuts, n - 1, "one flag per cut, or null for every cut")
        where = (row.name, row.gradient, row.links, None if row.cuts is None else tuple(row.cuts))
        if where in seen:  # one codec may have several rows: one per set of cuts and links it may use
            direction = "gradient" if row.gradient else "activation"
            raise _fail(
                at, f"{direction} codec {row.name!r} is listed twice for the same links and cuts",
                "one row per name, direction and place",
            )  # fmt: skip
        seen.add(where)
        _check_codec_tensors(problem, row, at)
        for table in ("encode_s_per_byte", "decode_s_per_byte", "call_s"):
            _check_codec_table(problem, f"{at}.{table}", getattr(row, table))


def _check_codec_tensors(problem, row, at: str) -> None:
    if row.tensor_bytes is None and row.tensor_coded is None and problem.cut_tensors is None:
        return
    if problem.cut_tensors is None:
        raise _fail(f"{at}.tensor_bytes", "is given without cut_tensors", "give cut_tensors, or drop them")
    if row.tensor_bytes is None or row.tensor_coded is None:
        raise _fail(f"{at}.tensor_bytes", "tensor_bytes and tensor_coded are needed with cut_tensors",
                    "one entry per cut_tensors entry in each")  # fmt: skip
    count = len(problem.cut_tensors)
    _check_vector(f"{at}.tensor_bytes", row.tensor_bytes, count)
    _check_flags(f"{at}.tensor_coded", row.tensor_coded, count, "one flag per cut_tensors entry")


def _check_flags(field: str, flags, length: int, hint: str) -> None:
    if flags is None:
        return
    if not isinstance(flags, list) or len(flags) != length or not all(isinstance(f, bool) for f in flags):
        raise _fail(field, f"must be {length} booleans, got {flags!r}", hint)


def _check_codec_table(problem, field: str, table) -> None:
    """Seconds per device type: every type of the cluster, and no type the problem does not cost."""
    if not isinstance(table, dict):
        raise _fail(field, "must map device type -> seconds", "see WireCodec")
    unknown = sorted(set(table) - set(problem.fwd_s))
    if unknown:
        raise _fail(
            field, f"names unknown device type {unknown[0]!r}", f"use types of fwd_s: {sorted(problem.fwd_s)}"
        )
    for device in problem.devices:
        if device.type not in table:
            raise _fail(field, f"has no entry for device type {device.type!r} ({device.name})",
                        "cost the codec on every device type in the cluster")  # fmt: skip
    for kind, value in table.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise _fail(field, f"entry {kind!r} is {value!r}", "use finite, non-negative seconds")


def _index(value, n: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n


def _fail(field: str, reason: str, hint: str) -> PlanFormatError:
    return PlanFormatError(f"partition problem field {field!r}: {reason}", hint=hint)


def validate_problem(problem) -> None:
    """Raise PlanFormatError naming the first field of ``problem`` (a ``PartitionProblem``) whose type,
    length or values are inconsistent."""
    n, d = len(problem.blocks), len(problem.devices)
    if n == 0 or d == 0:
        raise _fail("blocks" if n == 0 else "devices", "is empty", "a problem needs blocks and devices")
    for name in ("blocks", "state_bytes", "act_bytes", "cut_bytes", "devices", "bandwidth_bps", "latency_s"):
        if not isinstance(getattr(problem, name), list):
            raise _fail(name, f"must be a list, got {type(getattr(problem, name)).__name__}", "see to_json")
    for name in ("fwd_s", "bwd_s"):
        if not isinstance(getattr(problem, name), dict):
            raise _fail(name, "must map device type -> seconds per block", "see to_json")
    for name in ("precision", "optimizer", "batch_dim"):
        if not isinstance(getattr(problem, name), str):
            raise _fail(name, f"must be a string, got {getattr(problem, name)!r}", "see to_json")
    if (
        isinstance(problem.batch_size, bool)
        or not isinstance(problem.batch_size, int)
        or problem.batch_size < 0
    ):
        raise _fail(
            "batch_size", f"must be a non-negative integer, got {problem.batch_size!r}", "see to_json"
        )
    if not all(isinstance(b, str) for b in problem.blocks):
        raise _fail("blocks", "must be block names", "see to_json")
    for device in problem.devices:
        if not (
            isinstance(device.name, str) and isinstance(device.type, str) and isinstance(device.node, str)
        ):
            raise _fail("devices", f"{device!r}: name, type and node must be strings", "see to_json")
        if isinstance(device.memory_bytes, bool) or not isinstance(device.memory_bytes, (int, float)):
            raise _fail(
                "devices", f"{device.name}: memory_bytes must be a number", "give usable memory in bytes"
            )
    if problem.schedule not in (*SCHEDULES, ZBV):  # ZB-V: priced by ``simulate(..., chunks=2)``, not searched
        raise _fail(
            "schedule", f"unknown schedule {problem.schedule!r}", f"use one of {', '.join(SCHEDULES)}"
        )
    m = problem.microbatches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise _fail("microbatches", f"must be a positive integer, got {m!r}", "pass microbatches >= 1")
    cap = problem.max_stages
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise _fail("max_stages", f"must be a non-negative integer, got {cap!r}", "0: no cap")
    _check_vector("state_bytes", problem.state_bytes, n)
    _check_vector("act_bytes", problem.act_bytes, n)
    _check_vector("cut_bytes", problem.cut_bytes, n - 1)
    if problem.param_bytes is not None:
        _check_vector("param_bytes", problem.param_bytes, n)
    if problem.cut_grad_bytes is not None:
        _check_vector("cut_grad_bytes", problem.cut_grad_bytes, n - 1)
    _check_tied(problem, n)
    _check_cut_tensors(problem, n)
    _check_type_bytes(problem, n)
    _check_optimizer(problem, n)
    for flag in ("training", "replicate", "recompute", "recompute_all", "shard", "shard_all"):
        if not isinstance(getattr(problem, flag), bool):
            raise _fail(flag, f"must be true or false, got {getattr(problem, flag)!r}", "use a JSON boolean")
    for device in problem.devices:
        for table in ("fwd_s", "bwd_s"):
            if device.type not in getattr(problem, table):
                raise _fail(
                    table,
                    f"has no entry for device type {device.type!r} ({device.name})",
                    "cost every block on every device type in the cluster",
                )
            _check_vector(f"{table}[{device.type!r}]", getattr(problem, table)[device.type], n)
        if not device.memory_bytes >= 0:
            raise _fail(
                "devices",
                f"{device.name}: memory_bytes {device.memory_bytes!r} is negative",
                "give usable memory in bytes",
            )
    _check_weight_grads(problem, n)
    if len({dev.name for dev in problem.devices}) != d:
        raise _fail("devices", "device names repeat", "name every device uniquely")
    _check_matrix("bandwidth_bps", problem.bandwidth_bps, d, positive=True)
    _check_matrix("latency_s", problem.latency_s, d, positive=False)
    _check_codecs(problem, n)
    _check_tensor_splits(problem, n)


# The per-block arrays ``type_bytes`` may override per device type.
TYPE_BYTE_FIELDS = ("state_bytes", "act_bytes", "param_bytes", "optimizer_bytes")


def _check_type_bytes(problem, n: int) -> None:
    """``type_bytes``: per device type of ``fwd_s``, some of ``TYPE_BYTE_FIELDS``, one number per block."""
    if problem.type_bytes is None:
        return
    if not isinstance(problem.type_bytes, dict):
        raise _fail("type_bytes", "must map device type -> {field: bytes per block}", "or null")
    for kind, arrays in problem.type_bytes.items():
        if kind not in problem.fwd_s:
            raise _fail(
                "type_bytes",
                f"names unknown device type {kind!r}",
                f"use types of fwd_s: {sorted(problem.fwd_s)}",
            )
        if not isinstance(arrays, dict) or not set(arrays) <= set(TYPE_BYTE_FIELDS):
            raise _fail(f"type_bytes[{kind!r}]", f"must map some of {', '.join(TYPE_BYTE_FIELDS)} to lists",
                        "one number per block in each")  # fmt: skip
        for name, values in arrays.items():
            _check_vector(f"type_bytes[{kind!r}][{name!r}]", values, n)


def _check_optimizer(problem, n: int) -> None:
    """``optimizer_bytes``: per block, the part of its ``state_bytes`` that is optimizer state, on every
    device type (``type_bytes`` may override either)."""
    if problem.optimizer_bytes is not None:
        _check_vector("optimizer_bytes", problem.optimizer_bytes, n)
    _check_part("optimizer_bytes", problem.optimizer_bytes or (), problem.state_bytes)
    for kind in problem.type_bytes or {}:
        _check_part(
            f"type_bytes[{kind!r}] optimizer_bytes", problem.optimizer_for(kind), problem.state_for(kind)
        )


def _check_part(field: str, optimizer, state) -> None:
    for i, (o, s) in enumerate(zip(optimizer, state)):
        if o > s:
            raise _fail(field, f"entry {i} ({o!r}) exceeds the block's state_bytes ({s!r})",
                        "optimizer state is a part of the state")  # fmt: skip


def _check_tensor_splits(problem, n: int) -> None:
    """``tensor_splits``: ``TensorSplit`` rows, one per degree >= 2, each costed per block on every device
    type with ``degree`` devices of one class (type and memory) on one node."""
    if problem.tensor_splits is None:
        return
    if not isinstance(problem.tensor_splits, list):
        raise _fail("tensor_splits", "must be a list of TensorSplit rows", "one row per degree, or null")
    degrees = set()
    for k, row in enumerate(problem.tensor_splits):
        at = f"tensor_splits[{k}]"
        if not all(hasattr(row, name) for name in ("degree", "fwd_s", "bwd_s", "wgrad_s", *TYPE_BYTE_FIELDS)):
            raise _fail(at, f"is not a TensorSplit: {row!r}", "build rows with TensorSplit(...)")
        if isinstance(row.degree, bool) or not isinstance(row.degree, int) or row.degree < 2:
            raise _fail(
                f"{at}.degree", f"must be an integer >= 2, got {row.degree!r}", "degree 1 is no split"
            )
        if row.degree in degrees:
            raise _fail(f"{at}.degree", f"degree {row.degree} has two rows", "one row per degree")
        degrees.add(row.degree)
        for name in TYPE_BYTE_FIELDS:
            if name != "optimizer_bytes" or row.optimizer_bytes is not None:
                _check_vector(f"{at}.{name}", getattr(row, name), n)
        _check_part(f"{at}.optimizer_bytes", row.optimizer_bytes or (), row.state_bytes)
        _check_split_times(problem, row, at, n)


def _check_split_times(problem, row, at: str, n: int) -> None:
    """A ``TensorSplit`` row's seconds: per device type of the problem (every type with ``degree``
    identical devices on a node among them), one number per block, weight gradients within backwards."""
    for table in ("fwd_s", "bwd_s"):
        if not isinstance(getattr(row, table), dict):
            raise _fail(f"{at}.{table}", "must map device type -> seconds per block", "see TensorSplit")
    if not set(row.fwd_s) <= set(problem.fwd_s) or set(row.bwd_s) != set(row.fwd_s):
        raise _fail(f"{at}.fwd_s", f"must name the same device types as bwd_s, of {sorted(problem.fwd_s)}",
                    "one list per device type in each")  # fmt: skip
    per_node = Counter((d.node, d.type, d.memory_bytes) for d in problem.devices)
    for (node, kind, _), count in per_node.items():
        if count >= row.degree and kind not in row.fwd_s:
            hint = f"cost degree {row.degree} on every type with {row.degree} like devices on a node"
            raise _fail(
                f"{at}.fwd_s", f"has no entry for device type {kind!r} ({count} on node {node})", hint
            )
    if problem.wgrad_s is not None and row.wgrad_s is None:
        raise _fail(f"{at}.wgrad_s", "is needed where the problem's wgrad_s is given", "give those seconds")
    for kind in row.fwd_s:
        for table in ("fwd_s", "bwd_s"):
            _check_vector(f"{at}.{table}[{kind!r}]", getattr(row, table)[kind], n)
    _check_wgrad_table(f"{at}.wgrad_s", row.wgrad_s, row.bwd_s, n)


def _check_weight_grads(problem, n: int) -> None:
    _check_wgrad_table("wgrad_s", problem.wgrad_s, problem.bwd_s, n)


def _check_wgrad_table(field: str, wgrad, bwd: dict, n: int) -> None:
    """``field`` (the problem's ``wgrad_s`` or a ``TensorSplit`` row's): per device type of ``bwd``, one
    share of each block's backward (never more); None: no weight gradients given."""
    if wgrad is None:
        return
    if not isinstance(wgrad, dict) or set(wgrad) != set(bwd):
        raise _fail(field, "must name the device types bwd_s names", "one list per device type, or null")
    for kind, values in wgrad.items():
        _check_vector(f"{field}[{kind!r}]", values, n)
        _check_within(f"{field}[{kind!r}]", values, bwd[kind])


def _check_within(field: str, weights, backward) -> None:
    for i, (w, b) in enumerate(zip(weights, backward)):
        if w > b * (1 + 1e-9) + 1e-15:
            raise _fail(field, f"entry {i} ({w!r}) exceeds the block's backward ({b!r})",
                        "the weight gradient is a part of the backward")  # fmt: skip


def _check_vector(field: str, values, length: int) -> None:
    if not isinstance(values, list):
        raise _fail(field, f"must be a list, got {type(values).__name__}", "one number per block")
    if len(values) != length:
        raise _fail(
            field, f"has {len(values)} entries, expected {length}", "one entry per block (cuts: blocks - 1)"
        )
    for i, v in enumerate(values):
        if not (isinstance(v, (int, float)) and 0 <= v < math.inf):
            raise _fail(field, f"entry {i} is {v!r}", "use finite, non-negative numbers")


def _check_matrix(field: str, rows, size: int, *, positive: bool) -> None:
    if len(rows) != size or any(not isinstance(r, list) or len(r) != size for r in rows):
        raise _fail(
            field, f"must be {size}x{size} (one row and column per device)", "rebuild it from the cluster"
        )
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _fail(field, f"entry [{i}][{j}] is {v!r}", 'use numbers (or "inf" on the diagonal)')
            ok = (v > 0) if positive else (0 <= v < math.inf)
            if i != j and not ok:
                raise _fail(
                    field, f"entry [{i}][{j}] is {v!r}", "bandwidths must be > 0, latencies finite >= 0"
                )
