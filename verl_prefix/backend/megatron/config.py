"""The ``prefix_megatron`` engine config, and what the engine refuses before it builds anything.

``PrefixMcoreEngineConfig`` is verl's ``McoreEngineConfig`` plus the reuse knobs (``prefix_reuse``, the dormant
policies), accepting ``strategy: prefix_megatron``. ``refusal`` names a parallelism the schedule is not built for
(each with the knob to set); ``model_refusal`` is an allowlist of model types whose attention megatron-core runs as
the plain causal attention the schedule's phase B spells out. Reuse switched off refuses nothing: the engine is
then verl's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import McoreEngineConfig

from verl_prefix.backend.config import PrefixReuseConfig, post_init_as_stock, reuse_knobs_checked
from verl_prefix.schedule.dormant import validate_policy

MEGATRON_BACKEND = "prefix_megatron"
MEGATRON_REUSE_OFF = "+actor_rollout_ref.actor.megatron.prefix_reuse.enable=false"


@dataclass
class PrefixMcoreEngineConfig(McoreEngineConfig):
    """verl's Megatron engine config plus ``prefix_reuse``; accepts ``strategy: prefix_megatron``.

    Select it with ``actor_rollout_ref.actor.megatron._target_=verl_prefix.config.PrefixMcoreEngineConfig`` to
    set the knobs from YAML; the engine also accepts verl's own config (defaults). ``dormant_prefix`` /
    ``dormant_prefix_budget_bytes``: where a group's phase-A graph waits until phase C (``schedule.dormant``).
    """

    strategy: str = MEGATRON_BACKEND
    prefix_reuse: PrefixReuseConfig = field(default_factory=PrefixReuseConfig)
    dormant_prefix: str = "keep"
    dormant_prefix_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        post_init_as_stock(self, MEGATRON_BACKEND, "megatron", super().__post_init__)
        reuse_knobs_checked(self)
        validate_policy(self.dormant_prefix, self.dormant_prefix_budget_bytes)


def reuse_of(config: Any) -> PrefixReuseConfig:
    """The config's reuse knobs (verl's own config: the defaults; from YAML without a ``_target_``: a mapping)."""
    reuse = getattr(config, "prefix_reuse", None)
    if isinstance(reuse, Mapping):
        reuse = PrefixReuseConfig(**reuse)
    return reuse if reuse is not None else PrefixReuseConfig()


# knob -> (value the schedule is built for, why anything else is refused)
_SERVED_VALUES: dict[str, tuple[Any, str]] = {
    "context_parallel_size": (
        1,
        "context parallelism shards every sequence over ranks; phase B's prefix leaves would need its ring "
        "attention's all-gathers, not built",
    ),
    "dynamic_context_parallel": (False, "dynamic context parallelism: see context_parallel_size"),
    "use_megatron_fsdp": (
        False,
        "megatron-core's FSDP reshards each layer's parameters after its forward, which phase C's backward through "
        "phase A's graph would need gathered again; not built, and its CUDA-only buffers keep verl's own engine with "
        "it off CPU, so nothing could test it here",
    ),
}


def refusal(config: Any) -> str | None:
    """Why this engine config cannot run the schedule (checked when the engine is built), or None."""
    if not reuse_of(config).enable:
        return None
    for knob, (value, why) in _SERVED_VALUES.items():
        got = getattr(config, knob, value)
        if value is None and got in (None, 1) or got == value:
            continue
        return (
            f"prefix_megatron: {knob}={got!r} is refused with reuse on ({why}); set "
            f"actor_rollout_ref.actor.megatron.{knob}={value!r}, or {MEGATRON_REUSE_OFF} for verl's Megatron engine"
        )
    return None


# what megatron-core runs as plain causal attention with RoPE: the model types served, and why others are not
SERVED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "deepseek_v3")


def model_refusal(hf_config: Any, config: Any) -> str | None:
    """Why reuse cannot run this model on megatron-core (an allowlist), or None; nothing with reuse off."""
    if not reuse_of(config).enable:
        return None
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SERVED_MODEL_TYPES:
        why = "not served by prefix_megatron yet (windows, other MoE and MLA families, multimodal towers)"
    elif getattr(hf_config, "use_sliding_window", False):
        why = "sliding-window attention is not served by prefix_megatron yet"
    else:
        return None
    return (
        f"prefix_megatron: model_type {model_type!r} is refused with reuse on ({why}); served: "
        f"{', '.join(SERVED_MODEL_TYPES)} (full attention). Use strategy=prefix_fsdp2, or set "
        f"{MEGATRON_REUSE_OFF} to train it through verl's Megatron engine"
    )


def lora_refusal(model_config: Any, config: Any) -> str | None:
    """Why reuse refuses verl's Megatron LoRA (``actor_rollout_ref.model.lora.rank > 0``: Megatron-Bridge's PEFT
    adapters around the layers), or None: not run under reuse yet."""
    if not reuse_of(config).enable:
        return None
    lora = getattr(model_config, "lora", None) or {}
    rank = lora.get("rank", 0) if isinstance(lora, Mapping) else getattr(lora, "rank", 0)
    if not rank or rank <= 0:
        return None
    return (
        f"prefix_megatron: actor_rollout_ref.model.lora.rank={rank} is refused with reuse on (Megatron-Bridge's LoRA "
        f"adapters are not run under reuse yet; prefix_fsdp2 serves LoRA); set {MEGATRON_REUSE_OFF} for verl's "
        "Megatron engine"
    )


def built_model_refusal(tf_config: Any, model_config: Any) -> str | None:
    """Why reuse cannot run the model verl built (its megatron-core ``TransformerConfig``), or None: what the
    schedule's attention or loss would leave out, said at initialisation instead of trained silently different."""
    override = "actor_rollout_ref.actor.megatron.override_transformer_config"
    dropout = {k: getattr(tf_config, k, 0.0) for k in ("hidden_dropout", "attention_dropout")}
    if any(dropout.values()):
        return (
            f"prefix_megatron: dropout {dropout} samples per forward, so a shared prefix cannot stand for each row's; "
            f"set it to 0 ({override}), or {MEGATRON_REUSE_OFF}"
        )
    checks = (
        ("calculate_per_token_loss", "megatron-core's per-token loss regime (its CP / MoE path) is not built"),
        ("window_size", "sliding-window attention: the schedule's attention would see the whole prefix"),
        ("softmax_type", "attention sinks (a softmax other than vanilla): the schedule's attention has none"),
        ("experimental_attention_variant", "a sparse attention variant (DeepSeek's DSA) the schedule does not run"),
        ("cache_mla_latents", "MLA's latent cache is an inference path"),
    )
    for key, why in checks:
        value = getattr(tf_config, key, None)
        if key == "softmax_type" and value == "vanilla":
            continue
        if value:
            return (
                f"prefix_megatron: {key}={value!r} is refused with reuse on ({why}); unset it, or {MEGATRON_REUSE_OFF}"
            )
    mtp = getattr(model_config, "mtp", None)
    mtp = dict(mtp) if isinstance(mtp, Mapping) else vars(mtp) if mtp is not None else {}
    if mtp.get("enable") or mtp.get("enable_train"):
        return (
            "prefix_megatron: multi-token prediction layers (actor_rollout_ref.model.mtp.enable / enable_train) run "
            f"over every row's tokens, which the schedule does not do; set them to false, or {MEGATRON_REUSE_OFF}"
        )
    return None
