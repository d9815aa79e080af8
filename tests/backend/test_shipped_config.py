"""configs/prefix_grpo.yaml composes over verl's stock config and passes verl's validation."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.utils.config import omega_conf_to_dataclass, validate_config

from verl_prefix import PrefixFSDPActorConfig, PrefixReuseConfig
from verl_prefix.backend.trainer.modes import PrefixPPOTrainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def compose_shipped(model_dir, *extra: str):
    """configs/prefix_grpo.yaml as a user composes it, with the few values verl's checks need."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return compose(
            config_name="prefix_grpo",
            overrides=[
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
                *extra,
            ],
        )


def test_prefix_grpo_config(tiny_qwen3_dir):
    config = compose_shipped(tiny_qwen3_dir)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    assert get_trainer_cls(config.trainer.v1.trainer_mode) is PrefixPPOTrainer
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert isinstance(actor, PrefixFSDPActorConfig)
    assert actor.prefix_reuse == PrefixReuseConfig()
    assert config.actor_rollout_ref.ref.strategy == "prefix_fsdp2"
    assert config.algorithm.adv_estimator == "grpo"


def test_every_reuse_knob_is_in_the_shipped_yaml(tiny_qwen3_dir):
    """``actor_rollout_ref.actor.prefix_reuse.<knob>=value`` works without Hydra's ``+`` for every knob of
    ``PrefixReuseConfig`` (a key missing from the YAML is "not in struct"), the tree's included."""
    import dataclasses

    config = compose_shipped(
        tiny_qwen3_dir,
        "actor_rollout_ref.actor.prefix_reuse.tree=true",
        "actor_rollout_ref.actor.prefix_reuse.min_shared_tokens=64",
    )
    knobs = {f.name for f in dataclasses.fields(PrefixReuseConfig) if not f.name.startswith("_")}
    assert set(config.actor_rollout_ref.actor.prefix_reuse) == knobs
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert actor.prefix_reuse == PrefixReuseConfig(tree=True, min_shared_tokens=64)


def test_the_reference_policy_obeys_the_actors_reuse_knobs(tiny_qwen3_dir):
    """The ref engine is prefix_fsdp2 too (ref.strategy follows the actor): it must read the same knobs,
    not ``PrefixReuseConfig()`` defaults (with reuse off on the actor, the ref pass reused)."""
    config = compose_shipped(
        tiny_qwen3_dir,
        "actor_rollout_ref.actor.prefix_reuse.enable=false",
        "actor_rollout_ref.actor.prefix_reuse.min_prefix_len=8",
    )
    want = PrefixReuseConfig(enable=False, min_prefix_len=8)
    ref_node = config.actor_rollout_ref.ref
    with open_dict(ref_node):  # what ActorRolloutRefWorker.init_model does to the ref config first
        ref_node.ppo_mini_batch_size = config.actor_rollout_ref.actor.ppo_mini_batch_size
        ref_node.ppo_micro_batch_size = ref_node.pop("log_prob_micro_batch_size", None)
        ref_node.ppo_micro_batch_size_per_gpu = ref_node.pop("log_prob_micro_batch_size_per_gpu", None)
        ref_node.use_dynamic_bsz = ref_node.pop("log_prob_use_dynamic_bsz", False)
        ref_node.ppo_max_token_len_per_gpu = ref_node.pop("log_prob_max_token_len_per_gpu", None)
    ref = omega_conf_to_dataclass(ref_node)
    assert isinstance(ref, PrefixFSDPActorConfig) and ref.strategy == "prefix_fsdp2"
    assert ref.prefix_reuse == want and ref.engine.prefix_reuse == want
    assert omega_conf_to_dataclass(config.actor_rollout_ref.actor).prefix_reuse == want
