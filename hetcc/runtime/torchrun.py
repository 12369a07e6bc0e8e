"""This process as torchrun started it: its pipeline rank, its device, the check that the device is the
one the plan was made for, and the process group (``hetcc.launch`` and ``hetcc.train.PipelineRank.join``).

With a placement written by ``hetcc.compile``, the process torchrun starts as (GROUP_RANK, LOCAL_RANK)
is the rank planned for that node's GPU (``hetcc.runtime.placement``); else it is RANK.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from hetcc import config
from hetcc.errors import HetccError, PlanFormatError
from hetcc.runtime.contract import PipelineMeta
from hetcc.runtime.groups import GPU_VENDORS, world_backend
from hetcc.runtime.placement import device_mismatch, rank_at


def this_rank(meta: PipelineMeta) -> int:
    """This process's pipeline rank: the placement entry of its (node rank, local rank), else RANK."""
    entries = meta.placement
    if entries[0].node_rank is not None and "GROUP_RANK" in os.environ:  # on every rank, or on none
        node_rank, local_rank = int(os.environ["GROUP_RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        try:
            return rank_at(entries, node_rank, local_rank).rank
        except LookupError as error:
            raise PlanFormatError(
                str(error), hint="start each node with the command `hetcc launch DIR` prints"
            ) from None
    return int(os.environ.get("RANK", "0"))


def planned_device(meta: PipelineMeta, rank: int) -> torch.device:
    """The planned GPU of this node (``local_index``), else cuda:LOCAL_RANK, else the CPU."""
    entry = meta.placement[rank]
    if entry.vendor.lower() in GPU_VENDORS and torch.cuda.is_available():
        local = entry.local_index
        return torch.device("cuda", int(local if local is not None else os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def found_device(device: torch.device) -> dict:
    """What this rank runs on, as ``device_mismatch`` compares it with the plan."""
    if device.type != "cuda":
        return {"vendor": "cpu", "name": "CPU", "memory_bytes": 0}
    props = torch.cuda.get_device_properties(device)
    vendor = "amd" if getattr(torch.version, "hip", None) else "nvidia"
    return {"vendor": vendor, "name": props.name, "memory_bytes": props.total_memory}


def check_device(meta: PipelineMeta, rank: int, device: torch.device, allow_substitute: bool) -> dict | None:
    """Stop if this rank's device is not the plan's, unless substitutes are allowed; then return what it
    found (``found_device``). None: the planned device (or a placement without device types)."""
    entry = meta.placement[rank]
    if entry.type is None:
        return None
    found = found_device(device)
    problem = device_mismatch(entry, found)
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


def start_process_group(directory: str, meta: PipelineMeta, allow_substitute: bool):
    """Join the job torchrun started: (rank, device, what a substituting rank found). Checks the world
    size against the plan's ranks and this rank's device against its placement first."""
    ranks = meta.placement  # replicas of a stage are ranks of their own
    num_stages = meta.num_stages
    unset = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if unset:
        raise HetccError(
            f"{' and '.join(unset)} {'is' if len(unset) == 1 else 'are'} not set: hetcc.launch runs in the "
            "processes torchrun starts",
            hint=f"start it with `torchrun --nproc-per-node {len(ranks)} -m hetcc.launch {directory}` (one node), "
            f"or print every node's command with `hetcc launch {directory} --rdzv-endpoint HOST:PORT`",
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != len(ranks):
        raise PlanFormatError(
            f"{directory} has {len(ranks)} ranks ({num_stages} stages) but WORLD_SIZE is {world}",
            hint=f"start torchrun with {len(ranks)} processes in all (--nproc-per-node times the node count)",
        )
    vendors = list(meta.vendors)
    rank = this_rank(meta)
    device = planned_device(meta, rank)
    substitute = check_device(meta, rank, device, allow_substitute)
    if not torch.cuda.is_available():  # a GPU plan on CPU hosts (allowed above): every link is gloo
        vendors = ["cpu"] * len(ranks)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's collectives (and object gathers) run on the current device
    timeout = datetime.timedelta(seconds=config.comm_timeout_s)
    dist.init_process_group(world_backend(vendors), timeout=timeout, rank=rank, world_size=len(ranks))
    return rank, device, substitute
