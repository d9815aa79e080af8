"""Can this mini-batch reuse, and if not, why: the reasons a batch runs through the stock dense path.

Every reason is a metric (``prefix/fallback_<reason>``) and one warning per reason per process
(``log_fallbacks``); none is silent. Data-parallel ranks agree on one path, since FSDP2 collectives must
match (``backend.distributed.mini_batch``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from tensordict import TensorDict
from torch import nn
from verl.utils import tensordict_utils as tu
from verl.utils.model import extract_multi_modal_inputs

from verl_prefix.backend.config import PrefixReuseConfig
from verl_prefix.backend.model_checks import (
    has_active_dropout,
    rope_length_limit,
    undeclared_windows,
    uses_activation_offload,
    uses_reentrant_checkpointing,
)
from verl_prefix.schedule.attention.positions import position_scale_limit
from verl_prefix.schedule.kv.seam import PREFIX_ATTENTION_NAMES, base_attention_implementation
from verl_prefix.schedule.models import mamba, moe, multimodal, recurrent

logger = logging.getLogger(__name__)

# reasons this process has already logged (``log_fallbacks``, once each; tests clear it)
LOGGED_REASONS: set[str] = set()

# non-tensor batch flags verl sets for features reuse does not serve -> reason
_BATCH_FLAGS = {
    "sum_pi_squared": "calculate_sum_pi_squared",
    "distillation": "distillation_use_topk",
}


def model_fallback_reason(module: nn.Module, reuse: PrefixReuseConfig, *, forward_only: bool) -> str | None:
    """A reason the whole mini-batch must run dense because of the model or the knobs, or None."""
    if not reuse.enable:
        return "disabled"
    if forward_only and not reuse.forward_only_reuse:
        return "forward_only_disabled"
    if base_attention_implementation(module) not in PREFIX_ATTENTION_NAMES:
        return "attn_implementation"
    if multimodal.attention_bypassed(module):
        return "multimodal_remove_padding"
    if not forward_only and has_active_dropout(module):
        return "dropout"
    if not forward_only and uses_activation_offload(module):
        return "activation_offload"
    if not forward_only and uses_reentrant_checkpointing(module):
        return "reentrant_checkpointing"
    if not forward_only:
        # a per-forward random router sample or an in-gate aux loss would see the prefix once per group
        return moe.stochastic_routing_reason(module) or moe.in_model_aux_reason(module)
    return None


def recurrent_fallback_reason(module: nn.Module) -> str | None:
    """``recurrent_layers`` when the model's recurrent (linear-attention) layers are not served
    (``schedule.models.recurrent.recurrent_refusal``: the mini-batch runs dense, the detail logged once), else None.
    Models without recurrent layers: always None. Settings that cannot serve served recurrent layers are
    refused at initialisation instead (``recurrent_settings_error``)."""
    detail = recurrent.recurrent_refusal(module)
    if detail is None:
        return None
    if detail not in LOGGED_REASONS:
        LOGGED_REASONS.add(detail)
        logger.warning("prefix reuse: %s; the model runs dense (prefix/fallback_recurrent_layers)", detail)
    return "recurrent_layers"


# attention implementations verl's Ulysses patch wraps with its all-to-alls (``_flash_attention_forward``)
ULYSSES_DENSE_ATTENTION = ("flash_attention_2", "flash_attention_3")


def dense_under_ulysses_error(module: nn.Module, reason: str) -> str | None:
    """Why rows that fall back to the stock engine cannot run under Ulysses, or None.

    verl's dense Ulysses path all-to-alls only inside flash attention; with sdpa or eager each rank would
    attend within its own slice of every sequence and train on the result without a word. Reuse does
    its own all-to-alls for any attention, so only the dense rows are refused."""
    implementation = base_attention_implementation(module)
    if implementation in ULYSSES_DENSE_ATTENTION:
        return None
    return (
        f"rows fall back to the stock engine ({reason}) under Ulysses sequence parallelism, but verl's dense "
        f"Ulysses path only covers flash attention and this model uses attn_implementation={implementation!r}: "
        "each rank would attend within its own slice of every sequence. Use flash_attention_2, make every "
        "row reusable, or set actor_rollout_ref.actor.ulysses_sequence_parallel_size=1."
    )


def length_fallback_reason(model: nn.Module, data: TensorDict, ulysses: bool = False) -> str | None:
    """A reason from the model and this mini-batch's longest sequence (tokens or largest position + 1):
    a window the config declares but no attention module carries, shorter than it (``undeclared_windows``;
    the windows the modules carry are served by reuse, ``schedule.attention.windows``), RoPE whose frequencies
    would differ between phase A, phase B and the dense call (``rope_length_limit``), or a sequence longer than
    a served Mamba-2 mixer's ``chunk_size``, where transformers' torch scan (the stock engine's) is not the
    recurrence reuse computes (``mamba.single_chunk_limit``), or, under Ulysses, a sequence reaching the length from
    which Llama-4's attention temperature tuning scales by positions each rank counts in its own slice
    (``positions.position_scale_limit``: the stock engine's shards and reuse's differ)."""
    positions = data["position_ids"]
    positions = positions.values() if positions.is_nested else positions
    longest = max(int(data["input_ids"].offsets().diff().max()), int(positions.max()) + 1)
    undeclared = undeclared_windows(model)
    if undeclared and min(undeclared) < longest:
        return "sliding_window"
    limit = rope_length_limit(model)
    if limit is not None and longest >= limit:
        return "dynamic_rope"
    chunk = mamba.single_chunk_limit(model)
    if chunk is not None and longest > chunk:
        return "mamba_multichunk"
    scaled = position_scale_limit(model) if ulysses else None
    if scaled is not None and longest >= scaled:
        return "temperature_tuning"
    return None


# what a user can set to make a reason's batches reuse (the full override path), where one knob decides it
REASON_HINTS: dict[str, str] = {
    "sum_pi_squared": (
        "verl's optimal-token-baseline estimators ask the actor for sum(pi^2) over the vocabulary per token, which "
        "reuse does not compute; with an advantage estimator that does not need it, "
        "actor_rollout_ref.actor.calculate_sum_pi_squared=false lets these batches reuse"
    ),
    "activation_offload": (
        "verl's activation offload wraps every decoder layer in a reentrant checkpoint, under which the prefix would "
        "get no gradient (forward-only passes still reuse); actor_rollout_ref.model.enable_activation_offload=false "
        "lets updates reuse (gradient checkpointing alone is served)"
    ),
    "distillation": (
        "top-k distillation reads the student's top-k logits per token, which reuse does not return; "
        "distillation.distillation_loss.loss_settings.use_topk=false lets these batches reuse"
    ),
}


def log_fallbacks(reasons: Iterable[str]) -> None:
    """One warning per reason per process, next to the ``prefix/fallback_<reason>`` metric: a metric
    nobody plots is still silent. Where one knob decides a reason, the warning names it (``REASON_HINTS``)."""
    for reason in reasons:
        if reason in LOGGED_REASONS:
            continue
        LOGGED_REASONS.add(reason)
        hint = REASON_HINTS.get(reason)
        logger.warning(
            "prefix reuse: samples run through the stock dense path, counted as prefix/fallback_%s%s "
            "(logged once per process; see 'What runs dense' in the verl-prefix README)",
            reason,
            f": {hint}" if hint else "",
        )


def batch_fallback_reason(data: TensorDict) -> str | None:
    """A reason from the batch itself: a verl feature the schedule does not serve."""
    for reason, key in _BATCH_FLAGS.items():
        if tu.get_non_tensor_data(data=data, key=key, default=False):
            return reason
    return None


def multimodal_fallback_reason(module: nn.Module, reuse: PrefixReuseConfig, data: TensorDict) -> str | None:
    """A reason a batch with visual inputs (or multimodal position ids) runs dense, or None where phase A serves
    them (``schedule.models.multimodal``): ``multimodal`` for a model whose visual inputs reuse does not feed yet (a
    family outside ``SERVED_VISUAL_MODELS``, or multimodal positions on a text model); chunked prefixes are
    served for every family served (``schedule.models.visual_chunks``). Per-group reasons (rows of a uid with different
    images, visual tokens past the prefix) are ``grouping.plan_batch``'s."""
    # verl's agent loop writes multi_modal_inputs={} for every text sample: only real inputs count
    visual = "multi_modal_inputs" in data.keys() and _has_mm_inputs(data)
    if not visual and data["position_ids"].dim() != 3:
        return None
    if multimodal.visual_model_refusal(module) is not None or not multimodal.uses_multimodal_rope(module):
        return "multimodal"
    return None


def _has_mm_inputs(data: TensorDict) -> bool:
    """verl's agent loop attaches an empty ``multi_modal_inputs`` to every text sample: only real inputs count."""
    return bool(extract_multi_modal_inputs(list(data["multi_modal_inputs"])))
