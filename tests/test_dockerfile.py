"""docker/Dockerfile: verl's published image plus the wheel, nothing compiled.

Read statically everywhere (the image it starts from, what each stage copies and runs, that .dockerignore lets
through exactly what the wheel stage copies); built for real where a Docker daemon answers (e2e).
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = [[]]
    for op, args in _instructions():
        if op == "FROM":
            stages.append([])
        stages[-1].append((op, args))
    return stages


def test_final_stage_is_verl_image_plus_the_wheel():
    preamble, wheel_stage, final = _stages()
    (arg,) = [a for op, a in preamble if op == "ARG"]
    name, image = arg.split("=", 1)
    assert name == "VERL_IMAGE" and re.fullmatch(r"verlai/verl:vllm0\d\d\.\w+", image), image
    assert final[0] == ("FROM", "${VERL_IMAGE}")
    assert [op for op, _ in final[1:]] == ["COPY", "RUN"]
    assert final[1][1].startswith("--from=wheel ")
    run = final[2][1]
    assert "pip install --no-cache-dir /tmp/verl-prefix-dist/verl_prefix-*-py3-none-any.whl" in run
    for compiled in ("flash", "-e ", "--no-build-isolation", "git+", "[gpu]", "apt-get"):
        assert compiled not in run, compiled
    assert "verl_prefix.is_registered()" in run


def test_wheel_stage_copies_what_the_context_holds():
    """The wheel stage copies only the package sources, all of which exist and pass .dockerignore."""
    _, wheel_stage, _ = _stages()
    assert wheel_stage[0][1].endswith(" AS wheel")
    copied = [Path(p).name for op, args in wheel_stage if op == "COPY" for p in args.split()[:-1]]
    assert copied == ["pyproject.toml", "README.md", "verl_prefix"]
    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]

    def sent(path: str) -> bool:  # Docker's rule: the last matching pattern decides
        keep = True
        for pattern in patterns:
            negated = pattern.startswith("!")
            if fnmatch.fnmatch(path, pattern.lstrip("!")):
                keep = negated
        return keep

    for name in copied:
        assert (ROOT / name).exists() and sent(name), name
    assert not sent(".venv") and not sent("outputs") and not sent("tests")


def _docker_daemon() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


@pytest.mark.e2e
@pytest.mark.timeout(3600)
@pytest.mark.skipif(not _docker_daemon(), reason="no Docker daemon answers `docker info`")
def test_image_builds():
    """Pulls verl's image (tens of GB) and adds the wheel; the build's last step imports the plugin."""
    done = subprocess.run(
        ["docker", "build", "-f", str(DOCKERFILE), "-t", "verl-prefix:test", str(ROOT)],
        capture_output=True, text=True, timeout=3500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-5000:]
