"""The ``prefix_torchtitan`` engine's config: verl's TorchTitan engine config plus the reuse knobs, and what
this slice refuses at config time (each with its reason) instead of running it wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import TorchtitanEngineConfig

from verl_prefix.backend.config import TITAN_REUSE_OFF, PrefixReuseConfig, post_init_as_stock, reuse_knobs_checked
from verl_prefix.schedule.dormant import validate_policy

TITAN_BACKEND = "prefix_torchtitan"


@dataclass
class PrefixTorchtitanEngineConfig(TorchtitanEngineConfig):
    """verl's TorchTitan engine config plus ``prefix_reuse``; accepts ``strategy: prefix_torchtitan``.

    Select it with ``actor_rollout_ref.actor.torchtitan._target_=verl_prefix.backend.titan.config.
    PrefixTorchtitanEngineConfig`` to set knobs from YAML; the engine also accepts verl's own config (defaults).
    ``mixed_precision_param`` is torchtitan's parameter/compute dtype under FSDP (``bfloat16``, its default, or
    ``float32``); verl's own config has no way to set it. ``dormant_prefix`` / ``dormant_prefix_budget_bytes``:
    where a group's phase-A graph waits until phase C, as on ``prefix_fsdp2`` (``schedule.dormant``).
    """

    strategy: str = TITAN_BACKEND
    prefix_reuse: PrefixReuseConfig = field(default_factory=PrefixReuseConfig)
    mixed_precision_param: str = "bfloat16"
    # what the schedule is built and tested on (verl's defaults are refused, see ``refusal``)
    spmd_backend: str = "default"
    activation_checkpoint: str = "none"
    use_torch_compile: bool = False
    dormant_prefix: str = "keep"
    dormant_prefix_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        post_init_as_stock(self, TITAN_BACKEND, "torchtitan", super().__post_init__)
        reuse_knobs_checked(self)
        validate_policy(self.dormant_prefix, self.dormant_prefix_budget_bytes)


# knob -> (value the schedule needs, why anything else is refused)
_SERVED_VALUES: dict[str, tuple[Any, str]] = {
    "context_parallel_size": (
        1,
        "context parallelism would shard the prefix and the suffix rows over ranks; phase B's prefix leaves "
        "would need the CP all-gathers of torchtitan's ring attention, not built yet",
    ),
    "expert_tensor_parallel_size": (1, "expert tensor parallelism is not tested under reuse yet"),
    "data_parallel_replicate_size": (1, "HSDP (replicate > 1) is not tested under reuse yet"),
    "spmd_backend": (
        "default",
        "verl's spmd_types backend fails at init with TP or FSDP > 1 on torch 2.13; partial_dtensor (verl's "
        "'default') is the backend the schedule is tested on",
    ),
    "activation_checkpoint": (
        "none",
        "torchtitan's activation checkpointing recomputes blocks in backward; phase A's K/V capture inside a "
        "recomputed block is not verified yet",
    ),
    "attn_type": (
        "flex",
        "phase B attends suffix queries to prefix + row keys (query length != key length): built on flex block "
        "masks; varlen's cu_seqlens path is not built yet",
    ),
    "use_torch_compile": (False, "compiled blocks would bake the inner-attention hook out of phase A/B"),
    "use_remove_padding": (
        True,
        "verl 0.9.1's TorchTitan engine hands torchtitan's attention a padding tensor where it expects a flex block "
        "mask when rows are padded, so its dense rows would fail; packed rows keep apart under flex's document "
        "mask (actor_rollout_ref.model.use_remove_padding)",
    ),
    "offload_policy": (False, "parameter offload between phase A and phase C is not verified yet"),
    "param_offload": (False, "parameter offload between phase A and phase C is not verified yet"),
    "optimizer_offload": (False, "optimizer offload is not verified under reuse yet"),
}


# under pipeline_parallel_size > 1, what else must stay 1 and why (the engine pipelines every pass itself,
# reuse on or off: verl 0.9.1's own TorchTitan engine has no pipelined forward step)
_PIPELINE_ALONE: dict[str, str] = {
    "tensor_parallel_size": "tensor x pipeline parallelism is not built (phase C's TP collectives inside a stage "
    "are not verified across stages)",
    "expert_parallel_size": "expert x pipeline parallelism is not built (MoE routing statistics per stage)",
    "context_parallel_size": "context x pipeline parallelism is not built",
    "data_parallel_shard_size": "FSDP x pipeline parallelism is not tested under reuse yet (each stage's "
    "data-parallel lockstep)",
    "data_parallel_replicate_size": "HSDP x pipeline parallelism is not tested under reuse yet",
}


# HF model types whose torchtitan model the schedule serves (verl maps each to a torchtitan model: these four to
# ``qwen3``, whose attention is plain causal, the one phase B's flex mask spells out), and why the others are refused
# with reuse on: phase B's block mask would ignore what their attention does, so they would train silently wrong
SERVED_MODEL_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_UNSERVED_MODEL_TYPES: dict[str, str] = {
    "llama4": "torchtitan's Llama-4 attends within chunks (iRoPE's chunked attention) on its RoPE layers and tunes "
    "its NoPE layers' query temperature by position, which phase B's causal block mask does not spell out "
    "(prefix_fsdp2 serves both)",
    "gpt_oss": "torchtitan's GPT-OSS attends within sliding windows with attention sinks, which phase B's causal "
    "block mask does not spell out (prefix_fsdp2 serves both)",
    "deepseek_v3": "torchtitan's DeepSeek-V3 (MLA) attention is not served by the inner-attention hook yet "
    "(prefix_fsdp2 serves MLA)",
    "llama": "torchtitan's Llama-3 is not tested under reuse yet",
}


def model_refusal(hf_config: Any, config: Any) -> str | None:
    """Why reuse cannot run this model on torchtitan (an allowlist: a model type not known to be served is
    refused), or None; nothing is refused with reuse switched off (the engine is then verl's)."""
    reuse = getattr(config, "prefix_reuse", None)
    if isinstance(reuse, Mapping):
        reuse = PrefixReuseConfig(**reuse)
    if reuse is not None and not reuse.enable:
        return None
    model_type = getattr(hf_config, "model_type", None)
    if model_type in SERVED_MODEL_TYPES:
        return None
    why = _UNSERVED_MODEL_TYPES.get(model_type, "a model type prefix_torchtitan does not know")
    return (
        f"prefix_torchtitan: model_type {model_type!r} is refused with reuse on ({why}); served: "
        f"{', '.join(SERVED_MODEL_TYPES)}. Use strategy=prefix_fsdp2, or set "
        f"{TITAN_REUSE_OFF} to train it through verl's TorchTitan engine"
    )


def pipeline_refusal(config: Any) -> str | None:
    """Why this config's pipeline parallelism is not served (one stage per rank, nothing else parallel), or None."""
    size = getattr(config, "pipeline_parallel_size", 1)
    if size == 1:
        return None
    for knob, why in _PIPELINE_ALONE.items():
        got = getattr(config, knob, 1)
        if got != 1:
            return (
                f"prefix_torchtitan: {knob}={got!r} with pipeline_parallel_size={size} is refused ({why}); set "
                f"{knob}=1 or pipeline_parallel_size=1"
            )
    return None


def refusal(config: Any) -> str | None:
    """Why this engine config cannot run the schedule (checked when the engine is built), or None.

    ``spmd_backend: default`` is torchtitan 0.3.0's ``partial_dtensor`` (``titan.platform``). Reuse switched off refuses
    nothing but pipeline combinations (``pipeline_refusal``): the engine is then verl's own TorchTitan engine, with
    its passes pipelined by ``distributed.stages`` under PP.
    """
    reuse = getattr(config, "prefix_reuse", None)
    if isinstance(reuse, Mapping):  # from YAML without a _target_
        reuse = PrefixReuseConfig(**reuse)
    pipeline = pipeline_refusal(config)
    if pipeline is not None:
        return pipeline
    if reuse is not None and not reuse.enable:
        return None
    for knob, (value, why) in _SERVED_VALUES.items():
        got = getattr(config, knob, value)
        if got != value:
            return f"prefix_torchtitan: {knob}={got!r} is refused ({why}); set {knob}={value!r}"
    if getattr(config, "pipeline_parallel_size", 1) > 1:
        return pipeline_dormant_refusal(getattr(config, "dormant_prefix", "keep"))
    return None


def pipeline_dormant_refusal(dormant_prefix: str) -> str | None:
    """Why a dormant policy cannot run over pipeline stages, or None. ``recompute`` (and ``auto``, which may pick
    it) runs a node's phase A again in phase C: on a stage that means receiving the previous stage's activation
    again and sending its output again, out of the order the other stages run their steps in."""
    if dormant_prefix not in ("recompute", "auto"):
        return None
    return (
        f"prefix_torchtitan: dormant_prefix={dormant_prefix} is refused with pipeline_parallel_size > 1 (recompute "
        "runs a prefix forward again in phase C, which would cross the stages again out of the order every stage "
        "runs its steps in); use keep or offload, or pipeline_parallel_size=1"
    )
