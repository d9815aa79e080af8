"""The capability check at engine initialisation (issue 21, item 5): a hybrid model whose recurrent layers the
schedule cannot serve (a tiny ``falcon_h1``: Mamba-2 mixers beside attention in each layer) runs dense from the
first step, counted as ``prefix/fallback_recurrent_layers`` with one log line at initialisation naming the
module, and its gradients are the stock engine's; under ``unsupported_model=raise`` the engine refuses it naming
the module, instead of stopping mid-step ("phase A did not capture K/V for every layer")."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.reuse import assert_no_reuse

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend.agreement import UnsupportedModel
from verl_prefix.schedule.capability import structure_refusal
from verl_prefix.tools import model_zoo as Z
from verl_prefix.tools import testing as T

TARGET = "actor_rollout_ref.actor.fsdp_config._target_=verl_prefix.config.PrefixFSDPEngineConfig"


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return Z.write_model(tmp_path_factory.mktemp("falcon_h1"), "falcon_h1", torch.float64)


def batch():
    return T.make_grpo_batch(
        num_groups=2, group_size=4, prompt_lens=[12, 9], response_len_range=(2, 6), vocab_size=Z.VOCAB, seed=3
    )


def test_hybrid_runs_dense_with_the_reason_from_step_one(hybrid_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="verl_prefix.backend.agreement"):
        prefix, p_loss, _ = T.build_verl_engine(hybrid_dir, backend="prefix_fsdp2", dtype="float64")
    said = [r.getMessage() for r in caplog.records if "cannot serve this model" in r.getMessage()]
    assert len(said) == 1 and "model.layers.0.mamba (FalconH1Mixer)" in said[0], said  # at init, before any step
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2)  # every group would reuse if it could
    dense, d_loss, _ = T.build_verl_engine(hybrid_dir, backend="fsdp2", dtype="float64")
    want = T.run_train_step(dense, d_loss, batch(), capture_grads=True)  # the same stock path: no promotion needed
    got = T.run_train_step(prefix, p_loss, batch(), capture_grads=True)
    metrics = got["reduced_metrics"]
    assert metrics["prefix/fallback_recurrent_layers"] == 8.0
    assert_no_reuse(metrics)
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
    assert worst < 1e-10
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verl_prefix.backend.agreement"):
        again = T.run_train_step(prefix, p_loss, batch())  # the decision stands: no new log line
    assert again["reduced_metrics"]["prefix/fallback_recurrent_layers"] == 8.0
    assert not [r for r in caplog.records if "cannot serve this model" in r.getMessage()]


def test_raise_refuses_at_initialisation_naming_the_module(hybrid_dir):
    with pytest.raises(UnsupportedModel, match=r"model\.layers\.0\.mamba \(FalconH1Mixer\).*recurrent_layers"):
        T.build_verl_engine(
            hybrid_dir,
            backend="prefix_fsdp2",
            overrides=[TARGET, "+actor_rollout_ref.actor.fsdp_config.prefix_reuse.unsupported_model=raise"],
        )


def test_a_served_model_is_decided_once_and_reuses(tiny_model):
    engine, loss, _ = T.build_verl_engine(tiny_model("qwen3"), backend="prefix_fsdp2")
    assert structure_refusal(engine.module) is None
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    metrics = T.run_train_step(engine, loss, batch())["reduced_metrics"]
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

    from verl_prefix.backend.agreement import UnsupportedModel, agree_on_structure

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
