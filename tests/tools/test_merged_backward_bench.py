"""``bench/merged_backward.py`` (run on the GPU by ``bench/gpu_check.sh``) runs its code on small CPU shapes and
writes one row per prefix length with both medians and their ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "merged_backward.json"
    cmd = [sys.executable, str(ROOT / "bench" / "merged_backward.py"), "--tiny", "--reps", "2", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["P"] for r in rows] == [16, 64]
    assert all(r["unsplit_ms"] > 0 and r["split_ms"] > 0 and r["speedup"] > 0 and r["splits"] == 1 for r in rows)
