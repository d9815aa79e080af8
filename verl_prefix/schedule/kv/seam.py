"""The one seam between the schedule and HF's model code: how phase A's K/V capture and phase B's serving reach
HF's attention without a fork of any modeling file.

The call, step by step:

1. ``prefix_attention_mode(model)`` wraps every phase (and every backward that may recompute a checkpointed
   layer, so a recompute never meets the plain kernel). It sets ``config._attn_implementation`` of each config
   the decoder's attention modules read (``_configs_of``: not a vision tower's, not a composite vision-language
   config) to the prefix attention registered for the model's own implementation (``PREFIX_ATTENTION_NAMES``:
   ``sdpa`` -> ``verl_prefix_sdpa``, ``eager`` -> ``verl_prefix_eager``, ``flash_attention_2``/``_3`` ->
   ``verl_prefix_flash``; any other raises here, and ``backend.fallbacks`` asks the same table through
   ``base_attention_implementation`` first: such a mini-batch runs dense, ``prefix/fallback_attn_implementation``).
   It also puts back HF's own forwards where verl patched them (``models.hf_forwards``,
   ``models.multimodal.hf_attention``), lets served recurrent layers take their state from the prefix context
   (``models.recurrent.recurrent_state_mode``) and has modules that count their own positions start at the call's
   first absolute position (``attention.positions``). The original implementation names come back when the block
   ends, whatever happens inside.
2. The executor calls the model as HF's causal LM with one more keyword, ``prefix_ctx``: a
   ``kv.contexts.CaptureContext`` (phase A: record), ``ChunkCaptureContext`` (phase A of a later chunk) or
   ``ServeContext`` (phase B: serve). HF hands unknown forward keywords down through the decoder layers to each
   attention module's ``attention_interface(...)`` call, so the context reaches attention as a kwarg. It is not
   ``past_key_values``: HF's gradient checkpointing drops caches inside checkpointed layers but keeps kwargs, so the
   same code is exact under non-reentrant checkpointing (DESIGN.md trap 8).
3. HF looks ``config._attn_implementation`` up in ``AttentionInterface`` and calls the prefix attention this
   module registered at import (``_make_prefix_attention``). It pops ``prefix_ctx`` (no context: the mode was left
   on outside the schedule, a loud error), picks the maths underneath (the family's eager attention for
   ``eager``; torch's sdpa for ``sdpa`` and flash models, whose softcap and sinks run in plain torch ops as flash
   applies them), checks every keyword HF passed (``attention.keywords``: honoured or refused, never dropped), and
   under Ulysses exchanges heads for sequence (``ulysses``). Then it hands the call to ``ctx.attend``: the context
   decides what the layer's keys are, and nothing is stored across calls the way ``DynamicCache.update`` does
   (trap 1): a serve context attends to ``cat(prefix.expand(B), new)`` or the merged two-part attention.
4. Phase A ends early by an exception: once every layer's K/V is captured (and the MoE routers have what they
   need) the capture context raises ``kv.container.PrefixCaptured`` out of attention; the executor catches it
   around the model call, so the last layer's MLP, the final norm and the LM head never run over the prefix.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama import modeling_llama

from verl_prefix.schedule.attention.keywords import (
    AttentionKeywordRefused,
    check_attention_keywords,
    dense_keywords,
    scored_keywords,
)
from verl_prefix.schedule.attention.positions import absolute_positions
from verl_prefix.schedule.models.hf_forwards import hf_causal_forward, hf_recurrent
from verl_prefix.schedule.models.multimodal import hf_attention, vision_encoder
from verl_prefix.schedule.models.recurrent import recurrent_state_mode
from verl_prefix.schedule.ulysses import ShardedAttentionModule

logger = logging.getLogger(__name__)
# what this module warned about once per process
_LOGGED: set[str] = set()

# Attention implementations the prefix attention can wrap, and the name it is registered under.
# flash-attention models get their own name, since flash attention applies keywords sdpa ignores (softcap,
# sinks: ``attention.keywords``); their maths otherwise run through torch's sdpa: phase B's keys are
# ``cat(prefix, suffix)`` per row, which sdpa takes with a bottom-right causal bias (its own flash kernel
# on CUDA, exact elsewhere).
PREFIX_ATTENTION_NAMES = {
    "sdpa": "verl_prefix_sdpa",
    "eager": "verl_prefix_eager",
    "flash_attention_2": "verl_prefix_flash",
    "flash_attention_3": "verl_prefix_flash",
}


def _eager_for(module: nn.Module) -> Callable:
    """The model family's own eager attention (identical maths across Llama/Qwen2/Qwen3)."""
    family = sys.modules.get(type(module).__module__)
    return getattr(family, "eager_attention_forward", modeling_llama.eager_attention_forward)


def _make_prefix_attention(base_kind: str) -> Callable:
    def prefix_attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: object,
    ) -> tuple:
        ctx = kwargs.pop("prefix_ctx", None)
        if ctx is None:
            raise RuntimeError(
                "verl_prefix attention was called without a prefix context: the model's attention "
                "implementation was left switched to prefix mode outside the reuse schedule"
            )
        # every keyword is honoured or refused (``attention.keywords``); flash models' maths run through
        # sdpa, or through ``scored_attention`` where flash applies what sdpa cannot (softcap, sinks)
        base = _eager_for(module) if base_kind == "eager" else sdpa_attention_forward
        kwargs = dense_keywords(base_kind, kwargs)
        if base_kind != "eager" and scored_keywords(kwargs) and "scored" not in _LOGGED:
            _LOGGED.add("scored")
            logger.warning(
                "prefix attention applies softcap/sinks as %s attention does, in plain torch ops: exact, but the "
                "scores are materialised (batch x heads x queries x keys in fp32 per layer)",
                base_kind,
            )
        ulysses = ctx.ulysses
        if ulysses is None:
            check_attention_keywords(module, kwargs)
            return ctx.attend(module, base, query, key, value, **kwargs)
        if kwargs.get("s_aux") is not None:
            reason = "attention sinks under Ulysses (one sink per head, not split into head shards)"
            raise AttentionKeywordRefused("s_aux", kwargs["s_aux"], reason)
        query, key, value = ulysses.heads_in(query, key, value)
        shard = ShardedAttentionModule(module, query.shape[1], key.shape[1])
        check_attention_keywords(shard, kwargs)
        out, weights = ctx.attend(shard, base, query, key, value, **kwargs)
        return ulysses.heads_out(out), weights

    prefix_attention.__name__ = f"verl_prefix_{base_kind}_attention"
    return prefix_attention


AttentionInterface.register("verl_prefix_sdpa", _make_prefix_attention("sdpa"))
AttentionInterface.register("verl_prefix_eager", _make_prefix_attention("eager"))
AttentionInterface.register("verl_prefix_flash", _make_prefix_attention("flash"))


def _configs_of(model: nn.Module) -> list:
    """Every distinct config object whose ``_attn_implementation`` the decoder's attention modules read. A vision
    encoder's config is not one (its attention is bidirectional and runs dense, in phase A), nor a composite
    vision-language config: setting its attention implementation switches every sub-config's."""
    tower = vision_encoder(model)
    inside = {id(m) for m in tower.modules()} if tower is not None else set()
    seen: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if id(module) in inside or getattr(config, "vision_config", None) is not None:
            continue
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def base_attention_implementation(model: nn.Module) -> str:
    """The attention implementation the decoder's configs name (``eager`` where unset): a key of
    ``PREFIX_ATTENTION_NAMES`` where reuse can wrap it."""
    configs = _configs_of(model)
    if not configs:
        raise ValueError(f"{type(model).__name__} has no HF config with an attention implementation")
    return configs[0]._attn_implementation or "eager"


@contextmanager
def prefix_attention_mode(model: nn.Module) -> Iterator[None]:
    """Switch attention to the prefix-aware wrapper for the duration of the reuse schedule.

    Every backward that may recompute a checkpointed layer runs inside this context, so a recompute
    never sees the plain kernel with a prefix-length mismatch. Served recurrent layers take their state
    from the prefix context meanwhile (``recurrent.recurrent_state_mode``).
    """
    configs = _configs_of(model)
    originals = [c._attn_implementation for c in configs]
    try:
        for config, original in zip(configs, originals):
            name = PREFIX_ATTENTION_NAMES.get(original or "eager")
            if name is None:
                raise ValueError(f"prefix reuse does not support attn_implementation={original!r}")
            config._attn_implementation = name
        # HF's delta-net/decoder-layer and attention forwards where verl patched them
        with (
            hf_recurrent(model),
            hf_causal_forward(model),
            recurrent_state_mode(model),
            hf_attention(model),
            absolute_positions(model),
        ):
            yield
    finally:
        for config, original in zip(configs, originals):
            config._attn_implementation = original
