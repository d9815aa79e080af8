"""torchtitan's model as the HF causal LM the one schedule calls (``schedule.executor`` / ``schedule.tree.schedule``).

The executor calls the model as an HF causal LM (``schedule.kv.shim.CausalLMStandIn``: the call, a copy of the
checkpoint's HF config) and walks its modules (FSDP units for phase C's unshard, no vision tower, no HF attention
module). ``TitanCausalLM`` is that: the torchtitan model as its one child, whose logits come from torchtitan's
model with every layer's inner attention handed to ``prefix_ctx`` (``InnerAttentionHooks.scheduling``).

Under TP the logits come back as a DTensor sharded over the vocabulary: gathered here (``full_tensor``, whose
backward hands each rank its shard), as verl's TorchTitan engine gathers them. The K/V the schedule captures and
serves are this rank's head shards.

MoE flavors: torchtitan's expert-load counts take the schedule's routing weights (``ScheduleOptions.count_routing``
-> ``titan.moe.ExpertCounts``); a training call with none is refused rather than counted physically. Under TP x EP
every sequence is padded at the end to a multiple of TP (``titan.sequence``): the schedule's attention sees the
real positions only, the padding's counts weigh zero, its logits are cut off.

Under pipeline parallelism the model is this rank's stage (``distributed.stages``): a stage after the first takes
the previous stage's output in place of the token ids, a stage before the last hands its output on instead of
returning logits (``scores`` False; the config's ``num_hidden_layers`` is the stage's, the layers the schedule
captures and serves).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from verl_prefix.backend.titan.attention import InnerAttentionHooks, causal_mask
from verl_prefix.backend.titan.moe import ExpertCounts
from verl_prefix.backend.titan.sequence import pad_tokens
from verl_prefix.schedule.kv.shim import CausalLMStandIn


class TitanCausalLM(CausalLMStandIn):
    """torchtitan's model (this rank's pipeline stage of it, with ``link``) behind the HF causal-LM call the
    schedule makes."""

    engine = "prefix_torchtitan"

    def __init__(
        self,
        model: nn.Module,
        hooks: InnerAttentionHooks,
        hf_config: Any,
        counts: ExpertCounts | None = None,
        sequence_multiple: int = 1,
        link: Any = None,
    ) -> None:
        super().__init__(hf_config)
        if link is not None:  # a pipeline stage: the layers the schedule captures and serves are its own
            self.config.get_text_config().num_hidden_layers = hooks.num_layers
        self.model = model
        self.hooks = hooks
        self.counts = counts if counts else None
        self.sequence_multiple = sequence_multiple
        self.link = link  # distributed.stages.StageLink: None or one stage, the whole model
        self.scores = link is None or link.is_last

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, prefix_ctx: Any) -> Any:
        counts = self.counts
        if counts is not None and counts.weights is None and self.model.training:
            raise RuntimeError(
                "prefix_torchtitan: a schedule model call without routing weights (ScheduleOptions.count_routing) "
                "would count the MoE's expert load physically"
            )
        length = input_ids.shape[1]
        input_ids, position_ids, _ = pad_tokens(input_ids, position_ids, 0.0, self.sequence_multiple)
        padded = input_ids.shape[1] > length
        # the hooked inner attention ignores torchtitan's mask; the model's forward still takes one
        mask = causal_mask(input_ids.shape[1], input_ids.device)
        link = self.link
        inputs = input_ids if link is None or link.is_first else link.receive(torch.is_grad_enabled())
        with self.hooks.scheduling(prefix_ctx, length if padded else None), self._padded(length if padded else None):
            logits = self.model(inputs, positions=position_ids, attention_masks=mask)
        if not self.scores:  # a pipeline stage before the last: its output goes on (padding: none under PP)
            return link.hand_off(logits)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return logits[:, :length] if padded else logits

    def _padded(self, real_length: int | None) -> Any:
        if self.counts is None or real_length is None:
            return contextlib.nullcontext()
        return self.counts.padded(real_length)
