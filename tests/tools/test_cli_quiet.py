"""The ``verl-prefix`` command starts without verl's import-time noise; library users still see it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_prefix._cli_quiet import invoked_as_cli

ROOT = Path(__file__).resolve().parents[2]
NOISE = ("engine is not available", "No supported accelerator detected", "is registered but not available")
CONSOLE_SCRIPT = (  # what pip's generated `verl-prefix` script does
    "import sys; sys.argv[0] = '/venv/bin/verl-prefix'; from verl_prefix.tools.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}  # as a user's shell has it
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.e2e  # the command in a fresh interpreter, as a user runs it
def test_help_has_no_verl_noise():
    """``python -m verl_prefix.tools.cli`` answers like the ``verl-prefix`` command, without verl's noise."""
    proc = _run("-m", "verl_prefix.tools.cli", "--help")
    assert proc.returncode == 0 and all(command in proc.stdout for command in ("dashboard", "bench", "replay"))
    assert not [n for n in NOISE if n in proc.stderr], proc.stderr
    assert "RuntimeWarning" not in proc.stderr, proc.stderr  # runpy: cli.py was not imported early


@pytest.mark.e2e  # the command in a fresh interpreter, as a user runs it
def test_a_quick_command_prints_only_its_own_error():
    proc = _run("-c", CONSOLE_SCRIPT, "trace", "show", "/nonexistent-trace")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["verl-prefix: error: trace directory /nonexistent-trace does not exist"]


@pytest.mark.e2e  # the command in a fresh interpreter, as a user runs it
def test_negative_control_library_import_still_warns():
    proc = _run("-c", "import verl_prefix")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "UserWarning: torchtitan engine is not available" in proc.stderr, proc.stderr
    if not torch.cuda.is_available():
        assert "No supported accelerator detected" in proc.stderr


def test_invoked_as_cli():
    assert invoked_as_cli("/venv/bin/verl-prefix", ["python", "/venv/bin/verl-prefix", "demo"])
    assert invoked_as_cli("-m", ["python", "-X", "importtime", "-m", "verl_prefix.tools.cli", "--help"])
    assert not invoked_as_cli("", ["python", "-c", "import verl_prefix.tools.cli"])
    assert not invoked_as_cli("/venv/bin/pytest", ["python", "-m", "pytest", "verl_prefix/tools/cli.py"])
