"""Gemma-4 text under reuse (issue 21, item 4): per-layer inputs computed outside the decoder layers, sliding
and global layers of different head sizes, and KV-shared layers (``num_kv_shared_layers``: the last layers
attend with an earlier layer's K/V); and ``capability.structure_refusal``, which names what the schedule
cannot serve before anything runs.

Phase A now stops after the last layer that computes its own K/V and gives each KV-shared layer its source
layer's prefix K/V (``structure.kv_sources``); the schedule against plain HF dense in fp64 (1e-10) and fp32
(1e-5), merged/concat/auto, chunked, without early exit and forward-only. The phase-C crash itself was an
FSDP2 matter: ``tests/backend/test_model_structures_engine.py``. Windows here are longer than any sequence
(shorter windows are the sliding-window work's).
"""

from __future__ import annotations

import pytest
import torch
from helpers.layouts import VOCAB, make_layout, token_weights
from helpers.precision import promote_fp32_upcasts
from helpers.schedule_runs import infer_reuse, reused_grads
from test_schedule_hf import dense_grads, dense_response_outputs, weighted_loss, worst_relative
from transformers import AutoModelForCausalLM, Gemma4TextConfig, LlamaConfig

from verl_prefix.schedule.executor import prefix_forward
from verl_prefix.schedule.kv.seam import prefix_attention_mode
from verl_prefix.schedule.models import structure
from verl_prefix.schedule.models.capability import structure_refusal
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.telemetry import PhaseMeter

CPU = torch.device("cpu")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GROUPS = [(9, [4, 7, 1, 6, 3]), (5, [3, 2])]


def gemma4(dtype: torch.dtype, shared: int = 2, **overrides) -> torch.nn.Module:
    """Four layers (sliding, global, sliding, global; head sizes 8 and 16), per-layer inputs of 8, the last
    ``shared`` layers KV-shared (layer 2 reads layer 0's K/V, layer 3 layer 1's)."""
    torch.manual_seed(0)
    config = Gemma4TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        global_head_dim=16,
        sliding_window=128,
        layer_types=LAYER_TYPES,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        num_kv_shared_layers=shared,
        initializer_range=0.1,
        attn_implementation="sdpa",
        **overrides,
    )
    return AutoModelForCausalLM.from_config(config).to(dtype).train()


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(dtype):
        if dtype not in cache:
            cache[dtype] = gemma4(dtype)
        return cache[dtype]

    return get


def run(model, layout, weights, *, rows, attention="auto", meter=None, **options):
    return reused_grads(
        model, layout, weighted_loss(weights), rows=rows, phase_b_attention=attention, meter=meter, **options
    )


def test_kv_sources_of_gemma4(models):
    model = models(torch.float64)
    assert structure.kv_sources(model) == {2: 0, 3: 1}
    assert structure.last_source_layer(4, structure.kv_sources(model)) == 1
    assert structure_refusal(model) is None
    assert structure.kernel_head_dim(model.config) == 16  # the global layers' heads


def test_phase_a_stops_before_the_shared_layers(models):
    """The shared layers compute no K/V: phase A never runs them, and their prefix K/V are their sources'."""
    model = models(torch.float64)
    ran = []
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, layer in enumerate(model.model.layers)
    ]
    ids = torch.arange(1, 9)
    try:
        with prefix_attention_mode(model):
            kv = prefix_forward(model, ids, torch.arange(8), ScheduleOptions(device=CPU))
    finally:
        for hook in hooks:
            hook.remove()
    assert ran == [0, 1]
    assert kv.keys[2] is kv.keys[0] and kv.values[3] is kv.values[1]
    assert kv.last_source is model.model.layers[1].self_attn
    assert kv.interrupted is model.model.layers[1].self_attn


def _fp64(grads: dict) -> dict:
    return {name: grad.double() for name, grad in grads.items()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_gemma4_matches_dense(models, dtype):
    """In fp64 against the dense path; in fp32 against the fp64 dense reference (the same weights), within the fp32
    dense path's own error against it (x3) or the fp32 tolerance, whichever is larger: gemma-4's per-layer inputs and
    norms leave the fp32 dense path itself about 1e-5 off fp64 (measured 9.6e-6), so reuse vs dense in fp32 compares
    two roundings of that size."""
    model = models(dtype)
    layout = make_layout(GROUPS)
    weights = token_weights(layout, dtype)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        bound = TOLERANCE[dtype]
        if dtype == torch.float32:
            reference = dense_grads(models(torch.float64), layout, token_weights(layout, torch.float64))
            bound = max(bound, 3 * worst_relative(_fp64(want), reference))
            want = reference
        for attention in ("auto", "merged", "concat"):
            meter = PhaseMeter(CPU)
            got = run(model, layout, weights, rows=3, attention=attention, meter=meter)
            assert worst_relative(_fp64(got), want) < bound, attention
            ran = "concat" if attention == "concat" else "merged"
            assert meter.counts[f"prefix/phase_b_attention/{ran}"] == 3, (attention, meter.counts)


def test_gemma4_chunked_no_early_exit_and_forward_only(models):
    model = models(torch.float64)
    layout = make_layout(GROUPS)
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        for options in ({"prefix_chunk_tokens": 3}, {"early_exit": False}):
            got = run(model, layout, weights, rows=2, **options)
            assert worst_relative(got, want) < 1e-10, options
        with torch.no_grad():
            want_lp, want_ent = dense_response_outputs(model, layout)
            got = infer_reuse(model, layout, rows=3)
    for i in range(len(layout)):
        torch.testing.assert_close(got[i][0], want_lp[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[i][1], want_ent[i], rtol=1e-12, atol=1e-12)


def test_unsupported_structures_are_named():
    bidirectional = gemma4(torch.float32, use_bidirectional_attention="all")
    refusal = structure_refusal(bidirectional)
    assert refusal is not None and refusal.reason == "bidirectional_attention"
    assert "Gemma4TextAttention" in refusal.module

    unknown_source = gemma4(torch.float32)
    unknown_source.model.layers[1].self_attn.store_full_length_kv = False
    refusal = structure_refusal(unknown_source)
    assert refusal is not None and refusal.reason == "kv_sharing"
    assert "layer 3" in refusal.detail and "is_kv_shared_layer" in refusal.detail
    with pytest.raises(ValueError, match="cannot tell which"):
        structure.kv_sources(unknown_source)

    plain = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    assert structure_refusal(AutoModelForCausalLM.from_config(plain)) is None
    assert structure_refusal(gemma4(torch.float32)) is None
