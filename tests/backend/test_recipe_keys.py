"""Nothing a verl recipe sets makes a run silently dense: every training-side key of verl's own
``ppo_trainer.yaml`` (``actor_rollout_ref.actor``, ``.ref``, ``.model``) is classified in
``verl_prefix.backend.recipe_keys.KEYS``, and the classification is checked here by building ``prefix_fsdp2``
engines with the keys set away from verl's defaults (bools flipped, numbers changed, enum values tried).

A key verl adds in a new release fails ``test_every_key_of_verls_yaml_is_classified`` until someone decides
what it does to reuse.
"""

from __future__ import annotations

import copy
import functools
import logging
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.utils.losses import ppo_loss

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend import fallbacks, recipe_keys
from verl_prefix.harness import grpo_batches, verl_engine

VOCAB = 128
ROOT = Path(__file__).resolve().parents[2]
A, M = "actor_rollout_ref.actor", "actor_rollout_ref.model"


def verl_keys(generated: str = "_generated_ppo_trainer.yaml") -> dict[str, object]:
    """Every leaf of verl's generated ``ppo_trainer.yaml`` (or another generated trainer config) under
    ``actor_rollout_ref.{actor,ref,model}``, relative to ``actor_rollout_ref``, with its default."""
    import verl

    path = Path(verl.__file__).parent / "trainer" / "config" / generated
    tree = yaml.safe_load(path.read_text())["actor_rollout_ref"]
    out: dict[str, object] = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}.{key}", value)
        else:
            out[prefix] = node

    for section in ("actor", "ref", "model"):
        walk(section, tree[section])
    return out


def grpo_batch(**overrides):
    args = dict(num_groups=2, group_size=4, prompt_lens=[9, 6], response_len_range=(1, 6), vocab_size=VOCAB, seed=5)
    args.update(overrides)
    return grpo_batches.make_grpo_batch(use_kl=True, **args)


def unclassified(keys) -> list[str]:
    return sorted(k for k in keys if recipe_keys.classify(k) is None)


def test_every_key_of_verls_yaml_is_classified():
    keys = verl_keys()
    missing = unclassified(keys)
    assert not missing, f"keys of verl's ppo_trainer.yaml that recipe_keys.KEYS does not classify: {missing}"
    stale = sorted(k for k in recipe_keys.KEYS if not k.endswith(".*") and k not in keys)
    assert not stale, f"recipe_keys.KEYS classifies keys verl's YAML does not have: {stale}"
    wild = [k for k in recipe_keys.KEYS if k.endswith(".*") and not any(p.startswith(k[:-1]) for p in keys)]
    assert not wild, wild


def test_every_megatron_engine_key_is_classified():
    """``model_engine=megatron``: every key of verl's Megatron engine config (actor and ref) in ``MEGATRON_KEYS``;
    the rest of that YAML's actor, ref and model keys in ``KEYS``."""
    keys = verl_keys("_generated_ppo_megatron_trainer.yaml")
    engine = {k for k in keys if k.startswith(("actor.megatron.", "ref.megatron."))}
    assert len(engine) > 80
    missing = sorted(k for k in engine if recipe_keys.classify_megatron(k) is None)
    assert not missing, f"Megatron engine keys MEGATRON_KEYS does not classify: {missing}"
    stale = sorted(k for k in recipe_keys.MEGATRON_KEYS if not k.endswith(".*") and k not in keys)
    stale = [k for k in stale if not k.endswith(".strategy")]  # set by the plugin, absent from verl's YAML
    assert not stale, stale
    assert not unclassified(set(keys) - engine)


def test_refused_megatron_keys_are_refused_by_name():
    """Every ``refused`` engine key of ``MEGATRON_KEYS`` that the engine config carries stops the prefix engine
    naming it (with reuse on), and refuses nothing with reuse off."""
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.backend.megatron.config import refusal

    away = {
        "context_parallel_size": 2,
        "dynamic_context_parallel": True,
        "use_megatron_fsdp": True,
    }
    refused = {
        k.split(".", 2)[2]
        for k, e in recipe_keys.MEGATRON_KEYS.items()
        if e.status == "refused" and k.startswith("actor.megatron.") and "." not in k.split(".", 2)[2]
    }
    assert refused == set(away), refused

    class Config:
        prefix_reuse = PrefixReuseConfig()

    for knob, value in away.items():
        config = Config()
        setattr(config, knob, value)
        assert f"actor_rollout_ref.actor.megatron.{knob}=" in (refusal(config) or ""), knob
        config.prefix_reuse = PrefixReuseConfig(enable=False)
        assert refusal(config) is None, knob


def test_a_key_verl_adds_is_caught(monkeypatch):
    """Negative control: a key the table lacks (here: one taken out, and one inside no ``.*`` block) is reported."""
    # a copy without the key (deleting from the table itself would move the key to its end when restored, and the
    # committed page lists the keys in the table's order)
    monkeypatch.setattr(
        recipe_keys, "KEYS", {k: v for k, v in recipe_keys.KEYS.items() if k != "actor.use_remove_padding"}
    )
    assert unclassified([*verl_keys(), "model.new_knob"]) == ["actor.use_remove_padding", "model.new_knob"]
    assert recipe_keys.classify("actor.profiler.tool_config.new_tool.enable") is not None  # inside a block


def test_ref_keys_say_what_their_actor_twins_say():
    """The reference policy runs the same engine code forward-only: a ref key and its actor twin agree."""
    for path, effect in recipe_keys.KEYS.items():
        if path.startswith("ref."):
            twin = recipe_keys.classify("actor." + path[4:])
            if twin is not None and effect.status != "no_effect":
                assert twin.status == effect.status, path


def test_dense_keys_name_themselves_in_the_warning():
    """A key classified dense has a fallback reason whose one warning names the key's full override path."""
    dense = {k: e for k, e in recipe_keys.KEYS.items() if e.status == "dense"}
    assert dense
    for path, effect in dense.items():
        assert effect.reason, path
        assert f"actor_rollout_ref.{path}=" in fallbacks.REASON_HINTS.get(effect.reason, ""), path


# -- loss-level keys: one engine, one step per setting ---------------------------------------------------------

LOSS_SETTINGS: list[tuple[str, ...]] = [
    ("actor.clip_ratio=0.1",),
    ("actor.clip_ratio_low=0.1", "actor.clip_ratio_high=0.28"),
    ("actor.clip_ratio_c=2.0",),
    ("actor.policy_loss.loss_mode=sapo", "actor.tau_pos=0.5", "actor.tau_neg=2.0"),
    *[(f"actor.policy_loss.loss_mode={m}",) for m in ("gspo", "gpg", "geo_mean", "cispo", "dppo_tv", "dppo_kl")],
    (
        "actor.policy_loss.loss_mode=clip_cov",
        "actor.policy_loss.clip_cov_ratio=0.5",
        "actor.policy_loss.clip_cov_lb=0.5",
    ),
    ("actor.policy_loss.loss_mode=clip_cov", "actor.policy_loss.clip_cov_ub=2.0"),
    ("actor.policy_loss.loss_mode=kl_cov", "actor.policy_loss.kl_cov_ratio=0.5", "actor.policy_loss.ppo_kl_coef=0.5"),
    ("actor.policy_loss.loss_mode=dro", "actor.policy_loss.dro_beta=0.1"),
    ("actor.policy_loss.loss_mode=bypass_mode",),
    *[(f"actor.loss_agg_mode={m}",) for m in ("token-sum", "seq-mean-token-sum", "seq-mean-token-mean")],
    ("actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.loss_scale_factor=16"),
    ("actor.entropy_coeff=0.01", "actor.calculate_entropy=true"),
    *[
        ("actor.use_kl_loss=true", f"actor.kl_loss_type={t}", "actor.kl_loss_coef=0.1")
        for t in ("kl", "k1", "abs", "mse", "k2", "k3")
    ],
]


def test_loss_settings_try_every_policy_loss_verl_registers():
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    tried = {s.split("=", 1)[1] for settings in LOSS_SETTINGS for s in settings if "loss_mode=" in s}
    assert set(POLICY_LOSS_REGISTRY) - {"vanilla"} <= tried  # vanilla: verl's default, every other build


def _loss_fn(base, engine_actor_config, settings: tuple[str, ...]):
    """verl's ``ppo_loss`` on the actor config a recipe with ``settings`` composes (``base``: verl's composed actor
    section, updated as Hydra would; the engine's own model config)."""
    cfg = copy.deepcopy(base)
    for setting in settings:
        key, value = setting.split("=", 1)
        OmegaConf.update(cfg, key.removeprefix("actor."), yaml.safe_load(value))
    config = omega_conf_to_dataclass(cfg)
    for setting in settings:  # the setting reached the dataclass the loss reads
        key, value = setting.split("=", 1)
        assert functools.reduce(getattr, key.split(".")[1:], config) == yaml.safe_load(value), setting
    config.model_config = engine_actor_config.model_config
    return functools.partial(ppo_loss, config=config)


def test_loss_keys_reuse(tiny_model):
    engine, _, actor_config = verl_engine.build_verl_engine(tiny_model("qwen3"), backend="prefix_fsdp2", lr=0.0)
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    base = verl_engine.compose_ppo_config([f"{A}.ppo_micro_batch_size_per_gpu=4"]).actor_rollout_ref.actor
    for settings in LOSS_SETTINGS:
        metrics = verl_engine.run_train_step(engine, _loss_fn(base, actor_config, settings), grpo_batch())[
            "reduced_metrics"
        ]
        assert metrics["prefix/groups"] == 2.0, settings
        assert not [k for k, v in metrics.items() if k.startswith("prefix/fallback_") and v], settings


# -- engine-level keys: a few builds, each setting several keys away from verl's defaults --------------------------

BUILDS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "fsdp": (
        {},
        (
            "actor.fsdp_config.wrap_policy.min_num_params=1000",
            "actor.fsdp_config.reshard_after_forward=false",
            "actor.fsdp_config.fsdp_size=1",
            "actor.fsdp_config.forward_prefetch=true",
            "actor.fsdp_config.use_orig_params=true",
            "actor.fsdp_config.seed=7",
            "actor.fsdp_config.full_determinism=true",
            "actor.fsdp_config.use_no_sync_for_gradient_accumulation=true",
            "actor.fsdp_config.pad_to_length=true",
            "actor.fsdp_config.entropy_from_logits_with_chunking=true",
            "actor.fsdp_config.entropy_from_logits_chunk_size=16",
            "actor.use_prefix_grouper=true",
            "actor.freeze_vision_tower=true",
            "actor.ppo_micro_batch_size_per_gpu=3",
            "actor.ppo_mini_batch_size=8",
        ),
    ),
    "packed": (
        {"use_remove_padding": True},
        (
            "model.use_remove_padding=true",
            "actor.use_remove_padding=true",
            "actor.pad_to_length=true",
            "actor.fsdp_config.pad_to_length_bucket=16",
            "actor.entropy_from_logits_with_chunking=true",
            "actor.entropy_from_logits_chunk_size=16",
            "actor.entropy_checkpointing=true",
            "actor.fsdp_config.entropy_checkpointing=true",
        ),
    ),
    "dynamic": (
        {"use_dynamic_bsz": True, "max_token_len_per_gpu": 40, "gradient_checkpointing": True},
        (
            "actor.use_dynamic_bsz=true",
            "actor.ppo_max_token_len_per_gpu=40",
            "model.enable_gradient_checkpointing=true",
        ),
    ),
    "lora_tiled": (
        {},
        (
            "model.lora_rank=8",
            "model.lora_alpha=32",
            "model.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj]",
            "model.exclude_modules=.*layers\\.0\\.self_attn\\.o_proj",
            "model.tiled_mlp.enabled=true",
            "model.tiled_mlp.num_shards=2",
        ),
    ),
    "fused": ({}, ("model.use_fused_kernels=true", "actor.use_fused_kernels=true")),
}

# served keys no build here sets, and where their claim is checked instead
CHECKED_ELSEWHERE = {
    "actor.ppo_micro_batch_size": "verl's deprecated global form; validation divides it into the per-GPU size",
    "actor.shuffle": "trainer-side: test_trainer_balance.py",
    "actor.ulysses_sequence_parallel_size": "two ranks: test_ulysses_engine.py",
    "actor.fsdp_config.ulysses_sequence_parallel_size": "two ranks: test_ulysses_engine.py",
    "actor.fsdp_config.model_dtype": "fp32/fp64 in every engine test; bf16: test_cuda.py",
    "actor.fsdp_config.dtype": "fp32/fp64 in every engine test; bf16: test_cuda.py",
    "model.fused_kernel_options.impl_backend": "torch in the fused build (verl's default); triton/liger: GPU kernels",
    "actor.use_torch_compile": "inductor on CPU, the e2e tier: test_torch_compile_engine.py",
    "actor.fsdp_config.use_torch_compile": "inductor on CPU, the e2e tier: test_torch_compile_engine.py",
}
# loss keys the loss settings above set
LOSS_KEYS = {s.split("=", 1)[0] for settings in LOSS_SETTINGS for s in settings}
DENSE_CHECKS = {"actor.calculate_sum_pi_squared", "model.enable_activation_offload"}


def test_every_served_or_dense_key_is_checked():
    """Each actor/model key classified served or dense is set by a build, a loss setting or a dense check here,
    or named with where else its claim is checked; ref keys follow their actor twins (the same engine code,
    forward-only, ``test_ref_keys_say_what_their_actor_twins_say``)."""
    built = {s.split("=", 1)[0] for _, settings in BUILDS.values() for s in settings}
    covered = built | LOSS_KEYS | DENSE_CHECKS | set(CHECKED_ELSEWHERE)
    keys = [k for k, e in recipe_keys.KEYS.items() if e.status in ("served", "dense") and not k.startswith("ref.")]
    assert not sorted(set(keys) - covered)
    assert not sorted(covered - set(recipe_keys.KEYS))


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_served_keys_reuse(tiny_model, build, monkeypatch):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM

    # verl patches its fused forward onto the model class for the whole process: put HF's back afterwards
    monkeypatch.setattr(Qwen3ForCausalLM, "forward", Qwen3ForCausalLM.forward)
    kwargs, settings = BUILDS[build]
    overrides = [f"actor_rollout_ref.{s}" for s in settings]
    engine, loss_fn, _ = verl_engine.build_verl_engine(
        tiny_model("qwen3"), backend="prefix_fsdp2", overrides=overrides, **kwargs
    )
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    for metrics in (
        verl_engine.run_train_step(engine, loss_fn, grpo_batch())["reduced_metrics"],
        verl_engine.reduce_step_metrics(verl_engine.run_infer(engine, grpo_batch())["metrics"]),
    ):
        assert metrics["prefix/groups"] == 2.0, build
        assert not [k for k, v in metrics.items() if k.startswith("prefix/fallback_") and v], build


def flipped_no_effect_keys() -> list[str]:
    """Every actor/model key classified ``no_effect`` whose default is a bool or a number, set away from it (bools
    flipped, numbers changed); ``forward_only`` is verl's per role (true on the actor builds no optimizer, in the
    stock engine too), strings and lists are paths, names and module lists."""
    out = []
    for key, default in verl_keys().items():
        effect = recipe_keys.classify(key)
        if effect.status != "no_effect" or key.startswith("ref.") or key.endswith(".forward_only"):
            continue
        if isinstance(default, bool):
            out.append(f"actor_rollout_ref.{key}={str(not default).lower()}")
        elif isinstance(default, int | float):
            out.append(f"actor_rollout_ref.{key}={default + 1 if isinstance(default, int) else default * 0.5 + 0.01!r}")
    return out


def test_no_effect_keys_set_together_still_reuse(tiny_model):
    overrides = flipped_no_effect_keys()
    assert len(overrides) > 40  # optimizer, checkpoint, profiler, MTP, Megatron LoRA, VeOmni blocks and the rest
    engine, loss_fn, _ = verl_engine.build_verl_engine(tiny_model("qwen3"), backend="prefix_fsdp2", overrides=overrides)
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    metrics = verl_engine.run_train_step(engine, loss_fn, grpo_batch())["reduced_metrics"]
    assert metrics["prefix/groups"] == 2.0
    assert not [k for k, v in metrics.items() if k.startswith("prefix/fallback_") and v]


def _warned(caplog, reason: str, key: str) -> None:
    assert f"prefix/fallback_{reason}" in caplog.text and f"actor_rollout_ref.{key}=" in caplog.text


def test_calculate_sum_pi_squared_runs_dense_and_names_the_key(tiny_model, caplog):
    """verl's trainer asks the old-log-prob pass for sum(pi^2) when ``actor.calculate_sum_pi_squared`` is set."""
    engine, _, _ = verl_engine.build_verl_engine(tiny_model("qwen3"), backend="prefix_fsdp2")
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    batch = grpo_batch()
    tu.assign_non_tensor(batch, calculate_sum_pi_squared=True)
    fallbacks.LOGGED_REASONS.discard("sum_pi_squared")
    with caplog.at_level(logging.WARNING, logger="verl_prefix.backend.fallbacks"):
        metrics = verl_engine.reduce_step_metrics(verl_engine.run_infer(engine, batch)["metrics"])
    assert metrics["prefix/fallback_sum_pi_squared"] == 8.0
    _warned(caplog, "sum_pi_squared", "actor.calculate_sum_pi_squared")


def test_activation_offload_runs_dense_and_names_the_key(tiny_model, monkeypatch, caplog):
    from verl.utils import activation_offload

    original = activation_offload.SynchronizedGroupOffloadHandler.offload
    monkeypatch.setattr(  # verl pins its CPU copies, which needs CUDA; the rest is verl's own code
        activation_offload.SynchronizedGroupOffloadHandler,
        "offload",
        staticmethod(lambda tensor, pin_memory=True: original(tensor, pin_memory=False)),
    )
    engine, loss_fn, _ = verl_engine.build_verl_engine(
        tiny_model("qwen3", num_layers=3),
        backend="prefix_fsdp2",
        gradient_checkpointing=True,
        overrides=[f"{M}.enable_activation_offload=true"],
    )
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    fallbacks.LOGGED_REASONS.discard("activation_offload")
    with caplog.at_level(logging.WARNING, logger="verl_prefix.backend.fallbacks"):
        metrics = verl_engine.run_train_step(engine, loss_fn, grpo_batch())["reduced_metrics"]
    assert metrics["prefix/fallback_activation_offload"] == 8.0
    _warned(caplog, "activation_offload", "model.enable_activation_offload")
