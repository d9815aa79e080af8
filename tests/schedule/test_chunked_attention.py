"""Chunked attention (Llama-4's ``chunked_attention`` layers) and Llama-4's attention temperature tuning under reuse,
against plain HF dense.

HF keeps key ``k`` for query ``q`` of a chunked layer iff ``k <= q`` and ``k // C == q // C`` (absolute positions);
a suffix query at ``L + i`` therefore sees only the prefix's last ``L % C`` positions, none when the prefix ends on
a chunk boundary or once the query passed into the next chunk. Llama-4's NoPE layers scale their queries by
positions they count from the cache's length (``schedule.attention.positions``). Before this was served, a 24-token
chunk trained silently wrong (update off by 1.6-1.9) and so did a ``floor_scale`` shorter than the sequence.

Every path is checked in fp64 (1e-10) and fp32 (1e-5): merged, concat (sdpa and eager), chunked prefixes, dormant
recompute, checkpointing, forward-only, the tree, Ulysses; every row reused, and each layer counted under the path
that served it. The negative controls (the chunk boundary off by one either way, the chunk ignored, the positions
counted from 0) must fail.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.layouts import VOCAB, make_layout, token_weights
from helpers.model_matrix import relative_errors
from helpers.precision import fp64_throughout
from helpers.schedule_runs import infer_reuse, reused_grads
from hypothesis import given, settings
from hypothesis import strategies as st
from test_schedule_hf import dense_grads, dense_response_outputs, weighted_loss, worst_relative
from transformers import AutoModelForCausalLM
from transformers.masking_utils import causal_mask_function, chunked_overlay, sliding_window_overlay

from verl_prefix.harness import model_zoo as Z
from verl_prefix.schedule.attention import positions, windows
from verl_prefix.schedule.dormant import Dormant
from verl_prefix.schedule.grouping import RowLayout, plan_batch
from verl_prefix.schedule.kv import contexts
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.telemetry import PhaseMeter
from verl_prefix.schedule.tree.schedule import train_tree
from verl_prefix.schedule.tree.trie import build_trie, trie_stats

CPU = torch.device("cpu")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
CHUNK = 12
# prefixes (prompt - 1) of 36 (a multiple of the chunk: no prefix key visible), 49 (one) and 41 (five); suffixes
# ragged, several crossing one or two chunk boundaries
GROUPS = [(37, [5, 30, 1, 12]), (50, [9, 3, 25]), (42, [14, 2])]


def build(dtype: torch.dtype, attn: str = "sdpa", chunk: int = CHUNK, floor_scale: int = 8192) -> torch.nn.Module:
    """A tiny Llama-4 text model: layer 0 chunked (RoPE), layer 1 full attention without RoPE (temperature tuning
    from ``floor_scale`` positions on), experts in both (eager loop: fp64 runs)."""
    config = Z.tiny_config(
        "llama4_text",
        attn_implementation=attn,
        no_rope_layers=[1, 0],
        attention_chunk_size=chunk,
        floor_scale=floor_scale,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, experts_implementation="eager")
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    return model.to(dtype).train()


def run(model, layout, weights, *, rows=3, attention="auto", meter=None, **options):
    """Reuse gradients; asserts every row reused (no dense rows, fewer physical than logical tokens)."""
    return reused_grads(
        model, layout, weighted_loss(weights), rows=rows, phase_b_attention=attention, meter=meter, **options
    )


def exact(dtype: torch.dtype):
    """True fp64 for fp64 runs (Llama-4's L2 norm and router round through fp32 otherwise), nothing for fp32."""
    return fp64_throughout() if dtype == torch.float64 else contextlib.nullcontext()


def layer_paths(meter: PhaseMeter) -> dict[str, float]:
    return {k.split("/")[-1]: v for k, v in meter.counts.items() if k.startswith("prefix/phase_b_layers/")}


def check(model, layout, weights, want, dtype, **options) -> dict[str, torch.Tensor]:
    got = run(model, layout, weights, **options)
    assert all(torch.isfinite(g).all() for g in got.values())
    error = relative_errors(got, want)  # floored: a chunk of 1 leaves layer 0's q/k gradients exactly zero
    assert error < TOLERANCE[dtype], (options, error)
    return got


# -- the mask: HF's own rule at absolute positions ------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.integers(0, 40),
    queries=st.integers(1, 20),
    chunk=st.integers(1, 16),
    window=st.one_of(st.none(), st.integers(1, 24)),
)
def test_masks_follow_hfs_chunk_rule(prefix, queries, chunk, window):
    """Concat's keys (the prefix cut to the window and to the first query's chunk, then the rows' own) under
    ``window_keep_mask & chunk_keep_mask`` keep exactly what HF's mask functions keep over the whole sequence;
    merged's two parts (the cut prefix, the suffix) split the same mask."""
    hf = [causal_mask_function, chunked_overlay(chunk, torch.zeros(1, dtype=torch.long))]
    if window is not None:
        hf.append(sliding_window_overlay(window))
    cut = prefix if window is None else windows.cut_length(prefix, window)
    cut = min(cut, windows.chunk_cut_length(prefix, chunk))
    keys = cut + queries
    keep = windows.window_keep_mask(queries, keys, window, CPU) & windows.chunk_keep_mask(
        queries, keys, prefix, chunk, CPU
    )
    for i in range(queries):
        q = prefix + i
        for k in range(prefix + queries):
            want = all(bool(f(0, 0, q, k)) for f in hf)
            got = bool(keep[0, 0, i, k - (prefix - cut)]) if k >= prefix - cut else False
            assert got == want, (q, k)
    # every key HF keeps for some suffix query lies in the cut (nothing visible was cut away)
    assert all(
        not all(bool(f(0, 0, prefix + i, k)) for f in hf) or k >= prefix - cut
        for i in range(queries)
        for k in range(prefix)
    )


def test_attention_chunk_reads_the_layer_type():
    model = build(torch.float32)
    attention = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "layer_idx")]
    assert [windows.attention_chunk(m) for m in attention] == [CHUNK, None]
    assert windows.active_chunk(CHUNK, CHUNK) is None and windows.active_chunk(CHUNK, CHUNK + 1) == CHUNK


# -- exactness --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_chunked_reuse_matches_dense(dtype):
    """auto, merged and concat against one dense reference; the chunked layer counted as ``<path>_chunk``, the
    full layer as ``<path>``, in every phase-B micro-batch (3 groups: 2 + 1 + 1 micro-batches of <= 3 rows)."""
    model = build(dtype, floor_scale=8)
    layout = make_layout(GROUPS)
    weights = token_weights(layout, dtype)
    micro = 4
    with exact(dtype):
        want = dense_grads(model, layout, weights)
        for attention in ("auto", "merged", "concat"):
            meter = PhaseMeter(CPU)
            check(model, layout, weights, want, dtype, attention=attention, meter=meter)
            path = "concat" if attention == "concat" else "merged"
            assert layer_paths(meter) == {f"{path}_chunk": micro, path: micro}, attention


def test_eager_models_are_served_by_concat():
    model = build(torch.float64, attn="eager", floor_scale=8)
    layout = make_layout(GROUPS, seed=1)
    weights = token_weights(layout, torch.float64)
    with fp64_throughout():
        want = dense_grads(model, layout, weights)
        meter = PhaseMeter(CPU)
        check(model, layout, weights, want, torch.float64, meter=meter)
    assert layer_paths(meter) == {"concat_chunk": 4, "concat": 4}


@pytest.mark.parametrize("chunk", [1, 5, 36, 49, 200])
def test_chunk_sizes_at_and_around_the_boundaries(chunk):
    """A chunk of one position (each query sees itself alone), chunks equal to a prefix's length (the suffix
    starts a chunk), and one longer than every sequence (nothing banded: the plain kernels serve)."""
    model = build(torch.float64, chunk=chunk)
    layout = make_layout(GROUPS, seed=2)
    weights = token_weights(layout, torch.float64)
    with fp64_throughout():
        want = dense_grads(model, layout, weights)
        meter = PhaseMeter(CPU)
        check(model, layout, weights, want, torch.float64, meter=meter)
    if chunk == 200:
        assert layer_paths(meter) == {"merged": 8}


@pytest.fixture(scope="module")
def llama4_fp64():
    """One fp64 model (chunk 12, temperature tuning from position 7), layout and dense reference."""
    model = build(torch.float64, floor_scale=8)
    layout = make_layout(GROUPS, seed=3)
    weights = token_weights(layout, torch.float64)
    with fp64_throughout():
        want = dense_grads(model, layout, weights)
    return model, layout, weights, want


@pytest.mark.parametrize("variant", ["chunked", "chunked-recompute", "recompute", "checkpointed", "one-row"])
def test_chunks_compose_with_prefix_chunks_dormant_policies_and_checkpointing(llama4_fp64, variant):
    """A later prefix chunk (13 tokens: prefix chunks and attention chunks cross each other) attends to the
    earlier ones at its absolute positions; recompute replays phase A; checkpointing re-runs the hooked
    attention modules with the same offsets."""
    model, layout, weights, want = llama4_fp64
    if variant == "checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    options: dict = {"rows": 1 if variant == "one-row" else 3}
    if variant.startswith("chunked"):
        options["prefix_chunk_tokens"] = 13
    if variant.endswith("recompute"):
        options["dormant"] = lambda: Dormant("recompute")
    try:
        with fp64_throughout():
            for attention in ("merged", "concat"):
                meter = PhaseMeter(CPU)
                check(model, layout, weights, want, torch.float64, attention=attention, meter=meter, **options)
                if variant.startswith("chunked"):
                    assert meter.counts["prefix/chunked_groups"] == 3
    finally:
        model.gradient_checkpointing_disable()


def test_forward_only_matches_dense(llama4_fp64):
    model, layout, _, _ = llama4_fp64
    with fp64_throughout(), torch.no_grad():
        want_lp, want_ent = dense_response_outputs(model, layout)
        for attention, chunk in (("auto", None), ("concat", 20)):
            got = infer_reuse(model, layout, rows=3, phase_b_attention=attention, prefix_chunk_tokens=chunk)
            for i in range(len(layout)):
                torch.testing.assert_close(got[i][0], want_lp[i], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(got[i][1], want_ent[i], rtol=1e-12, atol=1e-12)


def system_block_layout() -> RowLayout:
    """Three groups behind one 30-token system block: a trie of depth 2 whose second level starts mid-chunk."""
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(0, VOCAB, (30,), generator=gen)
    ids, p_lens, r_lens, uids = [], [], [], []
    for g, (own, responses) in enumerate(((9, [5, 14]), (4, [2, 20, 7]), (17, [3, 1]))):
        prompt = torch.cat([system, torch.randint(0, VOCAB, (own,), generator=gen)])
        for s in responses:
            ids.append(torch.cat([prompt, torch.randint(0, VOCAB, (s,), generator=gen)]))
            p_lens.append(len(prompt))
            r_lens.append(s)
            uids.append(f"g{g}")
    return RowLayout(ids, [torch.arange(len(row)) for row in ids], p_lens, r_lens, uids)


@pytest.mark.parametrize("attention", ["merged", "concat"])
def test_tree_matches_dense(attention):
    """The trie's nodes start at their path's length: a node's forward and its rows attend at absolute
    positions, chunked and temperature-tuned alike."""
    model = build(torch.float64, floor_scale=8)
    layout = system_block_layout()
    weights = token_weights(layout, torch.float64)
    with fp64_throughout():
        want = dense_grads(model, layout, weights)
        model.zero_grad()
        plan = plan_batch(layout, max_rows=2, max_tokens=None, min_prefix_len=1, min_group_size=1)
        roots = build_trie(layout, plan.groups, min_shared_tokens=2)
        stats = trie_stats(roots)
        assert not plan.dense_rows and stats.depth == 2 and stats.node_tokens < stats.prefix_tokens, stats
        options = ScheduleOptions(device=CPU, phase_b_attention=attention)
        train_tree(model, layout, roots, weighted_loss(weights), options)
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert worst_relative(got, want) < 1e-10


def _ulysses_body(rank: int, attention: str, chunk: int | None) -> dict:
    """One gloo rank of SP=2: chunked Llama-4 reuse (positions below ``floor_scale``: each rank counts its own
    slice's, as the stock engine's module does), gradients averaged over the group against plain HF on the rank;
    forward-only too (``test_sliding_windows.ulysses_errors``)."""
    from test_sliding_windows import ulysses_errors

    model = build(torch.float64)
    layout = make_layout([(37, [5, 30, 1]), (50, [9, 24])])  # prefixes 36 and 49: even and odd over 2 ranks
    return ulysses_errors(model, layout, attention, chunk, fp64_throughout())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("attention, chunk", [("merged", None), ("concat", 25)], ids=["merged", "concat-chunked"])
def test_chunks_under_ulysses_match_dense(attention, chunk):
    """Under Ulysses each rank attends with the whole (padded) sequence over its head shard: the chunk mask
    indexes the real absolute positions."""
    from helpers.ranks import run_ranks

    results = run_ranks(_ulysses_body, attention, chunk, world=2)
    for rank in range(2):
        assert results[rank]["worst"] < 1e-10, results[rank]
        assert results[rank]["infer"] < 1e-10, results[rank]
        assert results[rank]["all_to_all_bytes"] > 0


# -- negative controls --------------------------------------------------------------------------------------------


def _shifted_chunk(shift: int):
    original = windows.chunk_keep_mask

    def keep(query_len, key_len, first_query, chunk, device):
        return original(query_len, key_len, first_query + shift, chunk, device)

    return keep


@pytest.mark.parametrize("control", ["boundary+1", "boundary-1", "chunk_ignored", "positions_from_zero"])
def test_negative_controls_fail(llama4_fp64, monkeypatch, control):
    """The comparison can fail: the chunk boundary one position late or early (in every mask that spells it),
    the chunk ignored (phase A and B attend causally over everything), or the temperature-tuned layer's positions
    counted from 0 in phase B (as before the hook)."""
    model, layout, weights, want = llama4_fp64
    if control.startswith("boundary"):
        shifted = _shifted_chunk(1 if control == "boundary+1" else -1)
        monkeypatch.setattr(windows, "chunk_keep_mask", shifted)  # every band mask builds its chunk part here
    elif control == "chunk_ignored":
        monkeypatch.setattr(contexts, "attention_chunk", lambda module: None)
    else:
        monkeypatch.setattr(positions.PositionOffset, "get_seq_length", lambda self, layer_idx=0: 0)
    with fp64_throughout():
        for attention in ("merged", "concat"):
            got = run(model, layout, weights, attention=attention)
            assert worst_relative(got, want) > 1e-4, (control, attention)


def test_positions_past_floor_scale_under_ulysses_are_refused_by_the_hook():
    """Under Ulysses the module counts its own slice's positions (as the stock engine's does): the engine runs
    such mini-batches dense (``length_fallback_reason``); the hook refuses rather than train on other scales."""
    model = build(torch.float64, floor_scale=8)
    assert positions.position_scale_limit(model) == 8
    attention = model.model.layers[1].self_attn
    assert positions.counts_positions(attention) and not positions.counts_positions(model.model.layers[0].self_attn)

    class Ctx:
        query_offset = 6
        ulysses = type("SP", (), {"size": 2})()

    hidden = torch.zeros(1, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="temperature tuning.*Ulysses"):
        positions.position_offset_hook(attention, (), {"hidden_states": hidden, "prefix_ctx": Ctx()})
    Ctx.query_offset = 1
    assert positions.position_offset_hook(attention, (), {"hidden_states": hidden, "prefix_ctx": Ctx()}) is None
