"""The README's two pictures: the three phases (and the trie), and the CPU benchmark table as a plot.

    python bench/figures.py                 # writes docs/phases.png and docs/results.png
    python bench/figures.py --results bench/results/cpu.json --out docs

The results plot reads the CPU preset's result file (``verl-prefix bench --preset cpu``), the same numbers as
the table in docs/benchmarks.md: one update's speedup over verl's stock ``fsdp2`` engine, the forward-only
pass's, and the FLOP model's prediction, per cell (prompt / response / group size).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT, RESPONSE, FORWARD, BACKWARD = "#4c72b0", "#dd8452", "#55a868", "#c44e52"


def _box(ax, x, y, w, h, color, text="", alpha=1.0, fontsize=9, text_color="white"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.01,rounding_size=0.05", fc=color, ec="none",
                                alpha=alpha))  # fmt: skip
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def _arrow(ax, start, end, color="#444444", style="-|>", ls="-"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color, lw=1.4, ls=ls))


def phases(path: Path) -> None:
    """A GRPO group (one prompt, G responses) through phases A, B and C; beside it, the trie across groups."""
    fig, ax = plt.subplots(figsize=(10, 3.6))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 3.6)
    ax.axis("off")

    # dense: G copies of the prompt
    ax.text(1.05, 3.35, "dense: G copies", ha="center", fontsize=10, weight="bold")
    for i in range(4):
        y = 2.7 - i * 0.42
        _box(ax, 0.1, y, 1.3, 0.32, PROMPT, "prompt" if i == 0 else "", alpha=0.45)
        _box(ax, 1.42, y, 0.55, 0.32, RESPONSE, f"r{i + 1}" if i < 3 else "rG", fontsize=8)
    ax.text(1.05, 0.75, "forward + backward\nover the prompt G times", ha="center", va="top", fontsize=8.5,
            color="#444444")  # fmt: skip

    ax.plot([2.3, 2.3], [0.3, 3.4], color="#bbbbbb", lw=1)

    # prefix_fsdp2
    ax.text(4.55, 3.35, "prefix_fsdp2: one group", ha="center", fontsize=10, weight="bold")
    _box(ax, 2.6, 2.35, 1.6, 0.5, PROMPT, "A  prefix forward\nonce, keep K/V", fontsize=8.5)
    _box(ax, 2.6, 0.45, 1.6, 0.5, BACKWARD, "C  prefix backward\nseeded with dK/dV", fontsize=8.5)
    ax.text(3.4, 1.65, "K/V", ha="center", fontsize=9, color=PROMPT, weight="bold")
    _arrow(ax, (3.4, 2.33), (3.4, 1.8), PROMPT)
    _arrow(ax, (3.95, 1.62), (4.65, 1.62), PROMPT)
    for i in range(4):
        y = 2.55 - i * 0.5
        _box(ax, 4.7, y, 0.95, 0.36, RESPONSE, f"B  r{i + 1}" if i < 3 else "B  rG", fontsize=8.5)
        _arrow(ax, (5.7, y + 0.18), (6.05, y + 0.18), "#888888")
    ax.text(6.15, 1.85, "loss,\nbackward\nper micro-\nbatch", fontsize=8, va="center", color="#444444")
    ax.text(3.95, 1.1, "dK/dV summed", ha="center", fontsize=8.5, color=BACKWARD)
    _arrow(ax, (4.65, 1.0), (3.4, 0.98), BACKWARD)
    ax.text(4.55, 0.12, "gradients = dense's, up to rounding", ha="center", fontsize=8.5, style="italic")

    ax.plot([7.05, 7.05], [0.3, 3.4], color="#bbbbbb", lw=1)

    # the trie
    ax.text(8.55, 3.35, "prefix_reuse.tree: a trie", ha="center", fontsize=10, weight="bold")
    _box(ax, 7.35, 2.45, 2.4, 0.4, PROMPT, "system block (all groups)", fontsize=8.5)
    for j, x in enumerate((7.35, 8.6)):
        _arrow(ax, (8.55, 2.43), (x + 0.57, 1.9), "#888888")
        _box(ax, x, 1.45, 1.15, 0.42, PROMPT, f"question {j + 1}", alpha=0.7, fontsize=8.5)
        for k in range(3):
            xx = x + k * 0.39
            _arrow(ax, (x + 0.57, 1.43), (xx + 0.17, 1.05), "#aaaaaa")
            _box(ax, xx, 0.65, 0.34, 0.38, RESPONSE, "r", fontsize=8)
    ax.text(8.55, 0.12, "each shared node computed once per rank", ha="center", fontsize=8.5, style="italic")

    fig.savefig(path, dpi=130, bbox_inches="tight", facecolor="white")
    plt.close(fig)


def _label(cell: dict) -> str:
    """``prompt 2048 / resp 128 / G=8`` on three lines; a cell on another model says which."""
    text = f"prompt {cell['prompt_len']}\nresponse {cell['response_lens'][0]}\nG={cell['group_size']}"
    return f"{text}\n(MoE, {cell['model']['params'] / 1e6:.1f}M)" if cell["model"]["num_experts"] else text


def results(result_file: Path, path: Path) -> None:
    """Speedup over the stock engine per cell of the CPU preset: update, forward-only, FLOP model."""
    result = json.loads(result_file.read_text())
    cells = [c for c in result["cells"] if "dense_median_s" in c]
    labels = [_label(c) for c in cells]
    series = [
        ("update (forward + backward)", "ratio_median", PROMPT),
        ("forward-only (old/ref log-probs)", "infer_ratio_median", FORWARD),
        ("FLOP model", "predicted_speedup", "#999999"),
    ]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.27
    for k, (name, key, color) in enumerate(series):
        xs = [i + (k - 1) * width for i in range(len(cells))]
        values = [c.get(key) or 0.0 for c in cells]
        bars = ax.bar(xs, values, width, label=name, color=color)
        if k == 0:
            for bar, value in zip(bars, values):
                ax.text(bar.get_x() + bar.get_width() / 2, value + 0.1, f"{value:.2f}x", ha="center", fontsize=8)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels(labels, fontsize=7.5)
    ax.set_ylabel("speedup over verl's fsdp2\n(dashed: 1, no gain)")
    machine = result.get("machine", {})
    model = cells[0]["model"]
    ax.set_title(
        f"One GRPO update, {model['params'] / 1e6:.1f}M-parameter {model['family']}, {cells[0]['dtype']}, "
        f"{machine.get('cpu_count', '?')} vCPU ({result['date'][:10]}); gradients match to ~3e-6",
        fontsize=9.5,
    )
    ax.legend(fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.savefig(path, dpi=130, bbox_inches="tight", facecolor="white")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "bench/results/cpu.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args(argv)
    phases(args.out / "phases.png")
    results(args.results, args.out / "results.png")
    print(f"wrote {args.out / 'phases.png'} and {args.out / 'results.png'}")


if __name__ == "__main__":
    main()
