"""``phase_b_attention: merged_varlen`` (``verl_prefix.schedule.attention.varlen``): the CPU reference varlen
kernel against plain maths, the packed two-part attention against concat and merged (ragged rows, GQA 1/2/4,
1/2/G rows), pads that cannot leak, negative controls (wrong ``cu_seqlens``, per-part LSE, non-causal
suffix), the schedule through it against HF dense, and the CUDA dispatch (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from helpers.host_sync import HostSyncCounter
from helpers.layouts import make_layout, token_weights
from helpers.precision import promote_fp32_upcasts
from helpers.schedule_runs import infer_reuse
from hypothesis import given, settings
from hypothesis import strategies as st
from test_merged_attention import (
    RAGGED,
    attention_inputs,
    concat_reference,
    gqa_model,
    reference_math,
    reuse_with_attention,
    weighted_grads,
)
from test_schedule_hf import dense_grads, worst_relative

from verl_prefix.schedule.attention import merged as MA
from verl_prefix.schedule.attention import varlen as V
from verl_prefix.schedule.kv.contexts import ServeContext

CPU = torch.device("cpu")
LENGTHS = {1: [4], 2: [5, 2], 5: [3, 5, 1, 4, 2]}  # ragged rows, width 5


def _packing(lengths, width=5):
    return V.Packing.from_lengths(torch.tensor(lengths), width, CPU)


def _masked(x, mask):
    """``[B, S, ...]`` with pad positions zeroed."""
    return x * mask.view(*mask.shape, *([1] * (x.dim() - 2))).to(x.dtype)


# -- the CPU reference varlen kernel -------------------------------------------------------------------


def _spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` of each packed sequence, from its cumulative lengths."""
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_reference_varlen_kernel_is_per_sequence_attention(causal, groups):
    """flash-attn's varlen contract on CPU: ``[T, H, d]`` packed sequences, LSE ``[H, T]``, GQA native,
    dK/dV summed over each KV head's query heads; against per-sequence sdpa (fp64, 1e-12)."""
    gen = torch.Generator().manual_seed(3)
    q_lens, k_lens = [3, 1, 4], ([3, 1, 4] if causal else [6, 2, 5])
    heads, kv_heads, d = 2 * groups, 2, 8
    q = torch.randn(sum(q_lens), heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(k_lens), kv_heads, d, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    cu_q = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0, *k_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out, lse = V.reference_varlen_forward(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), 0.3, causal)
    assert out.shape == q.shape and lse.shape == (heads, sum(q_lens))
    want, want_lse = [], []
    for (qs, qe), (ks, ke) in zip(_spans(cu_q), _spans(cu_k)):
        qb, kb, vb = (x.transpose(0, 1) for x in (q[qs:qe], k[ks:ke].repeat_interleave(groups, 1), v[ks:ke]))
        vb = vb.repeat_interleave(groups, 0)
        scores = qb @ kb.transpose(-1, -2) * 0.3
        if causal:
            scores = scores.masked_fill(~torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(), float("-inf"))
        want.append((scores.softmax(-1) @ vb).transpose(0, 1))
        want_lse.append(scores.logsumexp(-1))
    want, want_lse = torch.cat(want), torch.cat(want_lse, dim=1)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = V.reference_varlen_backward(grad, q, k, v, out, lse, cu_q, cu_k, max(q_lens), max(k_lens), 0.3, causal)
    for g, w in zip(got, torch.autograd.grad(want, (q, k, v), grad)):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


# -- the packed two-part attention against concat and merged ------------------------------------------------


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_varlen_matches_concat_merged_and_reference(dtype, tol, groups, rows):
    q, pk, pv, sk, sv, w = attention_inputs(rows, 2 * groups, 2, prefix=7, suffix=5, dtype=dtype)
    packing = _packing(LENGTHS[rows])
    w = _masked(w, packing.mask)  # the loss reads real positions only, as the schedule's does
    tensors = (q, pk, pv, sk, sv)
    got = V.merged_varlen_attention(q, pk, pv, sk, sv, packing, scaling=0.3)
    assert got.shape == (rows, 5, 2 * groups, 8) and got.dtype == dtype
    assert not got[~packing.mask].any()  # pads: exactly zero
    others = {
        "concat": concat_reference(q, pk, pv, sk, sv, 0.3),
        "merged": MA.merged_attention(q, pk, pv, sk, sv, scaling=0.3),
        "fp64 maths": reference_math(*(t.double() for t in tensors), 0.3).to(dtype),
    }
    got_grads = weighted_grads(got, w, tensors)
    for name, want in others.items():
        torch.testing.assert_close(got, _masked(want, packing.mask), rtol=tol, atol=tol, msg=name)
        for g_got, g_want in zip(got_grads, weighted_grads(want, w, tensors)):
            assert ((g_got - g_want).norm() / g_want.norm()).item() < tol, name
    # the shared prefix's grads come out summed over rows and query heads: shape [1, kv_heads, P, d]
    assert got_grads[1].shape == pk.shape and got_grads[1].dtype == dtype


def test_pads_do_not_leak():
    """Whatever the pad positions of q/k/v hold, real outputs and every gradient are unchanged, and the pads'
    own gradients are zero (the varlen kernels never see them)."""
    q, pk, pv, sk, sv, w = attention_inputs(5, 4, 2, prefix=7, suffix=5, dtype=torch.float64)
    packing = _packing(LENGTHS[5])
    pad = ~packing.mask

    def run(q, sk, sv):
        tensors = (q, pk, pv, sk, sv)
        out = V.merged_varlen_attention(q, pk, pv, sk, sv, packing, 0.3)
        return out, weighted_grads(out, w, tensors)  # w is nonzero on pads too: pads must still not leak

    out, grads = run(q, sk, sv)
    for g in (grads[0], grads[3], grads[4]):  # q, suffix K, suffix V
        assert not g.transpose(1, 2)[pad].any(), "a pad position got a gradient"
    noisy = [x.detach().clone() for x in (q, sk, sv)]
    for x in noisy:
        x.transpose(1, 2)[pad] = 1e3
    noisy = [x.requires_grad_() for x in noisy]
    out2, grads2 = run(*noisy)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    for g2, g in zip(grads2, grads):
        torch.testing.assert_close(g2, g, rtol=0, atol=0)


def test_bf16_varlen_under_autocast_matches_merged():
    """CPU bf16 autocast with fp32 prefix leaves: the output is bf16, the leaves' grads fp32, and varlen is as
    close to fp64 as merged (the same fp32 forward kernels and one rounding)."""
    q, pk, pv, sk, sv, w = attention_inputs(4, 8, 2, prefix=33, suffix=9, dtype=torch.bfloat16, dim=16)
    packing = V.Packing.from_lengths([9, 4, 7, 1], 9, CPU)
    w = _masked(w, packing.mask)
    pk32, pv32 = pk.detach().float().requires_grad_(), pv.detach().float().requires_grad_()
    ref = _masked(reference_math(*(t.double() for t in (q, pk, pv, sk, sv)), 0.25), packing.mask)
    errors = {}
    for name in ("varlen", "merged"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if name == "varlen":
                out = V.merged_varlen_attention(q, pk32, pv32, sk, sv, packing, 0.25)
            else:
                out = MA.merged_attention(q, pk32, pv32, sk, sv, 0.25)
        assert out.dtype == torch.bfloat16
        grads = weighted_grads(out, w, (q, pk32, pv32, sk, sv))
        assert [g.dtype for g in grads[1:3]] == [torch.float32, torch.float32]
        errors[name] = ((_masked(out, packing.mask).double() - ref).norm() / ref.norm()).item()
    print(f"bf16 forward rel error vs fp64: varlen {errors['varlen']:.2e}, merged {errors['merged']:.2e}")
    assert errors["varlen"] < 1e-2
    assert errors["varlen"] <= 1.05 * errors["merged"]


# -- negative controls: each must move the result ---------------------------------------------------------


def _shifted_offsets(packing):
    """cu_seqlens one token off at every inner boundary: rows borrow a neighbour's first token."""
    cu = packing.cu_seqlens.clone()
    cu[1:-1] += 1
    return V.Packing(packing.mask, cu, packing.lengths, packing.width)


def _varlen_fault_error(monkeypatch, fault) -> float:
    q, pk, pv, sk, sv, w = attention_inputs(5, 4, 2, prefix=7, suffix=5, dtype=torch.float64)
    packing = _packing(LENGTHS[5])
    w = _masked(w, packing.mask)
    tensors = (q, pk, pv, sk, sv)
    want = weighted_grads(_masked(concat_reference(q, pk, pv, sk, sv, 0.3), packing.mask), w, tensors)
    packing = fault(monkeypatch, packing)
    got = weighted_grads(V.merged_varlen_attention(q, pk, pv, sk, sv, packing, 0.3), w, tensors)
    return max(((g - r).norm() / r.norm()).item() for g, r in zip(got, want))


def _wrong_offsets(mp, packing):
    return _shifted_offsets(packing)


def _per_part_lse(mp, packing):
    mp.setattr(MA, "backward_stats", lambda out, lse, parts: [*parts[0], *parts[1]])
    return packing


def _non_causal_suffix(mp, packing):
    forward, backward = V.reference_varlen_forward, V.reference_varlen_backward
    faulty = V.VarlenKernels("reference", lambda *a: forward(*a[:-1], False), lambda *a: backward(*a[:-1], False))
    mp.setattr(V, "REFERENCE", faulty)
    return packing


@pytest.mark.parametrize("fault", [_wrong_offsets, _per_part_lse, _non_causal_suffix])
def test_varlen_negative_controls(monkeypatch, fault):
    assert _varlen_fault_error(monkeypatch, fault) > 1e-2


# -- no host sync inside a layer (issue 27 item 1; on CUDA: gpu_check's set_sync_debug_mode cell) ----------------


def _layer_host_syncs(monkeypatch, prefix_len: int | None = 7):
    """The ops that would synchronise the host on CUDA, counted over two layers' forward and backward of one
    micro-batch (the packing built before them, as ``ServeContext.packing`` builds it; the CPU reference kernels
    themselves uncounted: CUDA runs one kernel per part where they loop over sequences on the host)."""
    q, pk, pv, sk, sv, w = attention_inputs(5, 4, 2, prefix=7, suffix=5, dtype=torch.float32)
    packing = V.Packing.from_lengths(LENGTHS[5], 5, CPU, prefix_len=prefix_len)
    assert torch.equal(packing.index, packing.mask.flatten().nonzero().flatten())
    w = _masked(w, packing.mask)
    counter = HostSyncCounter()

    def uncounted(kernel):
        def run(*args):
            with counter.paused():
                return kernel(*args)

        return run

    forward, backward = V.reference_varlen_forward, V.reference_varlen_backward
    monkeypatch.setattr(V, "REFERENCE", V.VarlenKernels("reference", uncounted(forward), uncounted(backward)))
    with counter:
        for _layer in range(2):
            out = V.merged_varlen_attention(q, pk, pv, sk, sv, packing, 0.3)
            weighted_grads(out, w, (q, pk, pv, sk, sv))
    return counter.syncs


def test_varlen_layer_has_no_host_sync(monkeypatch):
    """merged_varlen's layer (gather, both parts, merge, scatter; forward and backward) dispatches no op that
    makes the host wait on CUDA: the offsets and the gather index come built with the micro-batch's packing."""
    assert _layer_host_syncs(monkeypatch) == {}


def test_host_sync_negative_controls(monkeypatch):
    """The counter sees what the old code did: boolean-mask gathers (a nonzero forward, an ``index_put`` with a
    boolean index backward) and ``cu_seqlens`` made with ``torch.tensor`` in every layer, forward and backward."""
    # without the prefix length the packing builds [0, T] and [0, P] at their first use, once in the micro-batch
    assert _layer_host_syncs(monkeypatch, prefix_len=None) == {"aten.lift_fresh.default": 2}
    with monkeypatch.context() as mp:
        mp.setattr(V, "gather_packed", lambda x, packing: x[packing.mask])
        syncs = _layer_host_syncs(mp)
    assert syncs["aten.index.Tensor (boolean index)"] == 2 * 3 and syncs["aten.index_put.default (boolean index)"] > 0
    with monkeypatch.context() as mp:
        mp.setattr(V.Packing, "whole", lambda self, n: torch.tensor([0, n], dtype=torch.int32))
        assert _layer_host_syncs(mp)["aten.lift_fresh.default"] == 2 * 4  # two per forward, two per backward


# -- packing: bad input is refused, good input packs every real token once -----------------------------------


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(-2, 12), min_size=0, max_size=8), width=st.integers(1, 10))
def test_packing_from_any_lengths(lengths, width):
    if not lengths or min(lengths) < 1 or max(lengths) > width:
        with pytest.raises(ValueError, match="row lengths"):
            V.Packing.from_lengths(lengths, width, CPU)
        return
    packing = V.Packing.from_lengths(torch.tensor(lengths), width, CPU)
    assert packing.cu_seqlens.dtype == torch.int32
    assert packing.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert packing.mask.sum(1).tolist() == lengths and packing.total == sum(lengths)
    assert all(packing.mask[b, :n].all() for b, n in enumerate(lengths))  # right padding: real tokens first


def test_serve_context_refuses_what_varlen_cannot_serve():
    prefix = type("P", (), {"keys": [torch.zeros(1, 2, 4, 8)], "values": [torch.zeros(1, 2, 4, 8)], "length": 4})()
    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.zeros(2, 2, 3, 8)
    with pytest.raises(ValueError, match=r"merged_varlen cannot serve this attention call \(no_row_lengths\)"):
        ServeContext(prefix, 3, CPU, "merged_varlen").attend(module, None, q, q, q)
    with pytest.raises(ValueError, match=r"\(width\)"):  # attention sees rows other than the micro-batch's
        ServeContext(prefix, 4, CPU, "merged_varlen", row_lengths=[3, 2]).attend(module, None, q, q, q)
    with pytest.raises(ValueError, match=r"\(softcap\)"):
        ServeContext(prefix, 3, CPU, "merged_varlen", row_lengths=[3, 2]).attend(module, None, q, q, q, softcap=30.0)
    out, _ = ServeContext(prefix, 3, CPU, "merged_varlen", row_lengths=[3, 2]).attend(module, None, q, q, q)
    assert out.shape == (2, 3, 2, 8)


# -- the schedule through merged_varlen -------------------------------------------------------------------------
# (against dense HF and concat at 8/2/1 rows: test_merged_attention's
# test_schedule_two_part_attention_matches_dense_and_concat)


def test_schedule_varlen_under_gradient_checkpointing():
    """Non-reentrant checkpointing recomputes each layer's varlen attention in backward (same packing)."""
    model = gqa_model(2, torch.float64)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        assert worst_relative(reuse_with_attention(model, layout, weights, 3, "merged_varlen"), want) < 1e-10


def test_schedule_negative_control_wrong_offsets(monkeypatch):
    """The schedule with every micro-batch's cu_seqlens one token off must miss dense."""
    model = gqa_model(2, torch.float64)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    real = V.Packing.from_lengths
    monkeypatch.setattr(V.Packing, "from_lengths", lambda *a: _shifted_offsets(real(*a)))
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        assert worst_relative(reuse_with_attention(model, layout, weights, 4, "merged_varlen"), want) > 1e-3


def test_forward_only_varlen_matches_hf():
    model = gqa_model(2, torch.float64).eval()
    layout = make_layout([(9, [4, 7, 1, 6]), (4, [2, 3])])
    temperature = torch.tensor([0.7, 1.0, 1.3, 1.0, 0.9, 1.1])
    with promote_fp32_upcasts(), torch.no_grad():
        got = infer_reuse(model, layout, rows=3, temperature=temperature, phase_b_attention="merged_varlen")
        for i, (ids, p, s) in enumerate(zip(layout.input_ids, layout.prompt_lens, layout.response_lens)):
            logits = model(input_ids=ids[None]).logits[0, p - 1 : p - 1 + s] / temperature[i].double()
            want = torch.log_softmax(logits, -1).gather(-1, ids[p:, None]).squeeze(-1)
            torch.testing.assert_close(got[i][0], want, rtol=1e-12, atol=1e-12)


def test_moe_aux_through_varlen_matches_hf_dense():
    """MoE: each suffix row also feeds its last response token (``tokens.sum(1)`` counts it), which varlen packs."""
    from test_moe import RAGGED as MOE_RAGGED
    from test_moe import TOLERANCE, compare, tiny_moe

    model = tiny_moe(torch.float64)
    layout = make_layout(MOE_RAGGED)
    with promote_fp32_upcasts():
        for rows in (8, 3):
            grads, aux, flips, _, _ = compare(model, layout, rows, torch.float64, phase_b_attention="merged_varlen")
            assert flips == 0
            assert aux < TOLERANCE[torch.float64] and grads < TOLERANCE[torch.float64], rows


# -- the CUDA dispatch, on CPU with the kernels mocked (issue 20 item 6) ----------------------------------------

CUDA = torch.device("cuda")  # a device object only: nothing here allocates on it


def _no_cuda_kernels(monkeypatch, flash_attn: str | None, torch_varlen: bool = False) -> None:
    """What ``kernels_for`` sees: torch's varlen attention present or not, flash-attn at ``flash_attn``."""
    monkeypatch.setattr(V, "torch_varlen_available", lambda: torch_varlen)
    monkeypatch.setattr(V, "flash_attn_version", lambda: flash_attn)
    functions = (V.reference_varlen_forward, V.reference_varlen_backward) if flash_attn else None
    monkeypatch.setattr(V, "flash_attn_functions", lambda: functions)


def test_cuda_dispatch_prefers_torch_then_flash_attn_2_7(monkeypatch):
    assert V.kernels_for(CPU) is V.REFERENCE
    _no_cuda_kernels(monkeypatch, "2.8.3", torch_varlen=True)
    assert V.kernels_for(CUDA) is V.TORCH and V.varlen_kernel_problem() is None
    _no_cuda_kernels(monkeypatch, "2.8.3")
    assert V.kernels_for(CUDA) is V.FLASH_ATTN and V.varlen_kernel_problem() is None
    _no_cuda_kernels(monkeypatch, "2.7.0.post2")
    assert V.kernels_for(CUDA) is V.FLASH_ATTN
    for old in ("2.6.3", "2.5.9.post1", "1.0.9"):  # the 8-value forward with window_size as a tuple
        _no_cuda_kernels(monkeypatch, old)
        assert V.kernels_for(CUDA) is None
        problem = V.varlen_kernel_problem()
        assert f"flash-attn {old} is older than 2.7" in problem and torch.__version__ in problem, problem
    _no_cuda_kernels(monkeypatch, None)
    assert V.kernels_for(CUDA) is None
    assert "flash_attn does not import: install torch >= 2.10 or flash-attn >= 2.7" in V.varlen_kernel_problem()
    assert V.kernels_for(torch.device("meta")) is None


class OnDevice:
    """A stand-in query whose ``device`` reads as another device type (the refusals only read it)."""

    def __init__(self, tensor: torch.Tensor, device_type: str) -> None:
        self.tensor, self.device = tensor, torch.device(device_type)

    def __getattr__(self, name):
        return getattr(self.tensor, name)


def test_varlen_refusal_on_cuda_names_the_missing_kernel(monkeypatch):
    monkeypatch.setattr(
        MA, "merged_refusal", lambda query, kwargs, value_dim=None: None
    )  # the GPU serves the merged kernels
    query = OnDevice(torch.zeros(1, 2, 4, 8), "cuda")
    _no_cuda_kernels(monkeypatch, "2.6.3")
    assert V.varlen_refusal(query, {}) == "varlen_kernel"
    _no_cuda_kernels(monkeypatch, None)
    assert V.varlen_refusal(query, {}) == "varlen_kernel"
    _no_cuda_kernels(monkeypatch, "2.7.1")
    assert V.varlen_refusal(query, {}) is None
    _no_cuda_kernels(monkeypatch, None, torch_varlen=True)
    assert V.varlen_refusal(query, {}) is None


def _schema_call(op, args, kwargs) -> dict:
    """Bind a call to the installed torch's schema of ``op``: every positional argument in order, keywords
    only among the keyword-only ones, nothing required missing. Returns ``{name: value}``."""
    schema = op.default._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    keyword = {a.name for a in schema.arguments if a.kwarg_only}
    assert len(args) == len(positional), (len(args), [a.name for a in positional])
    assert set(kwargs) <= keyword, set(kwargs) - keyword
    return {**{a.name: v for a, v in zip(positional, args)}, **kwargs}


def test_torch_varlen_calls_the_aten_ops_as_their_schema_says(monkeypatch):
    """torch's varlen kernels through ``aten::_flash_attention_forward/_backward`` (CUDA only): the calls are
    bound to this torch's schemas and served by the CPU reference, so argument order, ``scale``, ``is_causal``
    and the LSE layout are checked, and the two-part attention through them equals the reference's."""
    calls = {"forward": 0, "backward": 0}
    aten_forward, aten_backward = torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward

    def forward(*args, **kwargs):
        bound = _schema_call(aten_forward, args, kwargs)
        assert bound["dropout_p"] == 0.0 and bound["return_debug_mask"] is False
        calls["forward"] += 1
        out, lse = V.reference_varlen_forward(
            *(bound[n] for n in ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k")),
            bound["scale"],
            bound["is_causal"],
        )
        return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)

    def backward(*args, **kwargs):
        bound = _schema_call(aten_backward, args, kwargs)
        assert bound["dropout_p"] == 0.0
        calls["backward"] += 1
        names = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k")
        return V.reference_varlen_backward(*(bound[n] for n in names), bound["scale"], bound["is_causal"])

    monkeypatch.setattr(V, "aten_flash_ops", lambda: (forward, backward))
    q, pk, pv, sk, sv, w = attention_inputs(5, 4, 2, prefix=7, suffix=5, dtype=torch.float64)
    packing = _packing(LENGTHS[5])
    w = _masked(w, packing.mask)
    tensors = (q, pk, pv, sk, sv)
    want = V.merged_varlen_attention(*tensors[:3], sk, sv, packing, 0.3)
    want_grads = weighted_grads(want, w, tensors)
    monkeypatch.setattr(V, "kernels_for", lambda device: V.TORCH)
    got = V.merged_varlen_attention(*tensors[:3], sk, sv, packing, 0.3)
    got_grads = weighted_grads(got, w, tensors)
    assert calls == {"forward": 2, "backward": 2}  # prefix part and suffix part
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_flash_attn_2_7_calls(monkeypatch):
    """flash-attn >= 2.7's private varlen API, mocked with its 2.7 signatures (keyword arguments; a 4-value
    forward; a backward that writes dq, dk, dv in place), served by the CPU reference."""

    def forward(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal):
        assert dropout_p == 0.0
        out, lse = V.reference_varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal
        )
        return out, lse, None, None

    def backward(dout, q, k, v, out, lse, dq, dk, dv, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
                 deterministic):  # fmt: skip
        assert (window_size_left, window_size_right, softcap, dropout_p) == (-1, -1, 0.0, 0.0)
        grads = V.reference_varlen_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal
        )
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)

    monkeypatch.setattr(V, "flash_attn_functions", lambda: (forward, backward))
    q, pk, pv, sk, sv, w = attention_inputs(2, 8, 2, prefix=7, suffix=5, dtype=torch.float64)
    packing = _packing(LENGTHS[2])
    w = _masked(w, packing.mask)
    tensors = (q, pk, pv, sk, sv)
    want = V.merged_varlen_attention(*tensors, packing, 0.3)
    want_grads = weighted_grads(want, w, tensors)
    monkeypatch.setattr(V, "kernels_for", lambda device: V.FLASH_ATTN)
    got = V.merged_varlen_attention(*tensors, packing, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, r in zip(weighted_grads(got, w, tensors), want_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("deterministic", [False, True])
def test_flash_attn_backward_honours_deterministic_algorithms(monkeypatch, deterministic):
    """flash-attn's backward is asked for its deterministic dK/dV exactly when torch's deterministic algorithms
    are on (issue 27 item 6; torch's own flash backward reads the same flag itself)."""
    seen = []

    def backward(dout, q, k, v, out, lse, dq, dk, dv, **kwargs):
        seen.append(kwargs["deterministic"])
        for dst in (dq, dk, dv):
            dst.zero_()

    monkeypatch.setattr(V, "flash_attn_functions", lambda: (None, backward))
    q, k = torch.zeros(3, 2, 8), torch.zeros(4, 2, 8)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        V.flash_attn_varlen_backward(q, q, k, k, q, torch.zeros(2, 3), cu_q, cu_k, 3, 4, 0.3, False)
    finally:
        torch.use_deterministic_algorithms(before)
    assert seen == [deterministic]


def test_version_tuple():
    assert V.version_tuple("2.7.4.post1") == (2, 7)
    assert V.version_tuple("2.10.0") == (2, 10) > (2, 7)
    assert V.version_tuple("3") == (3, 0)
    assert V.version_tuple("dev") == (0, 0)


# -- CUDA: the varlen kernels on a GPU (cannot run here) --------------------------------------------------------


def _cuda_kernels() -> list:
    """The CUDA varlen kernels this machine has: torch's own, flash-attn >= 2.7's."""
    if not torch.cuda.is_available():
        return []
    found = [V.TORCH] if V.torch_varlen_available() else []
    if V.flash_attn_version() and V.version_tuple(V.flash_attn_version()) >= V.FLASH_ATTN_MIN_VERSION:
        found.append(V.FLASH_ATTN)
    return found


@pytest.mark.skipif(not _cuda_kernels(), reason="needs CUDA with torch's varlen attention or flash-attn >= 2.7")
@pytest.mark.parametrize("kernels", _cuda_kernels() or [None], ids=lambda k: getattr(k, "name", "none"))
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_cuda_varlen_matches_cpu_reference(monkeypatch, kernels, groups):
    """The CUDA dispatch: each CUDA varlen kernel (bf16) against the CPU reference in fp32 on the same packed
    inputs, through MergedVarlenAttention (prefix fp32 leaves included; GQA native)."""
    q, pk, pv, sk, sv, w = attention_inputs(5, 2 * groups, 2, prefix=70, suffix=33, dtype=torch.float32, dim=64)
    packing_cpu = V.Packing.from_lengths([33, 12, 1, 20, 7], 33, CPU)
    w = _masked(w, packing_cpu.mask)
    want_out = V.merged_varlen_attention(q, pk, pv, sk, sv, packing_cpu, 0.125)
    want = weighted_grads(want_out, w, (q, pk, pv, sk, sv))
    cuda = torch.device("cuda")
    packing = V.Packing.from_lengths([33, 12, 1, 20, 7], 33, cuda)
    tensors = [t.detach().to(cuda, torch.bfloat16).requires_grad_() for t in (q, sk, sv)]
    leaves = [t.detach().to(cuda).requires_grad_() for t in (pk, pv)]
    monkeypatch.setattr(V, "kernels_for", lambda device: kernels if device.type == "cuda" else V.REFERENCE)
    out = V.merged_varlen_attention(tensors[0], *leaves, tensors[1], tensors[2], packing, 0.125)
    assert ((out.float().cpu() - want_out).norm() / want_out.norm()) < 2e-2
    got = weighted_grads(out, w.to(cuda, torch.bfloat16), (tensors[0], *leaves, *tensors[1:]))
    assert got[1].dtype == torch.float32
    for g, r in zip(got, want):
        assert ((g.float().cpu() - r).norm() / r.norm()) < 3e-2


@pytest.mark.skipif(not _cuda_kernels(), reason="needs CUDA with torch's varlen attention or flash-attn >= 2.7")
@pytest.mark.parametrize("kernels", _cuda_kernels() or [None], ids=lambda k: getattr(k, "name", "none"))
def test_cuda_varlen_layer_has_no_host_sync(monkeypatch, kernels):
    """Issue 27 item 1 on the device: two layers' forward and backward of one micro-batch (bf16, GQA 2, fp32
    prefix leaves) under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any op that synchronises
    the host (the kernels' own included); the packing is built before, as ``ServeContext.packing`` builds it."""
    cuda = torch.device("cuda")
    q, pk, pv, sk, sv, w = attention_inputs(5, 4, 2, prefix=70, suffix=33, dtype=torch.bfloat16, dim=64)
    tensors = [t.detach().to(cuda).requires_grad_() for t in (q, sk, sv)]
    leaves = [t.detach().to(cuda, torch.float32).requires_grad_() for t in (pk, pv)]
    packing = V.Packing.from_lengths([33, 12, 1, 20, 7], 33, cuda, prefix_len=70)
    w = _masked(w, packing.mask.cpu()).to(cuda)
    monkeypatch.setattr(V, "kernels_for", lambda device: kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _layer in range(2):
            out = V.merged_varlen_attention(tensors[0], *leaves, tensors[1], tensors[2], packing, 0.125)
            grads = weighted_grads(out, w, (tensors[0], *leaves, *tensors[1:]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.skipif(
    not torch.cuda.is_available() or V.FLASH_ATTN not in _cuda_kernels(), reason="needs CUDA and flash-attn >= 2.7"
)
def test_cuda_flash_attn_backward_is_deterministic_when_asked(monkeypatch):
    """Issue 27 item 6 on the device: under ``torch.use_deterministic_algorithms(True)`` two backward passes of
    merged_varlen on flash-attn give bitwise equal gradients (its dK/dV accumulate by atomics otherwise)."""
    cuda = torch.device("cuda")
    q, pk, pv, sk, sv, w = attention_inputs(5, 8, 2, prefix=300, suffix=64, dtype=torch.bfloat16, dim=64)
    packing = V.Packing.from_lengths([64, 40, 9, 64, 20], 64, cuda, prefix_len=300)
    w = _masked(w, packing.mask.cpu()).to(cuda)
    monkeypatch.setattr(V, "kernels_for", lambda device: V.FLASH_ATTN)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = []
        for _ in range(2):
            tensors = [t.detach().to(cuda).requires_grad_() for t in (q, sk, sv)]
            leaves = [t.detach().to(cuda, torch.float32).requires_grad_() for t in (pk, pv)]
            out = V.merged_varlen_attention(tensors[0], *leaves, tensors[1], tensors[2], packing, 0.125)
            runs.append(weighted_grads(out, w, (tensors[0], *leaves, *tensors[1:])))
    finally:
        torch.use_deterministic_algorithms(before)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
