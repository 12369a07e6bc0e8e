"""Run a saved pipeline folder on the ranks started by torchrun: ``python -m hetcc.launch DIR``.

    torchrun --standalone --nproc-per-node K -m hetcc.launch build/ --steps 10

Rank k runs the stage (and replica) ``meta["placement"]`` gives it, else stage k. With a placement
written by ``hetcc.compile``, the process torchrun starts as (GROUP_RANK, LOCAL_RANK) is the rank planned
for that node's GPU (``hetcc.runtime.placement``; ``hetcc launch DIR --rdzv-endpoint HOST:PORT`` prints
the torchrun command of every node), and it checks at start that it found the planned device: vendor,
and type by name and memory. ``--allow-substitute`` runs on whatever it found, says so, and rank 0 prints
the plan re-priced for the devices found (``hetcc.runtime.reprice``).
Checkpoints (``--checkpoint-dir``, default ``DIR/checkpoints``; ``--checkpoint-every``; ``--resume``)
are written as ``run_local`` writes them; the trained weights are saved there at the end. Inputs (and targets)
come from ``inputs.safetensors`` / ``targets.safetensors`` in the folder; schedule, microbatches,
optimizer and loss default to ``pipeline.json``'s ``meta``. Each rank reads only ``pipeline.json`` and its
own stage's files. The last stage's first replica prints one ``step <i> loss <value>`` line per step,
numbered on from the resumed checkpoint's step (and writes the losses to ``--losses-out``); with
``--stats-out DIR`` every rank writes its counters (``RunResult.stats``) to ``DIR/stats_rank<k>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys

import torch
import torch.distributed as dist

from hetcc import config
from hetcc.errors import HetccError, PlanFormatError
from hetcc.runtime.graph_json import resolve_function
from hetcc.runtime.groups import GPU_VENDORS, world_backend
from hetcc.runtime.layout import placements
from hetcc.runtime.local import Checkpointing, run_rank
from hetcc.runtime.placement import device_mismatch, rank_at, torchrun_commands
from hetcc.runtime.reprice import repricing_lines
from hetcc.runtime.store import load_inputs, load_stage, read_outline
from hetcc.train.checkpoint import write_build_pointer


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    outline = read_outline(args.directory)  # pipeline.json only: this rank reads no other stage's files
    meta = outline.meta
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ranks = placements(meta, len(outline.stages))  # replicas of a stage are ranks of their own
    if world != len(ranks):
        raise PlanFormatError(
            f"{args.directory} has {len(ranks)} ranks ({len(outline.stages)} stages) but WORLD_SIZE is {world}",
            hint=f"start torchrun with {len(ranks)} processes in all (--nproc-per-node times the node count)",
        )
    vendors = [placement.vendor for placement in ranks]
    rank = _rank(meta)
    device = _device(vendors[rank], meta, rank)
    substitute = _check_device(meta, rank, device, args.allow_substitute)
    stage = load_stage(args.directory, ranks[rank].stage)
    if not torch.cuda.is_available():  # a GPU plan on CPU hosts (allowed above): every link is gloo
        vendors = ["cpu"] * len(ranks)
    checkpoint = Checkpointing(args.checkpoint_dir or os.path.join(args.directory, "checkpoints"),
                               args.checkpoint_every, args.resume)  # fmt: skip
    if rank == 0:
        write_build_pointer(checkpoint.directory, args.directory)
    timeout = datetime.timedelta(seconds=config.comm_timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's collectives (and object gathers) run on the current device
    dist.init_process_group(world_backend(vendors), timeout=timeout, rank=rank, world_size=len(ranks))
    try:
        if args.allow_substitute:
            _print_repricing(args.directory, rank, substitute)
        inputs, targets = load_inputs(args.directory)
        result = run_rank(
            outline, stage, rank, inputs, targets,
            steps=args.steps,
            schedule=args.schedule or meta.get("schedule", "1f1b"),
            microbatches=args.microbatches or int(meta.get("microbatches", 1)),
            loss_fn=loss_function(meta.get("loss")),
            optimizer=meta.get("optimizer"),
            device=device,
            checkpoint=checkpoint,
        )  # fmt: skip
    finally:
        dist.destroy_process_group()
    if args.stats_out:
        _write_json(os.path.join(args.stats_out, f"stats_rank{rank}.json"), result["stats"])
    if stage.is_last and ranks[rank].replica == 0:  # one replica prints
        for step, loss in enumerate(result["losses"], start=result["first_step"]):
            print(f"step {step} loss {loss!r}", flush=True)
        if args.losses_out:
            _write_json(args.losses_out, result["losses"])
    return 0


def _write_json(path: str, value) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(value, f)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hetcc.launch", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="folder written by hetcc (pipeline.json, stage<k>.*)")
    parser.add_argument("--steps", type=int, default=1, help="training steps to run")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), help="default: pipeline.json meta")
    parser.add_argument("--microbatches", type=int, help="default: pipeline.json meta")
    parser.add_argument("--losses-out", help="last rank writes the per-step losses here as JSON")
    parser.add_argument("--stats-out", help="folder: every rank writes stats_rank<k>.json (RunResult.stats)")
    add_run_options(parser)
    return parser


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """Options ``hetcc launch`` passes on to every rank."""
    parser.add_argument("--checkpoint-dir", metavar="D", help="checkpoint folder (default: DIR/checkpoints); "
                        "the trained weights are saved there at the end")  # fmt: skip
    parser.add_argument("--checkpoint-every", metavar="N", type=int, default=0,
                        help="checkpoint every N steps (default: only at the end)")  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--allow-substitute", action="store_true",
                        help="run even where a rank finds another device than the plan's (and say so)")  # fmt: skip


def loss_function(name: str | None):
    """``None``/``"model"``: the model returns its loss; else a function of torch.nn.functional by name."""
    if name in (None, "model"):
        return None
    return resolve_function(f"torch.nn.functional.{name}", "pipeline.json meta.loss")


def read_placement(directory: str) -> list[dict]:
    """The saved placement: ``placement.json`` (every compiled folder) or ``pipeline.json``'s meta."""
    for name, pick in (
        ("placement.json", lambda d: d),
        ("pipeline.json", lambda d: d.get("meta", {}).get("placement")),
    ):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            with open(path) as f:
                entries = pick(json.load(f))
            if entries:
                return entries
    raise PlanFormatError(
        f"{directory} holds no placement (placement.json or pipeline.json meta.placement)",
        hint="compile again with this hetcc: `hetcc compile ... --out DIR` saves the placement",
    )


def node_commands(directory: str, endpoint: str, passthrough: list[str]) -> list[tuple[str, str]]:
    """``(node, command)`` for every node of the folder's placement (``placement.torchrun_commands``)."""
    try:
        return torchrun_commands(read_placement(directory), directory, endpoint, passthrough)
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


def _rank(meta: dict) -> int:
    """This process's pipeline rank: the placement entry of its (node rank, local rank), else RANK."""
    entries = meta.get("placement") or []
    if entries and all("node_rank" in e for e in entries) and "GROUP_RANK" in os.environ:
        node_rank, local_rank = int(os.environ["GROUP_RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        try:
            return int(rank_at(entries, node_rank, local_rank)["rank"])
        except LookupError as error:
            raise PlanFormatError(
                str(error), hint="start each node with the command `hetcc launch DIR` prints"
            ) from None
    return int(os.environ.get("RANK", "0"))


def _device(vendor: str, meta: dict, rank: int) -> torch.device:
    """The planned GPU of this node (``local_index``), else cuda:LOCAL_RANK, else the CPU."""
    if vendor.lower() in GPU_VENDORS and torch.cuda.is_available():
        entries = meta.get("placement") or []
        local = entries[rank].get("local_index") if entries else None
        return torch.device("cuda", int(local if local is not None else os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def found_device(device: torch.device) -> dict:
    """What this rank runs on, as ``device_mismatch`` compares it with the plan."""
    if device.type != "cuda":
        return {"vendor": "cpu", "name": "CPU", "memory_bytes": 0}
    props = torch.cuda.get_device_properties(device)
    vendor = "amd" if getattr(torch.version, "hip", None) else "nvidia"
    return {"vendor": vendor, "name": props.name, "memory_bytes": props.total_memory}


def _print_repricing(directory: str, rank: int, substitute: dict | None) -> None:
    """Every rank says which device it found in place of the plan's (``_check_device``; None: the planned
    one); rank 0 prints the plan re-priced for them (``hetcc.runtime.reprice``). Collective: every rank
    calls it."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, substitute)
    found = {r: seen for r, seen in enumerate(gathered) if seen is not None}
    if rank == 0 and found:
        for line in repricing_lines(directory, found):
            print(line, file=sys.stderr, flush=True)


def _check_device(meta: dict, rank: int, device: torch.device, allow_substitute: bool) -> dict | None:
    """Stop if this rank's device is not the plan's, unless substitutes are allowed; then return what it
    found (``found_device``). None: the planned device (or a plan without placement types)."""
    entries = meta.get("placement") or []
    if not entries or "type" not in entries[rank]:
        return None
    found = found_device(device)
    problem = device_mismatch(entries[rank], found)
    if problem is None:
        return None
    if not allow_substitute:
        raise HetccError(
            f"{problem}: the plan's stage sizes and times do not hold there",
            hint="start each node with the command `hetcc launch DIR --rdzv-endpoint HOST:PORT` prints, or "
            "pass --allow-substitute to run anyway",
        )
    print(f"hetcc.launch: {problem}; running on it anyway (--allow-substitute)", file=sys.stderr, flush=True)
    return found


if __name__ == "__main__":
    try:
        sys.exit(main())
    except HetccError as error:
        print(
            f"hetcc.launch rank {os.environ.get('RANK', '0')}: {type(error).__name__}: {error}",
            file=sys.stderr,
        )
        sys.exit(1)
