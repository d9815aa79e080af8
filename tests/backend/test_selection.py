"""Selecting the backend the way the README tells a verl user to: through the stock Hydra config."""

from __future__ import annotations

import importlib.metadata

import pytest

import verl_prefix
from verl_prefix import PrefixReuseConfig
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


# -- one selection line (backend.trainer.selection): actor.strategy=prefix_<engine> alone ------------------------

MCORE_BATCH = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]


def _composed(*overrides: str):
    """verl's composed ``actor_rollout_ref`` as a worker receives it (resolved by the TaskRunner)."""
    from omegaconf import OmegaConf

    config = verl_engine.compose_ppo_config([*overrides, *MCORE_BATCH])
    OmegaConf.resolve(config)
    return config.actor_rollout_ref


def _engine_configs(actor_rollout_ref, key: str):
    """The actor's engine config as verl's worker builds it, and the reference policy's engine config."""
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(actor_rollout_ref.actor)
    return actor.engine, omega_conf_to_dataclass(actor_rollout_ref.ref[key])


@pytest.mark.parametrize(
    ("engine", "strategy", "key", "config_class"),
    [
        ("megatron", "prefix_megatron", "megatron", "PrefixMcoreEngineConfig"),
        ("torchtitan", "prefix_torchtitan", "torchtitan", "PrefixTorchtitanEngineConfig"),
    ],
)
def test_one_line_builds_the_prefix_engine_for_actor_and_ref(engine, strategy, key, config_class):
    """verl's Megatron/TorchTitan actor configs keep ``strategy: megatron``/``torchtitan`` on their engine config,
    and the reference configs pin it: without the selection, ``EngineRegistry.new`` builds verl's own engine."""
    from verl_prefix import config as public
    from verl_prefix.backend.trainer.selection import select_engines

    raw = _composed(f"model_engine={engine}", f"actor_rollout_ref.actor.strategy={strategy}")
    stock_actor, _ = _engine_configs(raw.copy(), key)
    assert stock_actor.strategy == engine  # the trap: what verl would build
    said = select_engines(raw)
    actor, ref = _engine_configs(raw, key)
    assert type(actor) is type(ref) is getattr(public, config_class)
    assert actor.strategy == ref.strategy == raw.ref.strategy == strategy
    assert actor.prefix_reuse == ref.prefix_reuse == PrefixReuseConfig()
    assert len(said) == 1 and f"builds {strategy}" in said[0] and "prefix_reuse.enable=false" in said[0]
    assert select_engines(raw) == []  # idempotent: a second worker call changes nothing


def test_ref_follows_the_actors_reuse_knobs_unless_it_carries_its_own():
    from verl_prefix.backend.trainer.selection import select_engines

    mcore = "actor_rollout_ref.actor.megatron"
    knobs = (
        "model_engine=megatron",
        "actor_rollout_ref.actor.strategy=prefix_megatron",
        f"{mcore}._target_=verl_prefix.config.PrefixMcoreEngineConfig",
        f"+{mcore}.prefix_reuse.min_prefix_len=7",
        f"+{mcore}.dormant_prefix=recompute",
    )
    raw = _composed(*knobs)
    said = select_engines(raw)
    actor, ref = _engine_configs(raw, "megatron")
    assert actor.prefix_reuse.min_prefix_len == ref.prefix_reuse.min_prefix_len == 7
    assert ref.dormant_prefix == "recompute" and "the actor's reuse knobs" in said[0]
    # reuse turned off on the ref explicitly: kept (verl's path through the prefix engine), the actor's untouched
    raw = _composed(*knobs, "+actor_rollout_ref.ref.megatron.prefix_reuse.enable=false")
    said = select_engines(raw)
    actor, ref = _engine_configs(raw, "megatron")
    assert actor.prefix_reuse.enable and actor.prefix_reuse.min_prefix_len == 7
    assert not ref.prefix_reuse.enable and ref.prefix_reuse.min_prefix_len == PrefixReuseConfig().min_prefix_len
    assert "its own reuse knobs" in said[0]


def test_ref_pinned_to_fsdp2_follows_a_prefix_fsdp2_actor():
    """verl's Qwen3.5 / Seed-OSS recipes pin ``ref.strategy=fsdp2``: the reference pass would run verl's engine."""
    from verl_prefix.backend.trainer.selection import select_engines

    raw = _composed(
        "actor_rollout_ref.actor.strategy=prefix_fsdp2",
        "actor_rollout_ref.actor._target_=verl_prefix.PrefixFSDPActorConfig",
        "+actor_rollout_ref.actor.prefix_reuse.min_prefix_len=9",
        "actor_rollout_ref.ref.strategy=fsdp2",
    )
    said = select_engines(raw)
    assert raw.ref.strategy == "prefix_fsdp2" and "strategy=fsdp2" in said[0]
    _, ref_engine = _engine_configs(raw, "fsdp_config")
    assert ref_engine.prefix_reuse.min_prefix_len == 9
    # an actor config without knobs leaves its FSDP engine config as verl builds it (verl copies the strategy)
    plain = _composed("actor_rollout_ref.actor.strategy=prefix_fsdp2")
    before = plain.actor.fsdp_config.copy()
    select_engines(plain)
    assert plain.actor.fsdp_config == before


def test_stock_strategies_and_custom_engine_configs_are_left_alone():
    from omegaconf import OmegaConf

    from verl_prefix.backend.trainer.selection import select_engines

    for overrides in (("model_engine=megatron",), ("actor_rollout_ref.actor.strategy=fsdp2",)):
        raw = _composed(*overrides)
        before = OmegaConf.to_container(raw)
        assert select_engines(raw) == [] and OmegaConf.to_container(raw) == before
    custom = "my_package.MyEngineConfig"
    raw = _composed(
        "model_engine=megatron",
        "actor_rollout_ref.actor.strategy=prefix_megatron",
        f"actor_rollout_ref.actor.megatron._target_={custom}",
    )
    select_engines(raw)
    assert raw.actor.megatron._target_ == custom  # the guard after the build decides (below)


def test_a_stock_engine_built_under_a_prefix_strategy_stops_the_worker():
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from verl_prefix.backend.trainer.selection import built_refusal

    stock = object.__new__(MegatronEngineWithLMHead)
    reason = built_refusal("prefix_megatron", "ref", stock)
    assert "MegatronEngineWithLMHead" in reason and "actor_rollout_ref.ref.megatron._target_" in reason
    assert built_refusal("prefix_fsdp2", "actor", object.__new__(PrefixFSDPEngineWithLMHead)) is None
    assert built_refusal("megatron", "actor", stock) is None  # verl's engine, as asked
    # the wrapped init_model keeps verl's dispatch registration
    assert getattr(ActorRolloutRefWorker.init_model, "_verl_prefix", False)
    assert hasattr(ActorRolloutRefWorker.init_model, MAGIC_ATTR)


def test_only_the_registry_module_touches_verls_engine_table():
    """verl's ``EngineRegistry._engines`` is read and written in ``backend/registry.py`` alone (idempotent class
    registration, lazy factories, taking ours back); every engine registers through it."""
    import re
    from pathlib import Path

    from verl_prefix.backend import registry

    package = Path(verl_prefix.__file__).parent
    table = re.compile(r"\._engines\b")  # the attribute, not names ending in it
    own = package / "backend" / "registry.py"
    touching = sorted(
        str(p.relative_to(package)) for p in package.rglob("*.py") if p != own and table.search(p.read_text())
    )
    assert touching == [], touching
    for backend in ("prefix_fsdp2", "prefix_torchtitan", "prefix_megatron"):
        assert registry.is_registered(backend)
        assert {"cuda", "cpu"} <= set(registry.registered_devices(backend)), backend
