"""Hybrid linear-attention models under reuse (issue 22, slice 1): Qwen3.5's gated delta-net layers carry
their state (recurrent state and conv context) across the prefix boundary, next to the attention layers' K/V.

Reference: plain HF, each full sequence on its own. fp64 runs with ``helpers.delta_rule.fp64_delta_net``
(transformers computes the delta rule, its norms and the decay gate's ``A_log`` gradient in fp32 even in an
fp64 model), where reuse must match at 1e-10. In fp32 with transformers' own kernels the family's gradients
carry about 4e-5 of fp32 rounding (the dense fp32 model against the fp64 one, ``A_log``/``dt_bias`` summing
many decays); reuse is judged against the fp64 reference: within 1.5x the dense fp32 model's own error.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import offload as O
from helpers.delta_rule import delta_rule_in_dtype, fp64_delta_net
from helpers.layouts import VOCAB, make_layout, token_weights
from helpers.precision import promote_fp32_upcasts
from helpers.schedule_runs import infer_reuse, reused_grads, train_reuse
from test_moe import compare
from test_schedule_hf import RAGGED, dense_grads, dense_response_outputs, weighted_loss, worst_relative
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5

from verl_prefix.harness import model_zoo
from verl_prefix.schedule import executor
from verl_prefix.schedule.dormant import Dormant
from verl_prefix.schedule.grouping import plan_batch
from verl_prefix.schedule.kv import contexts, seam
from verl_prefix.schedule.models import recurrent
from verl_prefix.schedule.options import ScheduleOptions

CPU = torch.device("cpu")
# layer 3, the last, is recurrent: phase A's early exit comes after a recurrent layer's state
ENDS_RECURRENT = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
ENDS_ATTENTION = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def qwen3_5(dtype: torch.dtype, layer_types: list[str] = ENDS_RECURRENT, checkpointing: bool = False):
    """A tiny random Qwen3.5 text model: 4 layers, gated delta-nets with 2 key / 4 value heads, kernel 4."""
    torch.manual_seed(0)
    config = model_zoo.tiny_config(
        "qwen3_5_text",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=layer_types,
        initializer_range=0.2,
        attn_implementation="sdpa",
    )
    model = AutoModelForCausalLM.from_config(config).to(dtype).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.fixture(scope="module")
def model64():
    model = qwen3_5(torch.float64)
    with fp64_delta_net(model):
        yield model


def run(model, layout, weights, *, rows, **options):
    """Reuse gradients; asserts every row reused and the prefix ran once per group."""
    return reused_grads(model, layout, weighted_loss(weights), rows=rows, **options)


def test_reference_rule_is_transformers_rule_with_initial_state():
    """The fp64 helper computes what transformers' chunked kernel does, initial state and final state too."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 70, 4, 8, generator=gen) for _ in range(3))
    g = -torch.rand(2, 70, 4, generator=gen)
    beta = torch.rand(2, 70, 4, generator=gen)
    state = torch.randn(2, 4, 8, 8, generator=gen)
    kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_out, want_state = modeling_qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    got_out, got_state = delta_rule_in_dtype(q.double(), k.double(), v.double(), g.double(), beta.double(), **kw)
    torch.testing.assert_close(got_out.float(), want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_state.float(), want_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("layer_types", "partitions"),
    [(ENDS_RECURRENT, (8, 2, 1)), (ENDS_ATTENTION, (3,))],
    ids=["ends-recurrent", "ends-attention"],
)
def test_fp64_gradients_match_dense_for_every_partition(layer_types, partitions):
    model = qwen3_5(torch.float64, layer_types)
    layout = make_layout(RAGGED)  # G = 8, ragged: right-padded rows, a one-token suffix
    weights = token_weights(layout, torch.float64)
    with fp64_delta_net(model):
        want = dense_grads(model, layout, weights)
        for rows in partitions:  # micro-batches of G, 2 and 1 rows
            got = run(model, layout, weights, rows=rows)
            assert worst_relative(got, want) < 1e-10, f"{rows} rows per micro-batch"


def test_fp64_several_groups_entropy_checkpointing_and_no_early_exit():
    """Non-reentrant checkpointing replays each layer's cache in backward; without early exit phase A runs on."""
    model = qwen3_5(torch.float64, checkpointing=True)
    layout = make_layout([(6, [3, 5, 2]), (2, [6, 1, 2])])  # P=2: the prefix is shorter than kernel-1
    weights = token_weights(layout, torch.float64)
    with fp64_delta_net(model):
        want = dense_grads(model, layout, weights, with_entropy=True)
        grads, _ = train_reuse(model, layout, weighted_loss(weights), rows=2, calculate_entropy=True, early_exit=False)
    assert worst_relative(grads, want) < 1e-10


def test_fp32_transformers_kernels_within_the_dense_models_own_rounding(model64):
    """transformers' fp32 kernels (chunked rule, single-token recurrent rule for a one-token micro-batch):
    reuse's error against the fp64 reference is no larger than 1.5x the dense fp32 model's own."""
    layout = make_layout(RAGGED)
    weights64 = token_weights(layout, torch.float64)
    truth = dense_grads(model64, layout, weights64)
    model = qwen3_5(torch.float32)
    weights = token_weights(layout, torch.float32)
    as64 = lambda grads: {n: g.double() for n, g in grads.items()}  # noqa: E731
    dense_error = worst_relative(as64(dense_grads(model, layout, weights)), truth)
    assert dense_error < 1e-4
    for rows in (8, 1):
        error = worst_relative(as64(run(model, layout, weights, rows=rows)), truth)
        assert error < max(1.5 * dense_error, 1e-5), f"{rows} rows: {error:.2e} vs dense {dense_error:.2e}"


def test_forward_only_matches_dense(model64):
    layout = make_layout([(9, [4, 7, 1, 6]), (3, [1, 2])])
    with torch.no_grad():
        want_lp, want_ent = dense_response_outputs(model64, layout)
        for rows in (4, 1):
            got = infer_reuse(model64, layout, rows=rows)
            for i in range(len(layout)):
                torch.testing.assert_close(got[i][0], want_lp[i], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(got[i][1], want_ent[i], rtol=1e-12, atol=1e-12)


def test_phase_a_holds_the_state_and_phase_b_serves_it_unchanged(model64):
    """Phase A holds per recurrent layer ``[1, conv_dim, kernel-1]`` and ``[1, heads, d_k, d_v]``; after every
    suffix micro-batch (one-token ones included, where transformers writes its conv state in place) the leaves
    are bit-identical and have gradients (fp32 or wider)."""
    layout = make_layout([(9, [1, 3, 1])])
    group = plan_batch(layout, max_rows=1, max_tokens=None, min_prefix_len=1, min_group_size=1).groups[0]
    options = ScheduleOptions(device=CPU)
    ids, pos = layout.input_ids[0][:8], layout.position_ids[0][:8]
    with seam.prefix_attention_mode(model64):
        prefix = executor.prefix_forward(model64, ids, pos, options)
        leaves = prefix.as_leaves(requires_grad=True)
        for rows in group.micro_batches:
            batch = executor.build_suffix_batch(layout, rows, group.prompt_len, options)
            log_probs, _ = executor.suffix_forward(model64, leaves, batch, options)
            sum(lp.sum() for lp in log_probs).backward()
    assert prefix.recurrent_layers == {0, 2, 3} and prefix.complete
    for layer in (0, 2, 3):
        conv, state = prefix.layer_tensors(layer)
        assert conv.shape == (1, 64, 3) and state.shape == (1, 4, 8, 8)
        assert conv.requires_grad and state.requires_grad  # graph-attached roots for phase C
        leaf_conv, leaf_state = leaves.layer_tensors(layer)
        assert torch.equal(leaf_conv, conv.detach()) and torch.equal(leaf_state, state.detach())
        assert leaf_conv.grad.abs().sum() > 0 and leaf_state.grad.abs().sum() > 0
    model64.zero_grad()


@pytest.mark.parametrize("chunk", [1, 2])
def test_fp64_chunked_prefix_matches_dense(model64, chunk):
    """Each chunk continues from the previous chunk's state leaves. Chunks of 1 and 2 tokens are shorter than
    the conv window (kernel - 1 = 3), so a chunk's conv context reaches back over several earlier chunks, and
    1-token chunks run transformers' single-token path in phase A (a 7-token prefix in chunks of 2 ends in
    one too); forward-only too."""
    layout = make_layout([(8, [4, 7, 1, 6])])
    weights = token_weights(layout, torch.float64)
    want = dense_grads(model64, layout, weights)
    got = run(model64, layout, weights, rows=2, prefix_chunk_tokens=chunk)
    assert worst_relative(got, want) < 1e-10
    with torch.no_grad():
        want_lp, _ = dense_response_outputs(model64, layout)
        got_lp = infer_reuse(model64, layout, rows=4, prefix_chunk_tokens=chunk)
    for i in range(len(layout)):
        torch.testing.assert_close(got_lp[i][0], want_lp[i], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("policy", "chunk", "prefix_chunks"),
    [("recompute", None, 0), ("recompute", 3, 0), ("keep", 4, 5)],
    ids=["recompute", "recompute-chunked", "lockstep-filler-chunks"],
)
def test_fp64_recompute_policy_and_filler_chunks(model64, policy, chunk, prefix_chunks):
    """``recompute`` rebuilds phase A's graph in phase C (the recomputed states are checked against those
    phase B continued from); lockstep filler chunks run one-token prefixes seeded with zeros."""
    layout = make_layout([(9, [4, 7, 1, 6])])
    weights = token_weights(layout, torch.float64)
    want = dense_grads(model64, layout, weights)
    dormant = lambda: Dormant(policy)  # noqa: E731
    got = run(model64, layout, weights, rows=2, prefix_chunk_tokens=chunk, dormant=dormant, prefix_chunks=prefix_chunks)
    assert worst_relative(got, want) < 1e-10


def qwen3_5_moe(dtype: torch.dtype):
    """A tiny random Qwen3.5-MoE text model: linear, full, linear layers; 4 experts (top 2) and a shared one."""
    torch.manual_seed(0)
    config = model_zoo.tiny_config(
        "qwen3_5_moe_text",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        initializer_range=0.2,
        attn_implementation="sdpa",
        experts_implementation="eager",  # grouped_mm has no fp64 kernel
    )
    return AutoModelForCausalLM.from_config(config).to(dtype).train()


def test_qwen3_5_moe_with_and_without_router_aux_loss():
    """Qwen3.5-MoE: reuse against HF with its own aux loss (``output_router_logits``, the same micro-batch
    partition, ``test_moe.compare``) and without it, fp64."""
    model = qwen3_5_moe(torch.float64)
    layout = make_layout([(7, [3, 5, 1, 4])])
    weights = token_weights(layout, torch.float64)
    with fp64_delta_net(model), promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        assert worst_relative(run(model, layout, weights, rows=2), want) < 1e-10, "aux off"
        for rows in (4, 1):
            grads, aux, flips, got, _ = compare(model, layout, rows, torch.float64)
            assert flips == 0 and aux < 1e-10 and grads < 1e-10, f"aux on, {rows} rows: {grads:.2e} {aux:.2e}"
            assert all(got[n].norm() > 0 for n in got if n.endswith("mlp.gate.weight"))


def qwen3_next(dtype: torch.dtype):
    """A tiny random Qwen3-Next: linear, full, linear layers (fused ``in_proj_qkvz``/``in_proj_ba``, 2 key / 4 value
    heads, kernel 4), every layer sparse (4 experts, top 2, a gated shared expert)."""
    torch.manual_seed(0)
    config = model_zoo.tiny_config(
        "qwen3_next",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        initializer_range=0.2,
        attn_implementation="sdpa",
        experts_implementation="eager",
    )
    return AutoModelForCausalLM.from_config(config).to(dtype).train()


def test_qwen3_next_fp64_partitions_chunks_and_router_aux_loss():
    """Qwen3-Next's gated delta-net (its in-projections regrouped per key head before the convolution) under
    reuse, fp64 against HF dense: micro-batches of G, 2 and 1 rows, 2-token prefix chunks, forward-only, and
    with HF's own router aux loss on the same micro-batch partition (``test_moe.compare``)."""
    model = qwen3_next(torch.float64)
    assert sorted(recurrent.recurrent_layers(model)) == [0, 2] and recurrent.recurrent_refusal(model) is None
    layout = make_layout([(8, [3, 5, 1, 4])])
    weights = token_weights(layout, torch.float64)
    with fp64_delta_net(model), promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        for rows, chunk in ((4, None), (2, None), (1, None), (2, 2)):
            got = run(model, layout, weights, rows=rows, prefix_chunk_tokens=chunk)
            assert worst_relative(got, want) < 1e-10, f"{rows} rows, chunks of {chunk}"
        with torch.no_grad():
            want_lp, want_ent = dense_response_outputs(model, layout)
            got = infer_reuse(model, layout, rows=2, prefix_chunk_tokens=3)
        for i in range(len(layout)):
            torch.testing.assert_close(got[i][0], want_lp[i], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got[i][1], want_ent[i], rtol=1e-12, atol=1e-12)
        grads, aux, flips, got, _ = compare(model, layout, 2, torch.float64)
    assert flips == 0 and aux < 1e-10 and grads < 1e-10, f"aux on: {grads:.2e} {aux:.2e}"
    assert all(got[n].norm() > 0 for n in got if n.endswith("mlp.gate.weight"))


# -- negative controls: each wrong boundary must be caught by the same comparison ------------------


def _fp64_error(monkeypatch, patch) -> float:
    model = qwen3_5(torch.float64)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    with fp64_delta_net(model):
        want = dense_grads(model, layout, weights)
        patch(monkeypatch)
        return worst_relative(run(model, layout, weights, rows=3), want)


def test_negative_control_suffixes_from_a_zero_state(monkeypatch):
    def from_nothing(module, boundary, hidden_states):
        return recurrent.BoundaryCache(module.layer_idx, module.conv_kernel_size - 1)

    assert _fp64_error(monkeypatch, lambda mp: mp.setattr(contexts, "serving_cache", from_nothing)) > 1e-2


def test_negative_control_conv_context_shifted_by_one_token(monkeypatch):
    def one_token_early(self, conv_state, layer_idx):
        end = conv_state.shape[-1] - 1
        self._written_conv = torch.nn.functional.pad(conv_state[:, :, :end], (1, 0))[:, :, -self.width :]

    patch = lambda mp: mp.setattr(recurrent.BoundaryCache, "update_conv_state", one_token_early)  # noqa: E731
    assert _fp64_error(monkeypatch, patch) > 1e-3


def test_negative_control_chunk_from_a_zero_state(monkeypatch):
    """A later prefix chunk that starts its recurrent layers from nothing instead of the previous chunk's state."""
    model = qwen3_5(torch.float64)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)

    def from_nothing(self, module, hidden_states):
        return recurrent.capturing_cache(module, self.recorder(module))

    with fp64_delta_net(model):
        want = dense_grads(model, layout, weights)
        monkeypatch.setattr(contexts.ChunkCaptureContext, "recurrent_cache", from_nothing)
        assert worst_relative(run(model, layout, weights, rows=4, prefix_chunk_tokens=3), want) > 1e-3


@pytest.mark.parametrize("slot", [0, 1], ids=["conv-gradient", "state-gradient"])
def test_negative_control_state_gradient_dropped_in_phase_c(monkeypatch, slot):
    seeded = executor.seeded_backward

    def dropping(prefix, seeds, model=None):
        seeds = [None if i // 2 in prefix.recurrent_layers and i % 2 == slot else s for i, s in enumerate(seeds)]
        seeded(prefix, seeds, model)

    assert _fp64_error(monkeypatch, lambda mp: mp.setattr(executor, "seeded_backward", dropping)) > 1e-3


# -- what is not served is refused before phase A --------------------------------------------------


@pytest.mark.parametrize(
    ("options", "policy", "match"),
    [({"phase_b_attention": "merged_varlen"}, "keep", "merged_varlen")],
    ids=["merged_varlen"],
)
def test_unserved_settings_are_refused_before_phase_a(options, policy, match):
    model = qwen3_5(torch.float32)
    layout = make_layout([(9, [3, 4])])
    plan = plan_batch(layout, max_rows=None, max_tokens=None, min_prefix_len=1, min_group_size=1)
    model.zero_grad()
    loss = weighted_loss(token_weights(layout, torch.float32))
    schedule_options = ScheduleOptions(device=CPU, **options)
    with pytest.raises(ValueError, match=match):
        executor.train_group(model, layout, plan.groups[0], loss, schedule_options, Dormant(policy))
    assert all(p.grad is None for p in model.parameters()), "refused after something ran"
    if policy == "keep":
        with pytest.raises(ValueError, match=match):
            executor.infer_group(model, layout, plan.groups[0], schedule_options)
    assert "Ulysses" in recurrent.recurrent_refusal(model, ulysses=True)
    assert recurrent.recurrent_refusal(model, dormant_policy="offload") is None


def test_fp64_offload_policy_leaves_the_states_in_place(model64):
    """``offload`` (the CPU stand-in store) moves phase A's saved activations and back; the boundary states are
    copies, so no moved storage stays held on the device in phase B; exact and bit-identical to keep."""
    layout = make_layout([(9, [4, 7, 1, 6])])
    weights = token_weights(layout, torch.float64)
    O.RecordingStore.instances.clear()
    offload = lambda: Dormant("offload", store_factory=O.RecordingStore)  # noqa: E731
    keep = run(model64, layout, weights, rows=2)
    got = run(model64, layout, weights, rows=2, dormant=offload)
    assert worst_relative(got, dense_grads(model64, layout, weights)) < 1e-10
    assert all(torch.equal(got[n], keep[n]) for n in keep)
    (store,) = O.RecordingStore.instances
    found = O.claims(store, model64)
    assert store.restored_bytes > 0 and found["parameter_bytes_moved"] == found["resident_in_b"] == 0


def test_served_layers_and_unserved_kernels():
    model = qwen3_5(torch.float32)
    layers = recurrent.recurrent_layers(model)
    assert sorted(layers) == [0, 2, 3] and all(recurrent.served_recurrent_layer(m) for m in layers.values())
    assert recurrent.recurrent_refusal(model) is None
    assert not any(recurrent.served_recurrent_layer(m) for m in model.model.layers[1].modules())
    layers[2].causal_conv1d_fn = lambda **kwargs: None  # a fused conv kernel (causal_conv1d) is not served
    reason = recurrent.recurrent_refusal(model)
    assert reason is not None and "Qwen3_5GatedDeltaNet" in reason
    layers[2].causal_conv1d_fn = None
    assert recurrent.recurrent_refusal(model) is None


def _foreign_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    raise AssertionError("never called")


def test_a_patched_forward_is_not_served(monkeypatch):
    """A model whose layers run a forward other than transformers' is refused (verl's own patch is served from
    HF's forward remembered before it: ``schedule.models.hf_forwards``, tests/backend/test_recurrent_engine.py)."""
    model = qwen3_5(torch.float32)
    monkeypatch.setattr(modeling_qwen3_5.Qwen3_5GatedDeltaNet, "forward", _foreign_forward)
    assert not any(recurrent.served_recurrent_layer(m) for m in model.modules())
    assert "not served" in recurrent.recurrent_refusal(model)


def test_plain_attention_models_have_no_recurrent_layers():
    from test_schedule_hf import tiny_model

    model = tiny_model("qwen3", "sdpa", torch.float32)
    assert recurrent.recurrent_layers(model) == {} and recurrent.recurrent_refusal(model, ulysses=True) is None


# -- fla's kernels (CUDA): the chunked rule serves; its one-token kernel, which has no backward, is kept off grad --


class _NoBackward(torch.autograd.Function):
    """What fla's ``fused_recurrent_gated_delta_rule`` does in backward: raise."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("fla's fused recurrent kernel has no backward")


def fla_standins(calls: list):
    """CPU stand-ins with fla's names and contracts: the chunked rule (refuses stride-0 state views, as a Triton
    kernel would misread them) and the one-token rule (no backward), both computing ``delta_rule_in_dtype``."""

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, **kwargs):
        assert initial_state is None or initial_state.is_contiguous(), "a stride-0 view reached the kernel"
        calls.append(("chunk", q.shape[1], torch.is_grad_enabled()))
        return delta_rule_in_dtype(q, k, v, g, beta, initial_state=initial_state, **kwargs)

    def fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, **kwargs):
        calls.append(("fused", q.shape[1], torch.is_grad_enabled()))
        out, state = delta_rule_in_dtype(q, k, v, g, beta, initial_state=initial_state, **kwargs)
        return _NoBackward.apply(out), state

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule.chunk"
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def test_fla_kernels_serve_with_one_token_calls_kept_off_the_fused_kernel(model64):
    """With fla's kernels (stand-ins on CPU: ``test_fla_matches_torch_rule_on_cuda`` checks the real ones) the
    layers are served; one-token suffix rows and one-token prefix chunks under grad run the chunked kernel (the
    fused one has no backward), forward-only ones the fused kernel; fp64 exact, the kernels restored after."""
    layout = make_layout(RAGGED)  # a one-token suffix: one-row micro-batches include a one-token call
    weights = token_weights(layout, torch.float64)
    calls: list = []
    chunk, fused = fla_standins(calls)
    layers = recurrent.recurrent_layers(model64).values()
    want = dense_grads(model64, layout, weights)
    try:
        for layer in layers:
            layer.chunk_gated_delta_rule, layer.recurrent_gated_delta_rule = chunk, fused
        assert all(recurrent.served_recurrent_layer(m) for m in layers)
        got = run(model64, layout, weights, rows=1, prefix_chunk_tokens=1)
        assert worst_relative(got, want) < 1e-10
        assert ("chunk", 1, True) in calls and not any(c[0] == "fused" and c[2] for c in calls)
        assert all(layer.recurrent_gated_delta_rule is fused for layer in layers)
        with torch.no_grad():
            infer_reuse(model64, layout, rows=1)
        assert ("fused", 1, False) in calls
    finally:
        for layer in layers:
            layer.chunk_gated_delta_rule = layer.recurrent_gated_delta_rule = delta_rule_in_dtype


@pytest.mark.parametrize("user_setting", [None, "1"], ids=["unset", "user-opted-in"])
def test_fla_dispatch_is_pinned_to_triton_under_reuse(model64, monkeypatch, user_setting):
    """Issue 27 item 7: fla's dispatch could send Qwen3.5's delta rule to FlashQLA on Hopper (bf16, K = V = 128)
    where ``flash_qla`` is installed; every call of the reuse schedule, forward and backward, sees FlashQLA's
    switch off (``FLA_FLASH_QLA=0``, which fla reads per call), dense calls outside it the user's setting, restored
    after. fp64 exact against dense (stand-ins with fla's names on CPU; gpu_check's cell runs the real dispatch)."""
    if user_setting is None:
        monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    else:
        monkeypatch.setenv("FLA_FLASH_QLA", user_setting)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    calls: list = []
    chunk, fused = fla_standins(calls)
    switch = []

    def seen_chunk(*args, **kwargs):
        switch.append(os.environ.get("FLA_FLASH_QLA"))
        return chunk(*args, **kwargs)

    seen_chunk.__name__, seen_chunk.__module__ = chunk.__name__, chunk.__module__
    layers = recurrent.recurrent_layers(model64).values()
    try:
        for layer in layers:
            layer.chunk_gated_delta_rule, layer.recurrent_gated_delta_rule = seen_chunk, fused
        want = dense_grads(model64, layout, weights)
        assert switch and set(switch) == {user_setting}
        switch.clear()
        got = run(model64, layout, weights, rows=2)
        assert worst_relative(got, want) < 1e-10
        assert switch and set(switch) == {"0"}
        assert os.environ.get("FLA_FLASH_QLA") == user_setting
    finally:
        for layer in layers:
            layer.chunk_gated_delta_rule = layer.recurrent_gated_delta_rule = delta_rule_in_dtype


def test_olmo_hybrid_split_convolutions_and_a_decoder_layer_that_drops_keywords():
    """OLMo-Hybrid: q/k/v convolved separately (its cache keeps three conv contexts, ``SplitConvCache``) and a
    decoder layer that calls the mixer without the forward keywords (the prefix context comes from the layer's own
    call, replayed under non-reentrant checkpointing). fp64 (``fp64_throughout``) against HF dense: micro-batches of
    1 row (a one-token suffix), 1- and 2-token prefix chunks (single-token calls in phase A, conv contexts spanning
    chunks), forward-only; suffixes from a zero state must fail."""
    from helpers.precision import fp64_throughout

    from verl_prefix.harness import model_zoo

    model = model_zoo.build("olmo_hybrid", torch.float64)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert recurrent.recurrent_refusal(model) is None and sorted(recurrent.recurrent_layers(model)) == [0]
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    with fp64_throughout():
        want = dense_grads(model, layout, weights)
        for rows, chunk in ((1, None), (3, 1), (8, 2)):
            got = run(model, layout, weights, rows=rows, prefix_chunk_tokens=chunk)
            assert worst_relative(got, want) < 1e-10, f"{rows} rows, chunks of {chunk}"
        with torch.no_grad():
            want_lp, _ = dense_response_outputs(model, layout)
            got_lp = infer_reuse(model, layout, rows=1, prefix_chunk_tokens=2)
        for i in range(len(layout)):
            torch.testing.assert_close(got_lp[i][0], want_lp[i], rtol=1e-12, atol=1e-12)
        zero = recurrent.SplitConvCache((1, 1, 1))  # a cache without state: the layer starts from nothing
        original = contexts.serving_cache
        contexts.serving_cache = lambda module, boundary, hidden_states: zero
        try:
            assert worst_relative(run(model, layout, weights, rows=2), want) > 1e-3
        finally:
            contexts.serving_cache = original
