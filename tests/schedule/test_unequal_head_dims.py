"""Value heads of another size than query/key heads (MLA: DeepSeek-V2/V3, Kimi-K2) in every reuse path
(issue 21, item 3).

The flash ops behind ``merged`` and ``merged_varlen`` take one head size for Q, K and V ("Q/K/V should have the
same head size" was the crash). They now run at the wider size with the narrower side zero-padded and slice
the output and gradients back. Checked here: the two-part attention against plain maths in fp64 with values
narrower and wider than the queries (flash ops, varlen, scored path), and a tiny DeepSeek-V3 (MLA, with and
without ``q_lora_rank``, a dense first layer and MoE layers after it) against plain HF dense in fp64 (1e-10)
and fp32 (1e-5) through auto/merged/concat/merged_varlen, chunked and forward-only, asserting that merged
served (no concat) and that reuse ran. Negative controls: slicing the wrong columns of the padded output, and
leaving the scale to the kernel's default after padding, must fail.
"""

from __future__ import annotations

import pytest
import torch
from helpers.layouts import VOCAB, make_layout, token_weights
from helpers.precision import promote_fp32_upcasts
from helpers.schedule_runs import infer_reuse, reused_grads
from test_merged_attention import reference_math, weighted_grads
from test_schedule_hf import dense_grads, dense_response_outputs, weighted_loss, worst_relative
from transformers import AutoModelForCausalLM, DeepseekV3Config

from verl_prefix.schedule.attention import merged as MA
from verl_prefix.schedule.attention import varlen as V
from verl_prefix.schedule.models.structure import kernel_head_dim
from verl_prefix.schedule.telemetry import PhaseMeter

CPU = torch.device("cpu")
GROUP = [(9, [4, 7, 1, 6, 3])]  # G = 5: micro-batches of 3 and 2 rows
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def mla_inputs(rows, heads, kv_heads, prefix, suffix, dim, value_dim, seed=0):
    """``(q, prefix K, prefix V, suffix K, suffix V, output weight)`` with values ``value_dim`` wide, fp64."""
    gen = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    return (
        t(rows, heads, suffix, dim),
        t(1, kv_heads, prefix, dim),
        t(1, kv_heads, prefix, value_dim),
        t(rows, kv_heads, suffix, dim),
        t(rows, kv_heads, suffix, value_dim),
        torch.randn(rows, suffix, heads, value_dim, generator=gen, dtype=torch.float64),
    )


def check_against_reference(got, q, pk, pv, sk, sv, w, scale):
    want = reference_math(q, pk, pv, sk, sv, scale)
    assert got.shape == want.shape == (q.shape[0], q.shape[2], q.shape[1], pv.shape[-1])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    tensors = (q, pk, pv, sk, sv)
    for g_got, g_want, t in zip(weighted_grads(got, w, tensors), weighted_grads(want, w, tensors), tensors):
        assert g_got.shape == t.shape
        torch.testing.assert_close(g_got, g_want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("value_dim", [6, 20], ids=["v-narrower", "v-wider"])
@pytest.mark.parametrize("groups", [1, 2])
def test_merged_kernels_serve_unequal_head_dims(value_dim, groups):
    q, pk, pv, sk, sv, w = mla_inputs(3, 2 * groups, 2, prefix=7, suffix=5, dim=12, value_dim=value_dim)
    assert MA.merged_refusal(q, {}, value_dim) is None
    check_against_reference(MA.merged_attention(q, pk, pv, sk, sv, 0.3), q, pk, pv, sk, sv, w, 0.3)


@pytest.mark.parametrize("value_dim", [6, 20], ids=["v-narrower", "v-wider"])
def test_merged_varlen_serves_unequal_head_dims(value_dim):
    q, pk, pv, sk, sv, w = mla_inputs(3, 4, 2, prefix=7, suffix=5, dim=12, value_dim=value_dim)
    packing = V.Packing.from_lengths([5, 2, 4], 5, CPU)
    got = V.merged_varlen_attention(q, pk, pv, sk, sv, packing, 0.3)
    want = reference_math(q, pk, pv, sk, sv, 0.3) * packing.mask[:, :, None, None]  # pads are zero
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    tensors = (q, pk, pv, sk, sv)
    for g_got, g_want in zip(weighted_grads(got, w, tensors), weighted_grads(want, w, tensors)):
        torch.testing.assert_close(g_got, g_want, rtol=1e-11, atol=1e-12)


def test_scored_path_serves_unequal_head_dims():
    """softcap/sinks run in plain torch ops, which take any value head size: sinks at -1e4 (exp underflows to
    exactly 0) route the call through that path and change nothing, so the plain reference holds."""
    q, pk, pv, sk, sv, w = mla_inputs(2, 4, 2, prefix=6, suffix=4, dim=12, value_dim=6)
    sinks = torch.full((4,), -1e4, dtype=torch.float64)
    got = MA.merged_attention(q, pk, pv, sk, sv, 0.3, sinks=sinks)
    check_against_reference(got, q, pk, pv, sk, sv, w, 0.3)


def test_negative_control_wrong_slice_of_the_padded_output(monkeypatch):
    """The padded output's real columns come first; keeping its last ``dv`` columns instead must fail."""
    q, pk, pv, sk, sv, _ = mla_inputs(2, 2, 2, prefix=6, suffix=4, dim=12, value_dim=6)
    right = MA.merged_attention(q, pk, pv, sk, sv, 0.3)
    monkeypatch.setattr(MA, "unpad_head", lambda x, dim: x if x.shape[-1] == dim else x[..., -dim:])
    wrong = MA.merged_attention(q, pk, pv, sk, sv, 0.3)
    assert (wrong - right).abs().max() > 0.1


def test_negative_control_default_scale_after_padding(monkeypatch):
    """Wider values pad Q and K; the kernel's default scale is then ``1/sqrt(padded size)``, not the
    model's: leaving the scale to the kernel must fail."""
    q, pk, pv, sk, sv, _ = mla_inputs(2, 2, 2, prefix=6, suffix=4, dim=12, value_dim=20)
    right = MA.merged_attention(q, pk, pv, sk, sv, 12**-0.5)
    forward = MA.attention_forward
    monkeypatch.setattr(MA, "attention_forward", lambda q_, k, v, causal, scale: forward(q_, k, v, causal, None))
    wrong = MA.merged_attention(q, pk, pv, sk, sv, 12**-0.5)
    assert (wrong - right).abs().max() > 1e-2


# -- a tiny DeepSeek-V3 against plain HF dense ---------------------------------------------------------------


def deepseek(dtype: torch.dtype, attn: str = "sdpa", q_lora_rank: int | None = None) -> torch.nn.Module:
    """MLA with query/key heads of 16 (8 no-RoPE + 8 RoPE) and value heads of 8, one dense layer then one
    MoE layer (4 routed experts, top 2, one shared); ``num_key_value_heads == num_attention_heads``."""
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        initializer_range=0.2,
        attn_implementation=attn,
        experts_implementation="eager",  # grouped_mm has no fp64 kernel
    )
    return AutoModelForCausalLM.from_config(config).to(dtype).train()


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(dtype, attn="sdpa", q_lora_rank=None):
        key = (dtype, attn, q_lora_rank)
        if key not in cache:
            cache[key] = deepseek(dtype, attn, q_lora_rank)
        return cache[key]

    return get


def run(model, layout, weights, *, rows, attention, meter=None, **options):
    """Reuse gradients; asserts every row reused and fewer tokens ran than dense."""
    return reused_grads(
        model, layout, weighted_loss(weights), rows=rows, phase_b_attention=attention, meter=meter, **options
    )


def test_tiny_deepseek_is_mla_with_moe(models):
    model = models(torch.float64)
    attention = model.model.layers[0].self_attn
    assert attention.qk_head_dim == 16 and attention.v_head_dim == 8
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
    assert type(model.model.layers[1].mlp).__name__ == "DeepseekV3MoE"


EVERY_PATH = ("auto", "merged", "concat", "merged_varlen")


@pytest.mark.parametrize(
    "dtype, q_lora_rank, attentions",
    [
        (torch.float64, None, EVERY_PATH),
        (torch.float64, 12, ("auto", "concat")),
        (torch.float32, None, ("auto", "merged", "concat")),
    ],
    ids=["fp64-q-proj", "fp64-q-lora", "fp32-q-proj"],
)
def test_deepseek_matches_dense_in_every_path(models, dtype, q_lora_rank, attentions):
    model = models(dtype, q_lora_rank=q_lora_rank)
    layout = make_layout(GROUP)
    weights = token_weights(layout, dtype)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        for attention in attentions:
            meter = PhaseMeter(CPU)
            got = run(model, layout, weights, rows=3, attention=attention, meter=meter)
            assert worst_relative(got, want) < TOLERANCE[dtype], attention
            ran = {"auto": "merged"}.get(attention, attention)  # auto serves it merged, not concat
            assert meter.counts[f"prefix/phase_b_attention/{ran}"] == 2, (attention, meter.counts)
            assert not [k for k in meter.counts if k.startswith("prefix/phase_b_attention/concat_")]


def test_deepseek_eager_chunked_and_forward_only(models):
    """Eager dense reference (auto: concat, eager's numerics; merged on request), a prefix in chunks of 3,
    and forward-only log-probs and entropy."""
    model = models(torch.float64, "eager")
    layout = make_layout([(9, [4, 7, 1]), (5, [3, 2])])
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        for attention, chunk in (("auto", 0), ("merged", 0), ("merged", 3)):
            got = run(model, layout, weights, rows=2, attention=attention, prefix_chunk_tokens=chunk)
            assert worst_relative(got, want) < 1e-10, (attention, chunk)
        with torch.no_grad():
            want_lp, want_ent = dense_response_outputs(model, layout)
            got = infer_reuse(model, layout, rows=3, phase_b_attention="merged")
    for i in range(len(layout)):
        torch.testing.assert_close(got[i][0], want_lp[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[i][1], want_ent[i], rtol=1e-12, atol=1e-12)


def test_negative_control_wrong_slice_fails_on_the_model(models, monkeypatch):
    model = models(torch.float64)
    layout = make_layout(GROUP)
    weights = token_weights(layout, torch.float64)
    monkeypatch.setattr(MA, "unpad_head", lambda x, dim: x if x.shape[-1] == dim else x[..., -dim:])
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        got = run(model, layout, weights, rows=4, attention="merged")
    assert worst_relative(got, want) > 1e-2


def test_preflight_asks_about_the_padded_head_size(models):
    """The kernels run at the wider head size (16 here), not the config's ``head_dim`` (the RoPE part, 8)."""
    config = models(torch.float64).config
    assert config.head_dim == 8 and kernel_head_dim(config) == 16
