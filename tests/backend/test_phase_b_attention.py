"""``prefix_reuse.phase_b_attention`` through the engine: merged, merged_varlen and concat against verl's
stock fsdp2 engine on the same batch (fp64, fp32; GQA factors 1, 2, 4; micro-batches of 1, 2 and G rows), the
metric that says which ran, the knob's validation, and bf16 under CPU autocast judged against an fp32
run of the stock engine (DESIGN.md trap 18)."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_pairs import compare_on_pair
from helpers.precision import promote_fp32_upcasts
from hypothesis import given
from hypothesis import strategies as st
from test_engine_exactness import GRAD_TOL, compare_update, grpo_batch

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import verl_engine


def _assert_reuse_ran(metrics: dict, attention: str, micro_batches: int) -> None:
    assert metrics["prefix/groups"] > 0
    assert metrics["prefix/physical_tokens"] < metrics["prefix/logical_tokens"]
    assert metrics[f"prefix/phase_b_attention/{attention}"] == micro_batches
    for other in {"merged", "concat", "merged_varlen"} - {attention}:
        assert metrics[f"prefix/phase_b_attention/{other}"] == 0


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("attention", ["merged", "concat", "auto"])
def test_phase_b_attention_matches_stock_engine(engine_pairs, dtype, kv_heads, attention):
    reuse = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=2, phase_b_attention=attention)
    grads, dense, prefix = compare_on_pair(engine_pairs(dtype, kv_heads), grpo_batch(), reuse=reuse)  # 3 groups of 4
    assert grads < GRAD_TOL[dtype]
    assert prefix["grad_norm"] == pytest.approx(dense["grad_norm"], rel=1e-5)
    _assert_reuse_ran(prefix["reduced_metrics"], "concat" if attention == "concat" else "merged", 3 * 2)


@pytest.mark.parametrize("rows", [1, 2, 8])  # micro-batches of 1, 2 and G rows
def test_merged_for_every_partition(qwen3_pair, rows):
    batch = grpo_batch(num_groups=2, group_size=8, prompt_lens=[10, 6], response_len_range=(1, 9))
    reuse = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=rows, phase_b_attention="merged")
    grads, _, prefix = compare_on_pair(qwen3_pair, batch, reuse=reuse, micro_batch_size=4)
    assert grads < 1e-10
    _assert_reuse_ran(prefix["reduced_metrics"], "merged", 2 * (8 // rows))


def test_forward_only_merged_matches_stock(tiny_model):
    model_dir = tiny_model("qwen3")
    dense, _, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", dtype="float64", micro_batch_size_per_gpu=2)
    prefix, _, _ = verl_engine.build_verl_engine(
        model_dir, backend="prefix_fsdp2", dtype="float64", micro_batch_size_per_gpu=2
    )
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2, phase_b_attention="merged")
    batch = grpo_batch()
    with promote_fp32_upcasts():
        want = verl_engine.run_infer(dense, batch, calculate_entropy=True)
        got = verl_engine.run_infer(prefix, batch, calculate_entropy=True)
    for key in ("response_log_probs", "response_entropy"):
        w, g = want[key], got[key]
        torch.testing.assert_close(
            g.values() if g.is_nested else g, w.values() if w.is_nested else w, rtol=1e-10, atol=1e-10
        )
    _assert_reuse_ran(verl_engine.reduce_step_metrics(got["metrics"]), "merged", 3 * 2)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa2", "gqa4"])
def test_merged_varlen_matches_stock_engine(tiny_model, dtype, kv_heads):
    """``merged_varlen`` (CPU: the reference varlen kernel) through the engine against the stock fsdp2 engine,
    3 ragged groups of 4 in micro-batches of 2 and of G rows; then the forward-only pass."""
    model_dir = tiny_model("qwen3", num_kv_heads=kv_heads)
    for rows in (2, 4):
        reuse = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=rows, phase_b_attention="merged_varlen")
        grads, update, dense, prefix = compare_update(
            model_dir, grpo_batch(), dtype=dtype, reuse=reuse, micro_batch_size_per_gpu=2, use_kl_loss=True,
            entropy_coeff=0.01,
        )  # fmt: skip
        assert grads < GRAD_TOL[dtype], rows
        assert prefix["grad_norm"] == pytest.approx(dense["grad_norm"], rel=1e-5)
        _assert_reuse_ran(prefix["reduced_metrics"], "merged_varlen", 3 * (4 // rows))
    if dtype == "float64":
        dense, _, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", dtype=dtype, micro_batch_size_per_gpu=2)
        engine, _, _ = verl_engine.build_verl_engine(
            model_dir, backend="prefix_fsdp2", dtype=dtype, micro_batch_size_per_gpu=2
        )
        engine.reuse_config = PrefixReuseConfig(min_prefix_len=2, phase_b_attention="merged_varlen")
        with promote_fp32_upcasts():
            want = verl_engine.run_infer(dense, grpo_batch(), calculate_entropy=True)
            got = verl_engine.run_infer(engine, grpo_batch(), calculate_entropy=True)
        for key in ("response_log_probs", "response_entropy"):
            w, g = want[key], got[key]
            torch.testing.assert_close(
                g.values() if g.is_nested else g, w.values() if w.is_nested else w, rtol=1e-10, atol=1e-10
            )
        _assert_reuse_ran(verl_engine.reduce_step_metrics(got["metrics"]), "merged_varlen", 3 * 2)


def test_merged_varlen_negative_control_wrong_offsets(tiny_model, monkeypatch):
    """The engine with every micro-batch's cu_seqlens one token off must miss the stock engine."""
    from verl_prefix.schedule.attention import varlen as V

    real = V.Packing.from_lengths

    def shifted(*args):
        packing = real(*args)
        cu = packing.cu_seqlens.clone()
        cu[1:-1] += 1
        return V.Packing(packing.mask, cu, packing.lengths, packing.width)

    monkeypatch.setattr(V.Packing, "from_lengths", shifted)
    reuse = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=2, phase_b_attention="merged_varlen")
    grads, _, _, prefix = compare_update(
        tiny_model("qwen3", num_kv_heads=2), grpo_batch(), dtype="float64", reuse=reuse, micro_batch_size_per_gpu=2
    )
    _assert_reuse_ran(prefix["reduced_metrics"], "merged_varlen", 3 * 2)
    assert grads > 1e-3


@given(value=st.text(max_size=14).filter(lambda v: v not in ("auto", "merged", "concat", "merged_varlen")))
def test_knob_is_validated_at_config_time(value):
    with pytest.raises(ValueError, match="phase_b_attention"):
        PrefixReuseConfig(phase_b_attention=value)


def _bf16_run(engine_and_loss, batch, autocast: bool) -> tuple[torch.Tensor, float, dict]:
    engine, loss_fn, _ = engine_and_loss
    if autocast:
        engine._autocast_dtype = torch.bfloat16  # CPU bf16 autocast over fp32 parameters, both engines
    log_probs = verl_engine.run_infer(engine, batch)["response_log_probs"]
    log_probs = log_probs.values() if log_probs.is_nested else log_probs
    step = verl_engine.run_train_step(engine, loss_fn, batch)
    return log_probs.float(), float(step["grad_norm"]), step["reduced_metrics"]


def test_bf16_error_within_the_stock_engines_own(tiny_model):
    """G = 16 in single-row micro-batches under CPU bf16 autocast: reuse's error against an fp32 run of
    the stock engine (mean |log-prob| error, grad-norm error) is within the stock engine's own bf16 error
    against it (a run-twice "noise floor" is no floor on CPU: trap 18)."""
    model_dir = tiny_model("qwen3", num_kv_heads=1)
    batch = grpo_batch(num_groups=1, group_size=16, prompt_lens=[40], response_len_range=(4, 12), use_kl=False)
    kwargs = dict(dtype="float32", micro_batch_size_per_gpu=1)
    ref_lp, ref_gn, _ = _bf16_run(
        verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs), batch, autocast=False
    )
    dense_lp, dense_gn, _ = _bf16_run(
        verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs), batch, autocast=True
    )
    prefix = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **kwargs)
    prefix[0].reuse_config = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=1, phase_b_attention="merged")
    reuse_lp, reuse_gn, metrics = _bf16_run(prefix, batch, autocast=True)
    dense_err = ((dense_lp - ref_lp).abs().mean().item(), abs(dense_gn - ref_gn) / ref_gn)
    reuse_err = ((reuse_lp - ref_lp).abs().mean().item(), abs(reuse_gn - ref_gn) / ref_gn)
    print(
        f"bf16 vs fp32 stock: dense |lp| {dense_err[0]:.3e} gn {dense_err[1]:.3e}; "
        f"reuse |lp| {reuse_err[0]:.3e} gn {reuse_err[1]:.3e}"
    )
    assert dense_err[0] > 0  # autocast really ran
    assert reuse_err[0] <= 1.5 * dense_err[0]
    assert reuse_err[1] <= 1.5 * dense_err[1]
    _assert_reuse_ran(metrics, "merged", 16)
