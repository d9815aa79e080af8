"""configs/prefix_grpo.yaml composes over verl's stock config and passes verl's validation."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.utils.config import omega_conf_to_dataclass, validate_config

from verl_prefix import PrefixFSDPActorConfig, PrefixReuseConfig
from verl_prefix.trainer import PrefixPPOTrainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_prefix_grpo_config(tiny_qwen3_dir):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        config = compose(
            config_name="prefix_grpo",
            overrides=[
                f"actor_rollout_ref.model.path={tiny_qwen3_dir}",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            ],
        )
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    assert get_trainer_cls(config.trainer.v1.trainer_mode) is PrefixPPOTrainer
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert isinstance(actor, PrefixFSDPActorConfig)
    assert actor.prefix_reuse == PrefixReuseConfig()
    assert config.actor_rollout_ref.ref.strategy == "prefix_fsdp2"
    assert config.algorithm.adv_estimator == "grpo"
