"""A torchtitan flavor with exactly the shapes of a qwen3 / qwen3_moe HF checkpoint, registered where verl would
find none.

verl's TorchTitan engine derives its flavor inside each Ray worker from ``(hidden_size, num_hidden_layers,
vocab_size)`` against torchtitan's own flavor table, so a checkpoint of other shapes (a small model of one's
own, the CPU recipe's smoke model) fails there with "No matching torchtitan flavor". The engine factories
(``titan.registry``, which ``import verl`` loads in every process) call ``ensure_checkpoint_flavor`` right before
the engine is built: when torchtitan has no flavor of those shapes, one is built from the checkpoint's config
and registered under a name that says its shapes. When torchtitan has one, verl's choice stands (and
``titan.flavor.check_flavor`` still compares it with the checkpoint).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

FLAVOR_PREFIX = "verl_prefix_tiny"
MODEL_TYPES = ("qwen3", "qwen3_moe")


def _as_dict(hf_config: Any) -> dict[str, Any]:
    return dict(hf_config) if isinstance(hf_config, Mapping) else hf_config.to_dict()


def flavor_name(hf_config: Any) -> str:
    """The registered name: model type and ``hidden x layers x vocab``."""
    hf = _as_dict(hf_config)
    return f"{FLAVOR_PREFIX}_{hf['model_type']}_{hf['hidden_size']}x{hf['num_hidden_layers']}x{hf['vocab_size']}"


def checkpoint_model_config(hf: dict[str, Any], attn_backend: str = "flex") -> Any:
    """torchtitan's ``Qwen3Model.Config`` of the checkpoint's architecture: its heads, K/V heads, head size,
    FFN or experts, RoPE theta, norm epsilon and weight tying (what ``titan.flavor`` checks)."""
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
    ``verl_prefix_load_balance_coeff`` is in the config (the tests' "aux on" flavor)."""
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


def register_checkpoint_flavor(hf_config: Any) -> str:
    """Register (idempotent) the flavor of a qwen3 / qwen3_moe checkpoint's config (an HF config or its dict);
    returns its name."""
    from torchtitan.models import qwen3

    hf = _as_dict(hf_config)
    if hf.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"checkpoint flavors are built for {MODEL_TYPES}, not {hf.get('model_type')!r}")
    name = flavor_name(hf)
    qwen3.qwen3_configs[name] = functools.partial(checkpoint_model_config, hf)
    return name


def ensure_checkpoint_flavor(hf_config: Any) -> str | None:
    """Before an engine is built: register the checkpoint's flavor when torchtitan has none of its shapes and
    the model type is one this module builds; returns the registered name, or None when verl's lookup finds one
    of torchtitan's own flavors (or the type is not built here: verl's own error then says what it supports).
    A flavor this module registered earlier for the same shapes is rebuilt from this checkpoint: two
    checkpoints of one ``hidden x layers x vocab`` may differ in heads or FFN size."""
    if getattr(hf_config, "model_type", None) not in MODEL_TYPES:
        return None
    from verl_prefix.backend.titan.platform import ensure_titan_platform

    ensure_titan_platform()  # verl's torchtitan package imports only after the platform layer
    from verl.workers.engine.torchtitan.utils import derive_torchtitan_name_and_flavor

    try:
        _, found = derive_torchtitan_name_and_flavor(hf_config)
    except ValueError:
        found = None
    if found is not None and not found.startswith(FLAVOR_PREFIX):
        return None
    name = register_checkpoint_flavor(hf_config)
    if found is None:
        logger.info("torchtitan has no flavor of the checkpoint's shapes: registered %s, built from its config", name)
    return name


__all__ = [
    "FLAVOR_PREFIX",
    "MODEL_TYPES",
    "checkpoint_model_config",
    "ensure_checkpoint_flavor",
    "flavor_name",
    "register_checkpoint_flavor",
]
