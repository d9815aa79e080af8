"""torchtitan's model as the HF causal LM the one schedule calls (``schedule.executor`` / ``schedule.tree.schedule``).

The executor calls ``model(input_ids=..., position_ids=..., use_cache=False, prefix_ctx=ctx, logits_to_keep=...)``
and reads ``.logits``; it reads the model's ``config`` (``_attn_implementation``, which ``prefix_attention_mode``
switches and switches back, ``get_text_config().num_hidden_layers``, no ``vision_config``) and walks its modules
(FSDP units for phase C's unshard, no vision tower, no HF attention module). ``TitanCausalLM`` is that: the
torchtitan model as its one child, a copy of the checkpoint's HF config, and a forward that runs torchtitan's
model with every layer's inner attention handed to ``prefix_ctx`` (``InnerAttentionHooks.scheduling``).

Under TP the logits come back as a DTensor sharded over the vocabulary: gathered here (``full_tensor``, whose
backward hands each rank its shard), as verl's TorchTitan engine gathers them. The K/V the schedule captures and
serves are this rank's head shards.

MoE flavors: torchtitan's expert-load counts take the schedule's routing weights (``ScheduleOptions.count_routing``
-> ``titan.moe.ExpertCounts``); a training call with none is refused rather than counted physically. Under TP x EP
every sequence is padded at the end to a multiple of TP (``titan.sequence``): the schedule's attention sees the
real positions only, the padding's counts weigh zero, its logits are cut off.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from verl_prefix.backend.titan.attention import InnerAttentionHooks, causal_mask
from verl_prefix.backend.titan.moe import ExpertCounts
from verl_prefix.backend.titan.sequence import pad_tokens


@dataclass
class CausalLMOutput:
    logits: torch.Tensor


class TitanCausalLM(nn.Module):
    """torchtitan's (whole, one-stage) model behind the HF causal-LM call the schedule makes."""

    def __init__(
        self,
        model: nn.Module,
        hooks: InnerAttentionHooks,
        hf_config: Any,
        counts: ExpertCounts | None = None,
        sequence_multiple: int = 1,
    ) -> None:
        super().__init__()
        self.model = model
        self.hooks = hooks
        self.counts = counts if counts else None
        self.sequence_multiple = sequence_multiple
        config = copy.deepcopy(hf_config)
        config._attn_implementation = "sdpa"  # the schedule's attention is sdpa's maths (kv.contexts)
        self.config = config

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
        prefix_ctx: Any = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutput:
        if prefix_ctx is None or kwargs:
            raise ValueError(
                "prefix_torchtitan: the schedule's model call takes a prefix context and no other input "
                f"(got prefix_ctx={type(prefix_ctx).__name__}, {sorted(kwargs)})"
            )
        counts = self.counts
        if counts is not None and counts.weights is None and self.model.training:
            raise RuntimeError(
                "prefix_torchtitan: a schedule model call without routing weights (ScheduleOptions.count_routing) "
                "would count the MoE's expert load physically"
            )
        length = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device)[None]
        input_ids, position_ids, _ = pad_tokens(input_ids, position_ids, 0.0, self.sequence_multiple)
        padded = input_ids.shape[1] > length
        # the hooked inner attention ignores torchtitan's mask; the model's forward still takes one
        mask = causal_mask(input_ids.shape[1], input_ids.device)
        with self.hooks.scheduling(prefix_ctx, length if padded else None), self._padded(length if padded else None):
            logits = self.model(input_ids, positions=position_ids, attention_masks=mask)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        if padded:
            logits = logits[:, :length]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutput(logits=logits.contiguous())

    def _padded(self, real_length: int | None) -> Any:
        if self.counts is None or real_length is None:
            return contextlib.nullcontext()
        return self.counts.padded(real_length)
