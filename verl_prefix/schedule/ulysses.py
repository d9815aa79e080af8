"""Ulysses sequence parallelism for the A/B/C schedule, on verl's own collectives.

Every rank of a sequence-parallel group holds the same rows and runs a ``1/sp`` slice of every sequence
(the prefix in phase A, each suffix micro-batch in phase B). Around attention, verl's all-to-alls
(``verl.utils.ulysses``) trade the sequence split for a head split, so each rank attends its head shard
over whole sequences: phase A captures that head shard of the full prefix K/V, phase B attends its head
shard of the suffix queries to it, and the dK/dV of the shard stay on the rank. Phase C's backward runs
back through phase A's all-to-alls. Log-probs (and entropy) are gathered over the group with verl's
``Gather``, whose backward keeps the local slice scaled by ``sp``: each rank's parameter gradients are
then ``sp`` times its shard's share, which FSDP's average over ``dp x sp`` ranks turns into the
data-parallel mean, exactly as in verl's dense Ulysses path. MoE router statistics (sums over tokens)
are all-reduced over the group with a differentiable all-reduce, which scales their gradients the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv
from verl.utils.ulysses import gather_heads_scatter_seq, gather_outputs_and_unpad, gather_seq_scatter_heads

from verl_prefix.schedule.models.moe import RouterStats


@dataclass
class Ulysses:
    """One sequence-parallel group: how this rank slices sequences and trades them for heads.

    ``all_to_all_seconds`` and ``all_to_all_bytes`` add up the attention all-to-alls issued in forward
    (wall time: exact for gloo, which completes each call before returning; on CUDA it is launch time
    unless the caller synchronises)."""

    group: dist.ProcessGroup
    all_to_all_seconds: float = field(default=0.0, compare=False)
    all_to_all_bytes: int = field(default=0, compare=False)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def padded(self, length: int) -> int:
        """``length`` rounded up to a multiple of the group size (what the slices cover)."""
        return -(-length // self.size) * self.size

    def shard(self, x: torch.Tensor, continue_positions: bool = False) -> torch.Tensor:
        """This rank's slice of the last dimension, right-padded to a multiple of the group size.

        Pads are zeros, or with ``continue_positions`` positions counting on from the last real one; they
        sit after every real token, so causal attention keeps them out of every real token's view."""
        length = x.shape[-1]
        pad = self.padded(max(length, 1)) - length
        if pad:
            if continue_positions:
                tail = x[..., -1:] + torch.arange(1, pad + 1, device=x.device, dtype=x.dtype)
            else:
                tail = torch.zeros(*x.shape[:-1], pad, device=x.device, dtype=x.dtype)
            x = torch.cat([x, tail], dim=-1)
        part = x.shape[-1] // self.size
        return x[..., self.rank * part : (self.rank + 1) * part].contiguous()

    def real_tokens(self, length: int, device: torch.device) -> torch.Tensor:
        """Which positions of this rank's slice of a ``length``-token sequence are real (not padding)."""
        part = self.padded(max(length, 1)) // self.size
        return torch.arange(self.rank * part, (self.rank + 1) * part, device=device) < length

    def kept_in_slice(self, length: int, last: int) -> int:
        """How many positions at the end of this rank's slice of a ``length``-token sequence reach into its last
        ``last`` positions (padding after them included): what the rank's LM head must cover of them. At least 1,
        since HF's ``logits_to_keep=0`` keeps every position (one more is cut away by the caller)."""
        part = self.padded(max(length, 1)) // self.size
        first = max(length - last, self.rank * part)
        return min(max((self.rank + 1) * part - first, 1), part)

    def gather(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """Every rank's slices of dim 1 joined and cut to ``length``; backward keeps the local slice times
        the group size (verl's ``Gather`` with ``grad_scaler``)."""
        pad = self.padded(max(length, 1)) - length
        return gather_outputs_and_unpad(x, gather_dim=1, unpad_dim=1, padding_size=pad, group=self.group)

    def heads_in(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, heads, S/sp, D]`` slices to ``[B, heads/sp, S, D]`` shards. K/V heads fewer than the group
        are repeated first (as verl's Ulysses attention does), so every rank gets at least one."""
        repeats = max(self.size // key.shape[1], 1)
        key, value = repeat_kv(key, repeats), repeat_kv(value, repeats)
        return tuple(self._all_to_all(gather_seq_scatter_heads, t, seq_dim=2, head_dim=1) for t in (query, key, value))

    def heads_out(self, out: torch.Tensor) -> torch.Tensor:
        """An attention output ``[B, S, heads/sp, D]`` back to this rank's ``[B, S/sp, heads, D]``."""
        return self._all_to_all(gather_heads_scatter_seq, out, head_dim=2, seq_dim=1)

    def _all_to_all(self, fn: Any, x: torch.Tensor, **dims: int) -> torch.Tensor:
        start = time.perf_counter()
        out = fn(x, group=self.group, **dims)
        self.all_to_all_seconds += time.perf_counter() - start
        self.all_to_all_bytes += x.numel() * x.element_size()
        return out

    def metrics(self) -> dict[str, float]:
        """The sequence-parallel size and the attention all-to-alls this group issued in forward."""
        return {
            "prefix/sp/size": float(self.size),
            "prefix/sp/all_to_all_mib": self.all_to_all_bytes / 2**20,
            "prefix/time_s/all_to_all": self.all_to_all_seconds,
        }

    def sum_stats(self, stats: RouterStats) -> RouterStats:
        """Router statistics of whole sequences: the sum of every rank's slice (differentiable in ``prob_sum``)."""
        counts = stats.counts.clone()
        dist.all_reduce(counts, group=self.group)
        tokens = torch.tensor(stats.tokens, device=counts.device)
        dist.all_reduce(tokens, group=self.group)
        prob_sum = dist_nn.all_reduce(stats.prob_sum, group=self.group)
        z_sum = None if stats.z_sum is None else dist_nn.all_reduce(stats.z_sum, group=self.group)
        return RouterStats(counts=counts, prob_sum=prob_sum, tokens=int(tokens), layers=stats.layers, z_sum=z_sum)


class ShardedAttentionModule:
    """The attention module as HF's attention functions see it after the all-to-all: every attribute is
    the module's, except the GQA factor, which is that of the head shards (it differs once K/V heads were
    repeated)."""

    def __init__(self, module: nn.Module, query_heads: int, kv_heads: int) -> None:
        self.wrapped = module
        self.num_key_value_groups = query_heads // kv_heads

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)
