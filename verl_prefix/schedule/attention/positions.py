"""Attention modules that count their queries' absolute positions themselves, from the cache's length.

Llama-4's NoPE layers (``attn_temperature_tuning`` on a layer without RoPE) scale their queries by
``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` at position ``p = arange(call length) + the cache's
length``: they take no ``position_ids``. Reuse runs phase B's suffixes (and a chunked prefix's later chunks, a
trie's deeper nodes) without a cache, so such a module would count from 0 where the dense call counts from the
prefix's length: every query past ``floor_scale - 1`` would be scaled wrongly, without an error (8192 positions
in the released configs: every long prompt). ``absolute_positions`` hands each such module, for the schedule's
calls, a stand-in cache (``PositionOffset``) whose length is the call's first absolute position and whose
``update`` returns the K/V unchanged, so the module computes the dense scales itself, bit for bit.

Under Ulysses each rank's module sees a slice of the sequence and counts from 0 in the stock engine too; the
engine runs such a mini-batch dense when a position reaches ``floor_scale`` (``position_scale_limit``,
``prefix/fallback_temperature_tuning``) and the hook refuses to run past it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class PositionOffset:
    """A read-only cache stand-in: ``get_seq_length`` is the call's first absolute position; ``update`` stores
    nothing and returns the call's own K/V (the prefix K/V reach attention through the prefix context)."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.offset

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return key, value


def counts_positions(module: nn.Module) -> bool:
    """Whether ``module`` scales its queries by positions it counts itself (Llama-4's temperature tuning)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not bool(getattr(module, "use_rope", True))


def position_scale_limit(model: nn.Module) -> int | None:
    """The sequence length from which some module's self-counted query scale differs from 1 (its smallest
    ``floor_scale``): below it every position scales by 1 however it is counted. None without such modules."""
    limits = [int(getattr(m, "floor_scale", 0) or 0) for m in model.modules() if counts_positions(m)]
    return min(limits) if limits else None


def position_offset_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    ctx = kwargs.get("prefix_ctx")
    if ctx is None or kwargs.get("past_key_values") is not None:
        return None
    offset = ctx.query_offset
    if offset == 0:
        return None
    if ctx.ulysses is not None:  # each rank holds a slice of the sequence, as the stock engine's module does
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        span = offset + (hidden.shape[1] * ctx.ulysses.size if hidden is not None else 0)
        if span >= int(module.floor_scale):
            raise ValueError(
                f"attention temperature tuning (floor_scale={module.floor_scale}) under Ulysses on a sequence of "
                f"up to {span} positions: each rank counts its own slice's positions; the engine runs such "
                "mini-batches dense (prefix/fallback_temperature_tuning)"
            )
        return None
    return args, {**kwargs, "past_key_values": PositionOffset(offset)}


@contextmanager
def absolute_positions(model: nn.Module) -> Iterator[None]:
    """For the schedule's calls, every module that counts its own positions starts at the call's first
    absolute position (``ctx.query_offset`` of the prefix context it is called with)."""
    handles = [
        module.register_forward_pre_hook(position_offset_hook, with_kwargs=True)
        for module in model.modules()
        if counts_positions(module)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
