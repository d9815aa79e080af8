"""The trainer mode and actor config, composed from verl's stock ppo_trainer.yaml as main_ppo does."""

from __future__ import annotations

import pytest
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.utils.config import omega_conf_to_dataclass, validate_config

from verl_prefix import PrefixFSDPActorConfig, PrefixReuseConfig
from verl_prefix.backend.trainer.modes import PrefixPPOTrainer
from verl_prefix.harness import verl_engine

ACTOR = "actor_rollout_ref.actor"


def compose(model_dir, *extra):
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "trainer.v1.trainer_mode=prefix_sync",
        f"{ACTOR}.strategy=prefix_fsdp2",
        f"{ACTOR}._target_=verl_prefix.PrefixFSDPActorConfig",
        "trainer.n_gpus_per_node=2",
        "data.train_batch_size=8",
        f"{ACTOR}.ppo_mini_batch_size=4",
        f"{ACTOR}.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "algorithm.adv_estimator=grpo",
        *extra,
    ]
    config = verl_engine.compose_ppo_config(overrides)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    return config


def test_two_lines_select_the_trainer_mode_and_engine(tiny_qwen3_dir):
    config = compose(tiny_qwen3_dir, f"+{ACTOR}.prefix_reuse.min_prefix_len=64")
    assert get_trainer_cls(config.trainer.v1.trainer_mode) is PrefixPPOTrainer
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert isinstance(actor, PrefixFSDPActorConfig)
    assert actor.prefix_reuse == PrefixReuseConfig(min_prefix_len=64)
    assert actor.engine.strategy == "prefix_fsdp2"
    assert actor.engine.prefix_reuse is actor.prefix_reuse  # what the engine reads
    assert config.actor_rollout_ref.ref.strategy == "prefix_fsdp2"


def test_knobs_reach_the_engine_through_the_actor_config(tiny_qwen3_dir):
    engine, _, _ = verl_engine.build_verl_engine(
        tiny_qwen3_dir,
        backend="prefix_fsdp2",
        overrides=[
            f"{ACTOR}._target_=verl_prefix.PrefixFSDPActorConfig",
            f"+{ACTOR}.prefix_reuse.suffix_token_budget=512",
            f"+{ACTOR}.moe_aux_loss_coef=0.01",
        ],
    )
    assert engine.reuse_config.suffix_token_budget == 512
    assert engine.moe_aux_loss_coef == 0.01


@pytest.mark.parametrize(
    "override, message",
    [
        (f"+{ACTOR}.prefix_reuse.min_prefix_len=0", "min_prefix_len must be >= 1"),
        (f"+{ACTOR}.prefix_reuse.min_group_size=0", "min_group_size must be >= 1"),
        (f"+{ACTOR}.prefix_reuse.suffix_micro_batch_size=-2", "suffix_micro_batch_size must be >= 1 or null"),
        (f"+{ACTOR}.prefix_reuse.suffix_token_budget=0", "suffix_token_budget must be >= 1 or null"),
        (f"+{ACTOR}.dormant_prefix=swap", "dormant_prefix=.swap. is not supported"),
        (f"+{ACTOR}.dormant_prefix=auto", "dormant_prefix=auto needs dormant_prefix_budget_bytes"),
        (f"+{ACTOR}.prefix_reuse.no_such_knob=1", "no_such_knob"),
        (f"+{ACTOR}.moe_aux_loss_coef=-1", "moe_aux_loss_coef must be a finite number >= 0"),
    ],
)
def test_invalid_knobs_fail_with_the_message_a_user_needs(tiny_qwen3_dir, override, message):
    with pytest.raises(Exception, match=message):
        config = compose(tiny_qwen3_dir, override)
        omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def test_actor_config_refuses_another_strategy(tiny_qwen3_dir):
    config = compose(tiny_qwen3_dir)
    config.actor_rollout_ref.actor.strategy = "fsdp2"
    with pytest.raises(Exception, match="needs actor.strategy=prefix_fsdp2"):
        omega_conf_to_dataclass(config.actor_rollout_ref.actor)
