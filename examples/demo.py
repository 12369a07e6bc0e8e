"""hetcc in one minute: analyse GPT-2, plan it over a mixed NVIDIA/AMD cluster, compare with baselines.

Run from the repository root: ``make demo`` (or ``.venv/bin/python examples/demo.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hetcc  # noqa: E402
from examples.models import gpt2_medium  # noqa: E402

CLUSTERS = Path(__file__).resolve().parent / "clusters"


def main() -> None:
    cluster = hetcc.Cluster.from_file(CLUSTERS / "mixed_nvidia_amd.yaml")
    print("== cluster ==")
    print(cluster.describe())

    model, inputs = gpt2_medium(batch=64, seq=512)
    print("\n== GPT-2 medium (355 M params, on the meta device), 16 microbatches of 4 x 512 tokens ==")
    compiled = hetcc.compile(model, cluster, example_kwargs=inputs, microbatches=16, dump_dir="build/demo/ir")
    print(compiled.analysis.summary().split("\ncuts")[0])
    print("\n== plan ==")
    print(compiled.explain())
    print("\nIR after every pass: build/demo/ir/ (00_traced.py ... 09_codegen.txt, plan.json, stage<k>.py)")


if __name__ == "__main__":
    main()
