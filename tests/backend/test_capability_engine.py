"""The capability check at engine initialisation (issue 21, item 5): a hybrid model whose recurrent layers the
schedule cannot serve (a tiny ``falcon_h1``: Mamba-2 mixers beside attention in each layer) runs dense from the
first step, counted as ``prefix/fallback_recurrent_layers`` with one log line at initialisation naming the
module, and its gradients are the stock engine's; under ``unsupported_model=raise`` the engine refuses it naming
the module, instead of stopping mid-step ("phase A did not capture K/V for every layer"). The allowlist (issue 36): a
model whose config lists a layer type verl-prefix does not know, and DeepSeek-V4's compressed attention (which
stopped mid-step), run dense from step one with their reasons and the stock engine's gradients."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import deepseek_v4 as V4
from helpers.reuse import assert_no_reuse

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend.distributed.once import UnsupportedModel
from verl_prefix.harness import grpo_batches, tiny_models, verl_engine
from verl_prefix.harness import model_zoo as Z
from verl_prefix.schedule.models.capability import structure_refusal

TARGET = "actor_rollout_ref.actor.fsdp_config._target_=verl_prefix.config.PrefixFSDPEngineConfig"


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return Z.write_model(tmp_path_factory.mktemp("falcon_h1"), "falcon_h1", torch.float64)


def batch():
    return grpo_batches.make_grpo_batch(
        num_groups=2, group_size=4, prompt_lens=[12, 9], response_len_range=(2, 6), vocab_size=Z.VOCAB, seed=3
    )


def test_hybrid_runs_dense_with_the_reason_from_step_one(hybrid_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="verl_prefix.backend.distributed.once"):
        prefix, p_loss, _ = verl_engine.build_verl_engine(hybrid_dir, backend="prefix_fsdp2", dtype="float64")
    said = [r.getMessage() for r in caplog.records if "cannot serve this model" in r.getMessage()]
    assert len(said) == 1 and "model.layers.0.mamba (FalconH1Mixer)" in said[0], said  # at init, before any step
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2)  # every group would reuse if it could
    dense, d_loss, _ = verl_engine.build_verl_engine(hybrid_dir, backend="fsdp2", dtype="float64")
    want = verl_engine.run_train_step(
        dense, d_loss, batch(), capture_grads=True
    )  # the same stock path: no promotion needed
    got = verl_engine.run_train_step(prefix, p_loss, batch(), capture_grads=True)
    metrics = got["reduced_metrics"]
    assert metrics["prefix/fallback_recurrent_layers"] == 8.0
    assert_no_reuse(metrics)
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
    assert worst < 1e-10
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verl_prefix.backend.distributed.once"):
        again = verl_engine.run_train_step(prefix, p_loss, batch())  # the decision stands: no new log line
    assert again["reduced_metrics"]["prefix/fallback_recurrent_layers"] == 8.0
    assert not [r for r in caplog.records if "cannot serve this model" in r.getMessage()]


def dense_from_step_one(model_dir, reason: str, module: str, caplog, attn_implementation: str = "sdpa") -> None:
    """The prefix engine decides at initialisation (one log line naming ``module`` and ``reason``), then every
    row of every step runs dense, counted as ``prefix/fallback_<reason>``, with the stock engine's gradients."""
    with caplog.at_level(logging.WARNING, logger="verl_prefix.backend.distributed.once"):
        prefix, p_loss, _ = verl_engine.build_verl_engine(
            model_dir, backend="prefix_fsdp2", dtype="float64", attn_implementation=attn_implementation
        )
    said = [r.getMessage() for r in caplog.records if "cannot serve this model" in r.getMessage()]
    assert len(said) == 1 and module in said[0] and f"prefix/fallback_{reason}" in said[0], said
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2)  # every group would reuse if it could
    dense, d_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="fsdp2", dtype="float64", attn_implementation=attn_implementation
    )
    # prompts past the tiny models' lengths (DeepSeek-V4's 8-token compression, its 16-token window)
    data = grpo_batches.make_grpo_batch(
        num_groups=2, group_size=4, prompt_lens=[21, 13], response_len_range=(2, 6), vocab_size=Z.VOCAB, seed=5
    )
    want = verl_engine.run_train_step(dense, d_loss, data, capture_grads=True)
    got = verl_engine.run_train_step(prefix, p_loss, data.clone(), capture_grads=True)
    metrics = got["reduced_metrics"]
    assert metrics[f"prefix/fallback_{reason}"] == 8.0, sorted(metrics)
    assert_no_reuse(metrics)
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
    assert worst < 1e-10


def test_an_unknown_layer_type_runs_dense_from_step_one(tmp_path, monkeypatch, caplog):
    """A transformers that allows a layer type verl-prefix has never seen (simulated: ``future_attention`` added to
    ``ALLOWED_LAYER_TYPES``) on a model whose forward ignores it (Llama): dense, ``unknown_structure:<type>``."""
    from transformers import configuration_utils

    allowed = (*configuration_utils.ALLOWED_LAYER_TYPES, "future_attention")
    monkeypatch.setattr(configuration_utils, "ALLOWED_LAYER_TYPES", allowed)
    model_dir = tiny_models.write_tiny_model(
        tmp_path, "llama", dtype=torch.float64, extra_config={"layer_types": ["full_attention", "future_attention"]}
    )
    dense_from_step_one(
        model_dir, "unknown_structure:future_attention", "model.layers.1 (FSDPLlamaDecoderLayer)", caplog
    )


def test_deepseek_v4_compressed_attention_runs_dense_from_step_one(tmp_path, caplog):
    """Compression rates 8 and 4 with sequences past them: reuse stopped mid-step (``size of tensor a (77) must
    match b (69)``); now dense from the first step, ``compressed_attention``, equal to the stock engine."""
    model_dir = V4.write(tmp_path, [V4.HCA, V4.CSA])
    dense_from_step_one(
        model_dir,
        "compressed_attention",
        "model.layers.0 (FSDPDeepseekV4DecoderLayer)",
        caplog,
        attn_implementation="eager",
    )


def test_deepseek_v4_negative_control_past_the_check_reuse_stops_mid_step(tmp_path, monkeypatch):
    """What the refusal prevents: with the capability check bypassed the same engine and batch stop in a step."""
    from verl_prefix.backend.distributed import once as agreement

    monkeypatch.setattr(agreement, "structure_refusal", lambda model: None)
    engine, loss, _ = verl_engine.build_verl_engine(
        V4.write(tmp_path, [V4.HCA, V4.CSA]), backend="prefix_fsdp2", dtype="float64", attn_implementation="eager"
    )
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    data = grpo_batches.make_grpo_batch(
        num_groups=2, group_size=4, prompt_lens=[21, 13], response_len_range=(2, 6), vocab_size=Z.VOCAB, seed=5
    )
    with pytest.raises(RuntimeError, match="must match the size"):
        verl_engine.run_train_step(engine, loss, data)


def test_raise_refuses_at_initialisation_naming_the_module(hybrid_dir):
    with pytest.raises(UnsupportedModel, match=r"model\.layers\.0\.mamba \(FalconH1Mixer\).*recurrent_layers"):
        verl_engine.build_verl_engine(
            hybrid_dir,
            backend="prefix_fsdp2",
            overrides=[TARGET, "+actor_rollout_ref.actor.fsdp_config.prefix_reuse.unsupported_model=raise"],
        )


def test_a_served_model_is_decided_once_and_reuses(tiny_model):
    engine, loss, _ = verl_engine.build_verl_engine(tiny_model("qwen3"), backend="prefix_fsdp2")
    assert structure_refusal(engine.module) is None
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    metrics = verl_engine.run_train_step(engine, loss, batch())["reduced_metrics"]
    assert metrics["prefix/groups"] == 2.0
    assert not [k for k in metrics if k.startswith("prefix/fallback_") and metrics[k] > 0]


def test_the_knob_is_validated():
    with pytest.raises(ValueError, match="unsupported_model must be one of"):
        PrefixReuseConfig(unsupported_model="crash")


def test_a_dropout_rate_applied_without_a_module_runs_dense():
    """Seed-OSS applies ``residual_dropout`` through ``F.dropout`` (no ``nn.Dropout`` to find): its config rate
    is what says the model samples, so the mini-batch runs dense (``fallback_dropout``); at 0 it reuses."""
    from transformers import AutoModelForCausalLM

    from verl_prefix.backend.fallbacks import has_active_dropout

    config = Z.tiny_config("seed_oss")
    assert not has_active_dropout(AutoModelForCausalLM.from_config(config).train())
    config.residual_dropout = 0.1
    model = AutoModelForCausalLM.from_config(config).train()
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    assert has_active_dropout(model) and not has_active_dropout(model.eval())


def _structure_body(rank: int) -> dict:
    """Rank 1 holds a hybrid it cannot serve (falcon_h1), rank 0 a served model (llama): the ranks agree before
    any step."""
    import torch.distributed as dist

    from verl_prefix.backend.distributed.once import UnsupportedModel, agree_on_structure

    model = Z.build("falcon_h1" if rank == 1 else "llama")
    out = {"dense": agree_on_structure(model, "dense")}
    try:
        agree_on_structure(model, "raise")
        out["raised"] = None
    except UnsupportedModel as exc:
        out["raised"] = str(exc)
    dist.barrier()  # both ranks still in step after the refusal
    return out


def test_ranks_agree_on_the_structure_before_any_step():
    from helpers.ranks import run_two_ranks

    results = run_two_ranks(_structure_body, timeout=300)
    for rank in range(2):
        assert results[rank]["dense"] == "recurrent_layers", results[rank]
        assert "rank 1: model.layers.0.mamba (FalconH1Mixer)" in results[rank]["raised"], results[rank]
    assert results[0]["raised"] == results[1]["raised"]
