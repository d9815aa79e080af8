"""How an engine whose model is not HF's meets the schedule: its model behind the HF causal-LM call
(``CausalLMStandIn``), and its layers' attention behind an HF attention module (``AttentionShim``).

torchtitan's ``inner_attention`` and megatron-core's ``core_attention`` hand the schedule their post-RoPE q/k/v;
the engine's hook calls ``ctx.attend(shim, sdpa_attention_forward, q, k, v, scaling=...)`` with an
``AttentionShim`` in place of the HF module: the layer's index, the query heads per K/V head (under tensor
parallelism this rank's shards: the same ratio), causality, and ``wrapped``, the layer's real attention module
(phase C starts inside it: ``executor.unshard_cut_short`` unshards the FSDP units around it). No ``config``: no
sliding window or attention chunks (``schedule.attention.windows``); an engine whose layers have them refuses
them before a group runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


class AttentionShim:
    """An HF attention module's face for one layer of another engine (see the module docstring)."""

    is_causal = True
    training = False

    def __init__(self, layer_idx: int, groups: int, wrapped: nn.Module) -> None:
        self.layer_idx = layer_idx
        self.num_key_value_groups = groups
        self.wrapped = wrapped


class Handoff(Protocol):
    """What a model call returns on a pipeline stage before the last instead of logits: its output went on to the
    next stage, which scores the rows. The schedule runs such a stage's part of every step and of no loss:

    - ``backward()``: phase B, after the node's last suffix micro-batch (GPipe order: every forward first), this
      stage's backward of the micro-batch seeded with what the next stage sends back;
    - ``roots()``: phase C, the (output, gradient from the next stage) pair that joins the node's seeded backward
      (``executor.seeded_backward``): the next stage's phase C reached this node's K/V through its output;
    - ``eager``: phase B's ``backward()`` runs right after the micro-batch's forward instead (virtual pipeline
      stages, whose backward crosses the ring of ranks inside autograd: ``executor.handed_off``).
    """

    eager: bool

    def backward(self) -> None: ...

    def roots(self) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


@dataclass
class CausalLMOutput:
    """What the schedule reads of a model call: the logits, or on a pipeline stage before the last its
    ``Handoff`` (no logits)."""

    logits: torch.Tensor | None
    handoff: Handoff | None = None


def scores(model: nn.Module) -> bool:
    """Whether this rank's part of ``model`` ends in the LM head: False on a pipeline stage before the last,
    whose calls return a ``Handoff`` (their phase A does not exit early, no loss runs there)."""
    return getattr(model, "scores", True)


class CausalLMStandIn(nn.Module):
    """An engine's model behind the HF causal-LM call the schedule makes (``schedule.executor``,
    ``schedule.tree``): ``model(input_ids, position_ids, use_cache, prefix_ctx, logits_to_keep) -> .logits``, a
    copy of the checkpoint's HF config (``_attn_implementation`` set to sdpa: the schedule's attention is sdpa's
    maths; ``get_text_config()``'s ``num_hidden_layers``). A subclass computes the logits (``logits``) with every
    layer's attention handed to ``prefix_ctx``; ``engine`` names it in errors."""

    engine = "the engine"

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        config = copy.deepcopy(hf_config)
        config._attn_implementation = "sdpa"
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
                f"{self.engine}: the schedule's model call takes a prefix context and no other input "
                f"(got prefix_ctx={type(prefix_ctx).__name__}, {sorted(kwargs)})"
            )
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        logits = self.logits(input_ids, position_ids, prefix_ctx)
        if not isinstance(logits, torch.Tensor):  # a stage before the last: the next stage scores the rows
            return CausalLMOutput(logits=None, handoff=logits)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutput(logits=logits.contiguous())

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, prefix_ctx: Any) -> torch.Tensor | Handoff:
        """``[B, L, vocab]`` logits of the call, every layer attending through ``prefix_ctx`` (a ``Handoff`` on a
        pipeline stage before the last)."""
        raise NotImplementedError
