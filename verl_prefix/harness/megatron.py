"""verl's Megatron engine built in this process from a tiny HF model on disk, fp32, on CPU gloo as on CUDA.

The engine comes from verl's own ``EngineRegistry`` and config dataclasses (``McoreEngineConfig``,
``McoreOptimizerConfig``), as verl's worker builds it; on a host without CUDA the Megatron platform layer
(``backend.megatron.platform``) is applied first. ``verl_engine.run_train_step`` / ``run_infer`` step it like the
other engines, so it compares with plain HF and verl's FSDP2 engine on identical batches and weights.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def ppo_loss(overrides: Sequence[str] = ()) -> tuple[Any, Any]:
    """``(loss_fn, actor_config)``: verl's PPO loss as its actor config composes it (``overrides``: Hydra
    ``actor_rollout_ref.actor`` knobs); the actor config is what ``verl_engine.hf_ppo_loss`` takes."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    from verl_prefix.harness.verl_engine import compose_ppo_config

    knobs = ["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=1", *overrides]
    actor = compose_ppo_config([f"actor_rollout_ref.actor.{k}" for k in knobs]).actor_rollout_ref.actor
    actor_config = omega_conf_to_dataclass(actor)
    return functools.partial(verl_ppo_loss, config=actor_config), actor_config


def build_megatron_engine(
    model_dir: str | os.PathLike,
    *,
    backend: str = "megatron",
    lr: float = 1e-3,
    tensor_parallel_size: int = 1,
    use_distributed_optimizer: bool = True,
    vanilla_mbridge: bool = False,
    micro_batch_size_per_gpu: int = 4,
    use_remove_padding: bool = True,
    clip_grad: float = 1.0,
    **overrides: Any,
) -> Any:
    """An initialised verl Megatron engine (``backend``) in fp32, sequence parallel off, local attention.

    Data parallelism is what the world leaves over ``tensor_parallel_size`` (megatron-core's layout), with the
    distributed optimizer by default (verl's default, and what ``get_per_tensor_param`` needs). ``vanilla_mbridge``
    selects verl's deprecated mbridge loader instead of Megatron-Bridge (verl's default). ``overrides`` are further
    ``McoreEngineConfig`` fields. The process group must exist (``verl_engine.init_single_process_group`` for one
    rank)."""
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig

    from verl_prefix.backend.megatron.config import MEGATRON_BACKEND
    from verl_prefix.backend.megatron.platform import ensure_megatron_platform
    from verl_prefix.harness import verl_engine

    ensure_megatron_platform()
    model_config = HFModelConfig(path=str(Path(model_dir).resolve()), use_remove_padding=use_remove_padding)
    settings: dict[str, Any] = dict(
        strategy=backend,
        dtype="float32",
        tensor_model_parallel_size=tensor_parallel_size,
        sequence_parallel=False,
        use_distributed_optimizer=use_distributed_optimizer,
        vanilla_mbridge=vanilla_mbridge,
        override_transformer_config={"attention_backend": "local"},
        micro_batch_size_per_gpu=micro_batch_size_per_gpu,
        infer_micro_batch_size_per_gpu=micro_batch_size_per_gpu,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=16384,
        infer_max_token_len_per_gpu=16384,
        use_remove_padding=use_remove_padding,
    )
    settings.update(overrides)
    if backend == MEGATRON_BACKEND:  # the reuse knobs (prefix_reuse, dormant_prefix) ride on the engine config
        from verl_prefix.backend.megatron.config import PrefixMcoreEngineConfig

        engine_config = PrefixMcoreEngineConfig(**settings)
    else:
        engine_config = McoreEngineConfig(**settings)
    optimizer_config = McoreOptimizerConfig(lr=lr, total_training_steps=10, lr_warmup_steps=0, clip_grad=clip_grad)
    return verl_engine.new_language_model_engine(backend, model_config, engine_config, optimizer_config)


def exported_weights(engine: Any) -> dict[str, torch.Tensor]:
    """What verl's weight sync sends the rollout (``get_per_tensor_param``), by HF name, as full fp32 copies; every
    rank iterates (the gathers are collectives)."""
    weights, _ = engine.get_per_tensor_param()
    return {name: tensor.detach().float().clone() for name, tensor in weights}


def main_grads(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's accumulated gradient as megatron-core's DDP keeps it (``main_grad``: this rank's TP shard,
    after the data-parallel reduction once ``finalize_model_grads`` ran), by parameter name; for comparing two
    engines of the same layout rank by rank (under virtual pipeline stages each name behind its chunk's index)."""
    several = len(engine.module) > 1  # virtual pipeline stages: the chunks' names repeat, so each is prefixed
    return {
        f"chunk{index}.{name}" if several else name: param.main_grad.detach().clone()
        for index, chunk in enumerate(engine.module)
        for name, param in chunk.named_parameters()
        if getattr(param, "main_grad", None) is not None
    }
