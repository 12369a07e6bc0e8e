"""Inputs hetcc must not trust: small saved folders to tamper with, JSON mutations, and a tally of what
the fuzz tests tried (tests/test_fuzz_inputs.py, tests/test_untrusted_inputs.py)."""

from __future__ import annotations

import collections
import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from runtime_models import MLP_RULES, ResidualMLP, SmallCNN, export, stages_by_module
from torch.fx.passes.shape_prop import ShapeProp

import hetcc
from hetcc.passes.comm import split_stages
from hetcc.runtime.store import save_stages

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"


class FusedMLP(torch.nn.Module):
    """Three linear layers with a pointwise chain between them, so compiling it saves a fusion group."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.c(torch.nn.functional.gelu(self.b(torch.relu(self.a(x))) * 2.0 + 1.0))


def save_folders(root: Path) -> dict[str, Path]:
    """Three valid saved folders: ``compiled`` (hetcc.compile: plan, problem, kernels, inputs),
    ``split`` (a residual MLP in three stages: edges and a skip) and ``layers`` (symbolic_trace: nn layers)."""
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    with hetcc.config.patch(fuse="all"):  # a CPU cluster never fuses by cost; the folder needs a kernel
        compiled = hetcc.compile(FusedMLP(), CLUSTERS / "cpu4.yaml", (x,), microbatches=2)
    compiled.save(root / "compiled", inputs={"x": x})
    gm = export(ResidualMLP(), (torch.randn(4, 8),))
    save_stages(split_stages(gm, stages_by_module(gm, MLP_RULES), 3), str(root / "split"))
    cnn = SmallCNN().eval()
    traced = torch.fx.symbolic_trace(cnn)
    ShapeProp(traced).propagate(torch.randn(2, 3, 8, 8))
    stages = split_stages(traced, {"conv": 0, "bn": 0, "relu": 0, "flatten": 1, "fc": 1}, 2)
    save_stages(stages, str(root / "layers"))
    return {name: root / name for name in ("compiled", "split", "layers")}


def copy_folder(source: Path, target: Path) -> Path:
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    return target


# ---- JSON values and mutations ---------------------------------------------------------------------
_SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from([0, -1, 10**400, 2**63])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
    | st.sampled_from(["", "../../etc/passwd", "/etc/passwd", "x\0y", "__class__", "float64", "cuda", "1e400",
                       "-5 GiB", "nan GB/s", "builtins.eval", "torch.save", "a.b.c", "stage0.graph.json"])
)  # fmt: skip
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _places(value: Any, path: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) to a value inside ``value``, the root first."""
    found = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _places(child, (*path, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            found += _places(child, (*path, i))
    return found


def mutate(data: st.DataObject, document: Any, rounds: int = 2) -> Any:
    """A copy of ``document`` with up to ``rounds`` changes drawn by ``data``: a value replaced by any JSON
    value, a key or item removed, an unknown key added, or a value wrapped in a list."""
    document = copy.deepcopy(document)
    for _ in range(data.draw(st.integers(1, rounds))):
        path = data.draw(st.sampled_from(_places(document)))
        action = data.draw(st.sampled_from(["replace", "replace", "delete", "add", "wrap"]))
        if not path:
            if action in ("replace", "wrap"):
                document = data.draw(JSON_VALUES) if action == "replace" else [document]
            continue
        parent = document
        for step in path[:-1]:
            parent = parent[step]
        key = path[-1]
        if action == "replace":
            parent[key] = data.draw(JSON_VALUES)
        elif action == "delete":
            del parent[key]
        elif action == "wrap":
            parent[key] = [parent[key]]
        elif isinstance(parent[key], dict):
            parent[key][data.draw(st.text(max_size=8))] = data.draw(JSON_VALUES)
    return document


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def write_json(path: Path, document: Any) -> None:
    path.write_text(json.dumps(document))  # NaN and Infinity too: Python's reader accepts them


# ---- the tally ---------------------------------------------------------------------------------------
TRIED: collections.Counter[str] = collections.Counter()
ESCAPED: dict[str, list[str]] = collections.defaultdict(list)


def outcome(kind: str, run, accept=(hetcc.HetccError,)) -> BaseException | None:
    """Run ``run()``; count it under ``kind``; return the exception if it is not one of ``accept``."""
    TRIED[kind] += 1
    try:
        run()
    except accept:
        return None
    except Exception as error:  # noqa: BLE001 - what escaped is the finding
        ESCAPED[kind].append(f"{type(error).__name__}: {str(error)[:150]}")
        return error
    return None


def summary() -> str:
    lines = [f"{kind}: {TRIED[kind]} tried, {len(ESCAPED[kind])} escaped" for kind in sorted(TRIED)]
    for kind, errors in sorted(ESCAPED.items()):
        lines += [f"  {kind}: {e}" for e in errors[:5]]
    total = sum(TRIED.values()), sum(len(e) for e in ESCAPED.values())
    return "\n".join([*lines, f"total: {total[0]} tried, {total[1]} escaped"])
