"""The built wheel is a complete install: a fresh venv beside verl runs the CPU demo from it.

``python -m build`` makes the wheel from a copy of the package sources (so nothing of the checkout leaks in);
a new virtualenv sees verl and its dependencies (this interpreter's site-packages, through a ``.pth`` line:
installing verl from the registry again would take minutes and the network) and gets the wheel with ``pip
install --no-deps``. Everything then runs from a directory outside the checkout with no ``PYTHONPATH``: the
package, its entry points, the ``verl-prefix`` command and the demo's Ray workers can only find the wheel's copy.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "verl_prefix")
# what this file's conftest sets for in-process tests; a user's shell has none of it
_TEST_ENV = ("PYTHONPATH", "VERL_PLATFORM", "VERL_ENGINE_DEVICE", "VERL_USE_EXTERNAL_PLUGINS")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _run(cmd: list[str], cwd: Path, timeout: float = 300, *, user: bool = True) -> subprocess.CompletedProcess:
    """``cmd`` in a user's environment (``user``), or in this test's own (the build: its tools are here)."""
    env = {k: v for k, v in os.environ.items() if not (user and k in _TEST_ENV)}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``python -m build --wheel`` on a copy of the sources the wheel is made of (no isolation: offline)."""
    pytest.importorskip("build", reason="the test extra installs build")
    pytest.importorskip("setuptools", reason="the test extra installs setuptools (the build backend)")
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(src)], src, user=False)
    (built,) = dist.glob("verl_prefix-*-py3-none-any.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A new virtualenv that sees verl's stack (not this package) and has the wheel installed."""
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root)
    python = root / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=root)
    stack = [p for p in site.getsitepackages() if Path(p, "verl").is_dir()]
    assert stack, "verl is not installed beside this interpreter"
    Path(purelib.stdout.strip(), "verl_stack.pth").write_text("\n".join(stack) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)], root)
    return root


def test_wheel_holds_the_package_and_its_entry_points(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert {n.split("/")[0] for n in names} == {"verl_prefix", wheel.name.split("-py3")[0] + ".dist-info"}
    packaged = {n for n in names if n.startswith("verl_prefix/")}
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "verl_prefix").rglob("*.py")}
    assert packaged == sources  # every module, nothing else (no tests, configs or results)
    assert "[verl.plugins]\nverl_prefix = verl_prefix" in entry_points
    assert "verl-prefix = verl_prefix.tools.cli:main" in entry_points
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any('extra == "gpu"' in line and "vllm" in line for line in requires)
    assert not [line for line in requires if "flash" in line]  # a source-only build in no extra


def test_fresh_venv_imports_the_wheel_through_verl(venv, tmp_path):
    """``import verl`` loads the wheel's copy through the entry point and the engine registers."""
    probe = (
        "import json, sys, verl\n"
        "loaded_by_verl = 'verl_prefix' in sys.modules\n"
        "import verl_prefix\n"
        "print(json.dumps({'file': verl_prefix.__file__, 'loaded_by_verl': loaded_by_verl,"
        " 'registered': verl_prefix.is_registered(), 'verl': verl.__version__}))"
    )
    done = _run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(report["file"]).is_relative_to(venv), report["file"]
    assert not Path(report["file"]).is_relative_to(ROOT)
    assert report["loaded_by_verl"] is True and report["registered"] is True
    assert report["verl"].startswith("0.9.")


def test_fresh_venv_runs_the_demo(venv, tmp_path):
    """The ``verl-prefix demo`` command of the venv, a short run (one step, 2 prompts x 4 samples)."""
    out = tmp_path / "demo"
    done = _run(
        [str(venv / "bin" / "verl-prefix"), "demo", "--steps", "1", "--prompts", "2", "--n", "4", "--no-wandb",
         "--out-dir", str(out)],
        cwd=tmp_path, timeout=480,
    )  # fmt: skip
    assert "update_actor speedup" in done.stdout
    summary = json.loads((out / "demo.json").read_text())
    assert len(summary["steps"]) == 1
    assert summary["max_grad_norm_rel"] < 1e-4 and summary["max_update_rel"] < 1e-2  # stock and prefix agree
