"""The training options of ``hetcc run``, ``hetcc launch`` and ``python -m hetcc.launch``: defined once,
read into ``TrainSettings`` once. Imports no torch, so ``--help`` starts at once."""

from __future__ import annotations

import argparse
import os

from hetcc.runtime.contract import PipelineMeta

DECAYS = ("constant", "linear", "cosine")


def add_train_options(parser: argparse.ArgumentParser) -> None:
    """Data, optimizer, schedule, clipping, evaluation, checkpoints and metrics."""
    group = parser.add_argument_group("training")
    group.add_argument("--data", metavar="SPEC", help="what to train on: a token folder from `hetcc prepare-text`, "
                       "or pkg.module:factory / file.py:factory returning a Dataset, a DataLoader or an iterable "
                       "of global batches (default: the build's example batch at every step)")  # fmt: skip
    group.add_argument("--labels", choices=("inputs", "next"), default="inputs",
                       help="a token folder's labels: 'inputs' for models that shift them (transformers' "
                       "*ForCausalLM; default), 'next' for the next tokens")  # fmt: skip
    group.add_argument("--eval-data", metavar="SPEC", help="evaluated every --eval-every steps (default: a "
                       "token folder's val split)")  # fmt: skip
    group.add_argument(
        "--eval-every", metavar="N", type=int, default=0, help="evaluate every N steps (0: never)"
    )
    group.add_argument(
        "--eval-batches", metavar="N", type=int, default=1, help="batches per evaluation (default 1)"
    )
    group.add_argument("--lr", type=float, help="learning rate (default: the optimizer's)")
    group.add_argument("--weight-decay", type=float, help="weight decay of matrices and embeddings (not of "
                       "biases and norms)")  # fmt: skip
    group.add_argument(
        "--warmup-steps", metavar="N", type=int, default=0, help="linear warmup steps (default 0)"
    )
    group.add_argument("--decay", choices=DECAYS, default="constant", help="learning-rate decay after the "
                       "warmup (default constant)")  # fmt: skip
    group.add_argument("--min-lr-ratio", type=float, default=0.1, help="where the decay ends, as a share of "
                       "--lr (default 0.1)")  # fmt: skip
    group.add_argument("--total-steps", metavar="N", type=int, help="the step the decay ends at (default: the "
                       "run's last step)")  # fmt: skip
    group.add_argument("--clip-grad-norm", metavar="X", type=float, help="clip the global gradient norm to X")
    group.add_argument("--seed", type=int, default=0, help="data order (shuffling) seed (default 0)")
    group.add_argument("--log-dir", metavar="D", help="metrics.jsonl (and TensorBoard events) go here "
                       "(default: the checkpoint folder)")  # fmt: skip
    group.add_argument("--checkpoint-dir", metavar="D", help="where every stage checkpoints (default "
                       "BUILD/checkpoints); the trained weights are saved there at the end")  # fmt: skip
    group.add_argument("--checkpoint-every", metavar="N", type=int, default=0,
                       help="checkpoint every N steps (default: only at the end)")  # fmt: skip
    group.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint, "
                       "with the settings given now")  # fmt: skip


_VALUED = ("data", "labels", "eval_data", "eval_every", "eval_batches", "lr", "weight_decay", "warmup_steps",
           "decay", "min_lr_ratio", "total_steps", "clip_grad_norm", "seed", "log_dir", "checkpoint_dir",
           "checkpoint_every")  # fmt: skip


def passthrough(args: argparse.Namespace) -> list[str]:
    """The training options given (those not at their default), for the torchrun command ``hetcc launch``
    writes."""
    defaults = argparse.ArgumentParser()
    add_train_options(defaults)
    words = []
    for name in _VALUED:
        value = getattr(args, name)
        if value is not None and value != defaults.get_default(name):
            words += [f"--{name.replace('_', '-')}", str(value)]
    return words + ["--resume"] * bool(args.resume)


def settings(args: argparse.Namespace, build: str, meta: PipelineMeta, seq_len: int, progress: bool):
    """``(TrainSettings, data, eval_data)`` from the options; data are ``DataSpec``s each rank resolves."""
    from hetcc.train.loop import TrainSettings
    from hetcc.train.sources import DataSpec, check_spec, is_token_folder

    optimizer = dict(meta.optimizer or {"name": "adam"})
    optimizer.update(
        {k: v for k, v in (("lr", args.lr), ("weight_decay", args.weight_decay)) if v is not None}
    )
    schedule = {"warmup_steps": args.warmup_steps, "decay": args.decay, "min_lr_ratio": args.min_lr_ratio,
                "total_steps": args.total_steps}  # fmt: skip
    data = eval_data = None
    if args.data is not None:
        check_spec(args.data)
        data = DataSpec(args.data, seq_len, "train", args.labels)
    eval_spec = args.eval_data or (args.data if args.data and is_token_folder(args.data) else None)
    if args.eval_every and eval_spec is not None:
        check_spec(eval_spec, "--eval-data")
        eval_data = DataSpec(
            eval_spec, seq_len, "val" if is_token_folder(eval_spec) else "train", args.labels
        )
    checkpoint_dir = args.checkpoint_dir or os.path.join(build, "checkpoints")
    run = TrainSettings(
        args.steps, optimizer, schedule, args.clip_grad_norm, args.eval_every, args.eval_batches, checkpoint_dir,
        args.checkpoint_every, args.resume, args.log_dir, args.seed, progress,
    )  # fmt: skip
    return run, data, eval_data
