"""Chunked prefix (``prefix_chunk_tokens``) at schedule level against plain HF: phase A in chunks that
attend to the earlier chunks' K/V leaves, phase C chunk by chunk from the last. Every policy, fp64 and
fp32, chunk sizes that do and do not divide the prefix, checkpointing, the MoE aux loss, forward-only
passes, lockstep filler chunks; a negative control that drops the dK/dV hand-off between chunks."""

from __future__ import annotations

import pytest
import torch
from helpers.layouts import make_layout, token_weights
from helpers.precision import promote_fp32_upcasts
from helpers.schedule_runs import infer_reuse
from hypothesis import given
from hypothesis import strategies as st
from test_dormant_policies import run_policy
from test_moe import compare as moe_compare
from test_moe import tiny_moe
from test_schedule_hf import TOLERANCE, dense_grads, dense_response_outputs, tiny_model, worst_relative

from verl_prefix.schedule import chunked as C
from verl_prefix.schedule import dormant as D
from verl_prefix.schedule.telemetry import PhaseMeter
from verl_prefix.tools.bench.dormant_memory import LiveSaved

CPU = torch.device("cpu")
# prefixes of 12, 7 and 3 tokens: chunks of 4 divide 12, chunks of 5 divide none
LAYOUT = [(13, [4, 7, 1, 6, 3]), (8, [5, 3, 6]), (4, [2, 4])]


def run_chunked(model, layout, weights, policy, chunk_tokens, *, min_chunks=0, rows=2, **options):
    return run_policy(
        model, layout, weights, policy, rows=rows, prefix_chunk_tokens=chunk_tokens, prefix_chunks=min_chunks, **options
    )


@pytest.mark.parametrize(
    "dtype, checkpointing",
    [(torch.float64, False), (torch.float32, False), (torch.float64, True)],
    ids=["fp64", "fp32", "fp64-grad-ckpt"],
)
@pytest.mark.parametrize("policy", ["keep", "recompute", "offload"])
def test_chunked_prefix_matches_dense(policy, dtype, checkpointing):
    model = tiny_model("qwen3", "sdpa", dtype, tied=True, checkpointing=checkpointing)
    layout = make_layout(LAYOUT)
    weights = token_weights(layout, dtype)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        for chunk_tokens in (4, 5, 1):
            meter, stats = PhaseMeter(CPU), D.DormantStats()
            got, plan = run_chunked(model, layout, weights, policy, chunk_tokens, meter=meter, stats=stats)
            assert len(plan.groups) == 3 and not plan.dense_rows  # reuse ran
            counts = meter.counts
            chunks = [C.num_chunks(g.prefix_len, chunk_tokens) for g in plan.groups]
            assert counts["prefix/prefix_chunks"] == sum(n for n in chunks if n > 1) > 3  # chunking ran
            assert counts["prefix/chunked_groups"] == sum(g.prefix_len > chunk_tokens for g in plan.groups)
            assert stats.policies[policy] == 3
            err = worst_relative(got, want)
            assert err < TOLERANCE[dtype], (chunk_tokens, err)
            if policy == "recompute":
                assert stats.recompute_max_diff == 0.0


def test_negative_control_no_hand_off_between_chunks(monkeypatch):
    """Earlier chunks' K/V served to later chunks as constants: the later chunks' dK/dV never reach the
    earlier chunks, and the gradient is wrong by far more than rounding."""
    model = tiny_model("llama", "sdpa", torch.float64)
    layout = make_layout(LAYOUT)
    weights = token_weights(layout, torch.float64)
    original = C._view
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        assert worst_relative(run_chunked(model, layout, weights, "keep", 4)[0], want) < 1e-10
        monkeypatch.setattr(C, "_view", lambda full, start, end, detach=False: original(full, start, end, True))
        for policy in ("keep", "recompute"):
            assert worst_relative(run_chunked(model, layout, weights, policy, 4)[0], want) > 1e-3


def test_lockstep_filler_chunks_change_nothing():
    """A group padded with one-token filler chunks (what a peer rank's longer prefix forces) gives the
    same gradients; the fillers run (counted) and take zero seeds."""
    model = tiny_model("qwen3", "sdpa", torch.float64)
    layout = make_layout(LAYOUT)
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        for policy, chunk_tokens in (("keep", 5), ("recompute", 5), ("recompute", None)):
            meter = PhaseMeter(CPU)
            got, _ = run_chunked(model, layout, weights, policy, chunk_tokens, min_chunks=6, meter=meter)
            assert meter.counts["prefix/prefix_chunks"] == 18  # every group ran 6 prefix forwards
            assert worst_relative(got, want) < 1e-10


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_chunks_without_early_exit(policy):
    """Early exit off: every chunk also runs the last layer's MLP and the LM head (which feed nothing)."""
    model = tiny_model("qwen3", "sdpa", torch.float64)
    layout = make_layout(LAYOUT)
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        got, _ = run_chunked(model, layout, weights, policy, 5, early_exit=False)
    assert worst_relative(got, want) < 1e-10


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_chunked_prefix_with_the_moe_aux_loss(policy):
    """Router statistics of the chunks sum; every chunk's probability-sum root takes the router leaf's grad."""
    layout = make_layout([(13, [4, 7, 1, 6]), (8, [5, 3, 6])])
    with promote_fp32_upcasts():
        for checkpointing in (False, True):
            model = tiny_moe(torch.float64, checkpointing=checkpointing)
            grads, aux, _, got, _ = moe_compare(
                model, layout, 2, torch.float64, count=False, dormant=D.Dormant(policy), prefix_chunk_tokens=5
            )
            assert grads < 1e-10 and aux < 1e-10, (checkpointing, grads, aux)
            assert all(got[n].norm() > 0 for n in got if n.endswith("mlp.gate.weight"))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_forward_only_chunks(attn):
    model = tiny_model("qwen3", attn, torch.float64).eval()
    layout = make_layout(LAYOUT)
    with promote_fp32_upcasts(), torch.no_grad():
        want_lp, want_ent = dense_response_outputs(model, layout)
        got = infer_reuse(model, layout, rows=3, prefix_chunk_tokens=5, prefix_chunks=4)
    for i in range(len(layout)):
        torch.testing.assert_close(got[i][0], want_lp[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[i][1], want_ent[i], rtol=1e-12, atol=1e-12)


def test_recompute_with_chunks_holds_one_chunk_graph():
    """Peak bytes saved for backward at once over the whole update (P=256, G=2, S=4): recompute alone
    holds the whole prefix graph in phase C; recompute with chunks of 32 holds one chunk's graph. The
    phase meter's counts (``prefix/max_saved_for_backward_*``) agree with a live count."""
    model = tiny_model("qwen3", "sdpa", torch.float32)
    layout = make_layout([(257, [4, 4])])
    weights = token_weights(layout, torch.float32)
    peaks, metered = {}, {}
    for name, chunk_tokens in (("whole", None), ("chunks", 32)):
        live, meter = LiveSaved(model), PhaseMeter(CPU)
        with live.hooks():
            run_chunked(model, layout, weights, "recompute", chunk_tokens)
        run_chunked(model, layout, weights, "recompute", chunk_tokens, meter=meter)  # its own saved hooks
        peaks[name] = live.peak
        metered[name] = meter.metrics(1, 1)
    assert peaks["chunks"] < 0.4 * peaks["whole"], peaks
    # the meter agrees: phase C's count is the largest chunk's graph, not every chunk's summed
    held = {name: m["prefix/max_saved_for_backward_held_mib"] * 1024**2 for name, m in metered.items()}
    assert held["chunks"] < 0.4 * held["whole"], held
    for name in peaks:
        assert 0.5 * peaks[name] <= held[name] <= peaks[name], (name, held, peaks)
        assert metered[name]["prefix/max_saved_for_backward_mib/C"] * 1024**2 == pytest.approx(held[name])


def _count_varlen_calls(monkeypatch) -> list[tuple[int, tuple[int, ...]]]:
    """Record ``(keys the prefix part saw, packed row lengths)`` of every ``merged_varlen`` attention call."""
    from verl_prefix.schedule.kv import contexts

    calls: list[tuple[int, tuple[int, ...]]] = []
    real = contexts.merged_varlen_attention

    def counting(query, prefix_key, prefix_value, key, value, packing, scaling=None):
        calls.append((prefix_key.shape[2], packing.lengths))
        return real(query, prefix_key, prefix_value, key, value, packing, scaling)

    monkeypatch.setattr(contexts, "merged_varlen_attention", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_chunks_through_merged_varlen(monkeypatch, policy, dtype):
    """``phase_b_attention=merged_varlen`` with a chunked prefix (issue 20 item 3: the chunk's serve context had
    no row lengths and raised at the first later chunk): each later chunk is one packed row of its own tokens
    against the earlier chunks' leaves, and the gradients are plain HF's (fp64 1e-10, fp32 1e-5), with lockstep
    filler chunks too."""
    model = tiny_model("qwen3", "sdpa", dtype)
    layout = make_layout(LAYOUT)
    weights = token_weights(layout, dtype)
    calls = _count_varlen_calls(monkeypatch)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        for min_chunks in (0, 5):
            calls.clear()
            got, plan = run_chunked(
                model, layout, weights, policy, 4, min_chunks=min_chunks, phase_b_attention="merged_varlen"
            )
            assert len(plan.groups) == 3 and not plan.dense_rows
            assert worst_relative(got, want) < TOLERANCE[dtype], min_chunks
            # prefixes 12 (chunks at 0, 4, 8), 7 (0, 4) and 3 (whole): later chunks of 4 and 3 tokens
            chunk_calls = sorted({c for c in calls if c[0] not in (12, 7, 3)})
            assert chunk_calls == [(4, (3,)), (4, (4,)), (8, (4,))], chunk_calls


def test_forward_only_chunks_through_merged_varlen(monkeypatch):
    model = tiny_model("qwen3", "sdpa", torch.float64).eval()
    layout = make_layout(LAYOUT)
    calls = _count_varlen_calls(monkeypatch)
    with promote_fp32_upcasts(), torch.no_grad():
        want_lp, want_ent = dense_response_outputs(model, layout)
        got = infer_reuse(
            model, layout, rows=3, prefix_chunk_tokens=5, prefix_chunks=4, phase_b_attention="merged_varlen"
        )
    for i in range(len(layout)):
        torch.testing.assert_close(got[i][0], want_lp[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[i][1], want_ent[i], rtol=1e-12, atol=1e-12)
    assert (5, (5,)) in calls and (10, (2,)) in calls  # prefix 12 = 5 + 5 + 2: its later chunks ran varlen


@given(st.one_of(st.integers(-5, 10**6), st.booleans(), st.none(), st.floats(), st.text(max_size=3)))
def test_chunk_knob_validation(value):
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
    if ok:
        assert C.validate_chunk_tokens(value) == (value or None)
    else:
        with pytest.raises(ValueError, match="prefix_chunk_tokens must be a positive integer"):
            C.validate_chunk_tokens(value)


@given(st.integers(1, 300), st.one_of(st.none(), st.integers(1, 300)))
def test_chunk_bounds_cover_the_prefix(prefix_len, chunk_tokens):
    bounds = C.chunk_bounds(prefix_len, chunk_tokens)
    assert bounds[0][0] == 0 and bounds[-1][1] == prefix_len
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(0 < e - s <= (chunk_tokens or prefix_len) for s, e in bounds)
