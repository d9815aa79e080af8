"""Sliding-window and chunked attention under reuse: which keys a query sees when a window (or a chunk) is
shorter than the call.

HF 5.10.4's rule, the same in every implementation: query ``q`` sees key ``k`` iff ``q - W < k <= q`` (``W``
keys, itself included; ``masking_utils.sliding_window_overlay``; flash attention's ``window_size=(W - 1,
W - 1)`` with a causal, bottom-right aligned mask). Under reuse a suffix query at row index ``i`` sits at
absolute position ``L + i`` (``L`` prefix K/V positions, or the earlier chunks of a chunked prefix), so it
sees prefix keys ``[L + i - W + 1, L - 1]`` and its own row's keys ``(i - W, i]``. Only the last ``W - 1``
prefix positions can ever be seen: ``cut_prefix`` serves a view of that slice (dK/dV land in place and are
zero on every earlier position), which bounds phase B's work per query by ``W`` whatever the prefix length.

A window that covers every key a call sees (``active_window`` returns None) changes nothing and is
left out: such calls run the plain causal paths and kernels.
"""

from __future__ import annotations

import torch


def active_window(window: object, span: int) -> int | None:
    """The window that changes this call (``span`` keys seen by its last real query), or None when there is
    none or it covers them all."""
    if window is None or int(window) >= span:
        return None
    return int(window)


def window_keep_mask(query_len: int, key_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean ``[1, 1, query_len, key_len]``: the queries are the last ``query_len`` of the keys (bottom-right
    aligned, as phase B's concat keys and flash attention align them); query ``i`` sees key ``k`` iff
    ``k <= i + key_len - query_len`` and, with a window, ``k > i + key_len - query_len - window``."""
    last = torch.arange(query_len, device=device)[:, None] + (key_len - query_len)
    key = torch.arange(key_len, device=device)[None, :]
    keep = key <= last
    if window is not None:
        keep = keep & (key > last - window)
    return keep[None, None]


def cut_length(prefix_len: int, window: int) -> int:
    """How many trailing prefix positions any suffix query of a ``window`` layer can see: ``W - 1`` at most."""
    return min(prefix_len, window - 1)


def cut_prefix(prefix: torch.Tensor, window: int) -> torch.Tensor:
    """``[..., L, d]`` -> a view of its last ``cut_length(L, window)`` positions (``[..., 0, d]`` for ``W = 1``)."""
    length = prefix.shape[-2]
    return prefix[..., length - cut_length(length, window) :, :]


def banded_prefix_keep(query_len: int, cut_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[query_len, cut_len]``: suffix query ``i`` sees cut-prefix key ``m`` iff
    ``m >= i + cut_len - window + 1`` (the cut's last key is the position right before the row's first).
    Queries ``i >= window - 1`` see no prefix key at all."""
    query = torch.arange(query_len, device=device)[:, None]
    key = torch.arange(cut_len, device=device)[None, :]
    return key >= query + cut_len - window + 1


# -- chunked attention (Llama-4's ``chunked_attention`` layers) ------------------------------------------------
#
# HF 5.10.4's rule (``masking_utils.chunked_overlay``): query ``q`` sees key ``k`` iff ``k <= q`` and both sit in
# the same chunk of ``C`` positions, ``k // C == q // C``, positions counted from the sequence's first token.
# Unlike a window this depends on absolute positions: a suffix query at ``L + i`` sees prefix keys from its
# chunk's start ``C * floor((L + i) / C)`` to ``L - 1``: only the prefix's last ``L % C`` positions (those in
# the chunk holding position ``L``) can ever be seen, and none at all when ``L`` is a multiple of ``C``; queries
# past that chunk see no prefix key (their prefix part is empty: weight 0 in the log-sum-exp merge).


def attention_chunk(module: object) -> int | None:
    """The chunk size of ``module``'s layer when its config declares it a ``chunked_attention`` layer (Llama-4:
    ``layer_types`` and ``attention_chunk_size``), else None. HF passes attention no keyword for it (only a mask,
    which the schedule replaces), so the schedule reads the layer's type from the config."""
    module = getattr(module, "wrapped", module)  # a head-shard view under Ulysses
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    if not types or not isinstance(layer, int) or layer >= len(types) or types[layer] != "chunked_attention":
        return None
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is None or isinstance(chunk, bool) or int(chunk) != chunk or chunk < 1:
        raise ValueError(f"a chunked_attention layer needs a positive attention_chunk_size, got {chunk!r}")
    return int(chunk)


def active_chunk(chunk: int | None, span: int) -> int | None:
    """The chunk size that changes this call (``span``: the absolute position of its last real query, plus one),
    or None when there is none or every position of the call lies in the first chunk."""
    if chunk is None or span <= int(chunk):
        return None
    return int(chunk)


def chunk_cut_length(prefix_len: int, chunk: int) -> int:
    """How many trailing prefix positions any suffix query of a ``chunk`` layer can see: ``L % C``."""
    return prefix_len % chunk


def cut_to_chunk(prefix: torch.Tensor, prefix_len: int, chunk: int) -> torch.Tensor:
    """A view of ``prefix`` (``[..., n, d]``, the last ``n`` of ``prefix_len`` positions, e.g. already cut to a
    window) keeping only positions in the chunk that holds position ``prefix_len``: its last
    ``min(n, L % C)`` positions (possibly none)."""
    length = prefix.shape[-2]
    return prefix[..., length - min(length, chunk_cut_length(prefix_len, chunk)) :, :]


def chunk_keep_mask(query_len: int, key_len: int, first_query: int, chunk: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[1, 1, query_len, key_len]``: the chunk condition alone (``key // C == query // C``) for queries
    at absolute positions ``first_query + i`` over keys that end right before the last query (bottom-right
    aligned, as ``window_keep_mask``): key ``k`` sits at ``first_query - (key_len - query_len) + k``."""
    query = torch.arange(query_len, device=device)[:, None] + first_query
    key = torch.arange(key_len, device=device)[None, :] + (first_query - key_len + query_len)
    return (torch.div(key, chunk, rounding_mode="floor") == torch.div(query, chunk, rounding_mode="floor"))[None, None]


def band_keep_mask(
    query_len: int, key_len: int, first_query: int, window: int | None, chunk: int | None, device: torch.device
) -> torch.Tensor:
    """Every mask the schedule builds for a layer with a window and/or chunks: ``window_keep_mask`` (causal,
    within the window if any) and, for a chunked layer, ``chunk_keep_mask`` at the queries' absolute positions."""
    keep = window_keep_mask(query_len, key_len, window, device)
    if chunk is not None:
        keep = keep & chunk_keep_mask(query_len, key_len, first_query, chunk, device)
    return keep
