"""``verl-prefix dashboard``: the engine's metrics as a wandb workspace, or as one offline HTML page.

Both draw the panels of ``verl_prefix.tools.report.dashboard_spec``. The wandb workspace is built with
``wandb-workspaces`` (the ``dashboard`` extra) and saved to a project; the HTML page is drawn from runs on
disk (offline wandb run directories, read with ``read_wandb_run``, or verl's ``file`` logger JSONL) as
inline SVG with a few lines of inline script (legend toggles): no network when viewed.
"""

from __future__ import annotations

import html
import json
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_prefix.tools.report.dashboard_spec import ACTOR, PASSES, SECTIONS, Panel, all_panels

WORKSPACE_NAME = "verl-prefix: dense vs prefix reuse"


class DashboardError(ValueError):
    """A user mistake (a path that holds no run, a missing extra): one line, exit status 2."""


# -- wandb workspace ---------------------------------------------------------------------------------


def build_workspace(entity: str, project: str, name: str = WORKSPACE_NAME) -> Any:
    """The ``wandb_workspaces`` Workspace with every panel of the spec, not yet saved.

    Kept separate from saving so the spec can be checked without a login or network.
    """
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as exc:
        raise DashboardError(
            f"the wandb workspace needs wandb-workspaces: pip install 'verl-prefix[dashboard]' ({exc})"
        ) from None

    def line_plot(panel: Panel) -> Any:
        kwargs: dict[str, Any] = {"title": f"{panel.title} ({panel.unit})", "x": "Step", "title_y": panel.unit}
        if panel.keys:
            kwargs["y"] = panel.metric_keys()
        if panel.pattern is not None:
            kwargs["metric_regex"] = f"^{panel.pattern}$"
        return wr.LinePlot(**kwargs)

    sections = [
        ws.Section(name=section.name, panels=[line_plot(p) for p in section.panels], is_open=True)
        for section in SECTIONS
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=sections,
        settings=ws.WorkspaceSettings(x_axis="Step"),
    )


def save_workspace(entity: str, project: str, name: str = WORKSPACE_NAME) -> str:
    """Create the workspace in ``entity/project`` (needs a wandb login) and return its URL."""
    import requests
    import wandb

    workspace = build_workspace(entity, project, name)
    try:
        workspace.save()
    except (wandb.errors.Error, requests.RequestException) as exc:
        raise DashboardError(
            f"could not save the workspace to {entity}/{project}: {exc} "
            "(log in with `wandb login` or set WANDB_API_KEY; the HTML dashboard works offline)"
        ) from None
    return str(workspace.url)


# -- runs on disk ----------------------------------------------------------------------------------


@dataclass
class RunSeries:
    """One run's numeric history: ``rows[i]`` holds the metrics logged at ``steps[i]``."""

    name: str
    source: str
    steps: list[float]
    rows: list[dict[str, float]]

    def keys(self) -> set[str]:
        """Every metric this run logged at least once."""
        return {key for row in self.rows for key in row}

    def series(self, key: str) -> list[tuple[float, float]]:
        """(step, value) for every step that logged ``key``."""
        return [(s, row[key]) for s, row in zip(self.steps, self.rows) if key in row]


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in row.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value) and not key.startswith("_"):
            out[key] = float(value)
    return out


def _wandb_run(run_dir: Path) -> RunSeries:
    from verl_prefix.tools.demo.echo import read_wandb_run

    run = read_wandb_run(run_dir)
    steps, rows = [], []
    for i, row in enumerate(run.history):
        steps.append(float(row.get("_step", i)))
        rows.append(_numbers(row))
    return RunSeries(name=run.name or run_dir.name, source=str(run_dir), steps=steps, rows=rows)


def _file_logger_run(path: Path) -> RunSeries:
    """verl's ``file`` logger: one ``{"step": N, "data": {...}}`` JSON object per line, named by experiment."""
    steps, rows = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step, data = record["step"], record["data"]
        except (ValueError, KeyError, TypeError):
            raise DashboardError(
                f"{path}:{number} is not a verl file-logger line ({{'step': N, 'data': {{...}}}})"
            ) from None

        steps.append(float(step))
        rows.append(_numbers(data))
    return RunSeries(name=path.stem, source=str(path), steps=steps, rows=rows)


def _is_file_logger(path: Path) -> bool:
    try:
        with path.open() as f:
            record = json.loads(f.readline())
        return isinstance(record, dict) and "step" in record and isinstance(record.get("data"), dict)
    except (OSError, ValueError):
        return False


def find_runs(paths: Iterable[str | os.PathLike]) -> list[RunSeries]:
    """Runs under ``paths``: an offline wandb run directory, a file-logger ``.jsonl``, or a directory
    searched for both (the demo's ``--out-dir`` finds its two runs)."""
    runs: list[RunSeries] = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise DashboardError(f"{path} does not exist")
        if path.is_file():
            if not _is_file_logger(path):
                raise DashboardError(f"{path} is not a verl file-logger JSONL (trainer.logger=[file])")
            runs.append(_file_logger_run(path))
            continue
        run_dirs = (
            [path]
            if any(path.glob("run-*.wandb"))
            else sorted({f.parent for f in path.rglob("run-*.wandb") if not any(p.is_symlink() for p in f.parents)})
        )
        files = sorted(f for f in path.rglob("*.jsonl") if _is_file_logger(f))
        if not run_dirs and not files:
            raise DashboardError(f"no offline wandb run (run-*.wandb) or verl file-logger JSONL under {path}")
        runs += [_wandb_run(d) for d in run_dirs] + [_file_logger_run(f) for f in files]
    seen: dict[str, int] = {}
    for run in runs:  # two runs with one name stay apart in the legend
        seen[run.name] = seen.get(run.name, 0) + 1
        if seen[run.name] > 1:
            run.name = f"{run.name} ({seen[run.name]})"
    return runs


# -- HTML ------------------------------------------------------------------------------------------

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
DASHES = ("", "6 3", "2 3", "8 3 2 3")
WIDTH, HEIGHT = 400, 220
LEFT, RIGHT, TOP, BOTTOM = 58, 12, 10, 34


@dataclass
class _Line:
    run: int
    run_name: str
    label: str
    points: list[tuple[float, float]]


def panel_lines(panel: Panel, runs: Sequence[RunSeries]) -> list[_Line]:
    """The lines a panel draws: one per run and key that the run logged."""
    lines = []
    for index, run in enumerate(runs):
        logged = run.keys()
        keys = [k for k in panel.metric_keys() if k in logged]
        if panel.pattern is not None:
            keys += sorted(k for k in logged if panel.matches(k) and k not in keys)
        for key in keys:
            lines.append(_Line(index, run.name, panel.label(key), run.series(key)))
    return lines


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    raw = (hi - lo) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = min((m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw), default=raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.2g}"
    return f"{value:.4g}"


def _styles(lines: list[_Line]) -> list[tuple[str, str]]:
    """(colour, dash) per line: colour tells the keys apart and dashes the runs when a panel has several
    keys; with one key, colour tells the runs apart."""
    labels = list(dict.fromkeys(line.label for line in lines))
    runs = list(dict.fromkeys(line.run for line in lines))
    out = []
    for line in lines:
        if len(labels) > 1:
            dash = DASHES[runs.index(line.run) % len(DASHES)] if len(runs) > 1 else ""
            out.append((PALETTE[labels.index(line.label) % len(PALETTE)], dash))
        else:
            out.append((PALETTE[line.run % len(PALETTE)], ""))
    return out


def _svg(lines: list[_Line], unit: str) -> str:
    xs = [x for line in lines for x, _ in line.points]
    ys = [y for line in lines for _, y in line.points]
    x_lo, x_hi = min(xs), max(xs)
    if x_lo == x_hi:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_lo, y_hi = min(0.0, min(ys)), max(ys)
    if y_lo == y_hi:
        y_hi = y_lo + 1
    y_hi += (y_hi - y_lo) * 0.05
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w

    def py(y: float) -> float:
        return TOP + (1 - (y - y_lo) / (y_hi - y_lo)) * plot_h

    parts = [f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img">']
    for y in _ticks(y_lo, y_hi):
        parts.append(
            f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py(y):.1f}" y2="{py(y):.1f}"/>'
            f'<text class="tick" x="{LEFT - 4}" y="{py(y) + 4:.1f}" text-anchor="end">{_fmt(y)}</text>'
        )
    integer_steps = all(float(x).is_integer() for x in xs)
    x_ticks = sorted(set(xs)) if integer_steps and len(set(xs)) <= 12 else _ticks(x_lo, x_hi)
    for x in x_ticks:
        parts.append(
            f'<text class="tick" x="{px(x):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{_fmt(x)}</text>'
        )
    parts.append(
        f'<line class="axis" x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{HEIGHT - BOTTOM}"/>'
        f'<line class="axis" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{HEIGHT - BOTTOM}" y2="{HEIGHT - BOTTOM}"/>'
        f'<text class="label" x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 4}" text-anchor="middle">step</text>'
        f'<text class="label" x="12" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 12 {TOP + plot_h / 2:.1f})">{html.escape(unit)}</text>'
    )
    styles = _styles(lines)
    for i, line in enumerate(lines):
        color, dash = styles[i]
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in line.points)
        name = html.escape(f"{line.run_name}: {line.label}")
        parts.append(f'<g class="series" data-series="{i}" style="color:{color}"><title>{name}</title>')
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(f'<polyline points="{points}"{dash_attr}/>')
        for x, y in line.points:
            parts.append(
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5"><title>{name}\nstep {_fmt(x)}: {y:.6g}'
                f"</title></circle>"
            )
        parts.append("</g>")
    parts.append("</svg>")
    legend = []
    for i, line in enumerate(lines):
        color, dash = styles[i]
        swatch = (
            f'<svg width="22" height="8"><line x1="1" x2="21" y1="4" y2="4" stroke="{color}" stroke-width="2.5"'
            + (f' stroke-dasharray="{dash}"' if dash else "")
            + "/></svg>"
        )
        legend.append(f'<li data-series="{i}">{swatch}{html.escape(line.run_name)}: {html.escape(line.label)}</li>')
    return "".join(parts) + '<ul class="legend">' + "".join(legend) + "</ul>"


_STYLE = """
body{font-family:system-ui,sans-serif;margin:16px 24px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 6px}h2{font-size:16px;margin:22px 0 8px;border-bottom:1px solid #ddd}
table.runs{border-collapse:collapse;font-size:13px}table.runs td,table.runs th{padding:2px 10px;
text-align:left;border-bottom:1px solid #eee}.grid-panels{display:flex;flex-wrap:wrap;gap:12px}
.panel{background:#fff;border:1px solid #ddd;border-radius:4px;padding:8px;width:400px}
.panel h3{font-size:13px;margin:0 0 4px;font-weight:600}.panel .keys{font-size:10px;color:#777;
margin:0 0 4px;word-break:break-all}.empty{font-size:12px;color:#777;height:60px;display:flex;
align-items:center;justify-content:center;border:1px dashed #ccc}
svg .grid{stroke:#eee}svg .axis{stroke:#999}svg .tick,svg .label{font-size:10px;fill:#555}
svg .series polyline{fill:none;stroke:currentColor;stroke-width:1.8}svg .series circle{fill:currentColor}
.legend{list-style:none;margin:4px 0 0;padding:0;font-size:11px;display:flex;flex-wrap:wrap;gap:2px 10px}
.legend li{cursor:pointer;display:flex;align-items:center;gap:4px}.legend li.off{opacity:.35}
.series.off{display:none}table.check{margin:0 0 10px}table.check td.ok{color:#2a7d2a}
table.check td.bad{color:#c0392b;font-weight:600}
"""

_SCRIPT = """
(function(){
  var panels=document.querySelectorAll('section.panel'), drawn=0;
  panels.forEach(function(panel){
    if(panel.querySelector('svg .series')||panel.querySelector('.empty')){drawn++;}
    panel.querySelectorAll('.legend li').forEach(function(item){
      item.addEventListener('click',function(){
        var off=item.classList.toggle('off');
        panel.querySelectorAll('.series[data-series="'+item.dataset.series+'"]').forEach(function(g){
          g.classList.toggle('off',off);});
      });
    });
  });
  document.body.dataset.panels=String(panels.length);
  document.body.dataset.drawn=String(drawn);
})();
"""


def _median_of(run: RunSeries, key: str) -> float | None:
    values = [v for _, v in run.series(key)]
    return statistics.median(values) if values else None


def _dense_samples(run: RunSeries, head: str) -> float | None:
    """Samples the pass ran dense over the run: ``dense_samples``, or the sum of ``fallback_*`` (older runs)."""
    total = [v for _, v in run.series(f"{head}dense_samples")]
    if total:
        return sum(total)
    reasons = [k for k in run.keys() if k.startswith(f"{head}fallback_")]
    return sum(v for k in reasons for _, v in run.series(k)) if reasons else None


def _mark(ok: bool | None, text: str) -> str:
    sign = {True: "&#10003;", False: "&#10007;", None: ""}[ok]
    css = {True: "ok", False: "bad", None: ""}[ok]
    return f'<td class="{css}">{sign} {html.escape(text)}</td>'


def quick_check(runs: Sequence[RunSeries]) -> list[dict[str, Any]]:
    """Per run that used the schedule: each pass's median reuse factor and FLOP-model saving, the samples it ran
    dense in all, and the update's measured speed-up over a stock run on the same page (a run that logged
    ``timing_s/update_actor`` and no ``actor/prefix/`` key), where there is one."""
    stock = [
        m
        for run in runs
        if not any(k.startswith(ACTOR) for k in run.keys())
        and (m := _median_of(run, "timing_s/update_actor")) is not None
    ]
    out = []
    for run in runs:
        if not any(k.startswith(ACTOR) for k in run.keys()):
            continue
        row: dict[str, Any] = {"run": run.name}
        for head, label in PASSES:
            row[label] = {
                "reuse_factor": _median_of(run, f"{head}reuse_factor"),
                "dense_samples": _dense_samples(run, head),
                "flops_saved_ratio": _median_of(run, f"{head}flops_saved_ratio"),
            }
        update = _median_of(run, "timing_s/update_actor")
        row["measured_speedup"] = statistics.median(stock) / update if stock and update else None
        out.append(row)
    return out


def _quick_check_table(runs: Sequence[RunSeries]) -> list[str]:
    rows = quick_check(runs)
    if not rows:
        return []
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in PASSES)
    out = [
        '<table class="runs check"><tr><th>run</th><th>check</th>' + head + "</tr>",
    ]

    def fmt(value: float | None, suffix: str = "") -> str:
        return "not run" if value is None else f"{value:.3g}{suffix}"

    for row in rows:
        name = html.escape(row["run"])
        reuse = "".join(
            _mark(None if v is None else v > 1, fmt(v, "x"))
            for v in (row[label]["reuse_factor"] for _, label in PASSES)
        )
        dense = "".join(
            _mark(None if v is None else v == 0, fmt(v)) for v in (row[label]["dense_samples"] for _, label in PASSES)
        )
        saved = "".join(f"<td>{fmt(row[label]['flops_saved_ratio'], 'x')}</td>" for _, label in PASSES)
        measured = row["measured_speedup"]
        speedup = "no stock run on this page" if measured is None else f"{measured:.3g}x measured (update_actor)"
        out += [
            f"<tr><td rowspan='4'>{name}</td><td>reuse factor &gt; 1</td>{reuse}</tr>",
            f"<tr><td>samples run dense = 0</td>{dense}</tr>",
            f"<tr><td>FLOPs saved (FLOP model)</td>{saved}</tr>",
            f"<tr><td>update speed-up vs a stock run</td><td colspan='{len(PASSES)}'>{html.escape(speedup)}</td></tr>",
        ]
    out.append("</table>")
    return out


def render_html(runs: Sequence[RunSeries], title: str = "verl-prefix dashboard") -> str:
    """One self-contained page: a table of the runs, then every section's panels as inline SVG."""
    rows = []
    for run in runs:
        update = [v for _, v in run.series("timing_s/update_actor")]
        median = f"{statistics.median(update):.3f}" if update else "–"
        rows.append(
            f"<tr><td>{html.escape(run.name)}</td><td>{len(run.steps)}</td><td>{median}</td>"
            f"<td>{html.escape(run.source)}</td></tr>"
        )
    body = [
        f"<h1>{html.escape(title)}</h1>",
        '<table class="runs"><tr><th>run</th><th>steps</th><th>update_actor median (s)</th><th>source</th></tr>',
        *rows,
        "</table>",
    ]
    for number, section in enumerate(SECTIONS):
        body.append(f"<h2>{html.escape(section.name)}</h2>")
        if number == 0:  # the quick check: per run, the panels' story in one table (medians over steps)
            body += _quick_check_table(runs)
        body.append("<div class='grid-panels'>")
        for panel in section.panels:
            lines = [line for line in panel_lines(panel, runs) if line.points]
            keys = ", ".join(panel.metric_keys()[:1] + (["…"] if len(panel.keys) > 1 else []))
            keys = keys or f"/{panel.pattern}/"
            body.append(
                f'<section class="panel" id="panel-{panel.id}" data-lines="{len(lines)}">'
                f"<h3>{html.escape(panel.title)} ({html.escape(panel.unit)})</h3>"
                f'<p class="keys">{html.escape(keys)}</p>'
            )
            if lines:
                body.append(_svg(lines, panel.unit))
            else:
                body.append(f'<div class="empty">{html.escape(panel.note or "not logged by these runs")}</div>')
            body.append("</section>")
        body.append("</div>")
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>\n"
        + "\n".join(body)
        + f"\n<script>{_SCRIPT}</script>\n</body></html>\n"
    )


def write_html(paths: Iterable[str | os.PathLike], out: str | os.PathLike, title: str | None = None) -> Path:
    """Find the runs under ``paths`` and write their dashboard page to ``out``."""
    runs = find_runs(paths)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_html(runs, title or "verl-prefix dashboard: " + ", ".join(r.name for r in runs)))
    return target


__all__ = [
    "DashboardError",
    "RunSeries",
    "all_panels",
    "build_workspace",
    "find_runs",
    "quick_check",
    "panel_lines",
    "render_html",
    "save_workspace",
    "write_html",
]
