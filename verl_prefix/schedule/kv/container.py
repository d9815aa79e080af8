"""The prefix's boundary tensors as the schedule holds them between phases: ``PrefixKV`` (per layer the K/V
phase A captured, or a recurrent layer's state after the prefix; the router statistics; the leaves phase B's
gradients collect on) and ``PrefixCaptured``, the signal that ends phase A's forward once every layer's K/V is
captured (``kv.seam``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from verl_prefix.schedule.models.recurrent import RecurrentState

if TYPE_CHECKING:
    from verl_prefix.schedule.kv.shim import Handoff
    from verl_prefix.schedule.models.moe import RouterStats


class PrefixCaptured(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised after the last layer's K/V is captured: the rest of the prefix forward feeds nothing."""


class PrefixKV:
    """Per-layer prefix K/V, ``[1, kv_heads, P-1, head_dim]`` each, as attention sees them (post-RoPE).

    A recurrent layer (``recurrent_layers``: gated delta-net, ``verl_prefix.schedule.models.recurrent``) holds its
    state after the prefix instead (``recurrent``: conv context and recurrent state), in the same two
    boundary slots per layer. With the MoE router aux loss on, ``router_stats`` holds the prefix's router
    statistics; its probability sum is one more boundary tensor next to them (``verl_prefix.schedule.models.moe``).
    """

    def __init__(self, num_layers: int, recurrent_layers: Iterable[int] = ()) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.recurrent_layers = frozenset(recurrent_layers)
        self.recurrent: list[RecurrentState | None] = [None] * num_layers
        self.router_stats: RouterStats | None = None
        # the module whose forward phase A cut short (early exit), if any
        self.interrupted: nn.Module | None = None
        # the attention module of the last layer whose K/V phase A computed itself (not a KV-shared layer's)
        self.last_source: nn.Module | None = None
        # per layer: phase A captured its K/V with autograd on (a K/V without a graph is then a constant)
        self.captured_with_grad: list[bool] = [False] * num_layers
        # phase A's logits of its last ``options.keep_logits`` positions (a loss-carrying tree node; under Ulysses
        # this rank's share of them), or None
        self.logits: torch.Tensor | None = None
        # under verl's fused kernels ``logits`` holds packed (log-prob, entropy) pairs of these dtypes (fused_head)
        self.fused_dtypes: tuple[torch.dtype, torch.dtype] | None = None
        # on a pipeline stage before the last: phase A's output, handed to the next stage (``kv.shim.Handoff``);
        # its gradient joins phase C's backward
        self.handoff: Handoff | None = None

    def share(self, sources: dict[int, int]) -> None:
        """KV-shared layers (``structure.kv_sources``): each one's prefix K/V are its source layer's tensors."""
        for layer, source in sources.items():
            if self.keys[layer] is None and self.keys[source] is not None:
                self.keys[layer], self.values[layer] = self.keys[source], self.values[source]
                self.captured_with_grad[layer] = self.captured_with_grad[source]

    def captured(self, layer: int) -> bool:
        if layer in self.recurrent_layers:
            return self.recurrent[layer] is not None
        return self.keys[layer] is not None and self.values[layer] is not None

    @property
    def complete(self) -> bool:
        return all(self.captured(layer) for layer in range(len(self.keys)))

    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's two boundary tensors: its K and V, or a recurrent layer's conv context and state."""
        if layer in self.recurrent_layers:
            return self.recurrent[layer].tensors()
        return self.keys[layer], self.values[layer]

    def tensors(self) -> list[torch.Tensor]:
        """Every boundary tensor: two per layer (``layer_tensors``), then the router sums if any
        (``RouterStats.boundary``)."""
        out = [t for layer in range(len(self.keys)) for t in self.layer_tensors(layer)]
        if self.router_stats is not None:
            out.extend(self.router_stats.boundary())
        return out

    def describe(self, index: int) -> str:
        """What ``tensors()[index]`` is, for an error message."""
        layer = index // 2
        if layer >= len(self.keys):
            return "router statistics"
        if layer in self.recurrent_layers:
            return f"{('conv context', 'recurrent state')[index % 2]} of layer {layer}"
        return f"{'KV'[index % 2]} of layer {layer}"

    def as_leaves(self, requires_grad: bool, min_dtype: torch.dtype | None = torch.float32) -> PrefixKV:
        """Detached copies that collect dK/dV (and d(state), d(aux)/d(prob sums)) from every suffix micro-batch.

        K/V (and recurrent state) leaves are held in at least ``min_dtype`` (fp32 by default) so their
        gradients accumulate over the micro-batches in fp32 whatever the compute dtype, as dense training
        accumulates parameter grads; attention (the conv) casts them to its own dtype (an exact round trip).
        ``None`` keeps their dtype. Layers that share one K/V tensor (KV-shared layers, ``share``) share one
        leaf: one copy, one dK/dV holding both layers' shares (``executor.seeded_backward`` seeds such a root
        once)."""
        leaves = PrefixKV(len(self.keys), self.recurrent_layers)
        made: dict[int, torch.Tensor] = {}

        def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if id(t) not in made:
                dtype = t.dtype if min_dtype is None else torch.promote_types(t.dtype, min_dtype)
                made[id(t)] = t.detach().to(dtype).requires_grad_(requires_grad)
            return made[id(t)]

        leaves.keys = [leaf(k) for k in self.keys]
        leaves.values = [leaf(v) for v in self.values]
        leaves.recurrent = [
            None if r is None else RecurrentState(leaf(r.conv), leaf(r.state), r.conv_dtype) for r in self.recurrent
        ]
        if self.router_stats is not None:
            leaves.router_stats = self.router_stats.detached_leaf(requires_grad)
        return leaves

    @property
    def length(self) -> int:
        """Prefix tokens the attention layers' K/V hold."""
        return next(k for k in self.keys if k is not None).shape[2]
