"""megatron-core's GPT model as the HF causal LM the one schedule calls (``schedule.executor``, ``schedule.tree``).

The executor calls the model as an HF causal LM (``schedule.kv.shim.CausalLMStandIn``: the call, a copy of the
checkpoint's HF config) and walks its modules (no FSDP unit, no vision tower). ``MegatronCausalLM`` is that:
verl's model chunk (the DDP wrapper, whose parameter hooks accumulate the main gradients) as its one child, whose
logits come from megatron-core's ``GPTModel`` with every layer's core attention handed to ``prefix_ctx``
(``megatron.attention``).

Positions: megatron-core's rotary embedding counts from 0 over the call's length, and its forward takes no
per-row positions for it. Every call of the schedule is a run of consecutive positions that starts at the same
place on every row (a prefix from 0 or a chunk or trie node from its start; suffix rows of one group from the
prompt's last position, right-padded): the call's first position goes to ``RotaryEmbedding.forward(offset=...)``
(``rotary_offset``), and anything else is refused, never embedded at the wrong positions.

Under TP the logits come back sharded over the vocabulary: gathered here (megatron-core's
``gather_from_tensor_model_parallel_region``, whose backward hands each rank its shard); verl's own engine
computes the same log-probs from the shards. With sequence parallelism (verl's default at TP > 1 on GPU) megatron-
core splits every sequence over the TP ranks, which must divide its length: each call is padded at the end to a
multiple of ``sequence_multiple`` (``pad_tokens``), the attention hook hands the schedule the real positions only,
and the logits are cut back; the padding comes after every real token, so causal attention never reads it.

Under megatron-core's router aux loss (``routers``) every call runs with the routers' own aux off: the schedule adds
it per logical micro-batch (``megatron.moe``).

Under pipeline parallelism the chunk is this rank's stage (``distributed.stages``): a stage after the first takes the
previous stage's hidden states (``set_input_tensor``) in place of the embedded ids, a stage before the last hands its
hidden states on instead of returning logits (``scores`` False: the schedule runs no loss there and phase A does not
exit early); the schedule captures and serves the stage's own layers. Under virtual stages the rank holds several
chunks, run in order within the call with the ring's relay between them (``through_chunks``); their layers are the
schedule's, numbered in the order a sequence meets them on this rank.

Under megatron-core's activation recompute each call is a ``recompute.schedule_call``: phase A's calls (a capture
context) keep their graph, phase B's recompute in backward re-enters the call's attention hook, RoPE offset and
unfused forward (``megatron.recompute``).

Under ``use_fused_kernels`` verl replaces the ``GPTModel``'s forward with one that returns log-probs from the last
hidden states (its fused linear cross-entropy) instead of logits; the schedule's calls run the model's own forward
(``unfused``: verl keeps it as ``forward_backup``), so reused rows take their log-probs from the logits, the same
maths up to rounding, and verl's dense rows keep its fused path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from verl_prefix.backend.megatron.attention import CoreAttentionHooks
from verl_prefix.backend.megatron.moe import ExpertCounts, McoreRouters
from verl_prefix.backend.megatron.recompute import schedule_call
from verl_prefix.schedule.kv.contexts import CaptureContext
from verl_prefix.schedule.kv.shim import CausalLMStandIn


def unwrapped(module: nn.Module) -> nn.Module:
    """The ``GPTModel`` under verl's wrappers (megatron-core's DDP, ``Float16Module``): each keeps it as
    ``.module``."""
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    return module


def call_offset(position_ids: torch.Tensor) -> int:
    """The first position of a call whose rows are each ``offset + arange(length)``, the same offset on every
    row; anything else is refused (megatron-core's rotary embedding takes one offset per call)."""
    offset = int(position_ids[0, 0])
    expected = offset + torch.arange(position_ids.shape[-1], device=position_ids.device)
    if not bool((position_ids == expected).all()):
        raise ValueError(
            "prefix_megatron: a schedule call whose rows are not one run of consecutive positions from the same "
            "start (megatron-core's RoPE takes one offset per call)"
        )
    return offset


def pad_tokens(input_ids: torch.Tensor, multiple: int) -> torch.Tensor:
    """``[B, L]`` ids padded at the end (id 0) to a length ``multiple`` divides."""
    extra = -input_ids.shape[1] % multiple
    return torch.nn.functional.pad(input_ids, (0, extra)) if extra else input_ids


class RotaryOffset:
    """megatron-core's rotary embeddings of one model, shifted by ``offset`` while set: the model's
    ``RotaryEmbedding``, or under MLA (which embeds positions inside each layer's attention, YaRN among them) every
    layer's own. Both their ``forward`` and the fused path's ``get_cached_cos_sin`` take the offset."""

    def __init__(self, model: nn.Module) -> None:
        self.offset = 0
        if getattr(model, "position_embedding_type", None) != "rope":
            raise ValueError("prefix_megatron: only megatron-core's RoPE models are served (position_embedding_type)")
        rotaries = [getattr(model, "rotary_pos_emb", None)]
        if rotaries[0] is None:  # MLA: one rotary embedding per layer's attention
            rotaries = [getattr(layer.self_attention, "rotary_pos_emb", None) for layer in model.decoder.layers]
        if not rotaries or any(r is None for r in rotaries):
            raise ValueError("prefix_megatron: a RoPE model without megatron-core rotary embeddings")
        for rotary in rotaries:
            self._shift(rotary)

    def _shift(self, rotary: nn.Module) -> None:
        original = rotary.forward

        def forward(max_seq_len: int, offset: int = 0, *args: Any, **kwargs: Any) -> Any:
            return original(max_seq_len, offset + self.offset, *args, **kwargs)  # positions offset.. offset + len

        rotary.forward = forward
        cached = getattr(rotary, "get_cached_cos_sin", None)
        if cached is None:
            return

        def get_cached_cos_sin(seq_len: int, offset: int = 0, *args: Any, **kwargs: Any) -> Any:
            shift = self.offset  # the cache is keyed by the shifted offset; its fill calls forward unshifted
            with self.at(0):
                return cached(seq_len, offset + shift, *args, **kwargs)

        rotary.get_cached_cos_sin = get_cached_cos_sin

    @contextmanager
    def at(self, offset: int) -> Iterator[None]:
        saved, self.offset = self.offset, offset
        try:
            yield
        finally:
            self.offset = saved


@contextmanager
def unfused(model: nn.Module) -> Iterator[None]:
    """megatron-core's own ``GPTModel.forward`` for the duration, where verl's fused forward replaced it."""
    backup = model.__dict__.get("forward_backup")
    if backup is None:
        yield
        return
    fused = model.__dict__["forward"]
    model.forward = backup
    try:
        yield
    finally:
        model.forward = fused


class MegatronCausalLM(CausalLMStandIn):
    """verl's Megatron model chunk (this rank's pipeline stage of it, with ``link``) behind the HF causal-LM call the
    schedule makes."""

    engine = "prefix_megatron"

    def __init__(self, chunks: list[nn.Module], hf_config: Any, sequence_multiple: int = 1, link: Any = None) -> None:
        super().__init__(hf_config)
        if len(chunks) > 1 and (link is None or link.chunks != len(chunks)):
            raise ValueError(f"prefix_megatron: {len(chunks)} model chunks on this rank without virtual stages")
        self.chunks = nn.ModuleList(chunks)
        self.sequence_multiple = sequence_multiple
        self.gpts = [unwrapped(chunk) for chunk in chunks]
        self.gpt = self.gpts[0]  # the chunk a stage's input goes into
        self.hooks = CoreAttentionHooks(self.gpts)
        self.link = link  # distributed.stages.StageLink under pipeline parallelism, else None
        self.scores = link is None or link.is_last
        if link is not None:  # the layers the schedule captures and serves are this stage's own
            self.config.get_text_config().num_hidden_layers = self.hooks.num_layers
        self.rotaries = [RotaryOffset(gpt) for gpt in self.gpts]
        self.routers: McoreRouters | None = None  # the MoE routers under the aux loss (``megatron.moe``)
        self.counts: ExpertCounts | None = None  # expert-biased routers' load counts (``megatron.moe``)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, prefix_ctx: Any) -> Any:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        length = input_ids.shape[1]
        offset = call_offset(position_ids.expand(input_ids.shape[0], -1))
        input_ids = pad_tokens(input_ids, self.sequence_multiple)
        padded = input_ids.shape[1] > length
        zero = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        real = length if padded else None
        counts, weights = self.counts, self.counts.weights if self.counts is not None else None
        if counts is not None and weights is None and torch.is_grad_enabled() and self.chunks[0].training:
            raise RuntimeError(
                "prefix_megatron: a schedule call without routing weights (ScheduleOptions.count_routing) would "
                "count the experts' load physically"
            )
        shape = input_ids.shape

        def call_state() -> ExitStack:
            """What the call's forward runs inside, and a recompute of it in backward re-enters (the expert counts'
            weights too: a recomputed layer routes, and counts, there instead of in the no-grad forward)."""
            stack = ExitStack()
            stack.enter_context(self.hooks.scheduling(prefix_ctx, real))
            for rotary, gpt in zip(self.rotaries, self.gpts):
                stack.enter_context(rotary.at(offset))
                stack.enter_context(unfused(gpt))
            if self.routers is not None:
                stack.enter_context(self.routers.own_aux_off(real))
            if counts is not None and weights is not None:
                stack.enter_context(counts.weighted(weights))
                stack.enter_context(counts.call(*shape, length))
            return stack

        keep_graph = isinstance(prefix_ctx, CaptureContext)  # phase A: its K/V's graph is phase C's
        link = self.link
        if link is not None and not link.is_first:  # the previous stage's output, its gradient sent back
            self.gpt.set_input_tensor(link.receive(torch.is_grad_enabled()))
        with call_state(), schedule_call(keep_graph, call_state):
            logits = self.through_chunks(
                lambda chunk: chunk(input_ids=input_ids, position_ids=zero, attention_mask=None)
            )
        if not self.scores:  # a stage before the last: its hidden states go on, the next stage scores the rows
            return link.hand_off(logits)
        return gather_from_tensor_model_parallel_region(logits[:, :length] if padded else logits)

    def through_chunks(self, call: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
        """``call(chunk)`` on each of this rank's model chunks in order (the first's input set by the caller); under
        virtual stages each later chunk's input is what came around the ring for it (``StageLink.relay``)."""
        output = call(self.chunks[0])
        for gpt, chunk in zip(self.gpts[1:], self.chunks[1:]):
            gpt.set_input_tensor(self.link.relay(output))
            output = call(chunk)
        return output
