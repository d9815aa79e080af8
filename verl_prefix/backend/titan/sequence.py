"""Sequence lengths torchtitan's MoE can split: tensor parallelism with expert parallelism (TP x EP).

Under TP x EP torchtitan's MoE shards its tokens on the sequence over the TP ranks (the router's input is
``Shard(1)``), and its token dispatch needs a sequence length that TP divides: verl's own TorchTitan engine
fails inside DTensor's shape propagation otherwise. Phase A's prefix (``P - 1`` tokens) and phase B's suffix
widths are whatever the data make them, so the schedule pads them at the end to a multiple of TP. The
padding is exact: it comes after every real token (causal attention never reads it), the MoE routes each
token on its own (torchtitan's experts drop no tokens), it is trimmed from the captured K/V and the logits,
and its expert counts weigh zero (``titan.moe``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sequence_multiple(tensor_parallel: int, expert_parallel: int, has_moe: bool) -> int:
    """What every sequence length fed to the model must be a multiple of (1: anything goes)."""
    return tensor_parallel if has_moe and expert_parallel > 1 and tensor_parallel > 1 else 1


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def pad_tokens(
    ids: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | float, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | float]:
    """``[B, L]`` ids, positions and expert-count weights padded on the right to a length ``multiple``
    divides: id 0, positions continuing the row's last one, weight 0."""
    extra = padded_length(ids.shape[-1], multiple) - ids.shape[-1]
    if extra == 0:
        return ids, positions, weights
    steps = torch.arange(1, extra + 1, device=positions.device, dtype=positions.dtype)
    positions = torch.cat([positions, positions[..., -1:] + steps], dim=-1)
    if isinstance(weights, torch.Tensor):
        weights = F.pad(weights.expand(ids.shape).to(torch.float32), (0, extra))
    elif weights != 0.0:  # a scalar weight for the real tokens, none for the padding
        weights = F.pad(torch.full(ids.shape, float(weights), device=ids.device), (0, extra))
    return F.pad(ids, (0, extra)), positions, weights
