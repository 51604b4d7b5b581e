"""The pictures a run leaves behind: ``reward_curve.png`` and ``report.html``.

Why both are drawn from one ``CurveSeries``: the PNG (matplotlib, when installed) and the
HTML page (plain SVG written here, so it opens anywhere with nothing fetched and needs no
plotting package) must show the same curves: the sampled reward, the held-out accuracy at each
validation (before the first step, every ``test_freq`` steps, after the last) and the target.
The report adds the step time by phase and the summary's numbers.
"""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCORE = "critic/score/mean"
VAL_PREFIX = "val-core/"
"""Held-out metrics (``val-core/<source>/reward/mean@1`` ...): a row with one is a validation."""

PHASES: dict[str, tuple[str, ...]] = {
    "generate": ("timing_s/gen",),
    "reward": ("timing_s/reward",),
    "reference": ("timing_s/ref", "timing_s/old_log_prob", "timing_s/values"),
    "update": ("timing_s/adv", "timing_s/update_critic", "timing_s/update_actor"),
    "push": ("timing_s/push_weights",),
    "idle": ("timing_s/idle_trainer",),
}
"""Step-time phases, each the sum of the trainer's ``timing_s/*`` parts (the dashboard stacks
the same ones)."""

SMALL_CURVES: dict[str, str] = {
    "KL": "actor/kl_loss",
    "entropy": "actor/entropy",
    "response length (tokens)": "response_length/mean",
    "step time (s)": "timing_s/step",
}
"""The report's smaller charts: title -> metric (a metric no row has is left out)."""


@dataclass
class CurveSeries:
    """What ``reward_curve.png`` and the report's first chart plot."""

    steps: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    smooth: list[float] = field(default_factory=list)
    window: int = 1
    val: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Held-out metric name (``val-core/`` dropped) -> ``(step, value)`` per validation."""
    target: float | None = None


def is_step_row(row: dict[str, Any]) -> bool:
    return "training/global_step" in row or SCORE in row


def moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def curve_series(
    history: list[dict],
    before: dict[str, float] | None = None,
    after: dict[str, float] | None = None,
    final_step: int | None = None,
    target: float | None = None,
) -> CurveSeries:
    """The sampled reward per step (and its moving average), and the held-out accuracy:
    ``before`` at step 0, every validation row of ``history``, ``after`` at ``final_step``
    (these two are not rows of ``metrics.jsonl``: they come from the summary)."""
    rows = [r for r in history if is_step_row(r) and SCORE in r]
    scores = [float(r[SCORE]) for r in rows]
    window = max(1, len(scores) // 20)
    val: dict[str, list[tuple[int, float]]] = {}
    for step, metrics in _validations(history, before, after, final_step):
        for key, value in metrics.items():
            if key.startswith(VAL_PREFIX) and isinstance(value, int | float):
                points = val.setdefault(key[len(VAL_PREFIX) :], [])
                if points and points[-1][0] == step:
                    points.pop()  # the same step validated again (the final validation)
                points.append((step, float(value)))
    return CurveSeries(
        [int(r["step"]) for r in rows], scores, moving_average(scores, window), window, val, target
    )


def _validations(history, before, after, final_step):
    """``(step, metrics)`` of each validation, in order."""
    found = [(0, before)] if before else []
    found += [(int(r["step"]), r) for r in history if any(k.startswith(VAL_PREFIX) for k in r)]
    if after and final_step is not None:
        found.append((final_step, after))
    return found


def phase_means(history: list[dict]) -> dict[str, float]:
    """Mean seconds per step in each phase, over every training step."""
    steps = [r for r in history if is_step_row(r)]
    if not steps:
        return {}
    return {
        name: sum(sum(float(r.get(k, 0.0)) for k in keys) for r in steps) / len(steps)
        for name, keys in PHASES.items()
    }


# ---- reward_curve.png -------------------------------------------------------------------


def plot_reward_curve(series: CurveSeries, path: Path) -> Path | None:
    """The PNG of ``series``; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: no reward curve")
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(series.steps, series.scores, alpha=0.3, label="sampled reward (critic/score/mean)")
    ax.plot(series.steps, series.smooth, label=f"moving average ({series.window})")
    for name, points in series.val.items():
        ax.plot(
            [s for s, _ in points], [v for _, v in points], marker="o", label=f"held-out {name}"
        )
    if series.target is not None:
        ax.axhline(
            series.target,
            color="tab:red",
            linestyle="--",
            linewidth=1,
            label=f"target {series.target:g}",
        )
    ax.set(xlabel="step", ylabel="reward / accuracy", title="rlfleet: reward and held-out accuracy")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---- report.html ------------------------------------------------------------------------

COLORS = ("#2f6fdb", "#e8710a", "#12a37f", "#9334e6", "#d01884", "#7f7f7f")
WIDTH, HEIGHT, PAD = 560, 220, 46


def svg_chart(
    lines: Sequence[tuple[str, Sequence[tuple[float, float]], str]],
    hlines: Sequence[tuple[str, float, str]] = (),
    width: int = WIDTH,
    height: int = HEIGHT,
) -> str:
    """An SVG line chart: ``lines`` are ``(label, points, color)``, ``hlines`` dashed
    horizontal ``(label, y, color)``; axes carry the x and y ranges."""
    xs = [x for _, pts, _ in lines for x, _ in pts]
    ys = [y for _, pts, _ in lines for _, y in pts] + [y for _, y, _ in hlines]
    if not xs:
        return "<p>(no points)</p>"
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-9:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def at(x: float, y: float) -> str:
        px = PAD + (x - x0) / (x1 - x0) * (width - 2 * PAD)
        py = height - PAD + (y0 - y) / (y1 - y0) * (height - 2 * PAD)
        return f"{px:.1f},{py:.1f}"

    parts = [
        f'<svg width="{width}" height="{height}">',
        f'<rect x="{PAD}" y="{PAD}" width="{width - 2 * PAD}" height="{height - 2 * PAD}" '
        'fill="none" stroke="#ccc"/>',
        _text(PAD - 4, height - PAD, f"{y0:.3g}", "end"),
        _text(PAD - 4, PAD + 4, f"{y1:.3g}", "end"),
        _text(PAD, height - PAD + 14, f"{x0:g}", "start"),
        _text(width - PAD, height - PAD + 14, f"step {x1:g}", "end"),
    ]
    for label, y, color in hlines:
        parts.append(
            f'<polyline points="{at(x0, y)} {at(x1, y)}" stroke="{color}" '
            f'stroke-dasharray="5,4" fill="none"><title>{html.escape(label)}</title>'
            "</polyline>"
        )
    for label, points, color in lines:
        coords = " ".join(at(x, y) for x, y in points)
        parts.append(
            f'<polyline points="{coords}" stroke="{color}" fill="none" '
            f'stroke-width="1.5"><title>{html.escape(label)}</title></polyline>'
        )
        if len(points) <= 30:  # few points (validations): mark each
            for x, y in points:
                cx, cy = at(x, y).split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}"/>')
    parts.append("</svg>")
    legend = [(label, color) for label, _, color in lines] + [(label, c) for label, _, c in hlines]
    keys = " ".join(
        f'<span style="color:{c}">&#9632;</span> {html.escape(label)}' for label, c in legend
    )
    return "".join(parts) + f'<div class="legend">{keys}</div>'


def _text(x: float, y: float, text: str, anchor: str) -> str:
    return (
        f'<text x="{x}" y="{y}" font-size="11" fill="#555" text-anchor="{anchor}">'
        f"{html.escape(text)}</text>"
    )


def reward_chart(series: CurveSeries) -> str:
    lines = [
        ("sampled reward", list(zip(series.steps, series.scores, strict=True)), "#9db8ee"),
        (
            f"moving average ({series.window})",
            list(zip(series.steps, series.smooth, strict=True)),
            COLORS[0],
        ),
    ]
    for i, (name, points) in enumerate(series.val.items()):
        lines.append((f"held-out {name}", points, COLORS[1 + i % (len(COLORS) - 1)]))
    if series.target is None:
        return svg_chart(lines)
    return svg_chart(lines, [(f"target {series.target:g}", series.target, "#c5221f")])


def small_charts(history: list[dict]) -> str:
    out = []
    steps = [r for r in history if is_step_row(r)]
    for title, key in SMALL_CURVES.items():
        points = [(r["step"], float(r[key])) for r in steps if isinstance(r.get(key), int | float)]
        if points:
            out.append(
                f'<div class="chart"><h3>{html.escape(title)}</h3>'
                f"{svg_chart([(key, points, COLORS[0])], width=400, height=170)}</div>"
            )
    return "".join(out)


def phase_section(means: dict[str, float]) -> str:
    """A stacked bar and a table of the mean step time by phase."""
    total = sum(means.values())
    if not total:
        return "<p>(no step timings)</p>"
    bar, x = [], 0.0
    for i, (name, seconds) in enumerate(means.items()):
        width = seconds / total * WIDTH
        bar.append(
            f'<rect x="{x:.1f}" y="0" width="{width:.1f}" height="18" '
            f'fill="{COLORS[i % len(COLORS)]}"><title>{name}</title></rect>'
        )
        x += width
    rows = "".join(
        f'<tr><td><span style="color:{COLORS[i % len(COLORS)]}">&#9632;</span> '
        f"{name}</td><td>{seconds:.3f} s</td><td>{seconds / total:.0%}</td></tr>"
        for i, (name, seconds) in enumerate(means.items())
    )
    return (
        f'<svg width="{WIDTH}" height="18">'
        f'{"".join(bar)}</svg><table class="phases"><tr><th>phase</th><th>mean per step'
        f"</th><th>share</th></tr>{rows}<tr><td>sum</td><td>{total:.3f} s</td><td></td>"
        "</tr></table><p>In async mode generation overlaps the update: the phases add "
        "up to more than the step.</p>"
    )


def summary_table(summary: dict[str, Any]) -> str:
    rows = []
    for key, value in summary.items():
        shown = json.dumps(value) if isinstance(value, dict | list) else str(value)
        rows.append(f"<tr><th>{html.escape(key)}</th><td>{html.escape(shown)}</td></tr>")
    return f'<table class="summary">{"".join(rows)}</table>'


def headline(summary: dict[str, Any]) -> str:
    """The held-out numbers before -> after and the time to the target, in one line each."""
    before, after = summary.get("val_before") or {}, summary.get("val_after") or {}
    lines = []
    for name, value in after.items():
        start = f"{before[name]:.3f} &rarr; " if name in before else ""
        lines.append(f"held-out {html.escape(name)}: {start}{value:.3f}")
    reached = summary.get("time_to_target_s")
    target = summary.get("target_accuracy")
    lines.append(f"time to {target}: {'never' if reached is None else f'{reached} s'}")
    lines.append(
        f"steps {summary.get('steps')}, training {summary.get('training_time_s')} s, "
        f"wall {summary.get('wall_time_s')} s"
    )
    return "".join(f"<li>{line}</li>" for line in lines)


STYLE = """body{font:14px system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}h3{font-size:13px;margin:4px 0}
.legend{font-size:12px;color:#444}.chart{display:inline-block;margin:0 16px 16px 0}
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px;border-bottom:1px solid
#eee;text-align:left;vertical-align:top}"""


def report_html(series: CurveSeries, history: list[dict], summary: dict[str, Any]) -> str:
    """The whole page: one file, no external assets."""
    title = f"rlfleet run: {html.escape(str(summary.get('run_dir', '')))}"
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{STYLE}</style></head><body><h1>{title}</h1><ul>{headline(summary)}</ul>"
        "<h2>Sampled reward and held-out accuracy</h2>"
        f'<div class="chart" id="reward">{reward_chart(series)}</div>'
        f"<h2>Training</h2>{small_charts(history)}"
        f"<h2>Step time by phase</h2>{phase_section(phase_means(history))}"
        f"<h2>Summary</h2>{summary_table(summary)}</body></html>"
    )


def write_report(
    series: CurveSeries, history: list[dict], summary: dict[str, Any], path: Path
) -> Path:
    path.write_text(report_html(series, history, summary), encoding="utf-8")
    return path
