"""Llama-4 through the engine: prefix_fsdp2 against verl's stock fsdp2 with a 12-token attention chunk and query
temperature tuning from position 7 on, prompts of 37-50 tokens and responses up to 30 (every chunk boundary and the
tuning's floor crossed in the prefix and in the suffixes).

Before chunked attention was served this trained silently wrong (the update off by 1.6-1.9 relative at a 24-token
chunk). Now reuse must run (no fallback, every group reused, physical < logical tokens), match the stock update in
fp64 (1e-10) and fp32 (1e-5) and its forward-only log-probs, count the chunked layer under ``<path>_chunk``; the
negative control (the chunk ignored) must fail; ``merged_varlen`` is refused at initialisation.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.model_matrix import relative_errors
from helpers.precision import fp64_throughout
from helpers.reuse import assert_infer_matches, assert_reuse_ran, reduced
from test_engine_exactness import GRAD_TOL, engines
from transformers import AutoModelForCausalLM

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import grpo_batches, tiny_models, verl_engine
from verl_prefix.harness import model_zoo as Z
from verl_prefix.schedule.kv import contexts
from verl_prefix.schedule.kv.contexts import LAYER_PATHS

CHUNK = 12


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory):
    """A tiny Llama-4 text model: layer 0 chunked (RoPE), layer 1 full attention without RoPE, temperature-tuned."""
    out = tiny_models.write_tokenizer(tmp_path_factory.mktemp("llama4_chunked"), Z.VOCAB)
    config = Z.tiny_config(
        "llama4_text", no_rope_layers=[1, 0], attention_chunk_size=CHUNK, floor_scale=8, initializer_range=0.2
    )
    config.experts_implementation = "eager"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def batch():
    return grpo_batches.make_grpo_batch(
        num_groups=2,
        group_size=4,
        prompt_lens=[37, 50],
        response_len_range=(1, 30),
        vocab_size=Z.VOCAB,
        seed=5,
        use_kl=True,
        calculate_entropy=True,
    )


def precision(dtype: str):
    return fp64_throughout() if dtype == "float64" else contextlib.nullcontext()


def step(model_dir, dtype: str, attention: str = "auto"):
    """One update through both engines: (worst relative gradient error, the prefix engine's result)."""
    reuse = PrefixReuseConfig(min_prefix_len=2, phase_b_attention=attention, suffix_micro_batch_size=2)
    (d_engine, d_loss, _), (p_engine, p_loss, _) = engines(
        model_dir, reuse=reuse, dtype=dtype, micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01
    )
    with precision(dtype):
        dense = verl_engine.run_train_step(d_engine, d_loss, batch(), capture_grads=True)
        prefix = verl_engine.run_train_step(p_engine, p_loss, batch(), capture_grads=True)
    assert dense["grads"]
    return relative_errors(prefix["grads"], dense["grads"]), prefix


def layer_paths(metrics) -> dict[str, float]:
    layers = {k.rsplit("/", 1)[-1]: v for k, v in reduced(metrics).items() if k.startswith("prefix/phase_b_layers/")}
    assert set(layers) == set(LAYER_PATHS)
    return {path: n for path, n in layers.items() if n}


@pytest.mark.parametrize(
    "dtype, attention, served",
    [("float64", "auto", "merged"), ("float32", "auto", "merged"), ("float64", "concat", "concat")],
)
def test_chunked_update_matches_stock_engine(llama4_dir, dtype, attention, served):
    worst, prefix = step(llama4_dir, dtype, attention)
    assert worst < GRAD_TOL[dtype], worst
    assert_reuse_ran(prefix["metrics"], groups=2)
    metrics = reduced(prefix["metrics"])
    assert not any(v for k, v in metrics.items() if k.startswith("prefix/fallback_")), metrics
    paths = layer_paths(prefix["metrics"])
    assert set(paths) == {f"{served}_chunk", served} and paths[f"{served}_chunk"] == paths[served] > 0


def test_chunked_infer_matches_stock_engine(llama4_dir):
    (d_engine, _, _), (p_engine, _, _) = engines(llama4_dir, dtype="float64", micro_batch_size_per_gpu=2)
    with fp64_throughout():
        dense = verl_engine.run_infer(d_engine, batch(), calculate_entropy=True)
        prefix = verl_engine.run_infer(p_engine, batch(), calculate_entropy=True)
    assert_infer_matches(dense, prefix, 1e-10, groups=2)


def test_negative_control_chunk_ignored_fails(llama4_dir, monkeypatch):
    """The same comparison with the layer's chunk ignored in phase A and B (attention over the whole prefix, as
    before chunks were served) must fail, reuse running."""
    monkeypatch.setattr(contexts, "attention_chunk", lambda module: None)
    worst, prefix = step(llama4_dir, "float64")
    assert_reuse_ran(prefix["metrics"], groups=2)
    assert worst > 1e-3, worst


def test_merged_varlen_refuses_chunked_models_at_initialisation(llama4_dir):
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    with pytest.raises(ValueError, match=r"merged_varlen does not serve chunked attention.*12-token chunks"):
        verl_engine.build_verl_engine(
            llama4_dir,
            backend="prefix_fsdp2",
            overrides=[
                f"{fsdp}._target_=verl_prefix.config.PrefixFSDPEngineConfig",
                f"+{fsdp}.prefix_reuse.phase_b_attention=merged_varlen",
            ],
        )


def test_temperature_tuning_under_ulysses_runs_dense_past_floor_scale(llama4_dir):
    """Under Ulysses each rank's module counts its own slice's positions (the stock engine's do too): a mini-batch
    reaching ``floor_scale`` runs dense with the reason, one below it reuses."""
    from verl_prefix.backend import fallbacks

    model = AutoModelForCausalLM.from_pretrained(llama4_dir)
    data = batch()
    assert fallbacks.length_fallback_reason(model, data) is None
    assert fallbacks.length_fallback_reason(model, data, ulysses=True) == "temperature_tuning"
    model.config.floor_scale = 8192
    for layer in model.model.layers:
        layer.self_attn.floor_scale = 8192
    assert fallbacks.length_fallback_reason(model, data, ulysses=True) is None
