"""A hybrid linear-attention model (``qwen3_5_text``: gated delta-net + full attention) through ``prefix_fsdp2``
against verl's stock ``fsdp2`` engine on the same TensorDict (issue 22, slice 1): gradients, the update and
forward-only log-probs/entropy in fp64 (``helpers.delta_rule.fp64_delta_net`` on both engines' models), each
asserting reuse ran; settings the schedule does not serve for recurrent layers run dense, counted."""

from __future__ import annotations

import contextlib
import logging

import pytest
from helpers.delta_rule import fp64_delta_net
from helpers.reuse import assert_infer_matches, assert_reuse_ran
from test_engine_exactness import engines, grpo_batch, worst_relative
from transformers import AutoModelForCausalLM

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend import fallbacks
from verl_prefix.tools import testing as T

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return T.write_tiny_model(
        tmp_path_factory.mktemp("tiny_qwen3_5_text"),
        "qwen3_5_text",
        num_layers=4,
        hidden_size=32,
        extra_config={"layer_types": LAYER_TYPES},
    )


def _fp64(*engines_):
    stack = contextlib.ExitStack()
    for engine in engines_:
        stack.enter_context(fp64_delta_net(engine.module))
    return stack


def test_update_and_infer_match_stock_engine_fp64(hybrid_dir):
    """One pair of engines (building them is most of the cost): forward-only log-probs/entropy, then an update."""
    (d_engine, d_loss, _), (p_engine, p_loss, _) = engines(
        hybrid_dir, dtype="float64", micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01
    )
    batch = grpo_batch()
    with _fp64(d_engine, p_engine):
        dense = T.run_infer(d_engine, batch, calculate_entropy=True)
        prefix = T.run_infer(p_engine, batch, calculate_entropy=True)
    assert_infer_matches(dense, prefix, 1e-10, groups=3)

    before = T.params_of(d_engine)
    with _fp64(d_engine, p_engine):
        dense = T.run_train_step(d_engine, d_loss, batch, capture_grads=True)
        prefix = T.run_train_step(p_engine, p_loss, batch, capture_grads=True)
    assert_reuse_ran(prefix["metrics"], groups=3)
    assert worst_relative(prefix["grads"], dense["grads"]) < 1e-10
    d_after, p_after = T.params_of(d_engine), T.params_of(p_engine)
    update = worst_relative({n: p_after[n] - before[n] for n in before}, {n: d_after[n] - before[n] for n in before})
    assert update < 1e-9
    assert prefix["loss"] == pytest.approx(dense["loss"], rel=1e-10)


def test_unserved_settings_run_dense_with_a_reason(hybrid_dir, tmp_path, caplog):
    """What the schedule does not serve for recurrent layers runs dense before the mini-batch's schedule:
    ``prefix/fallback_recurrent_layers`` (the engine's ``_model_fallback_reason``), the detail logged once."""
    model = AutoModelForCausalLM.from_pretrained(hybrid_dir)
    fallbacks.LOGGED_REASONS.clear()
    served = PrefixReuseConfig()
    assert fallbacks.recurrent_fallback_reason(model, served, ulysses=False, dormant_policy="keep") is None
    assert (
        fallbacks.recurrent_fallback_reason(
            model, PrefixReuseConfig(prefix_chunk_tokens=64), ulysses=False, dormant_policy="recompute"
        )
        is None
    )
    for policy in ("offload", "auto"):  # every dormant policy carries the recurrent states (test_recurrent.py)
        assert fallbacks.recurrent_fallback_reason(model, served, ulysses=False, dormant_policy=policy) is None
    cases = [
        (served, True, "keep", "Ulysses"),
        (PrefixReuseConfig(phase_b_attention="merged_varlen"), False, "keep", "merged_varlen"),
    ]
    with caplog.at_level(logging.WARNING, logger=fallbacks.__name__):
        for reuse, ulysses, policy, what in cases:
            reason = fallbacks.recurrent_fallback_reason(model, reuse, ulysses=ulysses, dormant_policy=policy)
            assert reason == "recurrent_layers", what
            assert what in caplog.text
    plain = T.write_tiny_model(tmp_path / "qwen3", "qwen3")
    plain_model = AutoModelForCausalLM.from_pretrained(plain)
    assert fallbacks.recurrent_fallback_reason(plain_model, cases[0][0], ulysses=True, dormant_policy="auto") is None
