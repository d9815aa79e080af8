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
# prefix_torchtitan (docs/torchtitan.md): torchtitan 0.3.0 and what it imports, pinned and without their own
# dependencies, so that nothing already installed (torch, transformers, verl, datasets, fsspec) changes.
# triton is imported by torchtitan's model stack even on CPU. SKIP_TORCHTITAN=1 leaves them out.
if [ -z "${SKIP_TORCHTITAN:-}" ]; then
  .venv/bin/python -m pip install --quiet --no-deps torchtitan==0.3.0 triton==3.9.0 einops==0.8.2 spmd_types==0.2.3 \
    torch_checkpointing==0.1.1 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1
fi
# verl's Megatron engine on CPU (docs/megatron.md): megatron-core, Megatron-Bridge (verl's default loader) and mbridge
# (its deprecated vanilla_mbridge loader), pinned and without their own dependencies (Megatron-Bridge's name
# TransformerEngine, CUDA wheels and transformers<5): the platform layer (verl_prefix.backend.megatron.platform) is
# written against these versions. mbridge imports einops without declaring it; Megatron-Bridge imports triton.
# SKIP_MEGATRON=1 leaves them out.
if [ -z "${SKIP_MEGATRON:-}" ]; then
  .venv/bin/python -m pip install --quiet --no-deps megatron-core==0.16.1 megatron-bridge==0.3.1 mbridge==0.15.1 \
    einops==0.8.2 triton==3.9.0
fi
.venv/bin/python -c "import verl, verl_prefix; assert verl_prefix.is_registered(); print('verl-prefix ready:', verl.__version__)"
