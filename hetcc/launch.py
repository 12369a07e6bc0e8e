"""Train a saved pipeline folder on the ranks started by torchrun: ``python -m hetcc.launch DIR``.

    torchrun --standalone --nproc-per-node K -m hetcc.launch build/ --steps 10 --data tokens/

Each process joins as ``hetcc.train.PipelineRank.join`` does: rank k runs the stage (and replica)
``PipelineMeta.placement`` gives it, on its planned device, checked at start (vendor, and type by name and
memory); ``--allow-substitute`` runs on whatever it found, says so, and rank 0 prints the plan re-priced
for the devices found (``hetcc.runtime.reprice``). Every rank then runs the built-in loop
(``hetcc.train.loop``) with the training options (``hetcc.train.options``): ``--data`` (a token folder or
a factory; default: ``inputs.safetensors``, the example batch, at every step), learning rate and
schedule, clipping, evaluation, checkpoints (``--checkpoint-dir``, default ``DIR/checkpoints``, where
the trained weights are saved at the end; ``--resume``) and metrics. Schedule, microbatches, optimizer
and loss come from ``pipeline.json``'s ``meta`` (``hetcc.runtime.contract.PipelineMeta``). Each rank reads only ``pipeline.json``, its own stage's
files and its share of the data. The reporting rank (the last stage's first replica) prints one
``step <i> loss <value>`` line per step, numbered on from a resumed checkpoint's step, the measured step
against the simulated one, and where the weights went (and writes the losses to ``--losses-out``); with
``--stats-out DIR`` every rank writes its counters (``RunResult.stats``) to ``DIR/stats_rank<k>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

import torch.distributed as dist

from hetcc.errors import HetccError, PlanFormatError
from hetcc.runtime.contract import RECOMPILE, read_placement_file
from hetcc.runtime.graph_json import resolve_function
from hetcc.runtime.placement import RankPlacement, torchrun_commands
from hetcc.runtime.reprice import repricing_lines
from hetcc.runtime.store import load_inputs, pipeline_meta
from hetcc.train.checkpoint import write_build_pointer
from hetcc.train.data import TARGET_KEYS
from hetcc.train.local import Repeated
from hetcc.train.loop import train
from hetcc.train.metrics import run_lines
from hetcc.train.options import add_train_options, settings
from hetcc.train.rank import PipelineRank


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rank = PipelineRank.join(args.directory, loss_fn=loss_function(_loss_name(args.directory)),
                             allow_substitute=args.allow_substitute)  # fmt: skip
    try:  # every rank reaches the end, or the first failure ends the run
        if args.allow_substitute:
            _print_repricing(args.directory, rank.rank, rank.substitute)
        run, data, eval_data = settings(args, args.directory, rank.outline.meta, rank.seq_len,
                                        progress=rank.reports and sys.stderr.isatty())  # fmt: skip
        if rank.rank == 0:
            write_build_pointer(run.checkpoint_dir, args.directory)
        result = train(rank, data if data is not None else example_batch(args.directory), run, eval_data)
    except BaseException:
        rank.close(finished=False)
        raise
    rank.close()
    if args.stats_out:
        _write_json(os.path.join(args.stats_out, f"stats_rank{rank.rank}.json"), result["stats"])
    if rank.reports:
        for line in run_lines(result, run.checkpoint_dir, args.directory):
            print(line, flush=True)
        if args.losses_out:
            _write_json(args.losses_out, result["losses"])
    return 0


def example_batch(directory: str) -> Repeated:
    """The build's saved example batch (``inputs.safetensors``, and ``targets.safetensors``), every step."""
    inputs, targets = load_inputs(directory)
    if targets is not None:
        inputs[TARGET_KEYS[0]] = targets
    return Repeated(inputs)


def _loss_name(directory: str) -> str:
    return pipeline_meta(directory).loss


def _write_json(path: str, value) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(value, f)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hetcc.launch", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="folder written by hetcc (pipeline.json, stage<k>.*)")
    parser.add_argument("--steps", type=_positive, default=1, help="training steps to run")
    parser.add_argument("--losses-out", help="last rank writes the per-step losses here as JSON")
    parser.add_argument("--stats-out", help="folder: every rank writes stats_rank<k>.json (RunResult.stats)")
    parser.add_argument("--allow-substitute", action="store_true",
                        help="run even where a rank finds another device than the plan's (and say so)")  # fmt: skip
    add_train_options(parser)
    return parser


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def loss_function(name: str | None):
    """``None``/``"model"``: the model returns its loss; else a function of torch.nn.functional by name."""
    if name in (None, "model"):
        return None
    return resolve_function(f"torch.nn.functional.{name}", "pipeline.json meta.loss")


def read_placement(directory: str) -> tuple[RankPlacement, ...]:
    """The saved placement: ``pipeline.json``'s (what the ranks run), which ``placement.json`` must repeat
    where both are saved; ``placement.json`` alone in a folder with only a plan."""
    listed = os.path.join(directory, "placement.json")
    if not os.path.exists(os.path.join(directory, "pipeline.json")):
        if not os.path.exists(listed):
            raise PlanFormatError(
                f"{directory} holds no placement (placement.json or pipeline.json)",
                hint="compile again with this hetcc: `hetcc compile ... --out DIR` saves the placement",
            )
        return read_placement_file(listed)
    ranks = pipeline_meta(directory).placement
    if os.path.exists(listed) and read_placement_file(listed) != ranks:
        raise PlanFormatError(
            f"{listed} and {directory}/pipeline.json's meta.placement place the ranks differently",
            hint=f"{RECOMPILE}; the ranks run what pipeline.json says",
        )
    return ranks


def node_commands(directory: str, endpoint: str, passthrough: list[str]) -> list[tuple[str, str]]:
    """``(node, command)`` for every node of the folder's placement (``placement.torchrun_commands``)."""
    ranks = read_placement(directory)
    if ranks[0].node_rank is None:  # then on no rank: a pipeline split by hand, not placed on a cluster
        raise PlanFormatError(
            f"{directory}'s placement puts no rank on a node (no node_rank / local_rank)",
            hint=f"start it on one node with `torchrun --nproc-per-node {len(ranks)} -m hetcc.launch {directory}`, "
            "or compile the model for a cluster (`hetcc compile ... --cluster FILE --out DIR`)",
        )
    try:
        return torchrun_commands(ranks, directory, endpoint, passthrough)
    except ValueError as error:
        raise HetccError(
            str(error), hint="pass --rdzv-endpoint HOST:PORT of node 0, reachable from every node"
        ) from None


def launch_node(directory: str, endpoint: str, node: int | None, passthrough: list[str]) -> int:
    """Print every node's torchrun command, or (``node`` given) run that node's and return its exit code."""
    commands = node_commands(directory, endpoint, passthrough)
    if node is None:
        print("\n\n".join(command for _, command in commands))
        return 0
    if not 0 <= node < len(commands):
        raise HetccError(f"--node {node}: the plan has nodes 0..{len(commands) - 1}")
    comment, line = commands[node][1].split("\n", 1)
    words = shlex.split(line)
    print(f"{comment}\n{line}", file=sys.stderr, flush=True)
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", *words[1:]])


def _print_repricing(directory: str, rank: int, substitute: dict | None) -> None:
    """Every rank says which device it found in place of the plan's (``runtime.torchrun.check_device``; None: the planned
    one); rank 0 prints the plan re-priced for them (``hetcc.runtime.reprice``). Collective: every rank
    calls it."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, substitute)
    found = {r: seen for r, seen in enumerate(gathered) if seen is not None}
    if rank == 0 and found:
        for line in repricing_lines(directory, found):
            print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except HetccError as error:
        print(
            f"hetcc.launch rank {os.environ.get('RANK', '0')}: {type(error).__name__}: {error}",
            file=sys.stderr,
        )
        sys.exit(1)
