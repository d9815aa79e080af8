#!/usr/bin/env bash
# The GPU check in one command (docs/gpu.md; how the project's own checks run it on a borrowed machine:
# docs/maintainers/gpu-check.md): from the repo root, `bash bench/gpu_check.sh`, with .whl/ built by
# `bash scripts/gpu_kit.sh` beside the working tree where the machine lacks verl. It installs the kit into /tmp/site, prints the
# machine and versions, runs the smoke preset on CUDA as a sanity step (about a minute, fails fast),
# then `verl-prefix bench --preset gpu`, and leaves in $OUT (at most 8 files come back):
#   env.txt          nvidia-smi, python3 -m pip list, the versions verl_prefix imports
#   smoke.log/.json  the CUDA sanity step
#   cuda_tests.log   tests/backend/test_cuda.py on the GPU (exactness, bf16 error vs an fp32 run with the phase-B
#                    attention each case ran, allocator peaks, NCCL), the CUDA varlen kernels against the CPU
#                    reference, the kernel checks of tests/schedule/test_kernels.py, then the offload residency
#                    check tests/schedule/test_offload_cuda.py, the sliding-window cell
#                    tests/backend/test_windows_cuda.py and the settings cells tests/backend/test_cuda_settings.py
#                    (all appended)
#
# Issue 27's cells (each item's CPU test runs in CI; these are the device's side of it):
#   1  merged_varlen without host syncs: test_varlen_attention.py::test_cuda_varlen_layer_has_no_host_sync, two layers
#      forward and backward under torch.cuda.set_sync_debug_mode("error") (CUDA_TESTS)
#   3  offload's pinned slabs: test_offload_cuda.py::test_offload_pinned_slabs_on_cuda, cudaHostRegister'd, nothing
#      through torch's caching host allocator, bounded, released (OFFLOAD_TESTS)
#   4  merged's suffix K/V unrepeated on CUDA: test_kernels.py::test_cuda_merged_takes_gqa_unrepeated (CUDA_TESTS)
#   5  bf16 with CUDA's rounding: the bf16 cells of test_cuda.py (1.5x the stock engine's own error) (CUDA_TESTS)
#   6  flash-attn's deterministic backward: test_varlen_attention.py::
#      test_cuda_flash_attn_backward_is_deterministic_when_asked, where flash-attn >= 2.7 is installed (CUDA_TESTS)
#   7  fla's dispatch kept off FlashQLA: test_recurrent_cuda.py::test_fla_dispatch_keeps_flashqla_off_under_reuse
#      (CUDA_TESTS; FlashQLA itself only where the kit carries flash_qla, on SM90/SM100)
#   9  param_offload, optimizer_offload, offload_policy, reshard_after_forward (false and true), activation offload,
#      and verl's fused kernels on the triton and liger backends (bf16, tied and untied), reuse asserted in each:
#      tests/backend/test_cuda_settings.py (SETTINGS_TESTS)
#   Every test step's time limit is cut to what is left of BUDGET (cap), so the script ends inside one 600 s call
#   whatever runs; the bench gets the rest. The first run of these cells: BENCH=0 (about 5 minutes).
#   gpu_bench.log    the gpu preset's log (per-rep times; all that is left if the bench is cut short)
#   gpu.json         the result, rewritten after every cell ("complete": false while cells are missing)
#   benchmarks.md    a copy of docs/benchmarks.md with the gpu table written in by the CLI (between
#                    <!-- bench:gpu:start/end --> markers; appended at the end while the doc has none)
#   nvidia_smi.csv   GPU memory, utilisation and clocks every 5 s during both runs
#
# The gpu preset's cells run three engines side by side: the stock fsdp2 engine and
# prefix_fsdp2 with prefix_reuse.phase_b_attention=merged and =concat, interleaved rep by rep (rotating
# order), each timed for one update and one forward-only pass; the table has one row per cell and engine.
# A fourth, prefix_fsdp2 with =merged_varlen (packed suffixes), runs on torch's own varlen flash attention
# (torch >= 2.10: the device's torch 2.11 has it) or else flash-attn >= 2.7; where neither serves the cell logs
# the skip (gpu.json: skipped_variants). Every variant's gradients are checked against the stock engine
# (gpu.json: grad_check, bf16 tolerance 0.5, a gross-error bound); the bench exits 1 when one fails.
# The preset's last cell, P2048/S128/G8/torchtitan, times verl's TorchTitan engine against prefix_torchtitan on
# the same model (bf16 parameters, torchtitan's flex attention kernel, no activation checkpointing; never run
# on a GPU yet): CELLS="P2048/S128/G8/torchtitan" runs it alone (the kit carries torchtitan 0.3.0).
#
# Time (BUDGET below: the run stops the bench after 560 s by default, to fit a 600 s call).
# FLOPs from verl_prefix.tools.flops for the gpu preset (Qwen3-1.7B shape, G=16, 12,288 tokens per sequence,
# bf16, gradient checkpointing so an update is ~4 forwards): one rep of cell P10240/S2048 is ~7.2 PFLOP
# (dense update 3.8, merged and concat prefix updates 1.0 each, forward-only 0.95 + 2 x 0.24), of cell
# P2048/S10240 ~13 PFLOP (prefix updates 3.4 each); at ~400 TFLOP/s that is ~18 s + ~33 s = ~51 s per rep.
# Warm-up + 3 reps is ~205 s of compute, plus ~10 s of pip install, ~45 s of smoke and version checks,
# ~20 s of imports, ~25 s writing the 7.6 GB random model and 6 engine builds of 15-30 s: ~435 s when all
# goes to plan; three engines hold ~41 GB of fp32 weights and gradients. With merged_varlen running as a
# fourth engine (the default now that torch's varlen attention serves it): ~25 PFLOP (~63 s) per rep, ~250 s of
# compute, ~500 s in all (~550 s with the longer CUDA tests), ~55 GB. Default REPS=3; run the headline cell
# alone first (CELLS="P10240/S2048/G16"), and whenever the GPU runs slower than that. The bench is also stopped
# (SIGINT, so Python prints where it was) when BUDGET seconds of this script have passed, so that the
# logs still come back inside the call. The offload residency check (OFFLOAD_TESTS) adds up to a minute before
# the bench, out of the same BUDGET; with the full gpu preset set OFFLOAD_TESTS=0 or run it on its own first.
#
# Overrides (env): REPS=3, BUDGET=560 (seconds for the whole script), PRESET=gpu, CELLS (space-separated
# cell names; empty runs them all, the headline P10240/S2048/G16 first), SMOKE=1 (0 skips the sanity
# step), CUDA_TESTS=1 (0 skips the CUDA tests, about 1-2 minutes), OFFLOAD_TESTS=1 (0 skips the offload
# residency check: dormant_prefix=offload's real CUDA store, pinned memory, side stream and events, never run on a
# GPU before; exactness, no parameter byte moved, nothing of the prefix graph on the device in phase B by the
# store's log and by the allocator's per-phase peaks against keep; under a minute), BENCH=1 (0 skips the preset:
# `SMOKE=0 CUDA_TESTS=0 BENCH=0 bash bench/gpu_check.sh` runs the offload check alone), WINDOW_TESTS=1 (0 skips
# the sliding-window cell: torch's and flash-attn's window arguments against the bottom-right rule with fewer
# queries than keys, a windowed gemma3_text through the engine in fp32 and bf16; about a minute), SETTINGS_TESTS=1 (0
# skips tests/backend/test_cuda_settings.py: FSDP2 offload and resharding knobs, activation offload, fused kernels on
# triton and liger; about two minutes), SP_TESTS=1 (on a machine with two or
# more GPUs, runs the Ulysses SP=2 reuse test on NCCL, sp_tests.log; skipped with one GPU), KIT=.whl,
# SITE=/tmp/site, PY=python3.
# Off the device, for a dry run of the script itself (CUDA_TESTS=0: they skip without a GPU anyway;
# PRESET=phase_b_smoke runs the same three engines side by side on a 1M-param model in about a minute):
#   OUT=/tmp/out PY=/path/to/venv/python KIT=/tmp/kit311 PRESET=phase_b_smoke CUDA_TESTS=0 VERL_PLATFORM=cpu \
#     bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

REPS="${REPS:-3}"
BUDGET="${BUDGET:-560}"
# PRESET=gpu_vl runs the vision-language cell (one image of 1,024 visual tokens + 200 text tokens, suffix
# 128, G=8, Qwen2.5-VL's 32-block tower on the gpu preset's decoder shape, stock fsdp2 vs prefix_fsdp2, update and
# forward-only; two engines of ~2.3B parameters, ~40 GB; the FLOP model counts the tower once per row dense, once
# per group reused): `run(command="PRESET=gpu_vl CUDA_TESTS=0 OFFLOAD_TESTS=0 WINDOW_TESTS=0 bash bench/gpu_check.sh")`.
# PRESET=gpu_offload runs the 10K/2K cell with dormant_prefix=offload; PRESET=gpu_capacity the capacity
# search (stock fsdp2, keep, recompute with 4K-token chunks; a fresh process per probe, about 8 probes).
PRESET="${PRESET:-gpu}"
SMOKE="${SMOKE:-1}"
CUDA_TESTS="${CUDA_TESTS:-1}"
SP_TESTS="${SP_TESTS:-1}"
OFFLOAD_TESTS="${OFFLOAD_TESTS:-1}"
WINDOW_TESTS="${WINDOW_TESTS:-1}"
SETTINGS_TESTS="${SETTINGS_TESTS:-1}"
BENCH="${BENCH:-1}"
CELLS="${CELLS:-}"
KIT="${KIT:-.whl}"
SITE="${SITE:-/tmp/site}"
PY="${PY:-python3}"
OUT="${OUT:?OUT must name the folder whose files come back (the results land there)}"
mkdir -p "$OUT"

step() { echo; echo "=== [$(date -u +%H:%M:%S), ${SECONDS}s] $*"; }
# a step's time limit: what it asks for, cut to what is left of BUDGET (at least 10 s)
cap() {
  local want=$1 left=$((BUDGET - SECONDS - 15))
  [ "$left" -lt "$want" ] && want=$left
  [ "$want" -lt 10 ] && want=10
  echo "$want"
}

smi_pid=""
finish() {
  rc=$?
  [ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null || true
  echo "=== gpu_check: exit $rc after ${SECONDS}s; in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
}
trap finish EXIT

# A step's exit status: 0 goes on; a stop at its time limit (timeout's 124, or 137 after SIGKILL) exits 3,
# so that it does not read as a timeout's own exit status (124, or 137 for a kill).
stopped() {
  case "$1" in
    0) return 0 ;;
    124 | 137) echo "gpu_check: $2 was stopped after its ${3}s; the per-rep times so far are in its log" >&2; exit 3 ;;
    *) echo "gpu_check: $2 failed (exit $1)" >&2; exit "$1" ;;
  esac
}

step "install the kit ($(ls "$KIT"/*.whl | wc -l) wheels) into $SITE"
ls "$KIT"/*.whl >/dev/null
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$KIT"/*.whl
export PYTHONPATH="$SITE:$PWD"
export PYTHONUNBUFFERED=1
# nothing outside the machine can be reached: never let a library wait on the hub
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled RAY_USAGE_STATS_ENABLED=0
# as verl's training workers set it: the dense engine's logits (2 x 12,288 x 151,936 per micro-batch) are
# the largest blocks, and expandable segments keep them from fragmenting the allocator
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

step "machine and versions (also in \$OUT/env.txt)"
{
  if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "no nvidia-smi"; fi
  uname -a
  echo "nproc $(nproc); $(grep MemTotal /proc/meminfo)"
  "$PY" - <<'EOF'
import importlib
import importlib.metadata as md
import sys

import torch

gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "|", gpu)
names = "verl transformers tokenizers huggingface_hub accelerate peft tensordict ray TransferQueue pydantic"
for name in (names + " numpy safetensors typing_extensions protobuf packaging").split():
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "MISSING")
# verl_prefix first, as the CLI does: off CUDA it registers verl's "cpu" platform (VERL_PLATFORM=cpu)
modules = ("verl_prefix", "verl_prefix.tools.bench.runner", "verl_prefix.tools.cli", "ray", "verl")
loaded = {name: importlib.import_module(name) for name in modules}
engine = importlib.import_module("verl.workers.engine.fsdp.transformer_impl").FSDPEngineWithLMHead
ray, verl = loaded["ray"], loaded["verl"]
registered = loaded["verl_prefix"].is_registered()
print(f"imports ok: ray {ray.__version__} from {ray.__file__} | verl {verl.__version__} | {engine.__name__}")
print(f"prefix_fsdp2 registered: {registered}")
EOF
  echo "--- python3 -m pip list (the device's own packages)"
  "$PY" -m pip list 2>/dev/null || true
} 2>&1 | tee "$OUT/env.txt"

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu,clocks.sm,power.draw,temperature.gpu \
    --format=csv -l 5 >"$OUT/nvidia_smi.csv" 2>&1 &
  smi_pid=$!
fi

if [ "$SMOKE" = 1 ]; then
  step "sanity: the smoke preset on $("$PY" -c 'import torch; print("CUDA" if torch.cuda.is_available() else "CPU")') (2 reps)"
  rc=0
  timeout --signal=INT --kill-after=15 180 \
    "$PY" -m verl_prefix.tools.cli bench --preset smoke --reps 2 --no-progress --out "$OUT/smoke.json" \
    2>&1 | tee "$OUT/smoke.log" || rc=$?
  stopped "$rc" "the smoke sanity step" 180
fi

if [ "$CUDA_TESTS" = 1 ]; then
  step "CUDA tests: exactness vs the stock engine, bf16 vs fp32, the varlen kernels, fla's delta rule, allocator peaks, NCCL"
  rc=0
  VERL_PLATFORM=nvidia timeout --signal=INT --kill-after=15 "$(cap 220)" \
    "$PY" -m pytest -q -rs -s -p no:cacheprovider tests/backend/test_cuda.py tests/schedule/test_kernels.py \
    tests/schedule/test_varlen_attention.py::test_cuda_varlen_matches_cpu_reference \
    tests/schedule/test_varlen_attention.py::test_cuda_varlen_layer_has_no_host_sync \
    tests/schedule/test_varlen_attention.py::test_cuda_flash_attn_backward_is_deterministic_when_asked \
    tests/schedule/test_recurrent_cuda.py tests/backend/test_mamba_cuda.py 2>&1 \
    | tee "$OUT/cuda_tests.log" || rc=$?
  # a failing test is a finding to read, not a reason to skip the benchmark
  [ "$rc" = 0 ] || echo "gpu_check: the CUDA tests exited $rc (see cuda_tests.log); going on" >&2
fi

if [ "$CUDA_TESTS" = 1 ]; then
  step "merged attention: the prefix part's backward split into batch entries vs not (median ms, bench/merged_backward.py)"
  rc=0
  VERL_PLATFORM=nvidia timeout --signal=INT --kill-after=15 "$(cap 90)" \
    "$PY" bench/merged_backward.py --out "$OUT/merged_backward.json" 2>&1 | tee "$OUT/merged_backward.log" || rc=$?
  [ "$rc" = 0 ] || echo "gpu_check: the merged backward bench exited $rc (see merged_backward.log); going on" >&2
fi

if [ "$OFFLOAD_TESTS" = 1 ]; then
  step "tests/schedule/test_offload_cuda.py: dormant_prefix=offload's CUDA store (residency, exactness, allocator peaks)"
  rc=0
  VERL_PLATFORM=nvidia timeout --signal=INT --kill-after=15 "$(cap 120)" \
    "$PY" -m pytest -q -rs -s -p no:cacheprovider tests/schedule/test_offload_cuda.py 2>&1 | tee -a "$OUT/cuda_tests.log" || rc=$?
  [ "$rc" = 0 ] || echo "gpu_check: the offload residency check exited $rc (see cuda_tests.log); going on" >&2
fi

if [ "$WINDOW_TESTS" = 1 ]; then
  step "tests/backend/test_windows_cuda.py: sliding windows on CUDA (kernel window alignment, fp32 exactness, bf16 error)"
  rc=0
  VERL_PLATFORM=nvidia timeout --signal=INT --kill-after=15 "$(cap 150)" \
    "$PY" -m pytest -q -rs -s -p no:cacheprovider tests/backend/test_windows_cuda.py 2>&1 | tee -a "$OUT/cuda_tests.log" || rc=$?
  [ "$rc" = 0 ] || echo "gpu_check: the sliding-window CUDA tests exited $rc (see cuda_tests.log); going on" >&2
fi

if [ "$SETTINGS_TESTS" = 1 ]; then
  step "tests/backend/test_cuda_settings.py: FSDP2 offload/resharding knobs, activation offload, fused kernels (triton, liger)"
  rc=0
  VERL_PLATFORM=nvidia timeout --signal=INT --kill-after=15 "$(cap 180)" \
    "$PY" -m pytest -q -rs -s -p no:cacheprovider tests/backend/test_cuda_settings.py 2>&1 | tee -a "$OUT/cuda_tests.log" || rc=$?
  [ "$rc" = 0 ] || echo "gpu_check: the settings cells exited $rc (see cuda_tests.log); going on" >&2
fi

gpus=$(command -v nvidia-smi >/dev/null && nvidia-smi -L | wc -l || echo 0)
if [ "$SP_TESTS" = 1 ] && [ "$gpus" -ge 2 ]; then
  step "Ulysses sequence parallelism on 2 of the $gpus GPUs: reuse with SP=2 vs the engine without SP (NCCL)"
  rc=0
  VERL_PLATFORM=nvidia timeout --signal=INT --kill-after=15 "$(cap 150)" \
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/backend/test_ulysses_engine.py -k two_gpus 2>&1 \
    | tee "$OUT/sp_tests.log" || rc=$?
  [ "$rc" = 0 ] || echo "gpu_check: the Ulysses GPU test exited $rc (see sp_tests.log); going on" >&2
elif [ "$SP_TESTS" = 1 ]; then
  echo "gpu_check: $gpus GPU(s): the Ulysses cell needs two; skipped"
fi

if [ "$SP_TESTS" = 1 ] && [ "$gpus" -ge 2 ] && "$PY" -c "import megatron.core" 2>/dev/null; then
  step "prefix_megatron on 2 of the $gpus GPUs, bf16, TE where installed (NCCL): TP=2 + sequence parallel; Qwen3-MoE at EP=2 (aux loss, expert bias) and TP=2 + SP; DeepSeek-V3 MLA at TP=2 + SP; PP=2 with full recompute and offload; selective recompute under SP; PP=2 with two virtual stages; Qwen3-MoE at TP=2 + SP x EP=2 with the aux loss, z-loss and expert bias"
  rc=0
  VERL_PLATFORM=nvidia timeout --signal=INT --kill-after=15 "$(cap 240)" \
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/backend/test_megatron_cuda.py 2>&1 \
    | tee "$OUT/megatron_tests.log" || rc=$?
  [ "$rc" = 0 ] || echo "gpu_check: the Megatron GPU test exited $rc (see megatron_tests.log); going on" >&2
elif [ "$SP_TESTS" = 1 ]; then
  echo "gpu_check: the Megatron cell needs two GPUs and megatron-core (scripts/setup.sh); skipped"
fi

if [ "$BENCH" != 1 ]; then
  echo "gpu_check: BENCH=$BENCH: no preset run"
  exit 0
fi

left=$((BUDGET - SECONDS))
step "verl-prefix bench --preset $PRESET --reps $REPS (stopped after ${left}s)"
if [ "$left" -lt 60 ]; then
  echo "gpu_check: only ${left}s of the ${BUDGET}s budget left; not starting the $PRESET preset" >&2
  exit 1
fi
cp docs/benchmarks.md "$OUT/benchmarks.md" # the CLI adds or replaces the preset's table in this copy
cell_args=()
for cell in $CELLS; do cell_args+=(--cell "$cell"); done
rc=0
timeout --signal=INT --kill-after=15 "$left" \
  "$PY" -m verl_prefix.tools.cli bench --preset "$PRESET" --reps "$REPS" --no-progress "${cell_args[@]}" \
  --out "$OUT/$PRESET.json" --table "$OUT/benchmarks.md" 2>&1 | tee "$OUT/gpu_bench.log" || rc=$?
stopped "$rc" "the $PRESET preset" "$left"

step "after the bench"
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=memory.used,memory.total --format=csv; fi
