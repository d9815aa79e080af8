"""What ``prefix_fsdp2`` refuses at initialisation, from the model and the configs, before any step: settings
under which reuse would train a model other than the stock engine's (never found mid-step, never a per-step
dense run). Each message names the override that fixes it."""

from __future__ import annotations

from torch import nn

from verl_prefix.backend.config import REUSE_OFF, PrefixReuseConfig
from verl_prefix.backend.model_checks import attention_windows, declared_windows
from verl_prefix.schedule.attention import windows
from verl_prefix.schedule.models import hf_forwards, mamba, recurrent
from verl_prefix.schedule.models.structure import attention_modules


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
    found = attention_windows(model) + declared_windows(model)
    if not found:
        return None
    return (
        "actor_rollout_ref.actor."
        f"prefix_reuse.phase_b_attention=merged_varlen does not serve sliding-window attention (this model has "
        f"windows of {sorted(set(found))} keys): use auto or merged (the window banded over the prefix's last "
        "W - 1 positions) or concat"
    )


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
