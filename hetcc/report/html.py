"""``report.html``: one self-contained page (inline CSS and SVG, no scripts, no network) about a plan.

It shows the headline numbers and the gap to the lower bound, the cluster with the devices the plan uses,
the block chain with its cuts, the stage table, per-stage time against each baseline, memory per device
against capacity and the simulated schedule per device. Everything is read from the folder ``hetcc
compile`` wrote (``plan.json``, ``problem.json`` and ``cluster.json``).
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

from hetcc.errors import PlanFormatError, format_bytes
from hetcc.report import charts
from hetcc.report.data import CLUSTER_FILE, SavedPlan, load, number

REPORT_FILE = "report.html"

STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px auto; max-width: 1000px;
       color: #222; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 12px; } td, th { padding: 3px 8px; border-bottom: 1px solid #eee; }
th { text-align: left; background: #f5f5f5; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; } .card { border: 1px solid #ddd; border-radius: 6px;
  padding: 8px 12px; min-width: 130px; } .card b { display: block; font-size: 18px; }
.note { color: #666; font-size: 12px; } .swatch { display: inline-block; width: 10px; height: 10px; }
svg { display: block; margin: 8px 0; }
"""


def write_report(folder: str | Path, cluster=None) -> Path:
    """Write ``report.html`` (and ``cluster.json`` when ``cluster`` is given) into a compiled folder."""
    folder = Path(folder)
    if cluster is not None:
        (folder / CLUSTER_FILE).write_text(json.dumps(cluster.to_spec(), indent=1))
    saved = load(folder)
    try:
        page = render(saved)
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as exc:  # an edited plan.json
        raise PlanFormatError(
            f"{folder}/plan.json has a field the report cannot read ({type(exc).__name__}: {exc})",
            hint="compile the model again with `hetcc compile`",
        ) from exc
    path = folder / REPORT_FILE
    path.write_text(page)
    return path


def render(saved: SavedPlan) -> str:
    sections = [
        ("Summary", _summary(saved)),
        ("Step time against the lower bound", charts.bound_chart(saved)),
        ("Cluster", charts.cluster_chart(saved) + _links_table(saved)),
        ("Block chain and cuts", charts.chain_chart(saved)),
        ("Stages", _stage_table(saved)),
        ("Per-stage time against each baseline", _baselines(saved)),
        ("Memory per device", charts.memory_chart(saved)),
        ("Simulated schedule", _gantt(saved)),
    ]
    body = "".join(f"<h2>{escape(title)}</h2>{content}" for title, content in sections)
    title = f"hetcc plan: {saved.folder.resolve().name}"
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{escape(title)}</h1>{body}</body></html>\n"
    )


def _summary(saved: SavedPlan) -> str:
    plan = saved.plan
    step, bound = plan.step_time_s, plan.lower_bound_s
    simulated = plan.simulated_step_s
    if math.isnan(simulated) and saved.simulation is not None:
        simulated = saved.simulation.step_time_s
    cards = [
        ("step time (plan)", _ms(step)),
        ("simulated step", _ms(simulated)),
        ("search formula", _ms(plan.objective_s)),
        ("lower bound", _ms(bound)),
        ("gap to the bound", f"{plan.gap:.1%}"),
        ("stages", str(len(saved.stages))),
        ("schedule", f"{plan.schedule}, {plan.microbatches} microbatches"),
        ("precision", plan.precision),
    ]
    for name, seconds in plan.baselines.items():
        versus = (
            "does not fit" if math.isinf(seconds) else f"{seconds / step:.2f}x hetcc's step" if step else "-"
        )
        cards.append((f"{name} split", versus))
    html = '<div class="cards">' + "".join(
        f'<div class="card">{escape(label)}<b>{escape(value)}</b></div>' for label, value in cards
    )
    notes = "".join(f"<li>{escape(note)}</li>" for note in plan.notes)
    mode = "training" if plan.training else "inference"
    html += f'</div><p class="note">{mode}; times are per step unless a column says per microbatch.</p>'
    return html + (f"<ul class='note'>{notes}</ul>" if notes else "")


def _links_table(saved: SavedPlan) -> str:
    spec = saved.cluster if isinstance(saved.cluster, dict) else None
    if not spec:
        return '<p class="note">No cluster.json in this folder: links are not shown.</p>'
    rows = [(f"within {n.get('name')}", n.get("intra_link")) for n in spec.get("nodes", [])]
    if spec.get("inter_node_link"):
        rows.append(("between nodes", spec["inter_node_link"]))
    rows += [(" <-> ".join(map(str, link.get("between", []))), link) for link in spec.get("links", [])]
    cells = "".join(
        f"<tr><td>{escape(where)}</td><td>{escape(str(link.get('kind', '')))}</td>"
        f"<td class='num'>{number(link.get('bandwidth')) / 1e9:g} GB/s</td>"
        f"<td class='num'>{number(link.get('latency')) * 1e6:g} us</td></tr>"
        for where, link in rows
        if isinstance(link, dict)
    )
    legend = ('<p class="note">Filled: the device runs the stage written on it; dashed: unused. '
              "Outline: green NVIDIA, red AMD, grey CPU.</p>")  # fmt: skip
    return (
        legend
        + f"<table><tr><th>link</th><th>kind</th><th>bandwidth</th><th>latency</th></tr>{cells}</table>"
    )


_HEADS = {"tensor": "tp"}  # optional columns headed other than by their PlanStage field


def _stage_table(saved: SavedPlan) -> str:
    shown = {"recompute": any(s.recompute for s in saved.stages),  # columns shown when a stage uses them
             "precision": any(s.precision != "fp32" for s in saved.stages),
             "tensor": any(s.tensor > 1 for s in saved.stages)}  # fmt: skip
    optional = [key for key, used in shown.items() if used]
    coded = any(s.codecs != ("none", "none") for s in saved.stages)
    head = ["stage", "devices", "type", "blocks", "fwd ms/mb", "bwd ms/mb", "compute ms/mb", "comm ms/mb",
            "in flight", "peak memory", "of capacity", "bubble"] + [_HEADS.get(k, k) for k in optional]  # fmt: skip
    head += ["codecs (act/grad)", "sent per mb: before -> on the wire"] if coded else []
    rows = []
    for s in saved.stages:
        capacity, peak = s.device_memory_bytes, s.peak_memory_bytes
        blocks = s.blocks
        span = blocks[0] if len(blocks) == 1 else f"{blocks[0]} .. {blocks[-1]} ({len(blocks)})"
        cells = [str(s.index), ", ".join(s.devices), s.device_type, span,
                 *(f"{getattr(s, k) * 1e3:.3f}" for k in ("fwd_s", "bwd_s", "compute_s", "comm_s")),
                 str(s.inflight), format_bytes(peak), f"{peak / capacity:.1%}" if capacity else "-",
                 f"{s.bubble:.0%}", *(str(getattr(s, k)) for k in optional)]  # fmt: skip
        if coded:
            act, grad, act_wire, grad_wire = s.wire_bytes
            cells += [
                "/".join(s.codecs),
                f"{format_bytes(act + grad)} -> {format_bytes(act_wire + grad_wire)}",
            ]
        colour = charts.stage_colour(s.index)
        cells[0] = f'<span class="swatch" style="background:{colour}"></span> {escape(cells[0])}'
        rows.append(
            "<tr>" + "".join(f"<td>{c if i == 0 else escape(c)}</td>" for i, c in enumerate(cells)) + "</tr>"
        )
    header = "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"
    note = '<p class="note">ms/mb: milliseconds per microbatch on the stage\'s device.</p>'
    return f"<table>{header}{''.join(rows)}</table>{note}"


def _baselines(saved: SavedPlan) -> str:
    note = ('<p class="note">Baselines use every device in the cluster\'s listed order with equal blocks '
            "(uniform), equal parameter bytes (parameters) or equal FLOPs (flops).</p>")  # fmt: skip
    return charts.baseline_chart(saved) + note


def _gantt(saved: SavedPlan) -> str:
    if saved.simulation is None:
        return f'<p class="note">Not simulated: {escape(saved.simulation_error or "unknown reason")}</p>'
    return charts.gantt_chart(saved) + (
        '<p class="note">From hetcc.solver.simulate: one step, every microbatch; '
        "a send belongs to the stage that issues it.</p>"
    )


def _ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    return "inf" if math.isinf(seconds) else f"{seconds * 1e3:.2f} ms"
