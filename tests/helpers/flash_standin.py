"""flash-attention's maths on CPU, registered under HF's ``flash_attention_2`` name for a test's duration.

CPU has no flash-attn, yet the reuse schedule must match what a model computes under
``attn_implementation="flash_attention_2"``, which verl uses by default. ``flash_attention_forward``
here has HF's signature (``transformers.integrations.flash_attention``) and computes in plain torch
what flash-attn computes: scores scaled, capped as ``softcap * tanh(s / softcap)`` (flash-attn's
``softcap``), a bottom-right causal mask (flash-attn >= 2.1 aligns a shorter query block to the end of
the keys), HF's window rule (``window_size = (w - 1, w - 1)`` once the keys outnumber ``w``), a 2-D
padding mask over the keys, attention sinks as one more logit per head, softmax in the input dtype
(fp64 stays fp64). Packed sequences and dropout are outside what the tests need: they raise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig

FLASH = "flash_attention_2"


def flash_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if dropout:
        raise NotImplementedError("the CPU flash stand-in has no dropout")
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and query.shape[0] == 1 and bool((position_ids[0, 1:] == 0).any()):
        raise NotImplementedError("the CPU flash stand-in does not unpack packed sequences")
    if kwargs.get("cu_seq_lens_q") is not None:
        raise NotImplementedError("the CPU flash stand-in does not take varlen kwargs")
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = query @ key.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_len, k_len = query.shape[2], key.shape[2]
    i = torch.arange(q_len)[:, None] + (k_len - q_len)  # bottom-right: the last query sees every key
    j = torch.arange(k_len)[None, :]
    causal = module.is_causal if is_causal is None else is_causal
    keep = j <= i if causal else torch.ones(q_len, k_len, dtype=torch.bool)
    if sliding_window is not None and k_len > sliding_window:
        keep = keep & (j >= i - (sliding_window - 1))
    keep = keep[None, None]
    if attention_mask is not None:  # flash takes the 2-D padding mask [B, keys], 1 = real
        keep = keep & attention_mask.bool()[:, None, None, :]
    scores = scores.masked_fill(~keep, float("-inf"))
    if s_aux is not None:
        sinks = s_aux.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, sinks], -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return (probs @ value).transpose(1, 2).contiguous(), None


@contextmanager
def flash_standin(monkeypatch) -> Iterator[None]:
    """HF's ``flash_attention_2`` name dispatches to ``flash_attention_forward`` (restored afterwards)."""
    monkeypatch.setitem(AttentionInterface._global_mapping, FLASH, flash_attention_forward)
    yield


def use_flash(model: nn.Module) -> nn.Module:
    """Switch a model built with eager attention to the ``flash_attention_2`` name (no flash-attn import:
    the name dispatches to whatever ``AttentionInterface`` holds for it, the stand-in under ``flash_standin``)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            config._attn_implementation = FLASH
    return model
