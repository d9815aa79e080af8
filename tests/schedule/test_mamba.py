"""Mamba-2 hybrids under reuse (issue 22): Nemotron-H, Bamba and Granite-4-hybrid mixers carry their SSM state
``[heads, head_dim, d_state]`` and conv context across the prefix boundary (``verl_prefix.schedule.models.mamba``).

Reference: plain HF, each full sequence on its own, true fp64 (``helpers.precision.fp64_throughout``: the
mixers compute their scan in fp32 otherwise). transformers' torch scan is the Mamba-2 recurrence only within
one chunk (its inter-chunk sum runs over the wrong index, pinned below), so the dense reference runs with a
``chunk_size`` longer than every sequence; the schedule's own scan is checked against the recurrence itself
over many chunks.
"""

from __future__ import annotations

import pytest
import torch
from helpers import offload as O
from helpers.hybrids import NEMOTRON_MIXERS
from helpers.layouts import VOCAB, make_layout, token_weights
from helpers.precision import fp64_throughout
from helpers.schedule_runs import infer_reuse, reused_grads
from test_schedule_hf import RAGGED, dense_grads, dense_response_outputs, weighted_loss, worst_relative
from transformers import AutoModelForCausalLM
from transformers.models.nemotron_h import modeling_nemotron_h

from verl_prefix.harness import model_zoo
from verl_prefix.schedule import dormant as D
from verl_prefix.schedule import executor
from verl_prefix.schedule.kv import contexts, seam
from verl_prefix.schedule.models import mamba, recurrent

MAMBA = {"initializer_range": 0.2, "use_mamba_kernels": False, "vocab_size": VOCAB, "hidden_size": 32}


def nemotron_h(dtype: torch.dtype, chunk_size: int = 32):
    """Mamba, MLP, attention, MoE and Mamba blocks (the last layer recurrent); 4 heads of 8, d_state 8, 2 groups."""
    torch.manual_seed(0)
    config = model_zoo.tiny_config(
        "nemotron_h",
        **MAMBA,
        layers_block_type=["mamba", "mlp", "attention", "moe", "mamba"],
        **NEMOTRON_MIXERS,
        mamba_chunk_size=chunk_size,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16,
        n_group=1,
        topk_group=1,
    )
    return _build(config, dtype)


def bamba(dtype: torch.dtype):
    torch.manual_seed(0)
    config = model_zoo.tiny_config(
        "bamba",
        **MAMBA,
        num_hidden_layers=3,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_d_conv=4,
        mamba_chunk_size=32,
        mamba_expand=1,
    )
    return _build(config, dtype)


def granite(dtype: torch.dtype):
    torch.manual_seed(0)
    config = model_zoo.tiny_config(
        "granitemoehybrid",
        **MAMBA,
        layer_types=["mamba", "attention", "mamba"],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        shared_intermediate_size=48,
        num_local_experts=0,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_d_conv=3,
        mamba_chunk_size=32,
        mamba_expand=1,
    )
    return _build(config, dtype)


def _build(config, dtype):
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", experts_implementation="eager")
    return model.to(dtype).train()


@pytest.fixture(scope="module")
def model64():
    return nemotron_h(torch.float64)  # each test runs it under ``fp64_throughout``


@pytest.fixture(scope="module")
def ragged64(model64):
    """The ragged layout (G = 8, right-padded rows, a one-token suffix), its weights and dense fp64 grads."""
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    with fp64_throughout():
        return layout, weights, dense_grads(model64, layout, weights)


def run(model, layout, weights, *, rows, **options):
    """Reuse gradients; asserts every row reused and the prefix ran once per group."""
    return reused_grads(model, layout, weighted_loss(weights), rows=rows, **options)


def test_scan_is_the_recurrence_and_transformers_multi_chunk_scan_is_not():
    """``mamba.ssd_scan`` (chunks of 4, an initial state) against the token-by-token recurrence over 11 tokens;
    the mixer's own torch path over more than one chunk is not that recurrence, ``continue_forward`` is."""
    gen = torch.Generator().manual_seed(0)
    x, b, c = (torch.randn(2, 11, 3, n, generator=gen, dtype=torch.float64) for n in (4, 5, 5))
    a = -torch.rand(2, 11, 3, generator=gen, dtype=torch.float64)
    state = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    y, final = mamba.ssd_scan(x, a, b, c, 4, state)
    h, want = state, []
    for t in range(11):
        h = torch.exp(a[:, t])[..., None, None] * h + x[:, t, :, :, None] * b[:, t, :, None, :]
        want.append((h * c[:, t, :, None, :]).sum(-1))
    torch.testing.assert_close(y, torch.stack(want, 1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, h, rtol=1e-12, atol=1e-12)

    with fp64_throughout(), torch.no_grad():
        mixer = nemotron_h(torch.float64).model.layers[0].mixer
        hidden = torch.randn(1, 11, 32, generator=gen, dtype=torch.float64)
        one_chunk = mixer.torch_forward(hidden)
        mixer.chunk_size = 4
        assert (mixer.torch_forward(hidden) - one_chunk).abs().max() > 1e-4  # transformers' multi-chunk scan
        ours = mamba.continue_forward(mixer, hidden, mamba.Continuation(mixer, None, None, None))
    torch.testing.assert_close(ours, one_chunk, rtol=1e-12, atol=1e-12)


def test_fp64_gradients_match_dense_for_every_partition(model64, ragged64):
    """Nemotron-H in micro-batches of G, 2 and 1 rows; Bamba and Granite-4 hybrid in micro-batches of 3."""
    layout, weights, want = ragged64
    with fp64_throughout():
        for rows in (8, 2, 1):
            assert worst_relative(run(model64, layout, weights, rows=rows), want) < 1e-10, f"{rows} rows"
        for build in (bamba, granite):
            model = build(torch.float64)
            assert any(mamba.served_mamba_layer(m) for m in model.modules())
            want = dense_grads(model, layout, weights)
            assert worst_relative(run(model, layout, weights, rows=3), want) < 1e-10, build.__name__


def test_fp64_chunked_prefix_and_forward_only_match_dense(model64):
    """Chunks of 2 (gradients) and 1 token (forward-only), shorter than the conv window (kernel - 1 = 3): a
    chunk's conv context reaches back over several earlier chunks; each starts from the previous one's state."""
    layout = make_layout([(8, [4, 7, 1, 6])])
    weights = token_weights(layout, torch.float64)
    with fp64_throughout():
        want = dense_grads(model64, layout, weights)
        assert worst_relative(run(model64, layout, weights, rows=2, prefix_chunk_tokens=2), want) < 1e-10
        with torch.no_grad():
            want_lp, want_ent = dense_response_outputs(model64, layout)
            got = infer_reuse(model64, layout, rows=4, prefix_chunk_tokens=1)
            unchunked = infer_reuse(model64, layout, rows=1)
    for i in range(len(layout)):
        for outputs in (got, unchunked):
            torch.testing.assert_close(outputs[i][0], want_lp[i], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(outputs[i][1], want_ent[i], rtol=1e-12, atol=1e-12)


def test_fp32_within_the_dense_models_own_rounding(ragged64):
    """fp32 (the scan in fp32, as transformers runs it): reuse's error against the fp64 reference within 1.5x
    the dense fp32 model's own (or 1e-5)."""
    layout, _, truth = ragged64
    model = nemotron_h(torch.float32)
    weights = token_weights(layout, torch.float32)
    as64 = lambda grads: {n: g.double() for n, g in grads.items()}  # noqa: E731
    dense_error = worst_relative(as64(dense_grads(model, layout, weights)), truth)
    for rows in (8, 1):
        error = worst_relative(as64(run(model, layout, weights, rows=rows)), truth)
        assert error < max(1.5 * dense_error, 1e-5), f"{rows} rows: {error:.2e} vs dense {dense_error:.2e}"


def test_phase_a_holds_the_state_and_empty_states_for_blocks_without_a_mixer(model64):
    layout = make_layout([(9, [3, 1])])
    ids, pos = layout.input_ids[0][:8], layout.position_ids[0][:8]
    options = executor.ScheduleOptions(device=torch.device("cpu"))
    with fp64_throughout(), seam.prefix_attention_mode(model64):
        prefix = executor.prefix_forward(model64, ids, pos, options)
    assert prefix.recurrent_layers == {0, 1, 3, 4} and prefix.complete
    for layer in (0, 4):  # conv_dim = 4 heads x 8 + 2 groups x 2 x d_state 8; state: 4 heads x 8 x 8
        conv, state = prefix.layer_tensors(layer)
        assert conv.shape == (1, 64, 3) and state.shape == (1, 4, 8, 8) and state.requires_grad
    assert all(t.numel() == 0 for layer in (1, 3) for t in prefix.layer_tensors(layer))


def test_dormant_policies_carry_the_states(model64):
    """``recompute`` re-derives the states in phase C (checked against phase A's), ``offload`` moves phase A's
    saved activations to the (stand-in) host and back, the boundary states staying like K/V: both exact, offload
    bit-identical to keep; ``auto`` resolves to one of them (recompute over budget on the CPU)."""
    layout = make_layout([(9, [4, 7, 1, 6]), (5, [3, 2])])
    weights = token_weights(layout, torch.float64)
    stats = D.DormantStats()
    policy = lambda name: lambda: D.Dormant(name, stats=stats, store_factory=O.RecordingStore)  # noqa: E731
    O.RecordingStore.instances.clear()
    with fp64_throughout():
        want = dense_grads(model64, layout, weights)
        keep = run(model64, layout, weights, rows=2)
        offload = run(model64, layout, weights, rows=2, dormant=policy("offload"))
        assert worst_relative(run(model64, layout, weights, rows=2, dormant=policy("recompute")), want) < 1e-10
        chunked = run(model64, layout, weights, rows=2, dormant=policy("offload"), prefix_chunk_tokens=3)
    assert worst_relative(offload, want) < 1e-10 and worst_relative(chunked, want) < 1e-10
    assert all(torch.equal(offload[n], keep[n]) for n in keep)
    assert stats.policies == {"offload": 4, "recompute": 2}
    for store in O.RecordingStore.instances:
        found = O.claims(store, model64)
        assert 0 < store.restored_bytes <= store.offloaded_bytes
        assert found["parameter_bytes_moved"] == found["resident_in_b"] == 0
    estimate = D.estimate_prefix_graph(model64, 8)
    assert D.choose_policy(estimate, 1, torch.device("cpu")) == ("recompute", "over_budget_cpu")


def test_lfm2_short_conv_carries_its_conv_context(monkeypatch):
    """LFM2 (a gated short conv, then full attention): only the conv context ``[1, hidden, L_cache - 1]`` crosses
    the boundary. fp64 against dense in micro-batches of G and 1, with 1-token prefix chunks (inside the conv
    window of 2); suffixes from a zero context fail."""
    model = model_zoo.build("lfm2", torch.float64)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    with fp64_throughout():
        want = dense_grads(model, layout, weights)
        for rows, chunk in ((8, None), (1, None), (2, 1)):
            got = run(model, layout, weights, rows=rows, prefix_chunk_tokens=chunk)
            assert worst_relative(got, want) < 1e-10, (rows, chunk)
        monkeypatch.setattr(contexts, "serving_cache", lambda m, b, h: recurrent.BoundaryCache(m.layer_idx, 2))
        assert worst_relative(run(model, layout, weights, rows=8), want) > 1e-3


# -- negative controls: each wrong boundary must be caught by the same comparison ------------------


def _fp64_error(model64, ragged64, monkeypatch, patch) -> float:
    layout, weights, want = ragged64
    patch(monkeypatch)
    with fp64_throughout():
        return worst_relative(run(model64, layout, weights, rows=3), want)


def test_negative_control_suffixes_from_a_zero_state(model64, ragged64, monkeypatch):
    def from_nothing(module, boundary, hidden_states):
        return recurrent.BoundaryCache(module.layer_idx, module.conv_kernel_size - 1)

    patch = lambda mp: mp.setattr(contexts, "serving_cache", from_nothing)  # noqa: E731
    assert _fp64_error(model64, ragged64, monkeypatch, patch) > 1e-2


def test_negative_control_conv_context_shifted_by_one_token(model64, ragged64, monkeypatch):
    made = recurrent.mamba_continuation

    def shifted(mixer, hidden_states, ctx):
        cont = made(mixer, hidden_states, ctx)
        if cont.conv is not None:
            cont.conv = torch.nn.functional.pad(cont.conv[:, :, :-1], (1, 0))
        return cont

    patch = lambda mp: mp.setattr(recurrent, "mamba_continuation", shifted)  # noqa: E731
    assert _fp64_error(model64, ragged64, monkeypatch, patch) > 1e-3


@pytest.mark.parametrize("slot", [0, 1], ids=["conv-gradient", "state-gradient"])
def test_negative_control_state_gradient_dropped_in_phase_c(model64, ragged64, monkeypatch, slot):
    seeded = executor.seeded_backward

    def dropping(prefix, seeds, model=None):
        seeds = [None if i // 2 in prefix.recurrent_layers and i % 2 == slot else s for i, s in enumerate(seeds)]
        seeded(prefix, seeds, model)

    patch = lambda mp: mp.setattr(executor, "seeded_backward", dropping)  # noqa: E731
    assert _fp64_error(model64, ragged64, monkeypatch, patch) > 1e-3


# -- what is not served is refused before phase A --------------------------------------------------


def test_patched_forwards_are_not_served_and_the_fused_path_is(monkeypatch):
    model = nemotron_h(torch.float32)
    assert recurrent.recurrent_refusal(model) is None
    monkeypatch.setattr(modeling_nemotron_h, "is_fast_path_available", True)  # mamba_ssm loaded (not on CUDA here)
    assert recurrent.recurrent_refusal(model) is None
    mixer = model.model.layers[0].mixer
    assert not mamba.takes_fast_path(mixer)  # transformers takes the kernels for CUDA weights only
    monkeypatch.setattr(modeling_nemotron_h, "is_fast_path_available", False)
    monkeypatch.setattr(modeling_nemotron_h.NemotronHMamba2Mixer, "forward", lambda self, *a, **k: None)
    assert "not served" in recurrent.recurrent_refusal(model)


# -- the fused path (mamba_ssm on a GPU): the kernel's own state arguments, past one chunk -------------------------


def chunk_scan_stand_in(x, dt, A, B, C, chunk_size, initial_states=None, return_final_states=False, **kwargs):
    """``mamba_chunk_scan_combined``'s call on CPU: what the kernel computes, the token-by-token recurrence
    ``h_t = exp(dt_t A) h_(t-1) + dt_t x_t B_t^T``, ``y_t = h_t C_t``, from ``initial_states``."""
    batch, length, heads, head_dim = x.shape
    h = initial_states if initial_states is not None else x.new_zeros(batch, heads, head_dim, B.shape[-1])
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append((h * C[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    return (y, h) if return_final_states else y


def fused_path(monkeypatch, scan=chunk_scan_stand_in) -> None:
    """Every Nemotron-H mixer as on a GPU with mamba_ssm: the schedule scans through the kernel's call (here its
    stand-in), and the stock mixer's fused forward computes the recurrence over every chunk from zeros."""

    def stock_fused(self, hidden_states, cache_params=None, attention_mask=None):
        start = mamba.Continuation(self, None, None, None)
        with monkeypatch.context() as inner:
            inner.setattr(mamba, "fused_chunk_scan", lambda: chunk_scan_stand_in)
            return mamba.continue_forward(self, hidden_states, start, attention_mask)

    monkeypatch.setattr(mamba, "takes_fast_path", lambda module: isinstance(module, mamba.MIXERS))
    monkeypatch.setattr(mamba, "fused_chunk_scan", lambda: scan)
    monkeypatch.setattr(modeling_nemotron_h.NemotronHMamba2Mixer, "torch_forward", stock_fused)


def test_fused_path_past_one_chunk_matches_dense(monkeypatch):
    """Chunks of 4 tokens under a 9-token prompt and suffixes of up to 8: on the fused path nothing runs dense for
    its length, and reuse (the prefix's final state into each suffix's scan, through the kernel's initial_states
    and return_final_states) equals the dense recurrence in fp64, in micro-batches of 8, 2 and 1 rows; a kernel
    call that drops the initial state fails."""
    model = nemotron_h(torch.float64, chunk_size=4)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    assert mamba.single_chunk_limit(model) == 4  # the torch path: past 4 tokens it runs dense
    fused_path(monkeypatch)
    assert mamba.single_chunk_limit(model) is None  # the engine's mamba_multichunk reason never fires
    with fp64_throughout():
        want = dense_grads(model, layout, weights)
        for rows in (8, 2, 1):
            assert worst_relative(run(model, layout, weights, rows=rows), want) < 1e-10, f"{rows} rows"

    def from_zero(*args, initial_states=None, **kwargs):
        return chunk_scan_stand_in(*args, initial_states=None, **kwargs)

    fused_path(monkeypatch, scan=from_zero)
    with fp64_throughout():
        assert worst_relative(run(model, layout, weights, rows=2), want) > 1e-2
