"""What a context's ``attend`` reads off an HF attention module, for an engine whose layers are not HF's.

torchtitan's ``inner_attention`` and megatron-core's ``core_attention`` hand the schedule their post-RoPE q/k/v;
the engine's hook calls ``ctx.attend(shim, sdpa_attention_forward, q, k, v, scaling=...)`` with an
``AttentionShim`` in place of the HF module: the layer's index, the query heads per K/V head (under tensor
parallelism this rank's shards: the same ratio), causality, and ``wrapped``, the layer's real attention module
(phase C starts inside it: ``executor.unshard_cut_short`` unshards the FSDP units around it). No ``config``: no
sliding window or attention chunks (``schedule.attention.windows``); an engine whose layers have them refuses
them before a group runs.
"""

from __future__ import annotations

from torch import nn


class AttentionShim:
    """An HF attention module's face for one layer of another engine (see the module docstring)."""

    is_causal = True
    training = False

    def __init__(self, layer_idx: int, groups: int, wrapped: nn.Module) -> None:
        self.layer_idx = layer_idx
        self.num_key_value_groups = groups
        self.wrapped = wrapped
