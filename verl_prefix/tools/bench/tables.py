"""Bench results as markdown: one table per result kind (classic cells, variant cells, capacity), and the
marker-delimited block of a markdown file that the CLI's ``--table`` rewrites in place (bench and replay).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from verl_prefix.tools.bench.capacity import capacity_table

# The tolerance ``max_rel_grad_diff`` (the worst parameter's ||g - g_ref|| / ||g_ref|| against the stock engine,
# or against concat where the stock engine does not run) is held to, by the dtype the engines compute in. Every
# result carries its verdict (``grad_check``: pass/fail) beside the tolerance it was judged by:
GRAD_TOLERANCE = {
    # rounding only: the tests' fp64 bound against HF and the stock engine
    "float64": 1e-10,
    # other kernels, another summation order: the tests' fp32 bound on CUDA (tests/backend/test_cuda.py); the
    # stored CPU results measured 1.2e-6 to 8.7e-6
    "float32": 1e-4,
    # a gross-error bound only: two bf16 runs differ by bf16 rounding of different reduction orders, measured on
    # the 1M smoke model (CPU) at 0.03-0.42 for the worst parameter while the stock engine's own bf16 error
    # against fp32 was 0.25-0.83. NaN, a missing phase C or a wrong mask still fail it; bf16 exactness is judged
    # against an fp32 run by tests/backend/test_cuda.py (reuse's error within 1.5x the stock engine's own)
    "bfloat16": 0.5,
}


def grad_check(max_rel_grad_diff: float | None, dtype: str) -> dict[str, Any]:
    """``{"grad_check": "pass" | "fail", "max_rel_grad_diff_tolerance": t}`` for a result in ``dtype``; a NaN
    fails. Empty where nothing was compared (the stock engine's own row)."""
    if max_rel_grad_diff is None:
        return {}
    tolerance = GRAD_TOLERANCE[dtype]
    passed = max_rel_grad_diff <= tolerance  # False for NaN
    return {"grad_check": "pass" if passed else "fail", "max_rel_grad_diff_tolerance": tolerance}


def grad_check_failures(result: dict) -> list[str]:
    """One line per result whose gradient check failed (``cell variant: diff > tolerance``)."""
    failures = []
    for c in result.get("cells", []):
        entries = c["variants"].items() if "variants" in c else [("prefix_fsdp2", c)]
        for name, entry in entries:
            check = entry if entry.get("grad_check") else grad_check(entry.get("max_rel_grad_diff"), c["dtype"])
            if check and check["grad_check"] != "pass":
                failures.append(
                    f"{c['cell']} {name}: max_rel_grad_diff {entry['max_rel_grad_diff']:.3e} > "
                    f"{check['max_rel_grad_diff_tolerance']:.0e} ({c['dtype']})"
                )
    return failures


def _verdict(entry: dict, dtype: str) -> str:
    """The table's word for a result's gradient check (computed for results stored before they carried it)."""
    check = entry.get("grad_check") and entry
    if not check:
        check = grad_check(entry.get("max_rel_grad_diff"), dtype)
    if not check:
        return "-"
    word = "pass" if check["grad_check"] == "pass" else "FAIL"
    return f"{word} (<= {check['max_rel_grad_diff_tolerance']:.0e})"


TABLE_HEADER = (
    "| cell | params | dense update (s) | prefix update (s) | speedup median | speedup of medians "
    "| FLOP model | forward-only speedup | max rel grad diff | grad check |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
)


def markdown_table(result: dict) -> str:
    """The result as a markdown table, one row per cell (what the CLI prints and docs embed); variant cells
    get ``variants_table`` (then the other cells' table below it, as the gpu preset's torchtitan cell), a
    capacity result ``capacity.capacity_table``."""
    if "capacity" in result:
        return capacity_table(result["capacity"])
    if any("measured_over_predicted" in c for c in result["cells"]):
        return tree_table(result)
    classic = [c for c in result["cells"] if "variants" not in c]
    tables = [variants_table(result)] if len(classic) < len(result["cells"]) else []
    if classic:
        tables.append(_classic_table(classic))
    return "\n\n".join(tables)


def _classic_table(cells: list[dict]) -> str:
    rows = [TABLE_HEADER]
    for c in cells:
        rows.append(
            f"| {c['cell']} | {c['model']['params'] / 1e6:.2f}M | {c['dense_median_s']:.3f} | "
            f"{c['prefix_median_s']:.3f} | {c['ratio_median']:.2f}x | {c['ratio_of_medians']:.2f}x | "
            f"{c['predicted_speedup']:.2f}x | {c['infer_ratio_median']:.2f}x | {c['max_rel_grad_diff']:.1e} | "
            f"{_verdict(c, c['dtype'])} |"
        )
    return "\n".join(rows)


VARIANTS_HEADER = (
    "| cell | variant | reps | update median (s) | speedup vs stock | time / concat | saved for backward, "
    "B per micro-batch (MiB) | held (MiB) | attention saved per micro-batch (MiB) | attention K/V inputs (MiB) "
    "| peak RSS, fresh process (MiB) | phase-B micro-batches merged/concat | max rel grad diff | grad check |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
)


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def variants_table(result: dict) -> str:
    """Variant cells as a markdown table, one row per cell and variant. Speedups are medians of per-rep
    ratios (stock / variant), and the stock row shows the FLOP model's prediction for reuse; "time / concat"
    is the median of per-rep merged / concat times (below 1: merged faster). Attention K/V inputs: what
    the shapes say a micro-batch hands its kernels (``attention_kv_bytes``); "attention saved": measured
    (``count_attention_saved``)."""
    rows = [VARIANTS_HEADER]
    for c in result["cells"]:
        if "variants" not in c:
            continue
        for name, v in c["variants"].items():
            counts = v.get("phase_b_micro_batches")
            ran = "-" if counts is None else f"{counts['merged']:g}/{counts['concat']:g}"
            if counts is not None and counts.get("merged_varlen"):
                ran += f" (varlen {counts['merged_varlen']:g})"
            attention = max(v["attention_saved_mib"]) if v.get("attention_saved_mib") else None
            rss = v.get("fresh_process", {}).get("peak_rss_mib")
            ratio = c.get(f"{name}_over_concat_time_median") if name in ("merged", "merged_varlen") else None
            speedup = _fmt(v.get("speedup_vs_stock_median"), ".2f", "x")
            if name == "fsdp2" and "predicted_speedup" in c:
                speedup = f"FLOP model {c['predicted_speedup']:.2f}x"
            rows.append(
                f"| {c['cell']} | {name} | {c['reps']} | {v['update_median_s']:.3f} | "
                f"{speedup} | {_fmt(ratio, '.3f')} | "
                f"{_fmt(v['saved_for_backward_per_micro_batch_mib'], '.1f')} | "
                f"{_fmt(v['saved_for_backward_held_mib'], '.1f')} | {_fmt(attention, '.1f')} | "
                f"{_fmt(v.get('attention_kv_mib', {}).get('held'), '.1f')} | {_fmt(rss, '.0f')} | "
                f"{ran} | "
                f"{_fmt(v.get('max_rel_grad_diff'), '.1e')} | {_verdict(v, c['dtype'])} |"
            )
    return "\n".join(rows)


TREE_HEADER = (
    "| cell | params | reps | trie nodes / depth | stock update (s) | one-level (s) | tree (s) "
    "| one-level vs stock (FLOP model) | tree vs stock (FLOP model) | tree vs one-level (FLOP model) "
    "| tree: measured / model | max rel grad diff one-level / tree | grad check |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
)


def tree_table(result: dict) -> str:
    """Tree cells (stock, one-level reuse, tree) as a markdown table: update medians, each speedup (median of
    per-rep ratios) beside its FLOP model (``tree_flops``), and the tree's measured speedup over the model's."""
    rows = [TREE_HEADER]
    for c in result["cells"]:
        if "measured_over_predicted" not in c:
            continue
        v, m, p = c["variants"], c["measured"], c["predicted"]
        one, tree = v["one_level"], v["tree"]
        checks = "/".join(_verdict(x, c["dtype"]).split(" ")[0] for x in (one, tree))
        rows.append(
            f"| {c['cell']} | {c['model']['params'] / 1e6:.2f}M | {c['reps']} | {c['tree']['nodes']} / "
            f"{c['tree']['depth']} | {v['fsdp2']['update_median_s']:.3f} | {one['update_median_s']:.3f} | "
            f"{tree['update_median_s']:.3f} | {m['one_level']:.2f}x ({p['one_level']:.2f}x) | "
            f"{m['tree']:.2f}x ({p['tree']:.2f}x) | {m['tree_over_one_level']:.2f}x ({p['tree_over_one_level']:.2f}x) "
            f"| {c['measured_over_predicted']['tree']:.0%} | {one['max_rel_grad_diff']:.1e} / "
            f"{tree['max_rel_grad_diff']:.1e} | {checks} |"
        )
    return "\n".join(rows)


def update_table_file(path: Path, preset: str, table: str) -> None:
    """Replace this preset's table between marker comments in ``path``, or append it (creating the file)."""
    start, end = f"<!-- bench:{preset}:start -->", f"<!-- bench:{preset}:end -->"
    block = f"{start}\n{table}\n{end}"
    text = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + block + "\n"
    path.write_text(text)
