"""Attention logit softcapping (Gemma-2's ``attn_logit_softcapping``) and attention sinks in every reuse path
(issue 20, item 1).

Under ``flash_attention_2`` (verl's default) the dense model caps every attention score; reuse used to route
flash models through an sdpa wrapper that dropped ``softcap``, a relative gradient error of 1.56 on the tiny
Gemma-2 below (``test_negative_control_dropping_softcap``). CPU has no flash-attn: ``helpers.flash_standin``
registers flash-attn's maths under HF's ``flash_attention_2`` name, so the dense reference is what the model
computes under FA2. Reuse must match it in phase A, concat and merged (each part capped before its own
log-sum-exp), in fp64 (1e-10) and fp32 (1e-5), chunked and checkpointed, forward-only too; under eager it
matches the family's eager function; under sdpa, which transformers runs without softcap, it matches that.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.flash_standin import flash_standin, use_flash
from helpers.layouts import VOCAB, make_layout, token_weights
from helpers.precision import promote_fp32_upcasts
from helpers.schedule_runs import infer_reuse, reused_grads
from test_merged_attention import attention_inputs, weighted_grads
from test_schedule_hf import RAGGED, dense_grads, dense_response_outputs, weighted_loss, worst_relative
from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig

from verl_prefix.schedule.attention import keywords as attention_keywords
from verl_prefix.schedule.attention import merged as MA
from verl_prefix.schedule.kv.contexts import causal_keep_mask, scored_attention
from verl_prefix.schedule.telemetry import PhaseMeter

CPU = torch.device("cpu")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
FLASH = "flash_attention_2"


@pytest.fixture
def flash(monkeypatch):
    with flash_standin(monkeypatch):
        yield


def gemma2(dtype: torch.dtype, attn: str, softcap: float | None = 2.0) -> torch.nn.Module:
    """A tiny random Gemma-2 whose softcap bites: a cap of 2 on scores scaled by head_dim ** -0.5 (its
    default cap of 50 with ``query_pre_attn_scalar=256`` moves these gradients by 2e-4 only). Its sliding
    layers' window (64) covers every sequence here, as the engine requires before it reuses."""
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        query_pre_attn_scalar=12,
        attn_logit_softcapping=softcap,
        final_logit_softcapping=30.0,
        sliding_window=64,
        initializer_range=0.2,
        attn_implementation="eager" if attn == FLASH else attn,
    )
    model = AutoModelForCausalLM.from_config(config).to(dtype).train()
    return use_flash(model) if attn == FLASH else model


def run(model, layout, weights, *, rows, attention="auto", meter=None, **options):
    """Reuse gradients; asserts every row reused (no dense rows, every group through A/B/C)."""
    return reused_grads(
        model, layout, weighted_loss(weights), rows=rows, phase_b_attention=attention, meter=meter, **options
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("attention", ["auto", "merged", "concat"])
def test_flash_softcap_matches_dense_in_every_path(flash, attention, dtype):
    model = gemma2(dtype, FLASH)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, dtype)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        for rows in (8, 3, 1):
            meter = PhaseMeter(CPU)
            got = run(model, layout, weights, rows=rows, attention=attention, meter=meter)
            assert worst_relative(got, want) < TOLERANCE[dtype], f"{rows} rows per micro-batch"
            ran = "concat" if attention == "concat" else "merged"  # auto: merged, softcap in plain torch ops
            assert meter.counts[f"prefix/phase_b_attention/{ran}"] == -(-8 // rows)
            assert not [k for k in meter.counts if k.startswith("prefix/phase_b_attention/concat_")]


def test_negative_control_dropping_softcap(flash, monkeypatch):
    """The old behaviour (flash models served as sdpa, which drops softcap) against the same dense reference:
    measured 1.56 relative gradient error in fp64 and fp32 (reuse then equals the uncapped dense model to 3e-15)."""
    model = gemma2(torch.float64, FLASH)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    monkeypatch.setitem(attention_keywords.DENSE_IGNORES, "flash", ("softcap", "s_aux"))
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        uncapped = dense_grads(gemma2(torch.float64, FLASH, softcap=None), layout, weights)
        got = run(model, layout, weights, rows=4)
    assert worst_relative(got, want) > 1.0
    assert worst_relative(got, uncapped) < 1e-10


@pytest.mark.parametrize("options", [{"prefix_chunk_tokens": 3}, {"checkpointing": True}], ids=["chunked", "ckpt"])
def test_flash_softcap_chunked_prefix_and_checkpointing(flash, options):
    model = gemma2(torch.float64, FLASH)
    if options.pop("checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layout = make_layout([(9, [4, 7, 1, 6]), (5, [3, 2])])
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        for attention in ("merged", "concat"):
            got = run(model, layout, weights, rows=2, attention=attention, **options)
            assert worst_relative(got, want) < 1e-10, attention


def test_flash_softcap_forward_only_matches_dense(flash):
    model = gemma2(torch.float64, FLASH).eval()
    layout = make_layout([(9, [4, 7, 1, 6]), (4, [2, 3])])
    with promote_fp32_upcasts(), torch.no_grad():
        want_lp, want_ent = dense_response_outputs(model, layout)
        for attention in ("merged", "concat"):
            got = infer_reuse(model, layout, rows=3, phase_b_attention=attention)
            for i in range(len(layout)):
                torch.testing.assert_close(got[i][0], want_lp[i], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(got[i][1], want_ent[i], rtol=1e-12, atol=1e-12)


def test_eager_softcap_matches_dense_eager():
    """Under eager the family's eager function caps (concat, phase A); explicit merged caps in plain torch."""
    model = gemma2(torch.float64, "eager")
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        for attention, ran in (("auto", "concat"), ("merged", "merged")):
            meter = PhaseMeter(CPU)
            got = run(model, layout, weights, rows=3, attention=attention, meter=meter)
            assert worst_relative(got, want) < 1e-10, attention
            assert meter.counts[f"prefix/phase_b_attention/{ran}"] == 3


def test_sdpa_computes_without_softcap_as_transformers_does(caplog):
    """transformers' sdpa attention takes no softcap: the dense sdpa model runs uncapped (it differs from
    eager by 1.56 here), and reuse under sdpa matches it, with one warning that says why."""
    model = gemma2(torch.float64, "sdpa")
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    attention_keywords.LOGGED.clear()
    with promote_fp32_upcasts(), caplog.at_level(logging.WARNING):
        want = dense_grads(model, layout, weights)
        capped = dense_grads(gemma2(torch.float64, "eager"), layout, weights)
        meter = PhaseMeter(CPU)
        got = run(model, layout, weights, rows=4, meter=meter)
    assert worst_relative(want, capped) > 1.0
    assert worst_relative(got, want) < 1e-10
    assert meter.counts["prefix/phase_b_attention/merged"] == 2  # the fused kernels: nothing to cap
    warned = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
    assert len(warned) == 1 and "softcap" in warned[0] and "sdpa" in warned[0]


# -- sinks (GPT-OSS's s_aux) -----------------------------------------------------------------------------


def gpt_oss(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=64,
        initializer_range=0.2,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    model = AutoModelForCausalLM.from_config(config).to(dtype).train()
    with torch.no_grad():  # sinks start at zero; spread them so they matter
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    return model


@pytest.mark.parametrize("attn", [FLASH, "eager"])
def test_sinks_match_dense(flash, attn):
    """GPT-OSS passes its per-head sinks as ``s_aux``: reuse applies them in every path (merged: a third part
    of the log-sum-exp merge), and the sinks' own gradient matches too."""
    model = gpt_oss(torch.float64)
    if attn == FLASH:
        use_flash(model)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        assert any("sinks" in name for name in want)
        for attention in ("merged", "concat"):
            got = run(model, layout, weights, rows=3, attention=attention)
            assert worst_relative(got, want) < 1e-10, attention


# -- the scored two-part attention against its concat and a plain reference ---------------------------------


def reference(q, pk, pv, sk, sv, scale, softcap, sinks):
    """softmax over [capped prefix scores, capped causal suffix scores, sink] of each query, by the book."""
    groups = q.shape[1] // sk.shape[1]
    rows, _, s, _ = q.shape
    key = torch.cat([pk.expand(rows, -1, -1, -1), sk], 2).repeat_interleave(groups, 1)
    value = torch.cat([pv.expand(rows, -1, -1, -1), sv], 2).repeat_interleave(groups, 1)
    scores = softcap * torch.tanh(q @ key.transpose(-1, -2) * scale / softcap)
    scores = scores.masked_fill(~causal_keep_mask(s, pk.shape[2], CPU), float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(rows, -1, s, 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return (probs @ value).transpose(1, 2)


@pytest.mark.parametrize("groups", [1, 2])
def test_scored_merged_matches_concat_and_reference(groups):
    q, pk, pv, sk, sv, w = attention_inputs(3, 2 * groups, 2, prefix=7, suffix=5, dtype=torch.float64)
    sinks = torch.randn(2 * groups, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    sinks.requires_grad_()
    tensors = (q, pk, pv, sk, sv, sinks)
    module = torch.nn.Module()
    module.num_key_value_groups = groups
    want = reference(q, pk, pv, sk, sv, 0.3, 1.5, sinks)
    merged = MA.merged_attention(q, pk, pv, sk, sv, 0.3, softcap=1.5, sinks=sinks)
    key = torch.cat([pk.expand(3, -1, -1, -1), sk], 2)
    value = torch.cat([pv.expand(3, -1, -1, -1), sv], 2)
    keep = causal_keep_mask(5, 7, CPU)
    concat, _ = scored_attention(module, q, key, value, keep, scaling=0.3, softcap=1.5, s_aux=sinks)
    uncapped = MA.merged_attention(q, pk, pv, sk, sv, 0.3)
    assert (uncapped - want).abs().max() > 1e-2  # the cap and the sinks matter at these scales
    want_grads = weighted_grads(want, w, tensors)
    for got in (merged, concat):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        got_grads = weighted_grads(got, w, tensors)
        for g_got, g_want in zip(got_grads, want_grads):
            torch.testing.assert_close(g_got, g_want, rtol=1e-11, atol=1e-12)
        assert got_grads[1].shape == pk.shape  # the prefix's dK summed over rows and heads
