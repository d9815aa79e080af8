"""Can this mini-batch reuse, and if not, why: the reasons a batch runs through the stock dense path.

Every reason is a metric (``prefix/fallback_<reason>``) and one warning per reason per process
(``log_fallbacks``); none is silent. Data-parallel ranks agree on one path, since FSDP2 collectives must
match (``backend.distributed.mini_batch``).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterable, Iterator

import torch
import torch.utils.checkpoint
from tensordict import TensorDict
from torch import nn
from verl.utils import tensordict_utils as tu
from verl.utils.activation_offload import ActivationHandler
from verl.utils.model import extract_multi_modal_inputs

from verl_prefix.backend.config import REUSE_OFF, PrefixReuseConfig
from verl_prefix.schedule import hf_forwards, mamba, moe, multimodal, recurrent, windows
from verl_prefix.schedule.positions import position_scale_limit
from verl_prefix.schedule.prefix_kv import PREFIX_ATTENTION_NAMES, base_attention_implementation
from verl_prefix.schedule.structure import attention_modules

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
    (``schedule.recurrent.recurrent_refusal``: the mini-batch runs dense, the detail logged once), else None.
    Models without recurrent layers: always None. Settings that cannot serve served recurrent layers are
    refused at initialisation instead (``recurrent_settings_error``)."""
    detail = recurrent.recurrent_refusal(module)
    if detail is None:
        return None
    if detail not in LOGGED_REASONS:
        LOGGED_REASONS.add(detail)
        logger.warning("prefix reuse: %s; the model runs dense (prefix/fallback_recurrent_layers)", detail)
    return "recurrent_layers"


def recurrent_settings_error(module: nn.Module, reuse: PrefixReuseConfig, ulysses: bool) -> str | None:
    """Why these settings cannot reuse this model's served recurrent layers, decided once at engine
    initialisation (never a per-step dense run), or None. Ulysses: every rank would run each recurrent layer
    over its own slice of the sequence from a zero state (verl's own Ulysses path passes the conv tails and
    the delta-rule state between slices only for Qwen3.5 on a GPU, through fla's context-parallel kernels over
    packed rows); ``merged_varlen``: the packed suffix row would carry one row's state into the next."""
    if not reuse.enable or not recurrent.recurrent_layers(module) or recurrent.recurrent_refusal(module):
        return None
    detail = recurrent.recurrent_refusal(module, ulysses=ulysses, phase_b_attention=reuse.phase_b_attention)
    if detail is None:
        return None
    return (
        f"prefix reuse: {detail}: set actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 and "
        "actor_rollout_ref.actor.prefix_reuse.phase_b_attention to auto, merged or concat, or "
        f"{REUSE_OFF} to train this model with the stock engine"
    )


def recurrent_packed_error(module: nn.Module, reuse: PrefixReuseConfig, use_remove_padding: bool) -> str | None:
    """Why verl's remove-padding (packed) layout cannot train this model beside reuse, decided at engine
    initialisation, or None. Packed, a micro-batch's sequences are one row, and transformers' forwards of
    recurrent layers take no sequence boundaries: each sequence starts from the previous one's recurrent and
    conv state (the stock engine computes that; measured on tiny ``qwen3_5_text`` / ``nemotron_h``: log-probs
    0.86 / 1.5 from the padded layout's). Reuse's groups run padded, one sequence a row, so its dense rows and
    its groups would train two different models. Layers running verl's own Qwen3.5 patch, which splits the
    packed row per sequence, are no reason."""
    if not (use_remove_padding and reuse.enable):
        return None
    layers = recurrent.recurrent_layers(module).values()
    packed = sorted(
        {
            type(m).__name__
            for m in layers
            if not mamba.is_stateless_block(m) and not hf_forwards.patched_by_verl(type(m))
        }
    )
    if not packed:
        return None
    return (
        f"use_remove_padding=true with recurrent layers {packed}: verl's packed layout runs a micro-batch's "
        "sequences as one row, and these layers' forwards take no sequence boundaries, so each sequence would "
        "start from the previous one's state (the stock engine computes that; reuse runs one sequence a row). "
        "Set actor_rollout_ref.model.use_remove_padding=false (the padded layout, which both engines compute "
        f"alike), or {REUSE_OFF}"
    )


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


def has_active_dropout(model: nn.Module) -> bool:
    """Reuse shares one prefix dropout sample across the group: a different distribution (trap 7)."""
    if not model.training:
        return False
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name, value in (vars(text) if text is not None else {}).items():
        # a rate the model applies through ``F.dropout`` (Seed-OSS's ``residual_dropout``): no module to find;
        # heads that causal LMs do not run (classifier, sequence summary) do not count
        if ("dropout" in name or "pdrop" in name) and not any(w in name for w in ("classifier", "summary")):
            if isinstance(value, float | int) and not isinstance(value, bool) and value > 0:
                return True
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            return True
        p = getattr(module, "attention_dropout", 0.0)
        if isinstance(p, float) and p > 0:
            return True
    return False


def uses_reentrant_checkpointing(model: nn.Module) -> bool:
    """Reentrant checkpointing runs a layer's forward under no_grad, so phase A's K/V carry no graph and
    the prefix would get no gradient (trap 8); verl itself enables the non-reentrant kind. Found through
    HF's flags, torch's ``CheckpointWrapper`` and forwards patched onto a module that close over
    ``checkpoint(use_reentrant=True)``; any other wrapper is caught by phase C (``prefix_backward``)."""
    if not model.training:
        return False
    for module in model.modules():
        checkpoint_fn = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and checkpoint_fn is not None:
            if (getattr(checkpoint_fn, "keywords", None) or {}).get("use_reentrant", True):
                return True
        if _is_reentrant_checkpoint(getattr(module, "checkpoint_fn", None)):  # torch's CheckpointWrapper
            return True
        patched = vars(module).get("forward")
        if patched is not None and any(_is_reentrant_checkpoint(obj) for obj in _reachable(patched)):
            return True
    return False


def _has_mm_inputs(data: TensorDict) -> bool:
    """verl's agent loop attaches an empty ``multi_modal_inputs`` to every text sample: only real inputs count."""
    return bool(extract_multi_modal_inputs(list(data["multi_modal_inputs"])))


def uses_activation_offload(model: nn.Module) -> bool:
    """verl's ``enable_activation_offload`` wraps each decoder layer's forward in an ``ActivationHandler``:
    a reentrant checkpoint when checkpointing is on (phase A's K/V lose their graph), and in any case an
    offload state machine that counts one forward per layer then one backward per layer, which phases
    A/B/C do not follow. It is idle in eval mode, so forward-only passes still reuse."""
    if not model.training:
        return False
    for module in model.modules():
        patched = vars(module).get("forward")
        if patched is not None and any(isinstance(obj, ActivationHandler) for obj in _reachable(patched)):
            return True
    return False


def _is_reentrant_checkpoint(obj: object) -> bool:
    if isinstance(obj, functools.partial) and obj.func is torch.utils.checkpoint.checkpoint:
        return bool(obj.keywords.get("use_reentrant", True))
    return obj is torch.utils.checkpoint.CheckpointFunction


def _reachable(fn: object, depth: int = 4) -> Iterator[object]:
    """What a patched forward closes over: bound methods' functions, ``functools.partial`` parts,
    ``__wrapped__`` and closure cells, ``depth`` steps deep."""
    seen: set[int] = set()
    stack = [(fn, 0)]
    while stack:
        obj, level = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        if level >= depth:
            continue
        children: list[object] = []
        if isinstance(obj, functools.partial):
            children += [obj.func, *obj.args, *obj.keywords.values()]
        for attr in ("__func__", "__wrapped__"):
            child = getattr(obj, attr, None) if callable(obj) else None
            if child is not None:
                children.append(child)
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                children.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        stack += [(child, level + 1) for child in children]


def attention_windows(model: nn.Module) -> list[int]:
    """The sliding window of each windowed attention layer, as HF 5.10.4 hands it to the kernel.

    Families with ``layer_types`` (Qwen2/Qwen3 via ``use_sliding_window``/``max_window_layers``, Gemma...)
    store ``sliding_window`` on each attention module, None on full-attention layers; the others (Mistral,
    Mixtral, Phi-3, Starcoder2) pass ``config.sliding_window`` from every layer.
    """
    windows = []
    attention = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    for module in attention:
        if "sliding_window" in vars(module):
            window = module.sliding_window
        else:
            window = getattr(getattr(module, "config", None), "sliding_window", None)
        if window is not None and hands_window_to_attention(type(module)):
            windows.append(int(window))
    if not attention:  # no module to read: trust the config
        window = getattr(model.config.get_text_config(), "sliding_window", None)
        windows += [int(window)] if window is not None else []
    return windows


@functools.cache
def hands_window_to_attention(cls: type) -> bool:
    """Whether ``cls.forward`` hands a ``sliding_window=`` keyword to the attention function (the window reuse
    serves, ``schedule.windows``). Qwen2-MoE's attention stores its window but passes none: its dense masks are
    windowed, the keyword the schedule reads is absent, so its window counts as undeclared (dense with the reason
    where it is shorter than the sequences). True where the source cannot be read."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True
    return "sliding_window=" in source.replace(" ", "")


def _declared_window(model: nn.Module) -> list[int]:
    """A window the config declares (``use_sliding_window``, ``sliding_attention`` layers) even where the
    modules ended up without it: verl's ``override_config`` sets attributes after the config derived its
    ``layer_types``. Reuse serves the windows the modules hand attention (``schedule.windows``); where the
    config and the modules disagree, dense is the safe side."""
    config = model.config.get_text_config()
    declared = getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or []
    )
    window = getattr(config, "sliding_window", None)
    return [int(window)] if declared and window is not None else []


def rope_length_limit(model: nn.Module) -> int | None:
    """For RoPE that recomputes its frequencies from each call's largest position (HF's
    ``dynamic_rope_update``: ``rope_type`` containing "dynamic", or "longrope"), the sequence length
    from which phase A (prefix only) and phase B (prefix + suffix) could rotate with other frequencies
    than the dense call; None for RoPE with fixed frequencies.

    Below it every call rotates with the original frequencies: longrope switches above
    ``original_max_position_embeddings``; dynamic grows above its cached length and resets only below
    ``max_position_embeddings``, so a call at exactly that length keeps an earlier call's frequencies.
    """
    config = model.config.get_text_config()
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    entries = [v for v in params.values() if isinstance(v, dict)] or [params]  # one dict per layer type
    types = [str(e.get("rope_type", e.get("type", "default"))) for e in entries]
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if isinstance(rope_type, dict):
            types += [str(t) for t in rope_type.values()]
        elif isinstance(rope_type, str):
            types.append(rope_type)
    if not any("dynamic" in t or t == "longrope" for t in types):
        return None
    limits = [getattr(config, name, None) for name in ("max_position_embeddings", "original_max_position_embeddings")]
    limits += [e.get("original_max_position_embeddings") for e in entries]
    limits += [getattr(m, "original_max_seq_len", None) for m in model.modules()]
    known = [int(v) for v in limits if isinstance(v, int | float)]
    return min(known) if known else 0  # no length known: every batch runs dense


def undeclared_windows(model: nn.Module) -> list[int]:
    """Windows the config declares that no attention module carries (``_declared_window``): the modules and
    the config disagree, and reuse cannot tell which one the dense model's masks follow."""
    carried = set(attention_windows(model))
    return [window for window in _declared_window(model) if window not in carried]


def length_fallback_reason(model: nn.Module, data: TensorDict, ulysses: bool = False) -> str | None:
    """A reason from the model and this mini-batch's longest sequence (tokens or largest position + 1):
    a window the config declares but no attention module carries, shorter than it (``undeclared_windows``;
    the windows the modules carry are served by reuse, ``schedule.windows``), RoPE whose frequencies
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


def windowed_varlen_error(model: nn.Module, reuse: PrefixReuseConfig) -> str | None:
    """Why ``phase_b_attention=merged_varlen`` cannot serve this model, decided once at engine initialisation
    (never mid-step): its packed kernels take no sliding window or attention chunk, and any windowed or chunked
    layer may meet a call its window or chunk does not cover. None where it can."""
    if reuse.phase_b_attention != "merged_varlen" or not reuse.enable:
        return None
    chunks = sorted({c for c in map(windows.attention_chunk, attention_modules(model).values()) if c is not None})
    if chunks:
        return (
            "actor_rollout_ref.actor."
            f"prefix_reuse.phase_b_attention=merged_varlen does not serve chunked attention (this model has "
            f"chunked_attention layers of {chunks[0]}-token chunks): use auto or merged (each query masked to its "
            "own chunk over the prefix's last L % C positions) or concat"
        )
    found = attention_windows(model) + _declared_window(model)
    if not found:
        return None
    return (
        "actor_rollout_ref.actor."
        f"prefix_reuse.phase_b_attention=merged_varlen does not serve sliding-window attention (this model has "
        f"windows of {sorted(set(found))} keys): use auto or merged (the window banded over the prefix's last "
        "W - 1 positions) or concat"
    )


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
    them (``schedule.multimodal``): ``multimodal`` for a model whose visual inputs reuse does not feed yet (a
    family outside ``SERVED_VISUAL_MODELS``, or multimodal positions on a text model); chunked prefixes are
    served for every family served (``schedule.visual_chunks``). Per-group reasons (rows of a uid with different
    images, visual tokens past the prefix) are ``grouping.plan_batch``'s."""
    # verl's agent loop writes multi_modal_inputs={} for every text sample: only real inputs count
    visual = "multi_modal_inputs" in data.keys() and _has_mm_inputs(data)
    if not visual and data["position_ids"].dim() != 3:
        return None
    if multimodal.visual_model_refusal(module) is not None or not multimodal.uses_multimodal_rope(module):
        return "multimodal"
    return None


def multimodal_ulysses_error(hf_config: object, reuse: PrefixReuseConfig, ulysses_size: int) -> str | None:
    """Why this vision-language model cannot reuse under Ulysses, decided from the configs before the model is
    built (``hf_config``: the checkpoint's; ``ulysses_size``: the engine's), or None. verl's own Ulysses path for
    these families scatters the image embeddings into the whole row first and slices the embeddings (and the
    ``[4, L]`` positions, and Qwen3-VL's deepstack features by visual token) inside the text model's forward
    (``patch_vlm_for_ulysses_input_slicing``); the schedule's Ulysses phase A slices token ids before the model
    call, where no image has been encoded yet. Not served yet."""
    if not (ulysses_size > 1 and reuse.enable and getattr(hf_config, "vision_config", None) is not None):
        return None
    return (
        f"prefix reuse does not serve vision-language models ({getattr(hf_config, 'model_type', None)!r}) under "
        f"Ulysses sequence parallelism yet (ulysses_sequence_parallel_size={ulysses_size}): set "
        f"actor_rollout_ref.actor.ulysses_sequence_parallel_size=1, or {REUSE_OFF} to train this model with the "
        "stock engine"
    )
