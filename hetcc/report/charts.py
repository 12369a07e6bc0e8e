"""The report's pictures, each an inline SVG string drawn from a ``SavedPlan``."""

from __future__ import annotations

import math

from hetcc.errors import format_bytes
from hetcc.plan import PlanStage
from hetcc.report.data import SavedPlan
from hetcc.report.svg import (
    IDLE,
    KIND_COLOURS,
    VENDOR_COLOURS,
    axis_top,
    line,
    rect,
    stage_colour,
    svg,
    text,
    x_axis,
)  # fmt: skip

LABEL_W = 170  # left column for row labels
CHART_W = 760


def cluster_chart(saved: SavedPlan) -> str:
    """Nodes as boxes, devices inside them; used devices filled with their stage's colour."""
    used = saved.used_devices
    nodes: dict[str, list] = {}
    for device in saved.problem.devices:
        nodes.setdefault(device.node, []).append(device)
    vendors = _vendors(saved)
    box_w, dev_h, pad = 210, 34, 10
    tallest = max(len(devices) for devices in nodes.values())
    height = 40 + tallest * (dev_h + 6) + 2 * pad
    body = []
    for i, (node, devices) in enumerate(nodes.items()):
        x = 10 + i * (box_w + 20)
        body.append(rect(x, 10, box_w, height - 20, "#fafafa", f"node {node}", stroke="#999"))
        body.append(text(x + pad, 28, node, 12, bold=True))
        for j, device in enumerate(devices):
            y = 40 + j * (dev_h + 6)
            stage = used.get(device.name)
            fill = stage_colour(stage) if stage is not None else "#ffffff"
            what = f"stage {stage}" if stage is not None else "unused"
            tip = f"{device.name}: {device.type}, {format_bytes(device.memory_bytes)} usable, {what}"
            body.append(rect(x + pad, y, box_w - 2 * pad, dev_h, fill, tip,
                             stroke=VENDOR_COLOURS.get(vendors.get(device.name, ""), "#666"),
                             dash=stage is None, extra=' stroke-width="2"'))  # fmt: skip
            colour = "#fff" if stage is not None else "#666"
            body.append(text(x + 2 * pad, y + 14, f"{device.name} ({device.type})", 11, fill=colour))
            body.append(text(x + 2 * pad, y + 28, what, 10, fill=colour))
    width = 10 + len(nodes) * (box_w + 20)
    return svg(width, height, body, "cluster: nodes, devices and the stage each device runs")


def chain_chart(saved: SavedPlan) -> str:
    """The block chain in compute order, coloured by stage, with a cut line between stages."""
    blocks = saved.problem.blocks
    stage_of = []
    for stage in saved.stages:
        stage_of += [stage.index] * len(stage.blocks)
    cell = CHART_W / max(len(blocks), 1)
    body, x = [], 10.0
    for i, name in enumerate(blocks):
        stage = stage_of[i] if i < len(stage_of) else 0
        body.append(rect(x, 26, cell - 1, 30, stage_colour(stage), f"block {i}: {name} (stage {stage})"))
        if i and i < len(stage_of) and stage_of[i] != stage_of[i - 1]:
            body.append(line(x - 0.5, 20, x - 0.5, 60, "#000", 2))
            body.append(
                text(x, 10 if stage % 2 else 19, f"{stage_of[i - 1]}|{stage}", 9, "middle")
            )  # staggered
        x += cell
    for stage in saved.stages:
        first = sum(len(s.blocks) for s in saved.stages if s.index < stage.index)
        middle = 10 + cell * (first + len(stage.blocks) / 2)
        low = 12 if stage.index % 2 and cell * len(stage.blocks) < 60 else 0  # narrow stages alternate
        body.append(text(middle, 74 + low, f"stage {stage.index}", 10, "middle"))
        body.append(text(middle, 86 + low, f"{len(stage.blocks)} blocks", 9, "middle", "#555"))
    return svg(
        CHART_W + 20, 104, body, "block chain with the cuts between stages (numbers: stages either side)"
    )


LABEL_ROOM = 220  # room right of the bars for their stage and device labels


def baseline_chart(saved: SavedPlan) -> str:
    """Per-stage busy time in one step (compute and cut transfers of every microbatch the stage's busiest
    replica runs) of hetcc's plan and of each baseline: the longest bar bounds the pipeline's period.
    Each bar is labelled with its stage and devices; its colour is the stage's, as in the other charts."""
    m = saved.problem.microbatches
    names = [d.name for d in saved.problem.devices]
    rows = [("hetcc", [(s.compute_s * _share(s, m), s.comm_s * m, _devices_label(s.devices))
                       for s in saved.stages], saved.plan.step_time_s)]  # fmt: skip
    for name, solution in saved.baselines.items():
        stages = [(s.compute_s * m, s.comm_s * m, _devices_label([names[d] for d in s.devices or (s.device,)]))
                  for s in solution.stages]  # fmt: skip
        rows.append((name, stages, saved.plan.baselines.get(name, solution.step_time_s)))
    finite = [c + m for _, stages, _ in rows for c, m, _ in stages if math.isfinite(c + m)]
    top = axis_top(max(finite, default=1e-3))
    bar_h, gap = 14, 4
    body, y = [], 10.0
    for name, stages, step_s in rows:
        step = "does not fit" if math.isinf(step_s) else f"step {step_s * 1e3:.2f} ms"
        body.append(text(10, y + 12, name, 12, bold=True))
        body.append(text(10, y + 26, step, 10, fill="#555"))
        for k, (compute_s, comm_s, devices) in enumerate(stages):
            width_c, width_t = CHART_W * compute_s / top, CHART_W * comm_s / top
            tip = (
                f"{name} stage {k} on {devices}: compute {compute_s * 1e3:.3f} ms, comm {comm_s * 1e3:.3f} ms"
            )
            body.append(rect(LABEL_W, y, width_c, bar_h, stage_colour(k), tip))
            body.append(rect(LABEL_W + width_c, y, width_t, bar_h, "#bbbbbb", tip))
            body.append(
                text(LABEL_W + width_c + width_t + 4, y + 11, f"stage {k}: {devices}", 10, fill="#333")
            )
            y += bar_h + 1
        y += max(gap, 32 - len(stages) * (bar_h + 1)) + gap
    body += x_axis(
        LABEL_W,
        y,
        CHART_W,
        top,
        "ms busy per step (bar: compute, in the stage's colour; grey: cut transfers)",
        1e3,
    )
    return svg(LABEL_W + CHART_W + LABEL_ROOM, y + 34, body, "per-stage time of hetcc and each baseline")


def _devices_label(devices) -> str:
    """A stage's devices as a bar label: the first and a count when there are many."""
    devices = list(devices)
    return ", ".join(devices) if len(devices) <= 2 else f"{devices[0]} +{len(devices) - 1} more"


def _share(stage: PlanStage, microbatches: int) -> int:
    """Microbatches the stage's busiest replica runs in a step (all of them without replicas)."""
    return max(stage.shares) if stage.shares else microbatches


def memory_chart(saved: SavedPlan) -> str:
    """Each used device's peak memory (parameters, gradients, optimizer, activations) vs its capacity."""
    parts = (("params_bytes", "#4e79a7", "parameters"), ("grads_bytes", "#59a14f", "gradients"),
             ("optimizer_bytes", "#edc948", "optimizer"), ("activations_bytes", "#e15759", "activations"))  # fmt: skip
    bar_h, body, y = 18, [], 10.0
    for stage in saved.stages:
        capacity = stage.device_memory_bytes
        memory = {key: getattr(stage.memory, key) for key, _, _ in parts}
        used = stage.memory.total_bytes
        label = ", ".join(stage.devices)
        body.append(text(10, y + 13, f"stage {stage.index}: {label}"[:30], 11))
        body.append(
            rect(LABEL_W, y, CHART_W, bar_h, IDLE, f"capacity {format_bytes(capacity)}", stroke="#999")
        )
        x = LABEL_W
        for key, colour, name in parts:
            width = CHART_W * memory[key] / capacity if capacity else 0.0
            body.append(rect(x, y, width, bar_h, colour, f"{name} {format_bytes(memory[key])}"))
            x += width
        share = f"{used / capacity:.1%}" if capacity else "-"
        body.append(text(LABEL_W + CHART_W + 4, y + 13, "", 10))
        body.append(text(LABEL_W + 4, y + bar_h + 12, f"{format_bytes(used)} of {format_bytes(capacity)} ({share})",
                         10, fill="#333"))  # fmt: skip
        y += bar_h + 20
    x = LABEL_W
    for _, colour, name in parts:
        body.append(rect(x, y + 2, 10, 10, colour))
        body.append(text(x + 14, y + 11, name, 10))
        x += 100
    return svg(LABEL_W + CHART_W + 20, y + 20, body, "memory per device against capacity")


def gantt_chart(saved: SavedPlan) -> str:
    """The simulated step per device (each replica of a stage its own row): forward, backward, sends and
    the replicas' gradient all-reduce over idle (grey) time."""
    simulation = saved.simulation
    step_s = simulation.step_time_s or 1.0
    top = axis_top(step_s)
    rows = dict(saved.rows)
    for event in simulation.events:
        rows.setdefault((event.stage, getattr(event, "replica", 0)), getattr(event, "device", "") or "?")
    row_h, send_h, body, y = 22, 8, [], 10.0
    for (k, replica), device in sorted(rows.items()):
        body.append(text(10, y + 15, f"stage {k}: {device}"[:30], 11))
        body.append(rect(LABEL_W, y, CHART_W * step_s / top, row_h, IDLE, f"{device} idle"))
        for event in simulation.events:
            if event.stage == k and getattr(event, "replica", 0) == replica:
                body += _gantt_event(event, y, top, row_h, send_h)
        y += row_h + send_h + 10
    body += x_axis(LABEL_W, y, CHART_W, top, "ms (simulated step)", 1e3)
    legend_y = y + 40
    x = 10
    kinds = {event.kind for event in simulation.events}
    legend = [("F", "forward"), ("B", "backward"), ("W", "weight gradient"), ("SEND_F", "send activation"),
              ("SEND_B", "send gradient"), ("ALLREDUCE", "replica all-reduce")]  # fmt: skip
    for kind, name in (entry for entry in legend if entry[0] != "W" or "W" in kinds):
        body.append(rect(x, legend_y, 10, 10, KIND_COLOURS[kind]))
        body.append(text(x + 14, legend_y + 9, name, 10))
        x += 125
    body.append(rect(x, legend_y, 10, 10, IDLE, stroke="#999"))
    body.append(text(x + 14, legend_y + 9, "idle", 10))
    return svg(LABEL_W + CHART_W + 20, legend_y + 20, body, "simulated schedule per device")


def _gantt_event(event, y: float, top: float, row_h: float, send_h: float) -> list[str]:
    is_send = event.kind.startswith("SEND")
    name = event.kind if event.microbatch < 0 else f"{event.kind}{event.microbatch}"
    x = LABEL_W + CHART_W * event.start_s / top
    width = CHART_W * (event.end_s - event.start_s) / top
    tip = f"{name}: {event.start_s * 1e3:.3f} .. {event.end_s * 1e3:.3f} ms"
    top_y = y + row_h + 1 if is_send else y
    body = [rect(x, top_y, width, send_h if is_send else row_h, KIND_COLOURS.get(event.kind, "#999"), tip,
                 stroke="none" if is_send else "#fff")]  # fmt: skip
    if not is_send and width > 16:
        body.append(text(x + width / 2, y + 15, name, 9, "middle", "#fff"))
    return body


def bound_chart(saved: SavedPlan) -> str:
    """Step times side by side: the lower bound, hetcc's prediction and simulation, the baselines."""
    plan = saved.plan
    rows = [("lower bound", plan.lower_bound_s, "#999999"), ("hetcc (plan)", plan.step_time_s, "#4e79a7")]
    simulated = plan.simulated_step_s
    if math.isnan(simulated) and saved.simulation is not None:
        simulated = saved.simulation.step_time_s
    if not math.isnan(simulated):
        rows.append(("hetcc (simulated)", simulated, "#76b7b2"))
    rows += [(name, t, "#f28e2b") for name, t in plan.baselines.items()]
    finite = [t for _, t, _ in rows if math.isfinite(t)]
    top = axis_top(max(finite, default=1e-3))
    body, y = [], 10.0
    for name, seconds, colour in rows:
        body.append(text(10, y + 13, name, 11))
        if math.isfinite(seconds):
            body.append(
                rect(LABEL_W, y, CHART_W * seconds / top, 18, colour, f"{name}: {seconds * 1e3:.3f} ms")
            )
            body.append(text(LABEL_W + CHART_W * seconds / top + 4, y + 13, f"{seconds * 1e3:.2f} ms", 10))
        else:
            body.append(text(LABEL_W, y + 13, "does not fit in memory", 10, fill="#e15759"))
        y += 24
    bound = plan.lower_bound_s
    if math.isfinite(bound):
        x = LABEL_W + CHART_W * bound / top
        body.append(line(x, 6, x, y, "#555", 1, dash=True))
    body += x_axis(LABEL_W, y + 4, CHART_W, top, "ms per step", 1e3)
    return svg(LABEL_W + CHART_W + 80, y + 38, body, "step time against the lower bound and the baselines")


def _vendors(saved: SavedPlan) -> dict[str, str]:
    """Device name -> vendor, from the saved cluster spec (``Cluster.to_spec``) where there is one."""
    spec = saved.cluster if isinstance(saved.cluster, dict) else {}
    type_vendor = {
        t.get("name"): t.get("vendor", "") for t in spec.get("custom_types", []) if isinstance(t, dict)
    }
    return {
        device.get("name"): type_vendor.get(device.get("type"), "")
        for node in spec.get("nodes", [])
        for device in node.get("devices", [])
        if isinstance(device, dict)
    }
