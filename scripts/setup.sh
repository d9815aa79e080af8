#!/usr/bin/env bash
# One-shot set-up on a fresh machine: a virtualenv in .venv with the torch wheel first (so no
# multi-GB CUDA build is pulled in by accident), then verl-prefix with its test tools.
# TORCH_SPEC overrides the torch requirement (e.g. TORCH_SPEC="torch==2.11.0" on a GPU node).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "$TORCH_SPEC"
.venv/bin/python -m pip install --quiet -e '.[test,dashboard]'
.venv/bin/python -c "import verl, verl_prefix; assert verl_prefix.is_registered(); print('verl-prefix ready:', verl.__version__)"
