"""torchtitan's model as the HF causal LM the one schedule calls (``schedule.executor`` / ``schedule.tree.schedule``).

The executor calls ``model(input_ids=..., position_ids=..., use_cache=False, prefix_ctx=ctx, logits_to_keep=...)``
and reads ``.logits``; it reads the model's ``config`` (``_attn_implementation``, which ``prefix_attention_mode``
switches and switches back, ``get_text_config().num_hidden_layers``, no ``vision_config``) and walks its modules
(FSDP units for phase C's unshard, no vision tower, no HF attention module). ``TitanCausalLM`` is that: the
torchtitan model as its one child, a copy of the checkpoint's HF config, and a forward that runs torchtitan's
model with every layer's inner attention handed to ``prefix_ctx`` (``InnerAttentionHooks.scheduling``).

Under TP the logits come back as a DTensor sharded over the vocabulary: gathered here (``full_tensor``, whose
backward hands each rank its shard), as verl's TorchTitan engine gathers them. The K/V the schedule captures and
serves are this rank's head shards. Sequence padding (TP x EP) is not needed: MoE flavors keep the engine's own
phases (``titan.engine``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from verl_prefix.backend.titan.attention import InnerAttentionHooks, causal_mask


@dataclass
class CausalLMOutput:
    logits: torch.Tensor


class TitanCausalLM(nn.Module):
    """torchtitan's (whole, one-stage) model behind the HF causal-LM call the schedule makes."""

    def __init__(self, model: nn.Module, hooks: InnerAttentionHooks, hf_config: Any) -> None:
        super().__init__()
        self.model = model
        self.hooks = hooks
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
        length = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device)[None]
        # the hooked inner attention ignores torchtitan's mask; the model's forward still takes one
        mask = causal_mask(length, input_ids.device)
        with self.hooks.scheduling(prefix_ctx):
            logits = self.model(input_ids, positions=position_ids, attention_masks=mask)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutput(logits=logits.contiguous())
