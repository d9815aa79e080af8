"""Run ``recipes/grpo_cpu_smoke.sh`` (verl's own ``main_ppo`` on CPU) from a test, and read what it wrote.

A launch costs a minute or more of CPU on 2 cores, so tests start their launches in the background
(``start_recipe``), run them side by side, and wait for each (``finish_recipe``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_cpu_smoke.sh"


def start_recipe(
    out: Path, *, mode: str, steps: int, save_at: int, env: dict | None = None, args: Sequence[str] = ()
) -> subprocess.Popen:
    """The recipe in the background (its own process group), its output to ``out/recipe.log``; ``args`` go
    to both of its ``main_ppo`` launches."""
    full_env = {
        **os.environ,
        "OUT": str(out),
        "STEPS": str(steps),
        "SAVE_AT": str(save_at),
        "MODE": mode,
        "PYTHON": sys.executable,
        "WANDB_MODE": "offline",
        **(env or {}),
    }
    out.mkdir(parents=True, exist_ok=True)
    with (out / "recipe.log").open("w") as log:
        return subprocess.Popen(
            ["bash", str(RECIPE), *args],
            env=full_env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: a run cut short is stopped with main_ppo and Ray
        )


def stop(proc: subprocess.Popen) -> None:
    """Kill a recipe run and everything it started (its process group), if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def finish_recipe(proc: subprocess.Popen, out: Path, timeout: float = 1200) -> str:
    """Wait for a recipe run; its log, which must end in success."""
    try:
        proc.wait(timeout=timeout)
    finally:
        stop(proc)
    log = (out / "recipe.log").read_text()
    assert proc.returncode == 0, log[-6000:]
    return log


def metrics(path: Path) -> dict[int, dict]:
    """verl's file logger output: ``{step: metrics}``."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(r["step"]): r["data"] for r in rows}


def ray_tmpdir(name: str) -> str:
    """A short per-worker Ray temp dir (Ray's socket paths have a length limit): a launch's own local cluster."""
    return f"/tmp/ray_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}_{name}"
