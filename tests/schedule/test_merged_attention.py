"""Phase B's two-part attention (``verl_prefix.schedule.attention.merged``): the kernel against the
concat reference, the schedule through it against plain HF, negative controls that must fail, fp32 dK/dV
accumulation under bf16 autocast, and the token budget that counts the prefix."""

from __future__ import annotations

import pytest
import torch
from helpers.layouts import make_layout, token_weights
from helpers.precision import promote_fp32_upcasts
from helpers.schedule_runs import infer_reuse, train_reuse
from hypothesis import given, settings
from hypothesis import strategies as st
from test_schedule_hf import dense_grads, weighted_loss, worst_relative
from transformers import AutoModelForCausalLM, Qwen3Config

from verl_prefix.schedule import executor
from verl_prefix.schedule.attention import merged as MA
from verl_prefix.schedule.grouping import plan_batch, plan_suffix_micro_batches
from verl_prefix.schedule.kv.contexts import ServeContext, sdpa_lower_right
from verl_prefix.schedule.telemetry import PhaseMeter

CPU = torch.device("cpu")
OPS = torch.ops.aten


def attention_inputs(rows, heads, kv_heads, prefix, suffix, dtype, seed=0, dim=8):
    gen = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    return (
        t(rows, heads, suffix, dim),
        t(1, kv_heads, prefix, dim),
        t(1, kv_heads, prefix, dim),
        t(rows, kv_heads, suffix, dim),
        t(rows, kv_heads, suffix, dim),
        torch.randn(rows, suffix, heads, dim, generator=gen, dtype=torch.float64).to(dtype),
    )


def weighted_grads(out, weight, tensors):
    return torch.autograd.grad((out * weight).sum(), tensors)


def concat_reference(q, pk, pv, sk, sv, scaling):
    module = torch.nn.Module()
    module.num_key_value_groups = q.shape[1] // sk.shape[1]
    rows = q.shape[0]
    key = torch.cat([pk.expand(rows, -1, -1, -1), sk], 2)
    value = torch.cat([pv.expand(rows, -1, -1, -1), sv], 2)
    return sdpa_lower_right(module, q, key, value, scaling=scaling)[0]


def reference_math(q, pk, pv, sk, sv, scaling):
    """The same two-part maths in plain torch ops (autograd's own backward): fp64 ground truth."""
    groups = q.shape[1] // sk.shape[1]
    rows, _, s, _ = q.shape
    key = torch.cat([pk.expand(rows, -1, -1, -1), sk], 2).repeat_interleave(groups, 1)
    value = torch.cat([pv.expand(rows, -1, -1, -1), sv], 2).repeat_interleave(groups, 1)
    scores = q @ key.transpose(-1, -2) * scaling
    keep = torch.cat([torch.ones(s, pk.shape[2], dtype=torch.bool), torch.ones(s, s, dtype=torch.bool).tril()], 1)
    scores = scores.masked_fill(~keep, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2)


# -- the kernels' own facts --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cpu_op_is_upper_left_causal_and_supports_the_dtype(dtype):
    """``is_causal`` of the CPU flash op aligns upper-left (query i sees keys 0..i), which the square
    suffix part needs; it runs fp64 natively, and its LSE is the natural-log one of the scaled scores."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    k6, v6 = torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64), torch.randn(1, 2, 6, 8, generator=gen)
    out, lse = OPS._scaled_dot_product_flash_attention_for_cpu(q.to(dtype), k6.to(dtype), v6.to(dtype), 0.0, True)
    assert out.dtype == dtype
    scores = q @ k6.transpose(-1, -2) * 8**-0.5
    upper_left = torch.ones(4, 6, dtype=torch.bool).tril()
    want_lse = scores.masked_fill(~upper_left, float("-inf")).logsumexp(-1)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(lse.double(), want_lse, rtol=tol, atol=tol)
    lower_right = torch.ones(4, 6, dtype=torch.bool).tril(diagonal=2)
    assert (scores.masked_fill(~lower_right, float("-inf")).logsumexp(-1) - lse.double()).abs().max() > 0.1
    # square (the suffix part): both alignments agree
    out_sq, _ = OPS._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out_sq, want, rtol=1e-12, atol=1e-12)


def test_cpu_op_takes_gqa_natively():
    """The CPU flash op takes K/V with fewer heads than the queries (query head h reads KV head h // groups)
    and its backward sums dK/dV over each group: merged feeds the suffix K/V unrepeated on CPU."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out, lse = OPS._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True, scale=0.3
    )
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = OPS._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, True, scale=0.3)
    for g, w in zip(got, torch.autograd.grad(want, (q, k, v), grad)):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert MA.native_gqa(q)
    # negative control: heads h and h + 1 swapped in the repeat (not HF's order) is a different attention
    wrong = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat(1, 4, 1, 1), v.repeat(1, 4, 1, 1), is_causal=True, scale=0.3
    )
    assert (wrong - out).abs().max() > 1e-2


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_merged_matches_concat_and_reference(dtype, tol, groups, rows):
    q, pk, pv, sk, sv, w = attention_inputs(rows, 2 * groups, 2, prefix=7, suffix=5, dtype=dtype)
    tensors = (q, pk, pv, sk, sv)
    got = MA.merged_attention(q, pk, pv, sk, sv, scaling=0.3)
    want = concat_reference(q, pk, pv, sk, sv, 0.3)
    ref = reference_math(*(t.double() for t in tensors), 0.3)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    got_grads = weighted_grads(got, w, tensors)
    for g_got, g_want in zip(got_grads, weighted_grads(want, w, tensors)):
        assert ((g_got - g_want).norm() / g_want.norm()).item() < tol
    # the shared prefix's grads come out summed over rows and query heads: shape [1, kv_heads, P, d]
    assert got_grads[1].shape == pk.shape


def test_bf16_merged_is_as_close_to_fp64_as_concat():
    q, pk, pv, sk, sv, w = attention_inputs(4, 8, 2, prefix=33, suffix=9, dtype=torch.bfloat16)
    tensors = (q, pk, pv, sk, sv)
    ref = reference_math(*(t.double() for t in tensors), 0.25)
    ref_grads = weighted_grads(ref, w.double(), tensors)
    for fn in (MA.merged_attention, concat_reference):
        out = fn(q, pk, pv, sk, sv, 0.25)
        assert (out.double() - ref).abs().max() < 2e-2
        for g, r in zip(weighted_grads(out, w, tensors), ref_grads):
            assert ((g.double() - r).norm() / r.norm()) < 2e-2


def _bf16_output_errors(seeds: int = 6) -> dict[str, float]:
    """Mean relative forward error against fp64 of bf16 merged (fp32 prefix leaves, as the schedule holds
    them) and bf16 concat (one sdpa call), over a few random draws."""
    errors = {"merged": 0.0, "concat": 0.0}
    for seed in range(seeds):
        q, pk, pv, sk, sv, _ = attention_inputs(4, 8, 2, prefix=257, suffix=17, dtype=torch.bfloat16, seed=seed, dim=64)
        ref = reference_math(*(t.double() for t in (q, pk, pv, sk, sv)), 0.125)
        for name, out in (
            ("merged", MA.merged_attention(q, pk.float(), pv.float(), sk, sv, 0.125)),
            ("concat", concat_reference(q, pk, pv, sk, sv, 0.125)),
        ):
            errors[name] += ((out.double() - ref).norm() / ref.norm()).item() / seeds
    return errors


def test_bf16_merged_rounds_once(monkeypatch):
    """CPU bf16: both parts run in fp32 and the merged output is rounded to bf16 once, so merged is at least
    as close to fp64 as one sdpa call (measured 1.7e-3 vs 2.2e-3). Negative control: kernels in bf16 (each
    part's output rounded before the merge, the old path) are measurably worse (2.8e-3)."""
    assert MA.forward_dtype(torch.zeros(1, dtype=torch.bfloat16)) == torch.float32
    assert MA.forward_dtype(torch.zeros(1, dtype=torch.float64)) == torch.float64
    errors = _bf16_output_errors()
    monkeypatch.setattr(MA, "forward_dtype", lambda query: query.dtype)
    rounded_twice = _bf16_output_errors()["merged"]
    print(
        f"bf16 forward rel error: merged {errors['merged']:.2e}, concat {errors['concat']:.2e}, "
        f"merged with bf16 kernels {rounded_twice:.2e}"
    )
    assert errors["merged"] <= errors["concat"]
    assert rounded_twice > 1.3 * errors["merged"]


def cuda_rounding(monkeypatch) -> None:
    """Emulate CUDA's bf16 path on CPU: the forward kernels in the compute dtype, so each part's output is rounded
    to bf16 before the fp32 merge (its LSE stays fp32), as torch's CUDA flash kernels return them; the backward
    already runs in the compute dtype on both. ``merged`` and ``merged_varlen`` both read ``forward_dtype``."""
    monkeypatch.setattr(MA, "forward_dtype", lambda query: query.dtype)


def test_bf16_bound_with_cuda_rounding(monkeypatch):
    """Issue 27 item 5: the CPU's own bf16 path (fp32 parts, one rounding) is tighter than CUDA's, so the CPU
    bf16 tests above bound the CPU path only. With CUDA's rounding emulated (``cuda_rounding``: each part rounded
    to bf16 first), merged must stay within 1.5x one sdpa call's error against fp64 (mean over draws), the bound
    ``tests/backend/test_cuda.py`` holds reuse to against the stock engine on the GPU, forward and, for the
    gradients, on one draw (backward is in bf16 on both devices already). What this does not bound: the CUDA
    kernels' own accumulation order and their fp32 softmax internals (gpu_check's bf16 cells measure those)."""
    concat = _bf16_output_errors()["concat"]
    cuda_rounding(monkeypatch)
    merged = _bf16_output_errors()["merged"]
    print(f"bf16 forward rel error with CUDA's rounding: merged {merged:.2e}, concat {concat:.2e}")
    assert merged <= 1.5 * concat
    q, pk, pv, sk, sv, w = attention_inputs(4, 8, 2, prefix=257, suffix=17, dtype=torch.bfloat16, dim=64)
    tensors = (q, pk, pv, sk, sv)
    ref_grads = weighted_grads(reference_math(*(t.double() for t in tensors), 0.125), w.double(), tensors)
    errors = {}
    for name, fn in (("merged", MA.merged_attention), ("concat", concat_reference)):
        grads = weighted_grads(fn(q, pk, pv, sk, sv, 0.125), w, tensors)
        errors[name] = max(((g.double() - r).norm() / r.norm()).item() for g, r in zip(grads, ref_grads))
    assert errors["merged"] <= 1.5 * errors["concat"], errors


def test_bf16_merged_under_autocast_keeps_fp32_leaf_grads():
    """Under CPU bf16 autocast the fp32 prefix leaves go in as they are and their grads come back in fp32;
    the output is in the queries' dtype."""
    q, pk, pv, sk, sv, w = attention_inputs(2, 4, 2, prefix=9, suffix=5, dtype=torch.bfloat16)
    pk32, pv32 = pk.detach().float().requires_grad_(), pv.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = MA.merged_attention(q, pk32, pv32, sk, sv, 0.3)
    assert out.dtype == torch.bfloat16
    grads = weighted_grads(out, w, (q, pk32, pv32, sk, sv))
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    ref_grads = weighted_grads(reference_math(*(t.double() for t in (q, pk, pv, sk, sv)), 0.3), w.double(), (pk, pv))
    for g, r in zip(grads[1:3], ref_grads):
        assert ((g.double() - r).norm() / r.norm()) < 2e-2


# -- negative controls of the kernel: each must move the result ------------------------------------


def _fault_error(monkeypatch, fault) -> float:
    q, pk, pv, sk, sv, w = attention_inputs(3, 4, 2, prefix=7, suffix=5, dtype=torch.float64)
    tensors = (q, pk, pv, sk, sv)
    want_grads = weighted_grads(concat_reference(q, pk, pv, sk, sv, 0.3), w, tensors)
    fault(monkeypatch)
    got_grads = weighted_grads(MA.merged_attention(q, pk, pv, sk, sv, scaling=0.3), w, tensors)
    return max(((g - r).norm() / r.norm()).item() for g, r in zip(got_grads, want_grads))


def _per_part_lse(mp):
    mp.setattr(MA, "backward_stats", lambda out, lse, parts: [*parts[0], *parts[1]])


def _wrong_prefix_scale(mp):
    """The prefix part (the non-causal call) with twice the softmax scale, forward and backward."""
    forward, backward = MA.attention_forward, MA.attention_backward

    def scale_of(causal, scale):
        return scale if causal else 2 * scale

    mp.setattr(
        MA, "attention_forward", lambda q, k, v, causal, scale: forward(q, k, v, causal, scale_of(causal, scale))
    )
    mp.setattr(
        MA,
        "attention_backward",
        lambda g, q, k, v, o, lse, aux, causal, scale: backward(
            g, q, k, v, o, lse, aux, causal, scale_of(causal, scale)
        ),
    )


def _non_causal_suffix(mp):
    forward, backward = MA.attention_forward, MA.attention_backward
    mp.setattr(MA, "attention_forward", lambda q, k, v, causal, scale: forward(q, k, v, False, scale))
    mp.setattr(
        MA,
        "attention_backward",
        lambda g, q, k, v, o, lse, aux, causal, scale: backward(g, q, k, v, o, lse, aux, False, scale),
    )


@pytest.mark.parametrize("fault", [_per_part_lse, _wrong_prefix_scale, _non_causal_suffix])
def test_kernel_negative_controls(monkeypatch, fault):
    assert _fault_error(monkeypatch, fault) > 1e-2


# -- the schedule through merged attention -------------------------------------------------------------

RAGGED = [(9, [4, 7, 1, 6, 3, 5, 2, 8])]  # G = 8


def reuse_with_attention(model, layout, weights, rows, attention, meter=None, **kwargs):
    grads, _ = train_reuse(
        model,
        layout,
        weighted_loss(weights),
        rows=rows,
        calculate_entropy=True,
        phase_b_attention=attention,
        meter=meter,
        **kwargs,
    )
    return grads


def gqa_model(kv_heads: int, dtype: torch.dtype, attn: str = "sdpa", heads: int = 4):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=12,
        attn_implementation=attn,
        initializer_range=0.2,
    )
    return AutoModelForCausalLM.from_config(config).to(dtype).train()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("attention", ["merged", "merged_varlen"])
def test_schedule_two_part_attention_matches_dense_and_concat(attention, dtype, kv_heads):
    """The schedule with merged (padded rows) or merged_varlen (packed rows) phase-B attention against dense
    HF and against concat, at 8, 2 and 1 rows per micro-batch; every micro-batch ran the attention asked for.
    (merged_varlen against merged kernel by kernel: test_varlen_attention.)"""
    tol = {torch.float64: 1e-10, torch.float32: 1e-5}[dtype]
    model = gqa_model(kv_heads, dtype)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, dtype)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        for rows in (8, 2, 1):
            meter = PhaseMeter(CPU)
            got = reuse_with_attention(model, layout, weights, rows, attention, meter)
            concat = reuse_with_attention(model, layout, weights, rows, "concat")
            assert worst_relative(got, want) < tol, f"{rows} rows per micro-batch"
            assert worst_relative(got, concat) < tol
            assert meter.counts[f"prefix/phase_b_attention/{attention}"] == -(-8 // rows)
            for other in {"merged", "concat", "merged_varlen"} - {attention}:
                assert f"prefix/phase_b_attention/{other}" not in meter.counts


def test_auto_runs_merged_for_sdpa_and_concat_for_eager():
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    for attn, ran in (("sdpa", "merged"), ("eager", "concat")):
        meter = PhaseMeter(CPU)
        reuse_with_attention(gqa_model(2, torch.float64, attn), layout, weights, 4, "auto", meter)
        assert meter.counts[f"prefix/phase_b_attention/{ran}"] == 2
    assert meter.counts["prefix/phase_b_attention/concat_eager"] == 2


def test_merged_refuses_unserved_features():
    q = torch.zeros(1, 2, 3, 8)
    assert MA.merged_refusal(q, {}) is None
    assert MA.merged_refusal(q, {"sliding_window": 4}) == "sliding_window"
    assert MA.merged_refusal(q, {"softcap": 30.0}) == "softcap"
    assert MA.merged_refusal(q, {"s_aux": torch.zeros(2)}) == "sinks"
    assert MA.merged_refusal(q, {"dropout": 0.1}) == "dropout"
    assert MA.merged_refusal(q.to(torch.int32), {}) == "kernel_dtype"
    prefix = type("P", (), {"keys": [torch.zeros(1, 2, 4, 8)], "values": [torch.zeros(1, 2, 4, 8)], "length": 4})()
    module = torch.nn.Module()
    module.layer_idx = 0
    with pytest.raises(ValueError, match=r"merged cannot serve this attention call \(kernel_dtype\)"):
        ServeContext(prefix, 3, CPU, "merged").attend(module, lambda *a, **k: None, *[q.to(torch.int32)] * 3)
    # what the fused kernels refuse and plain torch ops serve (softcap, sinks) runs merged all the same
    served = ServeContext(prefix, 3, CPU, "merged")
    out, _ = served.attend(module, lambda *a, **k: None, q, q, q, softcap=30.0, s_aux=torch.zeros(2))
    assert out.shape == (1, 3, 2, 8) and served.merged_calls == 1 and not served.refusals
    with pytest.raises(ValueError, match="phase_b_attention"):
        ServeContext(prefix, 3, CPU, "fast")


def test_forward_only_merged_matches_concat():
    model = gqa_model(2, torch.float64).eval()
    layout = make_layout([(9, [4, 7, 1, 6]), (4, [2, 3])])
    temperature = torch.tensor([0.7, 1.0, 1.3, 1.0, 0.9, 1.1])
    with promote_fp32_upcasts(), torch.no_grad():
        got = {
            a: infer_reuse(model, layout, rows=3, temperature=temperature, phase_b_attention=a)
            for a in ("merged", "concat")
        }
        for i, (ids, p, s) in enumerate(zip(layout.input_ids, layout.prompt_lens, layout.response_lens)):
            logits = model(input_ids=ids[None]).logits[0, p - 1 : p - 1 + s] / temperature[i].double()
            want = torch.log_softmax(logits, -1).gather(-1, ids[p:, None]).squeeze(-1)
            for attention in got:
                torch.testing.assert_close(got[attention][i][0], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fault", [_per_part_lse, _wrong_prefix_scale, _non_causal_suffix])
def test_schedule_negative_controls(monkeypatch, fault):
    model = gqa_model(2, torch.float64)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        fault(monkeypatch)
        assert worst_relative(reuse_with_attention(model, layout, weights, 4, "merged"), want) > 1e-3


# -- fp32 dK/dV accumulation under bf16 autocast ------------------------------------------------------


def _accumulated_dkdv(monkeypatch, model, layout, weights, **kwargs) -> list[torch.Tensor]:
    """The dK/dV phase C is seeded with (a spy on ``prefix_backward``), as fp64."""
    seen: list[torch.Tensor] = []
    real = executor.prefix_backward

    def spy(prefix, leaves, model=None):
        seen.extend(leaf.grad.double() for leaf in leaves.tensors())
        return real(prefix, leaves, model)

    monkeypatch.setattr(executor, "prefix_backward", spy)
    reuse_with_attention(model, layout, weights, 1, "merged", **kwargs)
    return seen


@pytest.mark.parametrize("group_size", [16, 64])
def test_fp32_prefix_grad_accumulation_beats_bf16(monkeypatch, group_size):
    """CPU bf16 autocast, single-row micro-batches: the dK/dV phase C receives, accumulated in bf16 (the
    leaves' own dtype) vs in fp32, against the same schedule in fp64."""
    layout = make_layout([(24, [3 + (i % 5) for i in range(group_size)])], seed=2)
    weights = token_weights(layout, torch.float64)
    model = gqa_model(2, torch.float64)
    with promote_fp32_upcasts():
        want = torch.cat([g.flatten() for g in _accumulated_dkdv(monkeypatch, model, layout, weights)])
    model = model.float()
    fp32_weights = [w.float() for w in weights]
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    errors = {}
    for name, dtype in (("bf16", None), ("fp32", torch.float32)):
        got = _accumulated_dkdv(monkeypatch, model, layout, fp32_weights, autocast=bf16, prefix_grad_dtype=dtype)
        errors[name] = ((torch.cat([g.flatten() for g in got]) - want).norm() / want.norm()).item()
    print(f"G={group_size}: accumulated dK/dV rel error, bf16 {errors['bf16']:.3e}, fp32 {errors['fp32']:.3e}")
    assert errors["fp32"] < errors["bf16"]


# -- the token budget counts the prefix ----------------------------------------------------------------


def test_token_budget_counts_the_prefix_each_row_attends_to():
    layout = make_layout([(200, [4] * 16)])
    counted = plan_batch(layout, max_rows=None, max_tokens=1024, min_prefix_len=1, min_group_size=1)
    suffix_only = plan_batch(
        layout, max_rows=None, max_tokens=1024, min_prefix_len=1, min_group_size=1, count_prefix_tokens=False
    )
    assert len(suffix_only.groups[0].micro_batches) == 1  # 16 x 4 = 64 suffix tokens: the old, untrue plan
    # each row holds 4 suffix tokens + 199 prefix keys: 5 rows (1015 tokens) per micro-batch
    assert [len(mb) for mb in counted.groups[0].micro_batches] == [5, 5, 5, 1]


@settings(max_examples=50, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=20),
    prefix=st.integers(0, 300),
    budget=st.integers(1, 2000),
)
def test_token_budget_holds_for_any_group(lens, prefix, budget):
    rows = list(range(len(lens)))
    batches = plan_suffix_micro_batches(rows, lens, None, budget, prefix_tokens_per_row=prefix)
    assert sorted(i for b in batches for i in b) == rows
    for b in batches:
        assert len(b) == 1 or len(b) * (max(lens[i] for i in b) + prefix) <= budget


# -- the meters see the fp32 leaves ------------------------------------------------------------------------


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_prefix_leaves_are_metered(autocast):
    """``prefix/max_prefix_kv_leaves_mib``: the fp32 dK/dV leaves' copies plus their grads. In fp32 the
    leaves share the K/V's storage and only the grads count (1x ``max_prefix_kv_mib``). Under bf16 autocast
    Qwen3's V is bf16 (a copy of twice its bytes) while K leaves k_norm in fp32 (its fp32 weight promotes
    the product; the leaf shares it), and both grads are fp32."""
    model = gqa_model(2, torch.float32)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float32)
    meter = PhaseMeter(CPU)
    kwargs = {"autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)} if autocast else {}
    reuse_with_attention(model, layout, weights, 4, "merged", meter, **kwargs)
    metrics = meter.metrics(logical_tokens=1, physical_tokens=1)
    one = 3 * 2 * 8 * 12 / 2**20  # elements of K (or V), all layers: 3 layers x 2 KV heads x 8 tokens x 12
    kv_bytes = one * (4 + 2) if autocast else one * (4 + 4)
    leaves_bytes = one * (4 + 8) if autocast else one * 8  # (V's fp32 copy +) K and V fp32 grads
    assert metrics["prefix/max_prefix_kv_mib"] == pytest.approx(kv_bytes)
    assert metrics["prefix/max_prefix_kv_leaves_mib"] == pytest.approx(leaves_bytes)


# -- the prefix part's backward split into batch entries (CUDA's occupancy; the same maths on every device) --------


def test_prefix_backward_splits_fill_the_sms():
    # Qwen3-8B (8 KV heads) on 132 SMs: a 512-token prefix gives 32 blocks, so 9 entries make two waves
    assert MA.prefix_backward_splits(8, 512, queries=8192, sms=132) == 9
    assert MA.prefix_backward_splits(8, 8192, queries=8192, sms=132) == 1  # a long prefix fills them already
    assert MA.prefix_backward_splits(8, 64, queries=600, sms=132) == 2  # each entry keeps 256 queries or more
    assert MA.prefix_backward_splits(1, 16, queries=1 << 20, sms=132) == MA.SPLIT_MAX
    assert MA.prefix_backward_splits(8, 512, queries=8192, sms=None) == 1  # CPU: no SMs to fill


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("groups", [1, 4])
def test_split_prefix_backward_is_the_same_maths(monkeypatch, splits, groups):
    """The backward split into ``splits`` batch entries (the last padded: 5 rows x groups x 5 queries do not
    divide) against the unsplit one in fp64; the kernel sees the entries; dropping an entry's dK/dV fails."""
    q, pk, pv, sk, sv, w = attention_inputs(5, 2 * groups, 2, prefix=7, suffix=5, dtype=torch.float64)
    tensors = (q, pk, pv, sk, sv)
    want = weighted_grads(MA.merged_attention(q, pk, pv, sk, sv, scaling=0.3), w, tensors)
    seen = []
    kernel = MA.attention_backward

    def spy(grad, query, *args):
        seen.append(query.shape[0])
        return kernel(grad, query, *args)

    monkeypatch.setattr(MA, "prefix_backward_splits", lambda *args: splits)
    monkeypatch.setattr(MA, "attention_backward", spy)
    got = weighted_grads(MA.merged_attention(q, pk, pv, sk, sv, scaling=0.3), w, tensors)
    assert splits in seen  # the prefix part ran as that many batch entries
    for g_got, g_want in zip(got, want):
        torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)

    def first_entry_only(grad, query, key, value, *args):
        dq, dk, dv = kernel(grad, query, key, value, *args)
        return (dq, dk[:1].expand_as(dk) * 0 + dk[:1], dv) if query.shape[0] == splits else (dq, dk, dv)

    monkeypatch.setattr(MA, "attention_backward", first_entry_only)
    dropped = weighted_grads(MA.merged_attention(q, pk, pv, sk, sv, scaling=0.3), w, tensors)
    assert (dropped[1] - want[1]).abs().max() > 1e-3
