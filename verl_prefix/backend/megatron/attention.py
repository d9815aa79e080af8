"""Phases A and B at megatron-core's attention seam: every layer's ``self_attention.core_attention``.

megatron-core's ``SelfAttention`` projects, applies RoPE, then calls ``core_attention(query, key, value,
attention_mask, attn_mask_type=..., attention_bias=..., packed_seq_params=...)`` with post-RoPE
``[s, b, heads, head_dim]`` tensors (under TP this rank's head shards) and takes back ``[s, b, heads * head_dim]``
for its row-parallel output projection. The local ``DotProductAttention`` and TransformerEngine's
``TEDotProductAttention`` take the same arguments, so one hook serves both. While ``scheduling`` is active the hook
hands q/k/v to the schedule's context (``kv.contexts``: phase A's capture, phase B's serve, a chunk over earlier
chunks' leaves, early exit included) in HF's ``[b, heads, s, head_dim]`` layout with an ``AttentionShim``
(``kv.shim``); outside it the layer's own attention runs unchanged (verl's dense forward, THD packing included).
Phase C starts inside ``self_attention`` (the shim's ``wrapped``); dK/dV stay on the rank that owns the heads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from verl_prefix.schedule.kv.shim import AttentionShim


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """megatron-core's transformer layers of a ``GPTModel`` (``decoder.layers``), in order."""
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError("prefix_megatron: the model has no decoder.layers; only megatron-core GPT models are served")
    return list(layers)


class CoreAttentionHooks:
    """Wraps every layer's ``core_attention``: pass-through, or the schedule's context (``scheduling``). ``models``:
    this rank's model chunks in order (several under virtual pipeline stages), their layers numbered in turn."""

    def __init__(self, models: list[nn.Module]) -> None:
        self.layers = [layer for model in models for layer in decoder_layers(model)]
        self.ctx: Any = None
        self.real_length: int | None = None  # a call padded past it (sequence parallelism, ``causal_lm``)
        for index, layer in enumerate(self.layers):
            core = layer.self_attention.core_attention
            if getattr(core, "_verl_prefix_hook", None) is not None:
                raise RuntimeError("prefix_megatron: core attention is hooked twice")
            if getattr(getattr(core, "attention_dropout", None), "p", 0.0):
                raise ValueError("prefix_megatron: attention dropout > 0 samples per forward; reuse needs it off")
            core.forward = functools.partial(self._forward, index, core.forward)
            core._verl_prefix_hook = self

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @contextmanager
    def scheduling(self, ctx: Any, real_length: int | None = None) -> Iterator[None]:
        """A forward of the one schedule: every layer attends through ``ctx.attend``. ``real_length``: the call
        was padded at the end past it; ``ctx`` sees the real positions only (causal: no real token reads the
        padding) and the padding's attention output is zero."""
        if self.ctx is not None:
            raise RuntimeError("prefix_megatron: a schedule call inside another")
        self.ctx, self.real_length = ctx, real_length
        try:
            yield
        finally:
            self.ctx, self.real_length = None, None

    def _forward(
        self,
        index: int,
        original: Callable,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if self.ctx is None:
            return original(query, key, value, attention_mask, *args, **kwargs)
        if kwargs.get("packed_seq_params") is not None or kwargs.get("attention_bias") is not None:
            raise RuntimeError("prefix_megatron: the schedule's calls are [b, s] batches without attention bias")
        core = self.layers[index].self_attention.core_attention
        real = self.real_length
        q, k, v = (t[:real].permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        shim = AttentionShim(index, q.shape[1] // k.shape[1], self.layers[index].self_attention)
        out, _ = self.ctx.attend(shim, sdpa_attention_forward, q, k, v, scaling=core.softmax_scale)
        out = out.transpose(0, 1).reshape(out.shape[1], out.shape[0], -1)  # [b, s, h, d] -> [s, b, h * d]
        extra = query.shape[0] - out.shape[0]
        return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, extra)) if extra else out
