"""Triton code generation for fusion groups: lowering table, group IR, codegen, cache, the
launcher every fused node calls (``fused``) and the custom op tracers see.

Nothing here imports Triton until a kernel is first compiled (``hetcc.kernels.cache``).
"""

from hetcc.kernels.cache import choose_backend, describe_backend
from hetcc.kernels.execute import launch_stats, reset_launch_stats
from hetcc.kernels.group import FusionGroup, group_from_json, group_to_json
from hetcc.kernels.launch import fused
from hetcc.kernels.op import FUSION_META_KEY, load_groups, register_group, register_groups_in
from hetcc.kernels.source import kernel_source, write_kernel

__all__ = [
    "FUSION_META_KEY",
    "FusionGroup",
    "choose_backend",
    "describe_backend",
    "fused",
    "group_from_json",
    "group_to_json",
    "kernel_source",
    "launch_stats",
    "load_groups",
    "register_group",
    "register_groups_in",
    "reset_launch_stats",
    "write_kernel",
]
