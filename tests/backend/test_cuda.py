"""The CUDA paths CPU cannot reach: phase B's bottom-right causal bias on torch's fused kernels, merged and
merged_varlen on torch's flash kernels in bf16 (each case asserts which attention ran; the tree schedule too,
with recompute and with offload's real store per node, and over image prompts), the allocator's
per-phase peaks, NCCL. Skipped without a GPU; ``bench/gpu_check.sh`` runs this file on a
lent one (``VERL_PLATFORM=nvidia``: the test suite otherwise puts verl on its CPU platform).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.reuse import assert_reuse_ran
from test_engine_exactness import compare_update, grpo_batch

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend.distributed.mini_batch import KernelRefused
from verl_prefix.harness import verl_engine
from verl_prefix.schedule.models.multimodal import text_only_call
from verl_prefix.schedule.telemetry import PhaseMeter
from verl_prefix.tools.bench.presets import BF16

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("VERL_PLATFORM") == "cpu",
    reason="needs a CUDA GPU and VERL_PLATFORM=nvidia (the suite defaults verl to its CPU platform)",
)

# fp64 runs sdpa's math kernel on both sides; fp32 runs the memory-efficient kernel (causal for dense,
# bottom-right causal for phase B), whose reduction order differs between the two calls.
GRAD_TOL = {"float64": 1e-10, "float32": 1e-4}
CUDA = torch.device("cuda")


def assert_phase_b_ran(metrics: dict, attention: str, micro_batches: int, reason: str | None = None) -> None:
    """Every phase-B micro-batch ran ``attention`` (merged, concat or merged_varlen), none another; a concat
    forced by a kernel refusal is counted under ``concat_<reason>`` too."""
    assert metrics[f"prefix/phase_b_attention/{attention}"] == micro_batches, metrics
    for other in {"merged", "concat", "merged_varlen"} - {attention}:
        assert metrics[f"prefix/phase_b_attention/{other}"] == 0, (other, metrics)
    if reason is not None:
        assert metrics[f"prefix/phase_b_attention/concat_{reason}"] == micro_batches, metrics


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
    # torch's CUDA flash kernels are half precision only: auto runs concat, every rank saying why
    assert_phase_b_ran(prefix["reduced_metrics"], "concat", 3 * 2, reason="kernel_dtype")
    # the allocator-peak metric exists only when the engine ran on the accelerator
    assert prefix["reduced_metrics"]["prefix/max_peak_device_mib/B"] > 0


@pytest.mark.parametrize("attention", ["merged", "merged_varlen"])
def test_explicit_two_part_attention_in_fp32_is_refused_before_it_runs(tiny_model, attention):
    engine, loss_fn, _ = verl_engine.build_verl_engine(
        tiny_model("qwen3"), backend="prefix_fsdp2", micro_batch_size_per_gpu=2
    )
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2, phase_b_attention=attention)
    with pytest.raises(KernelRefused, match=rf"phase_b_attention={attention} cannot run .*rank 0: kernel_dtype"):
        verl_engine.run_train_step(engine, loss_fn, grpo_batch())


def bf16_outputs(
    model_dir,
    backend: str,
    batch,
    bf16: bool,
    attention: str = "auto",
    tree: bool = False,
    dormant: str = "keep",
    min_shared_tokens: int = 8,
    overrides: tuple[str, ...] = (),
) -> tuple:
    """``(response log-probs, parameter grads, reduced metrics)`` of one engine: a forward-only pass, then one
    update. ``bf16``: verl's mixed precision (bf16 compute, fp32 master weights and reduction); else fp32.
    ``tree``, ``min_shared_tokens`` and ``dormant``: the prefix engine's ``prefix_reuse.tree``,
    ``prefix_reuse.min_shared_tokens`` and ``dormant_prefix``; ``overrides``: more Hydra overrides (both precisions)."""
    engine, loss_fn, _ = verl_engine.build_verl_engine(
        model_dir, backend=backend, micro_batch_size_per_gpu=1, overrides=(*(BF16 if bf16 else ()), *overrides)
    )
    if backend == "prefix_fsdp2":
        engine.reuse_config = PrefixReuseConfig(
            min_prefix_len=2,
            suffix_micro_batch_size=1,
            phase_b_attention=attention,
            tree=tree,
            min_shared_tokens=min_shared_tokens,
        )
        engine.dormant_prefix = dormant
    with text_only_call(engine.module):  # a vision-language model's text-only micro-batches (a no-op for text)
        log_probs = verl_engine.run_infer(engine, batch)[
            "response_log_probs"
        ]  # HF's own fp32 upcasts, as bf16 training has
        step = verl_engine.run_train_step(engine, loss_fn, batch, capture_grads=True)
    log_probs = log_probs.values() if log_probs.is_nested else log_probs
    return log_probs.float().cpu(), {n: g.float().cpu() for n, g in step["grads"].items()}, step["reduced_metrics"]


def bf16_errors(got: tuple, reference: tuple) -> tuple[float, float]:
    """(mean |log-prob| error, relative error of all parameter gradients together) against ``reference``."""
    lp = (got[0] - reference[0]).abs().mean().item()
    names = sorted(reference[1])
    diff = torch.cat([(got[1][n] - reference[1][n]).flatten() for n in names])
    ref = torch.cat([reference[1][n].flatten() for n in names])
    return lp, (diff.norm() / ref.norm()).item()


def assert_bf16_within_stocks_own(
    model_dir, batch, reference: tuple, groups: int, attention: str = "auto", **prefix_knobs
) -> dict:
    """bf16 through the stock engine and through reuse, each judged against ``reference`` (an fp32 run of the
    stock engine): reuse's mean |log-prob| error and gradient error within 1.5x the stock engine's own (DESIGN
    trap 18), bf16 really ran, reuse ran in ``groups`` groups. Returns reuse's reduced metrics. ``prefix_knobs``:
    ``bf16_outputs``'s ``tree``, ``min_shared_tokens`` and ``dormant``."""
    dense = bf16_outputs(model_dir, "fsdp2", batch, bf16=True)
    reuse = bf16_outputs(model_dir, "prefix_fsdp2", batch, bf16=True, attention=attention, **prefix_knobs)
    dense_err, reuse_err = bf16_errors(dense, reference), bf16_errors(reuse, reference)
    print(f"bf16 vs fp32 stock ({attention}): dense |lp| {dense_err[0]:.3e} grads {dense_err[1]:.3e}; "
          f"reuse |lp| {reuse_err[0]:.3e} grads {reuse_err[1]:.3e}")  # fmt: skip
    assert dense_err[0] > 0 and dense_err[1] > 0  # bf16 really ran
    assert reuse_err[0] <= 1.5 * dense_err[0], (reuse_err, dense_err)
    assert reuse_err[1] <= 1.5 * dense_err[1], (reuse_err, dense_err)
    assert_reuse_ran(reuse[2], groups=groups)
    return reuse[2]


def _has_varlen_kernels() -> bool:
    from verl_prefix.schedule.attention import varlen as V

    return torch.cuda.is_available() and V.kernels_for(CUDA) is not None


# phase_b_attention -> the attention each phase-B micro-batch must have run in bf16 on a GPU whose flash kernels
# serve (sm80+): auto picks merged; merged_varlen needs torch's varlen attention or flash-attn >= 2.7
BF16_CASES = {"auto": "merged", "concat": "concat", "merged_varlen": "merged_varlen"}


@pytest.mark.parametrize("attention", list(BF16_CASES))
def test_bf16_error_within_the_stock_engines_own(tiny_model, attention):
    """bf16 on CUDA, G = 16 in single-row micro-batches (DESIGN trap 18): reuse's error against an fp32 run of the
    stock engine (mean |log-prob| error, relative error of the gradients) must be within 1.5x the stock engine's
    own bf16 error against that run, and every micro-batch must have run the expected phase-B attention."""
    if attention == "merged_varlen" and not _has_varlen_kernels():
        pytest.skip("no CUDA varlen kernel here (torch < 2.10 and no flash-attn >= 2.7)")
    model_dir = tiny_model("qwen3", hidden_size=128, num_heads=4, num_kv_heads=2)  # head_dim 32
    batch = grpo_batch(num_groups=1, group_size=16, prompt_lens=[40], response_len_range=(4, 12), use_kl=False)
    reference = bf16_outputs(model_dir, "fsdp2", batch, bf16=False)
    metrics = assert_bf16_within_stocks_own(model_dir, batch, reference, groups=1, attention=attention)
    assert_phase_b_ran(metrics, BF16_CASES[attention], 16)


# the tree on CUDA: (phase_b_attention, dormant_prefix) -> the attention every phase-B micro-batch must have run
TREE_CASES = {("merged_varlen", "recompute"): "merged_varlen", ("auto", "offload"): "merged"}


@pytest.mark.parametrize("attention, dormant", list(TREE_CASES), ids=["-".join(c) for c in TREE_CASES])
def test_tree_bf16_error_within_the_stock_engines_own(tiny_model, attention, dormant):
    """``prefix_reuse.tree`` in bf16 on CUDA (4 groups of G = 4 behind a 40-token system block; single-row
    micro-batches): merged_varlen on torch's varlen kernels, every node rebuilt in phase C (``recompute``); and
    every node's graph offloaded to pinned host memory by the real store (the CPU runs the stand-in,
    ``test_tree_dormant_engine``). Reuse's error within 1.5x the stock engine's own; the tree, the attention and
    the policy ran (per node)."""
    if attention == "merged_varlen" and not _has_varlen_kernels():
        pytest.skip("no CUDA varlen kernel here (torch < 2.10 and no flash-attn >= 2.7)")
    model_dir = tiny_model("qwen3", hidden_size=128, num_heads=4, num_kv_heads=2)  # head_dim 32
    batch = grpo_batch(
        num_groups=4, group_size=4, prompt_lens=[8, 12, 5, 10], response_len_range=(4, 12), use_kl=False,
        shared_system=40,
    )  # fmt: skip
    reference = bf16_outputs(model_dir, "fsdp2", batch, bf16=False)
    metrics = assert_bf16_within_stocks_own(
        model_dir, batch, reference, groups=4, attention=attention, tree=True, dormant=dormant
    )
    assert_phase_b_ran(metrics, TREE_CASES[attention, dormant], 16)
    assert metrics["prefix/tree_depth"] >= 2 and metrics["prefix/tree_nodes"] == 5, metrics
    assert metrics["prefix/tree_shared_tokens/level1"] == 40, metrics
    assert metrics[f"prefix/policy/{dormant}"] == 5, metrics
    if dormant == "offload":
        assert metrics["prefix/offloaded_mib"] > 0 and metrics["prefix/max_offload_resident_mib/B"] == 0, metrics


def test_tree_with_images_bf16_error_within_the_stock_engines_own(tmp_path):
    """``prefix_reuse.tree`` over image prompts in bf16 on CUDA (``test_tree_multimodal_engine``'s batch: a
    system block, one image shared by two groups, another by two more, a text group; Qwen2.5-VL's tower on the
    device): reuse's error within 1.5x the stock engine's own, the tree ran and each shared image was encoded
    once."""
    from test_tree_multimodal_engine import GROUPS, ITEMS, vl_batch

    from verl_prefix.harness import vl as V

    model_dir = V.write_tiny_vl_model(tmp_path / "tree_vl")
    batch = vl_batch()
    reference = bf16_outputs(model_dir, "fsdp2", batch, bf16=False)
    metrics = assert_bf16_within_stocks_own(model_dir, batch, reference, groups=GROUPS, tree=True, min_shared_tokens=4)
    assert metrics["prefix/tree_depth"] >= 2 and metrics["prefix/tree_visual_items"] == ITEMS, metrics


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

    verl_engine.init_single_process_group()
    assert "nccl" in str(dist.get_backend())
    value = torch.ones(1, device="cuda")
    dist.all_reduce(value)
    assert value.item() == 1.0
