"""Convergence with codecs on the wire: the byte-level GPT-2 of the README's "Train on your data" (4 layers,
hidden 64) trained on the Python standard library's ``email`` package, on local CPU ranks, once per
codec pair pinned on every cut and once uncompressed, with the same data order, seed and schedule.

    python benchmarks/compress_convergence.py [--steps 300] [--codecs int8/bf16,fp8/bf16,int4/bf16,lowrank/bf16]

Prints per run: the mean loss of the last 20 steps, the evaluation loss (the token folder's val split),
their ratios to the uncompressed run's, and the bytes every rank sent per step (measured, after encoding)
next to the plan's prediction (``wire_bytes_per_step``).
"""

from __future__ import annotations

import argparse
import email
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hetcc  # noqa: E402
from examples.models import gpt2_bytes  # noqa: E402
from hetcc.solver.codecs import wire_bytes_per_step  # noqa: E402
from hetcc.train import TokenDataset  # noqa: E402
from hetcc.train.text import prepare_text  # noqa: E402

# cpu4 with 4 MiB per device: the model's state and activations need four stages (three cuts), recomputing
CLUSTER = "examples/clusters/cpu4.yaml"
MEMORY = "4 MiB"
TAIL = 20  # steps whose mean loss is compared
EVAL_BATCHES = 8


def run(codecs: tuple[str, str], tokens: Path, steps: int, seq: int, cluster: Path) -> dict:
    model, inputs = gpt2_bytes(seq=seq)
    pins = {"intra-node": codecs, "inter-node": codecs} if codecs != ("none", "none") else "off"
    compiled = hetcc.compile(
        model, cluster, example_kwargs=inputs, microbatches=4, compress=pins, replicate=False, schedule="1f1b"
    )
    started = time.perf_counter()
    result = hetcc.run_local(
        compiled, data=TokenDataset(tokens, seq_len=seq), steps=steps, seed=0,
        optimizer={"name": "adamw", "lr": 3e-3, "weight_decay": 0.1},
        lr_schedule={"warmup_steps": 30, "decay": "cosine"}, clip_grad_norm=1.0,
        eval_data=TokenDataset(tokens, seq_len=seq, split="val"), eval_every=steps, eval_batches=EVAL_BATCHES,
    )  # fmt: skip
    forward, back = wire_bytes_per_step(compiled.problem, compiled.solution)
    return {
        "codecs": "/".join(codecs),
        "stages": len(compiled.plan.stages),
        "tail_loss": statistics.fmean(result.losses[-TAIL:]),
        "eval_loss": result.eval_losses[-1][1] if result.eval_losses else float("nan"),
        # every rank's bytes after encoding, less the evaluation's forwards (one per eval batch)
        "sent_per_step": (sum(s["bytes_sent"] for s in result.stats) - EVAL_BATCHES * forward) / steps,
        "predicted_per_step": forward + back,
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--codecs", default="int8/bf16,fp8/bf16,int4/bf16,lowrank/bf16")
    args = parser.parse_args()
    pairs = [("none", "none")] + [tuple(p.split("/")) for p in args.codecs.split(",") if p]
    with tempfile.TemporaryDirectory() as folder:
        tokens, cluster = Path(folder) / "tokens", Path(folder) / "cluster.yaml"
        prepare_text(os.path.dirname(email.__file__), tokens, pattern="**/*.py")
        cluster.write_text(Path(CLUSTER).read_text().replace("memory: 2 GiB", f"memory: {MEMORY}"))
        rows = [run(pair, tokens, args.steps, args.seq, cluster) for pair in pairs]
    base = rows[0]
    print(f"byte-level GPT-2, {args.steps} steps on {CLUSTER} at {MEMORY} per device ({base['stages']} stages), "
          f"seq {args.seq}, same data order per run")  # fmt: skip
    print(f"{'codecs':<14} {'stages':>6} {'loss (last 20)':>14} {'vs none':>8} {'eval loss':>9} {'vs none':>8} "
          f"{'sent MB/step':>12} {'predicted':>9} {'wall s':>7}")  # fmt: skip
    for row in rows:
        print(
            f"{row['codecs']:<14} {row['stages']:>6} {row['tail_loss']:>14.4f} "
            f"{row['tail_loss'] / base['tail_loss']:>8.4f} {row['eval_loss']:>9.4f} "
            f"{row['eval_loss'] / base['eval_loss']:>8.4f} {row['sent_per_step'] / 1e6:>12.3f} "
            f"{row['predicted_per_step'] / 1e6:>9.3f} {row['wall_s']:>7.1f}"
        )


if __name__ == "__main__":
    main()
