"""Tiny torchtitan models and verl TorchTitan engines for tests, built in this process.

verl derives a torchtitan flavor from ``(hidden_size, num_hidden_layers, vocab_size)``; torchtitan's smallest
qwen3 flavor has 8 layers of width 256. ``register_tiny_flavor`` registers a qwen3 flavor with exactly the
shapes of a tiny HF checkpoint (``tiny_models.write_tiny_model``), so the engines load it like any other (the
engine factories do the same on their own where torchtitan has no flavor of those shapes).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any


def register_tiny_flavor(model_dir: str | os.PathLike) -> str:
    """Register (idempotent) a torchtitan qwen3 flavor with the shapes of the qwen3 or qwen3_moe checkpoint in
    ``model_dir`` (``backend.titan.checkpoint_flavor``, which the engine factories also call in every worker);
    returns its name. Registering in the parent before ranks fork makes every rank see it."""
    from verl_prefix.backend.titan.checkpoint_flavor import register_checkpoint_flavor

    return register_checkpoint_flavor(json.loads((Path(model_dir) / "config.json").read_text()))


def ppo_loss_fn(overrides: list[str] | None = None) -> Any:
    """verl's PPO loss as its actor config composes it (``overrides``: Hydra ``actor_rollout_ref.actor`` knobs)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    from verl_prefix.harness.verl_engine import compose_ppo_config

    knobs = ["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=1", *(overrides or [])]
    actor = compose_ppo_config([f"actor_rollout_ref.actor.{k}" for k in knobs]).actor_rollout_ref.actor
    return functools.partial(ppo_loss, config=omega_conf_to_dataclass(actor))


def build_titan_engine(
    model_dir: str | os.PathLike,
    *,
    backend: str = "torchtitan",
    tensor_parallel_size: int = 1,
    data_parallel_shard_size: int = 1,
    lr: float = 1e-3,
    micro_batch_size_per_gpu: int = 4,
    prefix_reuse: Any = None,
    engine_overrides: dict[str, Any] | None = None,
) -> Any:
    """An initialised verl TorchTitan engine (``backend`` "torchtitan" or "prefix_torchtitan") in fp32, no
    compile, no activation checkpointing, ``partial_dtensor`` (verl's ``default``): what the CPU gloo tests compare."""
    from verl.workers.config import HFModelConfig, TorchtitanOptimizerConfig

    from verl_prefix.backend.titan.config import PrefixTorchtitanEngineConfig
    from verl_prefix.backend.titan.registry import STOCK_BACKEND, register_stock
    from verl_prefix.harness import verl_engine

    if backend == STOCK_BACKEND:
        register_stock()  # the adapted stock engine is opt-in (importing the plugin leaves verl's entry alone)
    register_tiny_flavor(model_dir)
    model_config = HFModelConfig(path=str(Path(model_dir).resolve()), use_remove_padding=True)
    settings: dict[str, Any] = dict(
        strategy=backend,
        tensor_parallel_size=tensor_parallel_size,
        data_parallel_shard_size=data_parallel_shard_size,
        data_parallel_size=data_parallel_shard_size,
        use_torch_compile=False,
        activation_checkpoint="none",
        spmd_backend="default",  # torchtitan 0.3.0: partial_dtensor
        mixed_precision=False,
        mixed_precision_param="float32",
        micro_batch_size_per_gpu=micro_batch_size_per_gpu,
        infer_micro_batch_size_per_gpu=micro_batch_size_per_gpu,
        use_remove_padding=True,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=16384,
        infer_max_token_len_per_gpu=16384,
    )
    settings.update(engine_overrides or {})
    if prefix_reuse is not None:
        settings["prefix_reuse"] = prefix_reuse
    engine_config = PrefixTorchtitanEngineConfig(**settings)
    optimizer_config = TorchtitanOptimizerConfig(lr=lr, total_training_steps=10, lr_warmup_steps=0, clip_grad=1.0)
    return verl_engine.new_language_model_engine(backend, model_config, engine_config, optimizer_config)
