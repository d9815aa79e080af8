"""The recipes' ``TASK=vl`` overrides compose over ``configs/prefix_grpo.yaml`` and pass verl's validation,
without launching anything: each recipe runs with a stand-in ``python`` that records its arguments.

A typo in an override would otherwise surface only minutes into a ``main_ppo`` launch (CPU) or on a GPU
cluster (the vLLM recipe, which no test launches)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.utils.dataset.rl_dataset import get_dataset_class

from verl_prefix import PrefixFSDPActorConfig

ROOT = Path(__file__).resolve().parents[2]
STAND_IN = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["ARGS_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def _recorded_launches(tmp_path: Path, recipe: str, env: dict[str, str]) -> list[list[str]]:
    """Run ``recipe`` with ``python`` (and ``$PYTHON``) recording its arguments; the ``main_ppo`` launches."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    stand_in = bin_dir / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "args.jsonl"
    full_env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHON": str(stand_in),
        "ARGS_LOG": str(log),
        **env,
    }
    subprocess.run(["bash", str(ROOT / "recipes" / recipe)], env=full_env, cwd=ROOT, check=True, timeout=60)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return [c[2:] for c in calls if c[:2] == ["-m", "verl.trainer.main_ppo"]]


def _compose(launch: list[str]):
    """The config ``main_ppo`` would compose from a recorded launch's arguments."""
    config_dir = next(a.split("=", 1)[1] for a in launch if a.startswith("--config-path="))
    name = next(a.split("=", 1)[1] for a in launch if a.startswith("--config-name="))
    overrides = [a for a in launch if not a.startswith("--")]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name=name, overrides=overrides)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    return config


def test_gpu_recipe_vl_variant(tmp_path, tiny_qwen3_dir):
    env = {"TASK": "vl", "MODEL": str(tiny_qwen3_dir), "DATA": str(tmp_path), "FREEZE_VISION_TOWER": "true"}
    (launch,) = _recorded_launches(tmp_path, "grpo_qwen3_prefix.sh", env)
    config = _compose(launch)
    assert config.actor_rollout_ref.rollout.name == "vllm"
    assert config.actor_rollout_ref.rollout.n == 8
    assert config.actor_rollout_ref.rollout.enable_chunked_prefill is False
    assert config.data.image_key == "images" and config.data.train_files == f"{tmp_path}/train.parquet"
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert isinstance(actor, PrefixFSDPActorConfig) and actor.freeze_vision_tower is True


@pytest.mark.parametrize("trainer", ["sync", "colocate_async", "legacy", "separate_async"])
def test_gpu_recipe_trainer_modes(tmp_path, tiny_qwen3_dir, trainer):
    """``TRAINER``: every verl trainer mode composes over the prefix config and passes verl's validation, the
    actor on prefix_fsdp2 (the plugin keeps groups whole under each: ``test_trainer_balance.py``). separate_async,
    which cannot run on CPU (``test_main_ppo_trainer_modes_cpu.py``), gets what verl asserts at its start: a
    standalone rollout pool beside the trainer's GPUs, NCCL weight sync, train_batch_size = parameter_sync_step x
    ppo_mini_batch_size."""
    env = {"TRAINER": trainer, "MODEL": str(tiny_qwen3_dir), "DATA": str(tmp_path)}
    (launch,) = _recorded_launches(tmp_path, "grpo_qwen3_prefix.sh", env)
    config = _compose(launch)
    assert config.actor_rollout_ref.actor.strategy == "prefix_fsdp2"
    v1 = config.trainer.v1
    mode = {"sync": "prefix_sync", "legacy": "prefix_sync"}.get(trainer, trainer)
    assert v1.trainer_mode == mode and config.trainer.use_v1 is (trainer != "legacy")
    if trainer == "separate_async":
        rollout = config.actor_rollout_ref.rollout
        assert config.actor_rollout_ref.hybrid_engine is False and rollout.checkpoint_engine.backend == "nccl"
        assert rollout.nnodes == 1 and rollout.n_gpus_per_node == 4 and config.trainer.n_gpus_per_node == 4
        batch = config.data.train_batch_size
        assert batch == v1.separate_async.parameter_sync_step * config.actor_rollout_ref.actor.ppo_mini_batch_size
    else:
        assert config.trainer.n_gpus_per_node == 8


def test_gpu_recipe_refuses_a_rollout_pool_without_trainers(tmp_path):
    env = {"TRAINER": "separate_async", "ROLLOUT_GPUS": "8", "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(["bash", str(ROOT / "recipes" / "grpo_qwen3_prefix.sh")], env=env, capture_output=True)
    assert result.returncode == 2 and b"ROLLOUT_GPUS=8" in result.stderr


def test_cpu_recipe_vl_variant(tmp_path):
    env = {"TASK": "vl", "OUT": str(tmp_path / "out"), "STEPS": "2", "SAVE_AT": "1", "MODE": "prefix"}
    launches = _recorded_launches(tmp_path, "grpo_cpu_smoke.sh", env)
    assert len(launches) == 2  # steps 1..SAVE_AT, then the resumed launch
    config = _compose(launches[0])
    assert config.actor_rollout_ref.rollout.name == "hf"
    assert config.actor_rollout_ref.model.trust_remote_code and config.data.trust_remote_code
    assert get_dataset_class(config.data).__name__ == "SmokeVLDataset"
    assert config.reward.custom_reward_function.path == "pkg://verl_prefix.tools.smoke.vl"
    # the dense twin composes too, on the stock engine
    env["MODE"] = "dense"
    dense = _compose(_recorded_launches(tmp_path / "dense", "grpo_cpu_smoke.sh", env)[0])
    assert dense.actor_rollout_ref.actor.strategy == "fsdp2"


def test_cpu_recipe_torchtitan_variant(tmp_path):
    """``ENGINE=torchtitan``: ``configs/prefix_grpo_torchtitan.yaml`` under the smoke overlay, TP=2 on the two
    ranks, the actor and the reference policy on ``prefix_torchtitan`` with fp32 parameters; ``MODE=dense`` is
    verl's own TorchTitan engine and synchronous trainer."""
    from verl_prefix.backend.titan.config import PrefixTorchtitanEngineConfig

    env = {"ENGINE": "torchtitan", "OUT": str(tmp_path / "out"), "STEPS": "2", "SAVE_AT": "2", "MODE": "prefix"}
    (launch,) = _recorded_launches(tmp_path, "grpo_cpu_smoke.sh", env)
    config = _compose(launch)
    assert config.trainer.v1.trainer_mode == "prefix_sync"
    assert config.actor_rollout_ref.model.use_remove_padding is True  # the engine refuses padded rows
    for role in ("actor", "ref"):
        assert config.actor_rollout_ref[role].strategy == "prefix_torchtitan", role
        engine = omega_conf_to_dataclass(config.actor_rollout_ref[role].torchtitan)
        assert isinstance(engine, PrefixTorchtitanEngineConfig), role
        assert (engine.strategy, engine.tensor_parallel_size, engine.data_parallel_shard_size) == (
            "prefix_torchtitan", 2, 1
        ), role  # fmt: skip
        assert engine.mixed_precision_param == "float32" and engine.spmd_backend == "default", role
    assert isinstance(omega_conf_to_dataclass(config.actor_rollout_ref.actor).engine, PrefixTorchtitanEngineConfig)
    env["MODE"] = "dense"
    dense = _compose(_recorded_launches(tmp_path / "dense", "grpo_cpu_smoke.sh", env)[0])
    assert dense.trainer.v1.trainer_mode == "sync"
    for role in ("actor", "ref"):
        assert omega_conf_to_dataclass(dense.actor_rollout_ref[role].torchtitan).strategy == "torchtitan", role
        assert dense.actor_rollout_ref[role].strategy == "torchtitan", role
    # the adapted stock engine is opt-in in every worker; the prefix run leaves verl's torchtitan entry alone
    assert dense.ray_kwargs.ray_init.runtime_env.env_vars.VERL_PREFIX_STOCK_TORCHTITAN == "1"  # Ray takes strings
    assert "VERL_PREFIX_STOCK_TORCHTITAN" not in (config.ray_kwargs.ray_init.runtime_env.get("env_vars") or {})
    bad = subprocess.run(
        ["bash", str(ROOT / "recipes" / "grpo_cpu_smoke.sh")],
        env={**os.environ, "ENGINE": "torchtitan", "TP": "3", "OUT": str(tmp_path / "bad"), "PYTHON": "false"},
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "TP=3 must divide the 2 actor ranks" in bad.stderr


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_cpu_recipe_family_variants(tmp_path, family):
    """``FAMILY=qwen3_5|gpt_oss``: the smoke model of that family and the training-side overrides of verl's FSDP
    recipe for it compose over the smoke overlay and pass verl's validation, in both twins (each on its engine)."""
    env = {"FAMILY": family, "OUT": str(tmp_path / "out"), "STEPS": "2", "SAVE_AT": "2", "MODE": "prefix"}
    (launch,) = _recorded_launches(tmp_path, "grpo_cpu_smoke.sh", env)
    config = _compose(launch)
    env["MODE"] = "dense"
    (dense_launch,) = _recorded_launches(tmp_path / "dense", "grpo_cpu_smoke.sh", env)
    dense = _compose(dense_launch)
    assert config.actor_rollout_ref.actor.strategy == "prefix_fsdp2"
    assert dense.actor_rollout_ref.actor.strategy == "fsdp2"
    for run in (config, dense):
        actor, ref, model = run.actor_rollout_ref.actor, run.actor_rollout_ref.ref, run.actor_rollout_ref.model
        assert actor.use_kl_loss and actor.kl_loss_type == "low_var_kl" and actor.entropy_coeff == 0
        assert model.enable_gradient_checkpointing
        assert actor.fsdp_config.model_dtype == "fp32"  # the recipe's bf16 is not taken (docs/cpu.md)
        if family == "qwen3_5":
            assert (actor.kl_loss_coef, actor.optim.lr, actor.ppo_micro_batch_size_per_gpu) == (0.02, 5e-7, 1)
            fsdp = actor.fsdp_config
            assert fsdp.offload_policy and fsdp.param_offload and fsdp.entropy_checkpointing and fsdp.fsdp_size == 8
            assert actor.entropy_from_logits_with_chunking
            assert ref.log_prob_micro_batch_size_per_gpu == 1 and not run.trainer.balance_batch
            assert not model.use_remove_padding  # the 2B recipe's padded layout
        else:
            assert (actor.kl_loss_coef, actor.optim.lr) == (0.001, 1e-6) and ref.fsdp_config.param_offload
            assert model.use_remove_padding and model.override_config.attn_implementation == "eager"
    calls = [json.loads(line) for line in (tmp_path / "args.jsonl").read_text().splitlines()]
    (smoke_data,) = [c for c in calls if "smoke-data" in c]
    assert smoke_data[smoke_data.index("--family") + 1] == family
    for bad_env, message in (
        ({"ENGINE": "torchtitan"}, "runs ENGINE=fsdp2 TASK=text"),
        ({"FAMILY": "x"}, "FAMILY must"),
    ):
        bad = subprocess.run(
            ["bash", str(ROOT / "recipes" / "grpo_cpu_smoke.sh")],
            env={**os.environ, "FAMILY": family, "OUT": str(tmp_path / "bad"), "PYTHON": "false", **bad_env},
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr


# ``_compose`` of a recorded launch in a fresh interpreter that imports verl with the recipe's environment (the
# Megatron CPU opt-in changes verl's config validation in the process that sets it), and what the engines get
_COMPOSE_MEGATRON = """
import json, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.engine import EngineRegistry

launch = json.loads(sys.argv[1])
config_dir = next(a.split("=", 1)[1] for a in launch if a.startswith("--config-path="))
name = next(a.split("=", 1)[1] for a in launch if a.startswith("--config-name="))
with initialize_config_dir(config_dir=config_dir, version_base=None):
    config = compose(config_name=name, overrides=[a for a in launch if not a.startswith("--")])
validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
roles = {}
for role in ("actor", "ref"):
    engine = omega_conf_to_dataclass(config.actor_rollout_ref[role].megatron)
    roles[role] = {
        "strategy": config.actor_rollout_ref[role].strategy,
        "config": type(engine).__name__,
        "engine": [engine.strategy, engine.tensor_model_parallel_size, engine.dtype, engine.sequence_parallel,
                   engine.use_distributed_optimizer, engine.override_transformer_config.get("attention_backend")],
        "reuse": getattr(engine, "prefix_reuse", None) is not None,
    }
stock = EngineRegistry._engines["language_model"].get("megatron", {}).get("cpu")
print(json.dumps({
    "roles": roles,
    "trainer_mode": config.trainer.v1.trainer_mode,
    "env_vars": OmegaConf.to_container(config.ray_kwargs.ray_init.runtime_env.get("env_vars") or {}),
    "fsdp_config": "fsdp_config" in config.actor_rollout_ref.actor or "fsdp_config" in config.actor_rollout_ref.ref,
    "stock_cpu_factory": getattr(stock, "__name__", None),
}))
"""


def _compose_megatron(launch: list[str]) -> dict:
    """``_COMPOSE_MEGATRON`` over a recorded launch, with the recipe's ``VERL_PREFIX_MEGATRON_CPU=1``."""
    env = {**os.environ, "VERL_PREFIX_MEGATRON_CPU": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPOSE_MEGATRON, json.dumps(launch)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cpu_recipe_megatron_variant(tmp_path):
    """``ENGINE=megatron``: ``configs/prefix_grpo_megatron.yaml`` under the smoke overlay (its FSDP blocks removed),
    TP=2 on the two ranks, fp32, sequence parallelism on (verl's default at TP > 1), local attention, the distributed
    optimizer, the actor and the reference policy on ``prefix_megatron``; ``MODE=dense`` is verl's own Megatron engine
    and synchronous trainer. Both pass verl's validation with the opt-in the recipe sets, which both carry to their Ray
    workers."""
    pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 is an optional dependency (scripts/setup.sh)")
    served = ["prefix_megatron", 2, "float32", True, True, "local"]
    env = {"ENGINE": "megatron", "OUT": str(tmp_path / "out"), "STEPS": "2", "SAVE_AT": "2", "MODE": "prefix"}
    (launch,) = _recorded_launches(tmp_path, "grpo_cpu_smoke.sh", env)
    prefix = _compose_megatron(launch)
    assert prefix["trainer_mode"] == "prefix_sync" and not prefix["fsdp_config"]
    for role in ("actor", "ref"):
        found = prefix["roles"][role]
        assert found["strategy"] == "prefix_megatron" and found["config"] == "PrefixMcoreEngineConfig", role
        assert found["engine"] == served and found["reuse"], (role, found)
    env["MODE"] = "dense"
    (dense_launch,) = _recorded_launches(tmp_path / "dense", "grpo_cpu_smoke.sh", env)
    dense = _compose_megatron(dense_launch)
    assert dense["trainer_mode"] == "sync" and not dense["fsdp_config"]
    for role in ("actor", "ref"):
        found = dense["roles"][role]
        assert found["strategy"] == "megatron" and found["config"] == "McoreEngineConfig", role
        assert found["engine"] == ["megatron", *served[1:]] and not found["reuse"], (role, found)
    for run in (prefix, dense):  # the opt-in in every Ray worker (a string: Ray's env_vars)
        assert run["env_vars"]["VERL_PREFIX_MEGATRON_CPU"] == "1"
        assert run["stock_cpu_factory"] == "build_stock_megatron"


def test_gpu_megatron_recipe(tmp_path, tiny_qwen3_dir):
    """``recipes/grpo_qwen3_megatron_prefix.sh`` composes over ``configs/prefix_grpo_megatron.yaml`` and passes
    verl's validation; the actor and the reference policy are ``prefix_megatron`` on ``PrefixMcoreEngineConfig`` at
    TP=4 with sequence parallelism and the distributed optimizer, and nothing in it is refused at start-up: the
    engine configs as the worker hands them over (``use_fused_kernels`` from the model config) pass ``refusal``, the
    model config (the tiny Qwen3 for the model type, Qwen3-8B's heads for the TP split) ``model_refusal`` and
    ``lora_refusal``, the recipe's transformer overrides and MTP settings ``built_model_refusal``."""
    from types import SimpleNamespace

    from transformers import Qwen3Config

    from verl_prefix.backend.megatron.config import built_model_refusal, lora_refusal, model_refusal, refusal, reuse_of
    from verl_prefix.config import PrefixMcoreEngineConfig

    env = {"MODEL": str(tiny_qwen3_dir), "DATA": str(tmp_path)}
    (launch,) = _recorded_launches(tmp_path, "grpo_qwen3_megatron_prefix.sh", env)
    config = _compose(launch)
    assert config.trainer.v1.trainer_mode == "prefix_sync" and config.algorithm.adv_estimator == "grpo"
    assert config.actor_rollout_ref.rollout.name == "vllm" and config.actor_rollout_ref.rollout.n == 8
    assert config.data.max_prompt_length == 6144 and config.data.train_files == f"{tmp_path}/train.parquet"
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.CUDA_DEVICE_MAX_CONNECTIONS == "1"  # a string: Ray's
    n_gpus = config.trainer.n_gpus_per_node * config.trainer.nnodes
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert actor.strategy == "prefix_megatron" and actor.use_dynamic_bsz
    assert isinstance(actor.engine, PrefixMcoreEngineConfig)
    model = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    for role in ("actor", "ref"):
        assert config.actor_rollout_ref[role].strategy == "prefix_megatron", role
        assert config.actor_rollout_ref[role].megatron._target_ == "verl_prefix.config.PrefixMcoreEngineConfig", role
        engine = omega_conf_to_dataclass(config.actor_rollout_ref[role].megatron)
        assert isinstance(engine, PrefixMcoreEngineConfig) and engine.strategy == "prefix_megatron", role
        assert (engine.tensor_model_parallel_size, engine.sequence_parallel, engine.dtype) == (4, True, "bfloat16")
        assert engine.use_distributed_optimizer and n_gpus % engine.tensor_model_parallel_size == 0, role
        assert reuse_of(engine).enable and reuse_of(engine).tree is False, role
        engine.use_fused_kernels = model.use_fused_kernels  # what verl's worker does before building the engine
        assert refusal(engine) is None, (role, refusal(engine))
        assert model_refusal(model.hf_config, engine) is None and lora_refusal(model, engine) is None, role
        overrides = SimpleNamespace(**engine.override_transformer_config)  # what the recipe sets of the built config
        assert built_model_refusal(overrides, model) is None, role
    # the control: an override the engine refuses is seen by the same check
    cp = _compose([*launch, "actor_rollout_ref.actor.megatron.context_parallel_size=2"])
    assert "context_parallel_size=2 is refused" in refusal(omega_conf_to_dataclass(cp.actor_rollout_ref.actor.megatron))
    qwen3_8b = Qwen3Config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8)
    assert model_refusal(qwen3_8b, actor.engine) is None
    assert qwen3_8b.num_key_value_heads % actor.engine.tensor_model_parallel_size == 0  # megatron-core's TP split
    # TP=2 and the trie: the reference policy follows both; a TP that does not divide the GPUs stops the recipe
    env.update(TP="2", TREE="true", MAX_CONNECTIONS="")
    (launch,) = _recorded_launches(tmp_path / "tp2", "grpo_qwen3_megatron_prefix.sh", env)
    config = _compose(launch)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in (config.ray_kwargs.ray_init.runtime_env.get("env_vars") or {})
    for role in ("actor", "ref"):
        engine = omega_conf_to_dataclass(config.actor_rollout_ref[role].megatron)
        assert engine.tensor_model_parallel_size == 2 and reuse_of(engine).tree is True, role
        assert refusal(engine) is None, role
    no_python = tmp_path / "no_python"  # were the check missed, nothing would launch
    no_python.mkdir()
    (no_python / "python").symlink_to(shutil.which("false"))
    bad = subprocess.run(
        ["bash", str(ROOT / "recipes" / "grpo_qwen3_megatron_prefix.sh")],
        env={**os.environ, "TP": "3", "PATH": f"{no_python}:{os.environ['PATH']}"},
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "TP=3 must divide the 8 GPUs" in bad.stderr


def test_gpu_rag_recipe(tmp_path, tiny_qwen3_dir):
    """The long-prompt recipe composes: the prefix engine, dynamic batch size, HotpotQA's parquet files."""
    env = {"MODEL": str(tiny_qwen3_dir), "DATA": str(tmp_path), "TREE": "true"}
    (launch,) = _recorded_launches(tmp_path, "grpo_qwen3_rag_prefix.sh", env)
    config = _compose(launch)
    assert config.actor_rollout_ref.rollout.name == "vllm" and config.actor_rollout_ref.rollout.n == 8
    assert config.data.max_prompt_length == 6144 and config.data.train_files == f"{tmp_path}/train.parquet"
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert isinstance(actor, PrefixFSDPActorConfig) and actor.strategy == "prefix_fsdp2"
    assert actor.use_dynamic_bsz and actor.prefix_reuse.tree is True
    assert config.actor_rollout_ref.ref.prefix_reuse.tree is True  # the reference policy follows the actor's knobs


def test_rag_data_rows(tmp_path):
    """``recipes/hotpotqa_long_context.py`` turns HotpotQA examples into verl rows whose reward verl scores."""
    import importlib.util

    from verl.utils.reward_score import default_compute_score

    spec = importlib.util.spec_from_file_location("hotpotqa_long_context", ROOT / "recipes/hotpotqa_long_context.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def example(i: int) -> dict:
        titles = [f"T{i}-{j}" for j in range(10)]
        sentences = [[f"Paragraph {j} of question {i}. ", "More text."] for j in range(10)]
        return {"id": f"q{i}", "question": f"Who is {i}?", "answer": f"Person {i}",
                "context": {"title": titles, "sentences": sentences}}  # fmt: skip

    rows = module.make_rows([example(i) for i in range(4)], "train", extra_paragraphs=5)
    assert [r["extra_info"]["documents"] for r in rows] == [15] * 4  # never the question's own paragraphs twice
    user = rows[0]["prompt"][1]["content"]
    assert user.count("Document ") == 15 and user.endswith("Question: Who is 0?")
    assert "Paragraph 3 of question 0. More text." in user
    assert rows[0]["prompt"][0]["content"] == rows[3]["prompt"][0]["content"]  # one shared system message
    assert rows == module.make_rows([example(i) for i in range(4)], "train", extra_paragraphs=5)  # seeded
    truth = rows[2]["reward_model"]["ground_truth"]
    assert default_compute_score(rows[2]["data_source"], "so <answer>person 2</answer>", truth) == 1
    assert default_compute_score(rows[2]["data_source"], "<answer>Person 3</answer>", truth) == 0
