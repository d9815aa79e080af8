"""``bench/compare_revisions.py``: old vs new revision in temporary worktrees, interleaved (no timing assertions:
speed claims live in the benchmark pages, and CI machines are noisy)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench/compare_revisions.py"
_spec = importlib.util.spec_from_file_location("compare_revisions", SCRIPT)
CR = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = CR  # dataclasses look their module up there
_spec.loader.exec_module(CR)

# A stand-in for a bench command: reports 1 s per call on the old side and 2 s on the new (times the call's
# number on that side), the stock engine 5 s on both, and which package the run imported.
FAKE = """
import importlib.util, json, pathlib, sys
out, count = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
n = int(count.read_text()) + 1
count.write_text(str(n))
value = (2.0 if pathlib.Path.cwd().name == "new" else 1.0) * n
origin = importlib.util.find_spec("verl_prefix").origin
out.write_text(json.dumps({"machine": {"cpu_count": 2}, "steps": [{"prefix_median_s": value, "dense_median_s": 5.0,
                "tokens": 123, "origin": origin}]}))
"""
FAKE_RUN = CR.Run(
    "fake",
    ("-c", FAKE, "{out}", "{work}/count"),
    setup=(("-c", "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('0')", "{work}/count"),),
    batch=("steps", 0, "tokens"),
)
FAKE_ROW = CR.Row("fake row", FAKE_RUN, ("steps", 0, "prefix_median_s"), ("steps", 0, "dense_median_s"), "a stand-in")


def _git_checkout() -> None:
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")


def _worktrees() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout


def _check_table(md: str, rows: list[str]) -> list[list[str]]:
    """The table's header, separator and one line per row, each with 7 cells; the cells of the rows."""
    lines = [line for line in md.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| row | old median (s) | new median (s) | new/old |"), lines[0]
    assert lines[1] == "|---|---:|---:|---:|---:|---:|---:|"
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[0] for c in cells] == rows
    assert all(len(c) == 7 for c in cells)
    return cells


def test_summary_reads_medians_ratio_and_noise():
    series = CR.Series(old=[1.0, 3.0, 2.0], new=[1.0, 2.0, 4.0], old_control=[5.0, 5.0, 5.0], new_control=[5.0] * 3)
    summary = CR.summarise(series)
    assert summary["old_median_s"] == 2.0 and summary["new_median_s"] == 2.0
    assert summary["ratio"] == summary["new_median_s"] / summary["old_median_s"]
    assert summary["round_ratios"] == [1.0, 2.0 / 3.0, 2.0]
    assert summary["old_rel_iqr"] == pytest.approx(0.5)  # quartiles 1.5 and 2.5 over median 2
    assert summary["noise"] == max(summary["old_rel_iqr"], summary["new_rel_iqr"])
    assert summary["control_ratio"] == 1.0
    one = CR.summarise(CR.Series(old=[2.0], new=[3.0]))
    assert one["noise"] is None and one["ratio"] == 1.5 and "control_ratio" not in one


def test_rows_cover_the_four_speed_rows():
    assert set(CR.DEFAULT_ROWS) == {"update", "forward-only", "ragged 4-group", "agentic tree"}
    for name in CR.DEFAULT_ROWS:
        argv = CR.ROWS[name].run.argv
        assert argv[:2] == ("-m", "verl_prefix.tools.cli")  # the command line, never a module inside tools/
        assert "{out}" in argv and "{reps}" in argv


def test_interleaved_on_two_worktrees_then_removed(tmp_path):
    """The orchestration with a stand-in command: both revisions in their own worktree, old and new alternating,
    the table and the JSON written, the worktrees gone afterwards."""
    _git_checkout()
    lines: list[str] = []
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    result = CR.compare("HEAD", "HEAD", [FAKE_ROW], repeats=3, out_md=md, out_json=js, log=lines.append)
    rounds = [line for line in lines if line.startswith("round")]
    assert [re.search(r" (old|new): ", line).group(1) for line in rounds] == ["old", "new"] * 3
    row = json.loads(js.read_text())["rows"]["fake row"]
    assert row["old_s"] == [1.0, 2.0, 3.0] and row["new_s"] == [2.0, 4.0, 6.0]
    assert row["ratio"] == pytest.approx(row["new_median_s"] / row["old_median_s"]) == pytest.approx(2.0)
    assert row["round_ratios"] == [2.0, 2.0, 2.0] and row["control_ratio"] == 1.0 and row["same_batch"]
    assert result["old"]["sha"] == result["new"]["sha"] and result["repeats_done"] == 3
    cells = _check_table(md.read_text(), ["fake row"])
    assert cells[0][1:4] == ["2.000", "4.000", "2.000"]
    assert "verl_prefix_revisions_" not in _worktrees()


@pytest.mark.e2e  # the verl-prefix bench in fresh interpreters, twice
def test_script_on_the_smallest_row(tmp_path):
    _git_checkout()
    md = tmp_path / "revisions.md"
    cmd = [sys.executable, str(SCRIPT), "--old", "HEAD", "--new", "HEAD", "--row", "update", "--repeats", "1",
           "--bench-reps", "1", "--out", str(md)]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    result = json.loads(md.with_suffix(".json").read_text())
    row = result["rows"]["update"]
    assert row["ratio"] == pytest.approx(statistics.median(row["new_s"]) / statistics.median(row["old_s"]))
    assert row["same_batch"] and row["noise"] is None and math.isfinite(row["control_ratio"])
    _check_table(md.read_text(), ["update"])
    assert "verl_prefix_revisions_" not in _worktrees()
