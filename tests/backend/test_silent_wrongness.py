"""Configurations that used to train silently wrong under reuse: verl's activation offload (a reentrant
checkpoint per decoder layer), sliding-window attention declared by ``sliding_window`` alone, and RoPE
that recomputes its frequencies per call (dynamic, longrope). Each now runs dense and says so (metric
and one log line per reason), or is exact, or is a clear error."""

from __future__ import annotations

import contextlib
import functools
import logging

import pytest
import torch
from helpers.precision import promote_fp32_upcasts
from transformers import AutoConfig, AutoModelForCausalLM
from verl.utils import activation_offload

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend import fallbacks, model_checks
from verl_prefix.backend.inputs import row_layout
from verl_prefix.harness import grpo_batches, tiny_models, verl_engine
from verl_prefix.schedule.executor import prefix_backward, prefix_forward
from verl_prefix.schedule.kv.container import PrefixKV
from verl_prefix.schedule.kv.seam import prefix_attention_mode
from verl_prefix.schedule.options import ScheduleOptions

VOCAB = 128


def grpo_batch(**overrides):
    args = dict(num_groups=2, group_size=4, prompt_lens=[9, 5], response_len_range=(1, 6), vocab_size=VOCAB, seed=5)
    args.update(overrides)
    return grpo_batches.make_grpo_batch(**args)


@pytest.fixture(scope="module")
def tiny_config_model(tmp_path_factory):
    """``tiny_model`` for configs with nested values (``extra_config``), one directory per argument set."""
    cache = {}

    def make(family: str, **kwargs):
        key = repr((family, sorted(kwargs.items())))
        if key not in cache:
            cache[key] = tiny_models.write_tiny_model(tmp_path_factory.mktemp(f"tiny_{family}"), family, **kwargs)
        return cache[key]

    return make


def longest(batch) -> int:
    return int(batch["input_ids"].offsets().diff().max())


def worst_relative(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in want.items())


def compare(model_dir, batch, *, setup=None, reuse=None, **kwargs):
    """One update through verl's stock fsdp2 and prefix_fsdp2 (fp64, ``setup`` applied to both engines):
    (worst relative gradient difference, the prefix engine's reduced metrics)."""
    dense, d_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="fsdp2", dtype="float64", micro_batch_size_per_gpu=2, **kwargs
    )
    prefix, p_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="prefix_fsdp2", dtype="float64", micro_batch_size_per_gpu=2, **kwargs
    )
    prefix.reuse_config = reuse or PrefixReuseConfig(min_prefix_len=2)
    for engine in (dense, prefix):
        if setup is not None:
            setup(engine)
    with promote_fp32_upcasts():
        want = verl_engine.run_train_step(dense, d_loss, batch, capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
    assert want["grads"], "the stock engine produced no gradients"
    return worst_relative(got["grads"], want["grads"]), got["reduced_metrics"]


# -- verl's activation offload and reentrant per-layer checkpoint wrappers -------------------------------


@pytest.fixture
def offload_on_cpu(monkeypatch):
    """verl's offload handler pins its CPU copies, which needs CUDA; everything else is verl's own code."""
    original = activation_offload.SynchronizedGroupOffloadHandler.offload
    monkeypatch.setattr(
        activation_offload.SynchronizedGroupOffloadHandler,
        "offload",
        staticmethod(lambda tensor, pin_memory=True: original(tensor, pin_memory=False)),
    )


def test_verl_activation_offload_runs_dense_and_matches_stock(tiny_model, offload_on_cpu):
    """verl's engine with enable_activation_offload + gradient checkpointing (three layers: verl wraps
    nothing below three FSDP units) turns HF checkpointing off and wraps every decoder layer in its
    ActivationHandler with reentrant checkpointing. Reuse must not run under it."""
    overrides = ["actor_rollout_ref.model.enable_activation_offload=True"]
    worst, metrics = compare(
        tiny_model("qwen3", num_layers=3), grpo_batch(), gradient_checkpointing=True, overrides=overrides
    )
    assert metrics["prefix/fallback_activation_offload"] == 8.0
    assert metrics["prefix/groups"] == 0.0
    assert worst < 1e-10


def test_verl_activation_offload_forward_only_still_reuses(tiny_model, offload_on_cpu):
    """verl's offload handler is idle in eval mode: old/ref log-probs keep reusing, and match stock."""
    kwargs = dict(dtype="float64", gradient_checkpointing=True)
    kwargs["overrides"] = ["actor_rollout_ref.model.enable_activation_offload=True"]
    model_dir = tiny_model("qwen3", num_layers=3)
    dense, _, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs)
    prefix, _, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **kwargs)
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    with promote_fp32_upcasts():
        want = verl_engine.run_infer(dense, grpo_batch())
        got = verl_engine.run_infer(prefix, grpo_batch())
    assert verl_engine.reduce_step_metrics(got["metrics"])["prefix/groups"] == 2.0
    for w, g in zip(want["response_log_probs"].unbind(), got["response_log_probs"].unbind()):
        assert (w - g).abs().max() < 1e-10


def verl_reentrant_layers(engine) -> None:
    """verl's own per-layer wrapper (``ActivationHandler`` with checkpointing on) with the offload stream
    machinery left out: exactly the reentrant checkpoint verl puts around each decoder layer."""
    handler = activation_offload.ActivationHandler(
        contextlib.nullcontext(), lambda tensor: tensor, activation_offload.FSDPParameterFilter(), enable_ckpt=True
    )
    for layer in engine.module.model.layers:
        handler.wrap_module_forward_method(layer)


def test_verl_reentrant_layer_wrapper_runs_dense_and_matches_stock(tiny_model):
    """Before: reuse ran (prefix/groups 2) and phase A's K/V, captured inside the no-grad reentrant
    forward, carried no graph: phase C skipped every root and the prefix got no gradient."""
    worst, metrics = compare(tiny_model("qwen3"), grpo_batch(), setup=verl_reentrant_layers)
    assert metrics["prefix/fallback_activation_offload"] == 8.0
    assert worst < 1e-10


def partial_reentrant_layers(engine) -> None:
    """A hand-made reentrant checkpoint around each layer (not HF's flag, not verl's handler)."""
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    for layer in engine.module.model.layers:
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(lambda *a: _inner(*a, **kwargs), *args)

        layer.forward = forward


def test_reentrant_layer_wrapper_runs_dense_and_matches_stock(tiny_model):
    worst, metrics = compare(tiny_model("qwen3"), grpo_batch(), setup=partial_reentrant_layers)
    assert metrics["prefix/fallback_reentrant_checkpointing"] == 8.0
    assert worst < 1e-10


def hidden_reentrant_layers(engine) -> None:
    """A reentrant wrapper no inspection can see (it calls torch's checkpoint by its global name)."""
    for layer in engine.module.model.layers:
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            return torch.utils.checkpoint.checkpoint(lambda *a: _inner(*a, **kwargs), *args, use_reentrant=True)

        layer.forward = forward


def test_undetected_graphless_prefix_is_a_clear_error(tiny_model):
    """The net under detection: phase C refuses to drop the prefix gradient (before: it skipped every root)."""
    engine, loss_fn, _ = verl_engine.build_verl_engine(tiny_model("qwen3"), backend="prefix_fsdp2", dtype="float64")
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    hidden_reentrant_layers(engine)
    with pytest.raises(RuntimeError, match=r"phase C: the prefix K of layer 0 has no autograd graph"):
        verl_engine.run_train_step(engine, loss_fn, grpo_batch())


def _hf_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    return model.train()


def test_prefix_backward_raises_on_a_graphless_root(tiny_model):
    model = _hf_model(tiny_model("qwen3"))
    ids, pos = torch.arange(4, 12), torch.arange(8)
    with prefix_attention_mode(model):
        with torch.no_grad():  # phase A without autograd: what a reentrant checkpoint does inside
            prefix = prefix_forward(model, ids, pos, ScheduleOptions(torch.device("cpu")))
        leaves = prefix.as_leaves(requires_grad=True)
        with pytest.raises(RuntimeError, match=r"phase C: the prefix K of layer 0 has no autograd graph"):
            prefix_backward(prefix, leaves, model)
    # a prefix built by hand says nothing about how it was captured: not skippable either
    kv = PrefixKV(1)
    kv.keys, kv.values = [torch.zeros(1, 2, 3, 4)], [torch.zeros(1, 2, 3, 4)]
    with pytest.raises(RuntimeError, match="has no autograd graph"):
        prefix_backward(kv, kv.as_leaves(requires_grad=True))


def test_prefix_backward_skips_genuinely_constant_roots(tiny_model):
    """Frozen embeddings and layer 0's K/V projections: layer 0's K/V are constants (captured with
    autograd on), skipped; layer 1's still carry the graph and get their gradient."""
    model = _hf_model(tiny_model("qwen3"))
    attn0 = model.model.layers[0].self_attn
    frozen = [model.model.embed_tokens, model.model.layers[0].input_layernorm, attn0.k_proj, attn0.v_proj, attn0.k_norm]
    for module in frozen:
        module.requires_grad_(False)
    ids, pos = torch.arange(4, 12), torch.arange(8)
    with prefix_attention_mode(model):
        prefix = prefix_forward(model, ids, pos, ScheduleOptions(torch.device("cpu")))
        assert not prefix.keys[0].requires_grad and prefix.keys[1].requires_grad
        leaves = prefix.as_leaves(requires_grad=True)
        for leaf in leaves.tensors():
            leaf.grad = torch.ones_like(leaf)
        prefix_backward(prefix, leaves, model)
    assert attn0.k_proj.weight.grad is None
    assert model.model.layers[1].self_attn.k_proj.weight.grad.abs().sum() > 0


# -- sliding-window attention --------------------------------------------------------------------------


def test_window_shorter_than_a_sequence_reuses_exactly(tiny_config_model):
    """Mistral declares its window by ``sliding_window`` alone. Once: reuse ran, its phase B saw the whole
    prefix, and gradients differed from stock by ~1e-1; then: the mini-batch ran dense. Now reuse serves the
    window (``schedule.attention.windows``) and matches stock."""
    batch = grpo_batch()
    assert longest(batch) > 4
    worst, metrics = compare(tiny_config_model("mistral", extra_config={"sliding_window": 4}), batch)
    assert "prefix/fallback_sliding_window" not in metrics or metrics["prefix/fallback_sliding_window"] == 0
    assert metrics["prefix/groups"] == 2.0
    assert metrics["prefix/physical_tokens"] < metrics["prefix/logical_tokens"]
    assert worst < 1e-10


@pytest.mark.parametrize(
    "family, window_config",
    [
        ("mistral", {"sliding_window": 64}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}),
    ],
)
def test_window_longer_than_every_sequence_still_reuses_exactly(tiny_config_model, family, window_config):
    batch = grpo_batch()
    assert longest(batch) <= 64
    worst, metrics = compare(tiny_config_model(family, extra_config=window_config), batch)
    assert metrics["prefix/groups"] == 2.0
    assert metrics["prefix/physical_tokens"] < metrics["prefix/logical_tokens"]
    assert worst < 1e-10


def _model_from_config(family: str, **config) -> torch.nn.Module:
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=64)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**base, **config}))


@pytest.mark.parametrize(
    "family, config, windows",
    [
        ("mistral", {"sliding_window": 8}, [8]),
        ("mistral", {"sliding_window": None}, []),
        ("phi3", {"sliding_window": 8, "pad_token_id": 0}, [8]),
        ("starcoder2", {"sliding_window": 8}, [8]),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}, [8]),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}, []),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 8}, []),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, [8]),
        ("llama", {}, []),
    ],
)
def test_attention_windows_mirror_each_family(family, config, windows):
    """What each HF 5.10.4 family hands its attention as ``sliding_window``, per layer."""
    model = _model_from_config(family, **config)
    assert sorted(set(model_checks.attention_windows(model))) == windows


# -- RoPE whose frequencies depend on the longest position of each call ---------------------------------

DYNAMIC = {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}
LONGROPE = {
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,  # head_dim 16
        "long_factor": [3.0] * 8,
        "original_max_position_embeddings": 16,
    }
}


@pytest.mark.parametrize("rope, max_positions", [(DYNAMIC, 16), (LONGROPE, 64)], ids=["dynamic", "longrope"])
def test_rope_crossing_its_original_length_runs_dense(tiny_config_model, rope, max_positions):
    """Sequences up to 21 tokens against a 16-position original length. Before: reuse ran (prefix/groups
    2) with phase A rotating the prefix at its own short length, and gradients differed from stock."""
    batch = grpo_batch(response_len_range=(6, 12))
    assert longest(batch) > 16
    model_dir = tiny_config_model("llama", max_position_embeddings=max_positions, extra_config=rope)
    worst, metrics = compare(model_dir, batch)
    assert metrics["prefix/fallback_dynamic_rope"] == 8.0
    assert worst < 1e-10


@pytest.mark.parametrize("rope, max_positions", [(DYNAMIC, 16), (LONGROPE, 64)], ids=["dynamic", "longrope"])
def test_rope_below_its_original_length_still_reuses_exactly(tiny_config_model, rope, max_positions):
    batch = grpo_batch()
    assert longest(batch) < 16
    model_dir = tiny_config_model("llama", max_position_embeddings=max_positions, extra_config=rope)
    worst, metrics = compare(model_dir, batch)
    assert metrics["prefix/groups"] == 2.0
    assert worst < 1e-10


# -- one log line per reason per process ---------------------------------------------------------------


def test_each_fallback_reason_is_logged_once_per_process(tiny_model, monkeypatch, caplog):
    monkeypatch.setattr(fallbacks, "LOGGED_REASONS", set())
    engine, loss_fn, _ = verl_engine.build_verl_engine(tiny_model("qwen3"), backend="prefix_fsdp2")
    caplog.set_level(logging.WARNING, logger=fallbacks.__name__)
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=6)  # the P=5 group runs dense (short_prefix)
    for _ in range(2):
        verl_engine.run_train_step(engine, loss_fn, grpo_batch())
    engine.reuse_config = PrefixReuseConfig(enable=False)  # the whole mini-batch runs dense (disabled)
    for _ in range(2):
        verl_engine.run_train_step(engine, loss_fn, grpo_batch())
    lines = [r.getMessage() for r in caplog.records if r.name == fallbacks.__name__]
    assert sum("prefix/fallback_short_prefix" in line for line in lines) == 1
    assert sum("prefix/fallback_disabled" in line for line in lines) == 1
    assert len(lines) == 2


def test_empty_multimodal_inputs_of_text_samples_still_reuse():
    """verl's agent loop attaches ``multi_modal_inputs={}`` to every text sample; counting that as multimodal
    sent every real main_ppo batch dense. Only non-empty inputs are multimodal."""
    from tensordict import NonTensorStack

    text_model, reuse = torch.nn.Module(), PrefixReuseConfig()  # no vision encoder: visual inputs run dense
    batch = grpo_batch()
    batch["multi_modal_inputs"] = NonTensorStack(*[{} for _ in range(len(batch))])
    assert fallbacks.multimodal_fallback_reason(text_model, reuse, batch) is None
    assert row_layout(batch).visual is None
    pixels = {"pixel_values": torch.zeros(1, 3), "image_grid_thw": torch.ones(1, 3, dtype=torch.long)}
    batch["multi_modal_inputs"] = NonTensorStack(*[pixels if i == 0 else {} for i in range(len(batch))])
    assert fallbacks.multimodal_fallback_reason(text_model, reuse, batch) == "multimodal"
    visual = row_layout(batch).visual
    assert visual[0].keys() == pixels.keys() and visual[1:] == [None] * (len(batch) - 1)
