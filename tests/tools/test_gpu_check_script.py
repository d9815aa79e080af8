"""``bench/gpu_check.sh`` stays ready for a GPU run: every test file and test it names exists (a renamed test would
otherwise turn a device cell into "no tests ran", found only on the device), the script parses, and each test step's
time limit is cut to what is left of its budget."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def test_every_named_test_exists():
    text = SCRIPT.read_text()
    named = set(re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", text))
    assert len(named) >= 10
    for path, test in named:
        assert (ROOT / path).is_file(), path
        if test:
            assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), f"{path}::{test}"


def test_script_parses_and_caps_its_steps():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    limits = re.findall(r"VERL_PLATFORM=nvidia timeout --signal=INT --kill-after=15 (\S+)", SCRIPT.read_text())
    assert limits and all(limit == '"$(cap' for limit in limits), limits
