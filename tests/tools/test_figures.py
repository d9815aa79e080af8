"""``bench/figures.py`` redraws the README's two pictures from the committed benchmark result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_figures_redraw(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "bench/figures.py"), "--out", str(tmp_path)], check=True, timeout=120
    )  # fmt: skip
    for name in ("phases.png", "results.png"):
        png = (tmp_path / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000, name
        assert (ROOT / "docs" / name).exists(), name  # the committed copy the README shows
