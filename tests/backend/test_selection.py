"""Selecting the backend the way the README tells a verl user to: through the stock Hydra config."""

from __future__ import annotations

import importlib.metadata

import pytest

import verl_prefix
from verl_prefix.backend.fsdp.engine import PrefixFSDPEngineWithLMHead
from verl_prefix.harness import verl_engine


def test_plugin_entry_point_and_registration():
    names = [ep.value for ep in importlib.metadata.entry_points(group="verl.plugins")]
    assert "verl_prefix" in names
    assert verl_prefix.is_registered()


def test_actor_strategy_selects_the_prefix_engine(tiny_qwen3_dir):
    engine, _, actor_config = verl_engine.build_verl_engine(tiny_qwen3_dir, backend="prefix_fsdp2")
    assert type(engine) is PrefixFSDPEngineWithLMHead
    assert actor_config.strategy == "prefix_fsdp2"
    assert engine.engine_config.strategy == "fsdp2"  # what verl's FSDP code branches on
    assert actor_config.engine.strategy == "prefix_fsdp2"  # the caller's config is left as it was
    assert engine.reuse_config == verl_prefix.PrefixReuseConfig()


def test_reuse_knobs_from_yaml(tiny_qwen3_dir):
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    engine, _, _ = verl_engine.build_verl_engine(
        tiny_qwen3_dir,
        backend="prefix_fsdp2",
        overrides=[
            f"{fsdp}._target_=verl_prefix.config.PrefixFSDPEngineConfig",
            f"+{fsdp}.prefix_reuse.min_prefix_len=64",
            f"+{fsdp}.prefix_reuse.suffix_micro_batch_size=3",
        ],
    )
    assert engine.reuse_config.min_prefix_len == 64
    assert engine.reuse_config.suffix_micro_batch_size == 3


def test_invalid_knob_fails_at_config_time(tiny_qwen3_dir):
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    with pytest.raises(Exception, match="min_prefix_len must be >= 1"):
        verl_engine.build_verl_engine(
            tiny_qwen3_dir,
            backend="prefix_fsdp2",
            overrides=[
                f"{fsdp}._target_=verl_prefix.config.PrefixFSDPEngineConfig",
                f"+{fsdp}.prefix_reuse.min_prefix_len=0",
            ],
        )


def test_prefix_megatron_counts_as_megatron_for_verls_worker_environment():
    """verl gives Megatron workers ``CUDA_DEVICE_MAX_CONNECTIONS=1`` on Hopper/Ampere when the actor or critic
    strategy is ``megatron``; with the plugin imported ``prefix_megatron`` counts too, and nothing else changes."""
    from omegaconf import OmegaConf
    from verl.trainer import constants_ppo

    import verl_prefix  # noqa: F401  (the plugin wraps verl's check on import)

    def uses(actor: str, critic: str | None = None) -> bool:
        config = {"actor_rollout_ref": {"actor": {"strategy": actor}}}
        if critic is not None:
            config["critic"] = {"strategy": critic}
        return constants_ppo._uses_megatron(OmegaConf.create(config))

    assert uses("prefix_megatron") and uses("megatron") and uses("fsdp2", critic="megatron")
    assert not uses("fsdp2") and not uses("prefix_fsdp2") and not uses("prefix_torchtitan")
    assert constants_ppo._uses_megatron(None) is False
