"""Tiny torchtitan models and verl TorchTitan engines for tests, built in this process.

verl derives a torchtitan flavor from ``(hidden_size, num_hidden_layers, vocab_size)``; torchtitan's smallest
qwen3 flavor has 8 layers of width 256. ``register_tiny_flavor`` registers a qwen3 flavor with exactly the
shapes of a tiny HF checkpoint (``testing.write_tiny_model``), so the engines load it like any other.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from torch import nn

FLAVOR_PREFIX = "verl_prefix_tiny"


def _dense_flavor(hf: dict[str, Any], attn_backend: str) -> Any:
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.config_utils import get_attention_config, make_gqa_config
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    init = {"weight": functools.partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    dim, eps = int(hf["hidden_size"]), float(hf["rms_norm_eps"])
    head_dim = int(hf.get("head_dim") or dim // hf["num_attention_heads"])
    theta = float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))

    def norm(size: int) -> Any:
        return RMSNorm.Config(normalized_shape=size, eps=eps, param_init={"weight": nn.init.ones_})

    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim,
                n_heads=int(hf["num_attention_heads"]),
                n_kv_heads=int(hf["num_key_value_heads"]),
                head_dim=head_dim,
                wqkv_param_init=init,
                wo_param_init=init,
                inner_attention=get_attention_config(attn_backend),
                fuse_qkv=True,
                rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=int(hf["max_position_embeddings"]), theta=theta),
                qk_norm=norm(head_dim),
            ),
            **_ffn_or_moe(hf, dim, init),
        )
        for _ in range(int(hf["num_hidden_layers"]))
    ]
    vocab = int(hf["vocab_size"])
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=norm(dim),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init={"weight": init["weight"]}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=init),
        layers=layers,
    )


def _ffn_or_moe(hf: dict[str, Any], dim: int, init: dict[str, Any]) -> dict[str, Any]:
    """A dense qwen3 block's SwiGLU, or a qwen3_moe block's routed experts (softmax router, top-k renormalised
    as HF's ``norm_topk_prob``), with torchtitan's auxiliary-loss-free load balancing when
    ``verl_prefix_load_balance_coeff`` is in the config (the "aux on" flavor)."""
    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )

    if hf.get("model_type") != "qwen3_moe":
        hidden = int(hf["intermediate_size"])
        return {"feed_forward": make_ffn_config(dim=dim, hidden_dim=hidden, w1_param_init=init, w2w3_param_init=init)}
    experts, top_k = int(hf.get("num_experts") or hf["num_local_experts"]), int(hf["num_experts_per_tok"])
    router = make_router_config(
        dim=dim, num_experts=experts, gate_param_init=init, top_k=top_k, score_func="softmax",
        route_norm=bool(hf.get("norm_topk_prob", True)),
    )  # fmt: skip
    routed = make_routed_experts_config(
        dim=dim, hidden_dim=int(hf["moe_intermediate_size"]), num_experts=experts, top_k=top_k,
        param_init={"w1_EFD": init["weight"], "w2_EDF": init["weight"], "w3_EFD": init["weight"]},
        comm_backend="standard",
    )  # fmt: skip
    coeff = hf.get("verl_prefix_load_balance_coeff")
    return {"moe": make_moe_config(num_experts=experts, router=router, routed_experts=routed, load_balance_coeff=coeff)}


def register_tiny_flavor(model_dir: str | os.PathLike) -> str:
    """Register (idempotent) a torchtitan qwen3 flavor with the shapes of the qwen3 or qwen3_moe checkpoint in
    ``model_dir``; returns its name. Registering in the parent before ranks fork makes every rank see it."""
    from torchtitan.models import qwen3

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    if hf.get("model_type") not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"register_tiny_flavor builds qwen3 and qwen3_moe flavors, not {hf.get('model_type')!r}")
    name = f"{FLAVOR_PREFIX}_{hf['model_type']}_{hf['hidden_size']}x{hf['num_hidden_layers']}x{hf['vocab_size']}"
    qwen3.qwen3_configs[name] = functools.partial(_dense_flavor, hf)
    return name


def ppo_loss_fn(overrides: list[str] | None = None) -> Any:
    """verl's PPO loss as its actor config composes it (``overrides``: Hydra ``actor_rollout_ref.actor`` knobs)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    from verl_prefix.tools.testing import compose_ppo_config

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
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, TorchtitanOptimizerConfig
    from verl.workers.engine import EngineRegistry

    from verl_prefix.backend.titan_config import PrefixTorchtitanEngineConfig

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
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=backend,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine
