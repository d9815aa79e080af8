"""Settings that do nothing on CPU, on a GPU (issue 27 item 9 and verl's fused kernels): each is a cell of
``bench/gpu_check.sh`` (``SETTINGS_TESTS``), reuse asserted in every one.

- verl's FSDP2 knobs the recipe leaves at their defaults, each turned the other way: ``param_offload``,
  ``optimizer_offload``, ``offload_policy`` (FSDP2's ``CPUOffloadPolicy``), ``reshard_after_forward`` (false, and
  the default true): one update in fp64 against the stock engine with the same knob (1e-10 gradients, 1e-9 update)
  and a forward-only pass (1e-10), reuse ran in every group;
- ``enable_activation_offload`` with gradient checkpointing: verl's handler makes training fall back to dense
  (counted, exact against stock), forward-only passes still reuse (exact);
- verl's fused kernels (``model.use_fused_kernels``) on the ``triton`` and ``liger`` backends (CPU runs ``torch``:
  ``test_fused_kernels_engine.py``), bf16, tied and untied embeddings: reuse's mean |log-prob| and gradient errors
  against an fp32 run of the stock engine within 1.5x the stock engine's own bf16 errors (the stock engine with
  the same fused setting where it runs: tied; untied, verl's fused forward cannot read a sharded head, so the
  stock engine runs unfused), reuse ran and no mini-batch fell back.

Skipped without a GPU (``VERL_PLATFORM=nvidia``, as ``test_cuda.py``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from helpers.precision import promote_fp32_upcasts
from helpers.reuse import assert_infer_matches, assert_reuse_ran
from test_cuda import bf16_errors, bf16_outputs
from test_engine_exactness import compare_update, grpo_batch

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import verl_engine

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("VERL_PLATFORM") == "cpu",
    reason="needs a CUDA GPU and VERL_PLATFORM=nvidia (the suite defaults verl to its CPU platform)",
)

FSDP = "actor_rollout_ref.actor.fsdp_config"
SETTINGS = {
    "param_offload": (f"{FSDP}.param_offload=true",),
    "optimizer_offload": (f"{FSDP}.optimizer_offload=true",),
    "offload_policy": (f"{FSDP}.offload_policy=true",),
    "reshard_after_forward_false": (f"{FSDP}.reshard_after_forward=false",),
    "reshard_after_forward_true": (f"{FSDP}.reshard_after_forward=true",),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fsdp_setting_keeps_reuse_exact(tiny_model, setting):
    model_dir = tiny_model("qwen3", num_kv_heads=2)
    kwargs = dict(micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01, overrides=SETTINGS[setting])
    grads, update, dense, prefix = compare_update(model_dir, grpo_batch(), dtype="float64", **kwargs)
    print(f"{setting}: grads {grads:.2e}, update {update:.2e}")
    assert grads < 1e-10 and update < 1e-9
    assert_reuse_ran(prefix["metrics"], groups=3)
    stock, _, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", dtype="float64", **kwargs)
    reuse, _, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", dtype="float64", **kwargs)
    reuse.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    with promote_fp32_upcasts():
        assert_infer_matches(
            verl_engine.run_infer(stock, grpo_batch()), verl_engine.run_infer(reuse, grpo_batch()), 1e-10, groups=3
        )


def test_activation_offload_on_cuda(tiny_model):
    """verl's real activation offload (its CUDA streams, not the CPU suite's stand-in): training falls back to
    dense in every micro-batch and matches stock; forward-only reuses and matches stock."""
    from helpers.precision import promote_fp32_upcasts

    overrides = ("actor_rollout_ref.model.enable_activation_offload=true",)
    kwargs = dict(dtype="float64", gradient_checkpointing=True, micro_batch_size_per_gpu=2, overrides=overrides)
    model_dir = tiny_model("qwen3", num_layers=3)  # verl wraps nothing below three FSDP units
    (stock, s_loss, _), (reuse, r_loss, _) = (
        verl_engine.build_verl_engine(model_dir, backend=b, **kwargs) for b in ("fsdp2", "prefix_fsdp2")
    )
    reuse.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    with promote_fp32_upcasts():
        assert_infer_matches(
            verl_engine.run_infer(stock, grpo_batch()), verl_engine.run_infer(reuse, grpo_batch()), 1e-10, groups=3
        )
        want = verl_engine.run_train_step(stock, s_loss, grpo_batch(), capture_grads=True)
        got = verl_engine.run_train_step(reuse, r_loss, grpo_batch(), capture_grads=True)
    metrics = verl_engine.reduce_step_metrics(got["metrics"])
    assert metrics["prefix/fallback_activation_offload"] > 0 and metrics["prefix/groups"] == 0.0, metrics
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
    assert worst < 1e-10


def _backend_available(backend: str) -> bool:
    return importlib.util.find_spec({"triton": "triton", "liger": "liger_kernel"}[backend]) is not None


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("backend", ["triton", "liger"])
def test_fused_kernels_bf16_on_cuda(tiny_model, backend, tied):
    if not _backend_available(backend):
        pytest.skip(f"verl's fused kernels' {backend} backend needs its package, not installed here")
    fused = (
        "actor_rollout_ref.model.use_fused_kernels=true",
        f"actor_rollout_ref.model.fused_kernel_options.impl_backend={backend}",
    )
    model_dir = tiny_model("qwen2" if tied else "qwen3", tie_word_embeddings=tied, hidden_size=128, num_heads=4)
    batch = grpo_batch(num_groups=1, group_size=8, prompt_lens=[40], response_len_range=(4, 12), use_kl=False)
    reference = bf16_outputs(model_dir, "fsdp2", batch, bf16=False)
    dense = bf16_outputs(model_dir, "fsdp2", batch, bf16=True, overrides=fused if tied else ())
    reuse = bf16_outputs(model_dir, "prefix_fsdp2", batch, bf16=True, overrides=fused)
    dense_err, reuse_err = bf16_errors(dense, reference), bf16_errors(reuse, reference)
    print(f"fused {backend} {'tied' if tied else 'untied'}: dense |lp| {dense_err[0]:.3e} grads {dense_err[1]:.3e}; "
          f"reuse |lp| {reuse_err[0]:.3e} grads {reuse_err[1]:.3e}")  # fmt: skip
    assert dense_err[0] > 0 and dense_err[1] > 0
    assert reuse_err[0] <= 1.5 * dense_err[0] and reuse_err[1] <= 1.5 * dense_err[1], (reuse_err, dense_err)
    assert_reuse_ran(reuse[2], groups=1)
    assert not any(k.startswith("prefix/fallback_") and v for k, v in reuse[2].items()), reuse[2]
