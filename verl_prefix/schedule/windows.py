"""Sliding-window attention under reuse: which keys a query sees when a window is shorter than the call.

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
