"""PNG plots of a ``verl-prefix bench`` or ``verl-prefix replay`` result, for papers and reviews.

A bench result gives speedup against the prefix/suffix length ratio and against the group size, each beside
the FLOP model's curve (measured points that sit far from the curve are the ones to question), and per-phase
memory bars. A replay result gives the per-step speed ratio, the parameter drift against its noise floor, and
per-phase memory bars. Plots are written with matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from verl_prefix.tools.flops import ModelShape, predicted_speedup
from verl_prefix.tools.measure import prefix_memory_by_phase


class ReportError(ValueError):
    """An unreadable or unrecognised result file (a user mistake): one line, no traceback."""


def load_result(path: str | os.PathLike) -> dict[str, Any]:
    """A bench or replay result JSON, checked enough to plot; ``ReportError`` otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ReportError(f"result file {path} does not exist" if not path.exists() else f"{path} is not a file")
    try:
        result = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path} is not valid JSON ({exc})") from None
    if result_kind(result) is None:
        raise ReportError(f"{path} is neither a bench result (cells) nor a replay result (steps)")
    return result


def result_kind(result: Any) -> str | None:
    """``"bench"``, ``"replay"`` or None for anything else."""
    if not isinstance(result, dict):
        return None
    if result.get("kind") == "replay" and isinstance(result.get("steps"), list) and result["steps"]:
        return "replay"
    if isinstance(result.get("cells"), list) and result["cells"]:
        return "bench"
    return None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _shape_of_cell(cell: dict[str, Any]) -> ModelShape:
    m = cell["model"]
    return ModelShape(
        hidden=m["hidden_size"],
        intermediate=m["intermediate_size"],
        layers=m["num_layers"],
        heads=m["num_heads"],
        kv_heads=m["num_kv_heads"],
        head_dim=m["hidden_size"] // m["num_heads"],  # write_tiny_model's convention
        vocab=m["vocab_size"],
        windows=_cell_windows(m),
    )


def _cell_windows(model: dict[str, Any]) -> tuple[int, ...]:
    """The windows of a bench cell's sliding layers (``ModelSpec.sliding_window``/``layer_types``)."""
    window, types = model.get("sliding_window"), model.get("layer_types")
    if window is None:
        return ()
    if types is None:
        return (int(window),) * int(model["num_layers"])
    return tuple(int(window) for t in types if t == "sliding_attention")


def _rep_ratios(dense: list[float], prefix: list[float]) -> list[float]:
    return [d / p for d, p in zip(dense, prefix) if p > 0]


def _error(values: list[float], centre: float) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    return max(centre - min(values), 0.0), max(max(values) - centre, 0.0)


def _title(result: dict[str, Any], what: str) -> str:
    machine = result.get("machine") or {}
    where = machine.get("cuda") or machine.get("processor") or "unknown machine"
    return f"{what}\n{where}, torch {machine.get('torch', '?')}, {result.get('date', '')}"


def _save(fig: Any, out_dir: Path, name: str) -> Path:
    path = out_dir / name
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def _cell_response_mean(cell: dict[str, Any]) -> float:
    return statistics.mean(cell["response_lens"])


def _plot_speedup_vs(result: dict[str, Any], out_dir: Path, axis: str) -> Path:
    """Measured update/forward-only speedups per cell beside the FLOP model, against ``axis``.

    ``axis="ratio"``: x is prompt length / mean response length, series share model and group size, and the
    curve holds the series' total length P+S fixed. ``axis="group"``: x is the group size, series share model
    and lengths.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for cell in result["cells"]:
        shape = _shape_of_cell(cell)
        if axis == "ratio":
            key = (shape, cell["group_size"], cell["num_groups"], cell["dtype"])
        else:
            key = (shape, cell["prompt_len"], round(_cell_response_mean(cell)), cell["num_groups"], cell["dtype"])
        series[key].append(cell)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, (key, cells) in enumerate(series.items()):
        colour = colours[n % len(colours)]
        shape = key[0]
        params = cells[0]["model"].get("params", 0) / 1e6

        def x_of(cell: dict[str, Any]) -> float:
            return cell["prompt_len"] / _cell_response_mean(cell) if axis == "ratio" else cell["group_size"]

        cells = sorted(cells, key=x_of)
        xs = [x_of(c) for c in cells]
        if axis == "ratio":
            group = key[1]
            total = statistics.median(c["prompt_len"] + _cell_response_mean(c) for c in cells)
            lo, hi = min(xs) / 4, max(xs) * 4
            grid = [lo * (hi / lo) ** (i / 59) for i in range(60)]
            curve = []
            for r in grid:
                s = max(1, round(total / (1 + r)))
                p = max(2, round(total - s))
                curve.append(predicted_speedup(shape, [(p, [s] * group)] * key[2]))
            label = f"{params:.1f}M params, G={group}"
            curve_label = f"FLOP model (P+S={total:.0f}, G={group})"
        else:
            prompt, response = key[1], key[2]
            grid = list(range(2, max(int(max(xs)) * 2, 4) + 1))
            curve = [predicted_speedup(shape, [(prompt, [response] * g)] * key[3]) for g in grid]
            label = f"{params:.1f}M params, P={prompt}, S~{response}"
            curve_label = f"FLOP model (P={prompt}, S={response})"
        ax.plot(grid, curve, "-", color=colour, alpha=0.6, label=curve_label)
        ys = [c["ratio_median"] for c in cells]
        errs = [_error(_rep_ratios(c["dense_s"], c["prefix_s"]), c["ratio_median"]) for c in cells]
        ax.errorbar(
            xs,
            ys,
            yerr=[[e[0] for e in errs], [e[1] for e in errs]],
            fmt="o",
            color=colour,
            capsize=3,
            label=f"update, measured ({label})",
        )
        if all("infer_ratio_median" in c for c in cells):
            label = "forward-only, measured" if n == 0 else None
            ax.plot(xs, [c["infer_ratio_median"] for c in cells], "s", mfc="none", color=colour, label=label)
        label = "FLOP model, exact batch" if n == 0 else None
        ax.plot(xs, [c["predicted_speedup"] for c in cells], "x", color=colour, label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    if axis == "ratio":
        ax.set_xscale("log")
        ax.set_xlabel("prompt length / mean response length (P/S)")
        name, what = "speedup_vs_prefix_ratio.png", "Speedup vs prefix/suffix ratio"
    else:
        ax.set_xlabel("group size G (responses per prompt)")
        name, what = "speedup_vs_group_size.png", "Speedup vs group size"
    ax.set_ylabel("dense time / prefix time")
    ax.set_title(_title(result, what), fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, out_dir, name)


def _memory_bars(items: list[tuple[str, dict[str, float]]], ylabel: str, ax: Any) -> None:
    """Grouped bars: one group per item, one bar per key."""
    keys: list[str] = []
    for _, values in items:
        keys += [k for k in values if k not in keys]
    width = 0.8 / max(len(keys), 1)
    for j, key in enumerate(keys):
        xs = [i + (j - (len(keys) - 1) / 2) * width for i in range(len(items))]
        ys = [values.get(key, math.nan) for _, values in items]  # missing: no bar rather than a false 0
        bars = ax.bar(xs, ys, width=width, label=key)
        ax.bar_label(bars, labels=[f"{y:.1f}" if math.isfinite(y) else "" for y in ys], fontsize=6)
    ax.set_xticks(range(len(items)), [name for name, _ in items], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def _saved_bars(dense: dict[str, Any], prefix: dict[str, Any]) -> dict[str, float]:
    """Bytes saved for backward: dense's per micro-batch (held at once) beside prefix's per phase."""
    bars: dict[str, float] = {}
    if "saved_for_backward_held_mib" in dense:
        bars["dense (held)"] = dense["saved_for_backward_held_mib"]
    for phase, value in prefix.get("saved_for_backward_mib", {}).items():
        if phase != "C":  # phase C saves nothing: it is a backward
            bars[f"prefix {phase}"] = value
    if "saved_for_backward_held_mib" in prefix:
        bars["prefix (held, A + max B)"] = prefix["saved_for_backward_held_mib"]
    return bars


def _device_bars(dense: dict[str, Any], prefix: dict[str, Any]) -> dict[str, float]:
    """Allocator peaks (CUDA/NPU only): dense's whole update beside prefix's per phase."""
    bars: dict[str, float] = {}
    if "peak_device_mib" in dense:
        bars["dense (update)"] = dense["peak_device_mib"]
    for phase, value in prefix.get("peak_device_mib", {}).items():
        bars[f"prefix {phase}"] = value
    if "update_peak_device_mib" in prefix:
        bars["prefix (update)"] = prefix["update_peak_device_mib"]
    return bars


def _bench_memory(cell: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    memory = cell.get("memory") or {}
    prefix = prefix_memory_by_phase(cell.get("prefix_metrics") or {}, memory.get("prefix", {}).get("peak_device_mib"))
    return memory.get("dense", {}), prefix


def _plot_memory(result: dict[str, Any], out_dir: Path, items: list[tuple[str, dict, dict]], name: str) -> Path:
    plt = _pyplot()
    saved = [(label, _saved_bars(d, p)) for label, d, p in items]
    device = [(label, _device_bars(d, p)) for label, d, p in items]
    panels = [("saved for backward (MiB)", saved)]
    if any(bars for _, bars in device):
        panels.append(("device allocator peak (MiB)", device))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6, 2.5 * len(items)), 3.8 * len(panels)), squeeze=False)
    for ax, (ylabel, bars) in zip(axes[:, 0], panels):
        _memory_bars(bars, ylabel, ax)
    axes[0, 0].set_title(_title(result, "Per-phase memory: dense vs prefix"), fontsize=9)
    return _save(fig, out_dir, name)


def _replay_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    steps = result["steps"]
    xs = [r["index"] for r in steps]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ys = [r["ratio_median"] for r in steps]
    errs = [_error(_rep_ratios(r["dense_s"], r["prefix_s"]), r["ratio_median"]) for r in steps]
    ax.errorbar(
        xs, ys, yerr=[[e[0] for e in errs], [e[1] for e in errs]], fmt="o-", capsize=3, label="measured (median)"
    )
    ax.plot(xs, [r["predicted_speedup"] for r in steps], "x--", label="FLOP model")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("trace batch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("dense time / prefix time")
    ax.set_title(_title(result, "Replay: per-step speedup"), fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out_dir, "replay_speedup.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    drift = [r["drift"] for r in steps]
    noise = [r["noise_floor"] for r in steps]
    positive = [v for v in drift + noise if v is not None and math.isfinite(v) and v > 0]
    ax.plot(xs, drift, "o-", label="prefix vs dense")
    ax.plot(xs, noise, "s--", label=f"noise floor: dense vs dense ({steps[0].get('noise_variant') or 'n/a'})")
    if positive:
        ax.set_yscale("log")
    ax.set_xlabel("trace batch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("||p - p_dense|| / ||p_dense - p_initial||")
    ax.set_title(_title(result, f"Replay: parameter drift ({result.get('dtype', '')})"), fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    paths.append(_save(fig, out_dir, "replay_drift.png"))

    items = [(f"batch {r['index']}", r["memory"]["dense"], r["memory"]["prefix"]) for r in steps]
    if len(items) > 8:  # keep the bars legible: the worst step by prefix held bytes, and the first
        worst = max(steps, key=lambda r: r["memory"]["prefix"].get("saved_for_backward_held_mib", 0.0))
        items = [items[0], *[it for it in items if it[0] == f"batch {worst['index']}" and it is not items[0]]]
    paths.append(_plot_memory(result, out_dir, items, "replay_memory.png"))
    return paths


def write_report(result: dict[str, Any] | str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Write the PNGs for a bench or replay result (a dict or a JSON path) into ``out_dir``; returns them."""
    if not isinstance(result, dict):
        result = load_result(result)
    kind = result_kind(result)
    if kind is None:
        raise ReportError("result is neither a bench result (cells) nor a replay result (steps)")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ReportError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    if kind == "replay":
        return _replay_plots(result, out)
    paths = [_plot_speedup_vs(result, out, "ratio"), _plot_speedup_vs(result, out, "group")]
    items = [(c["cell"], *_bench_memory(c)) for c in result["cells"]]
    paths.append(_plot_memory(result, out, items, "memory_phases.png"))
    return paths
