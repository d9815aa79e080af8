"""The CUDA paths CPU cannot reach: phase B's bottom-right causal bias on torch's fused kernels, the
allocator's per-phase peaks, NCCL. Skipped without a GPU; ``bench/gpu_check.sh`` runs this file on a
lent one (``VERL_PLATFORM=nvidia``: the test suite otherwise puts verl on its CPU platform).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.precision import promote_fp32_upcasts
from helpers.reuse import assert_reuse_ran
from test_engine_exactness import compare_update, grpo_batch, worst_relative

from verl_prefix import PrefixReuseConfig
from verl_prefix.schedule.telemetry import PhaseMeter
from verl_prefix.tools import testing as T
from verl_prefix.tools.bench_presets import BF16

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("VERL_PLATFORM") == "cpu",
    reason="needs a CUDA GPU and VERL_PLATFORM=nvidia (the suite defaults verl to its CPU platform)",
)

# fp64 runs sdpa's math kernel on both sides; fp32 runs the memory-efficient kernel (causal for dense,
# bottom-right causal for phase B), whose reduction order differs between the two calls.
GRAD_TOL = {"float64": 1e-10, "float32": 1e-4}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_update_matches_stock_engine_on_cuda(tiny_model, dtype):
    grads, update, dense, prefix = compare_update(
        tiny_model("qwen3"),
        grpo_batch(),
        dtype=dtype,
        micro_batch_size_per_gpu=2,
        use_kl_loss=True,
        entropy_coeff=0.01,
    )
    assert grads < GRAD_TOL[dtype]
    assert prefix["loss"] == pytest.approx(dense["loss"], rel=1e-4)
    assert_reuse_ran(prefix["metrics"], groups=3)
    # the allocator-peak metric exists only when the engine ran on the accelerator
    assert prefix["reduced_metrics"]["prefix/max_peak_device_mib/B"] > 0


def _bf16_grads(model_dir, backend, micro_batch_size, batch):
    engine, loss_fn, _ = T.build_verl_engine(
        model_dir, backend=backend, micro_batch_size_per_gpu=micro_batch_size, overrides=BF16
    )
    if backend == "prefix_fsdp2":
        engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    with promote_fp32_upcasts():
        result = T.run_train_step(engine, loss_fn, batch, capture_grads=True)
    if backend == "prefix_fsdp2":
        assert_reuse_ran(result["metrics"], groups=3)
    return result["grads"]


def test_bf16_drift_stays_within_the_dense_noise_floor(tiny_model):
    """bf16 (torch's flash kernel serves phase B): reuse may differ from dense only as much as dense
    differs from itself under another micro-batch partition."""
    model_dir = tiny_model("qwen3", hidden_size=128, num_heads=4, num_kv_heads=2)
    batch = grpo_batch(prompt_lens=[96, 64, 80], response_len_range=(8, 24))
    dense = _bf16_grads(model_dir, "fsdp2", 2, batch)
    floor = worst_relative(_bf16_grads(model_dir, "fsdp2", 4, batch), dense)
    drift = worst_relative(_bf16_grads(model_dir, "prefix_fsdp2", 2, batch), dense)
    assert floor < 0.1
    # dense may even agree with itself bit for bit; then bf16's own resolution is the floor
    assert drift <= max(5 * floor, 3e-2), (drift, floor)


def test_allocator_peak_is_per_phase():
    device = torch.device("cuda", torch.cuda.current_device())
    meter = PhaseMeter(device)
    with meter.phase("A"):
        big = torch.empty(64 * 1024**2, dtype=torch.uint8, device=device)  # 64 MiB
        del big
    with meter.phase("B"):
        small = torch.empty(1024**2, dtype=torch.uint8, device=device)
        del small
    peaks = meter.metrics(1, 1)
    assert peaks["prefix/max_peak_device_mib/A"] >= 64
    assert peaks["prefix/max_peak_device_mib/B"] < peaks["prefix/max_peak_device_mib/A"] - 32


def test_process_group_uses_nccl_for_cuda_tensors():
    import torch.distributed as dist

    T.init_single_process_group()
    assert "nccl" in str(dist.get_backend())
    value = torch.ones(1, device="cuda")
    dist.all_reduce(value)
    assert value.item() == 1.0
