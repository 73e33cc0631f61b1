"""An incident's timeline as a Gantt chart: self-contained SVG/HTML, or PNG with matplotlib."""

from __future__ import annotations

import html
from datetime import datetime
from pathlib import Path

from models.incident import IncidentStatus, Step, seen

ROW = 26
LEFT = 150
WIDTH = 760
TOP = 56


def bars(status: IncidentStatus) -> list[tuple[str, float, float]]:
    """(step, start, end) in seconds since the incident opened, one per step, in order of start."""
    if not status.timeline:
        return []
    origin = status.timeline[0].at
    spans: dict[Step, list[datetime]] = {}
    for entry in status.timeline:
        if entry.event == "started" and entry.step not in spans:
            spans[entry.step] = [entry.at, entry.at]
        elif entry.step in spans and entry.event in {"finished", "failed"}:
            spans[entry.step][1] = entry.at
    rows = [
        (step.value, (a - origin).total_seconds(), (b - origin).total_seconds())
        for step, (a, b) in spans.items()
        if step != Step.CLOSED
    ]
    return sorted(rows, key=lambda row: row[1])


def outage(status: IncidentStatus) -> tuple[float, float] | None:
    """The job's outage: from SIGTERM (checkpoint step) until it runs again (resume step)."""
    rows = {name: (start, end) for name, start, end in bars(status)}
    if Step.CHECKPOINT.value in rows and Step.RESUME.value in rows and status.jobs:
        return rows[Step.CHECKPOINT.value][0], rows[Step.RESUME.value][1]
    return None


def svg(status: IncidentStatus) -> str:
    rows = bars(status)
    total = max((end for _, _, end in rows), default=1.0) or 1.0
    scale = WIDTH / total
    height = TOP + ROW * len(rows) + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 40}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="10" y="20" font-size="15" font-weight="bold">{html.escape(status.incident_id)}: '
        f"{html.escape(status.node)}, {html.escape(seen(status))}, {status.outcome.value}</text>",
    ]
    down = outage(status)
    if down:
        x0, x1 = LEFT + down[0] * scale, LEFT + down[1] * scale
        out.append(
            f'<rect x="{x0:.1f}" y="{TOP - 16}" width="{max(x1 - x0, 1):.1f}" height="{ROW * len(rows) + 16}" '
            'fill="#fde2e2"/>'
        )
        out.append(f'<text x="{x0 + 4:.1f}" y="{TOP - 4}" fill="#b42318">job outage {down[1] - down[0]:.1f} s</text>')
    for index, (name, start, end) in enumerate(rows):
        y = TOP + index * ROW
        x, w = LEFT + start * scale, max((end - start) * scale, 2)
        out.append(f'<text x="10" y="{y + 16}">{html.escape(name)}</text>')
        out.append(f'<rect x="{x:.1f}" y="{y + 4}" width="{w:.1f}" height="{ROW - 8}" fill="#2e6fd8" rx="3"/>')
        out.append(f'<text x="{x + w + 4:.1f}" y="{y + 16}" fill="#444">{end - start:.2f} s</text>')
    axis_y = TOP + ROW * len(rows) + 14
    out.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{LEFT + WIDTH}" y2="{axis_y}" stroke="#888"/>')
    for tick in range(6):
        seconds = total * tick / 5
        out.append(f'<text x="{LEFT + seconds * scale - 8:.1f}" y="{axis_y + 16}">{seconds:.1f}s</text>')
    out.append("</svg>")
    return "\n".join(out)


def write_chart(status: IncidentStatus, path: Path) -> Path:
    """Write the chart; the format follows the suffix (.svg, .html or .png).

    Raises:
        ValueError: an unknown suffix, or .png without matplotlib installed.
    """
    suffix = path.suffix.lower()
    if suffix == ".svg":
        path.write_text(svg(status), encoding="utf-8")
    elif suffix == ".html":
        title = html.escape(status.incident_id)
        path.write_text(
            f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head>"
            f"<body>{svg(status)}</body></html>",
            encoding="utf-8",
        )
    elif suffix == ".png":
        _png(status, path)
    else:
        raise ValueError(f"unsupported chart format {suffix or '(none)'}: use .html, .svg or .png")
    return path


def _png(status: IncidentStatus, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "a .png chart needs matplotlib (pip install matplotlib); .html and .svg need nothing"
        ) from None
    rows = bars(status)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    down = outage(status)
    if down:
        ax.axvspan(down[0], down[1], color="#fde2e2", label=f"job outage {down[1] - down[0]:.1f} s")
        ax.legend(loc="lower right")
    for index, (_, start, end) in enumerate(rows):
        ax.barh(index, max(end - start, 0.01), left=start, color="#2e6fd8")
    ax.set_yticks(range(len(rows)), [name for name, _, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the Xid")
    ax.set_title(f"{status.incident_id}: {status.node}, {seen(status)}, {status.outcome.value}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
