"""torchtitan's MoE load-balancing counts under reuse, with logical prefix-token accounting.

torchtitan 0.3.0 balances experts without an aux loss (its ``MoE.load_balance_coeff``): every training forward
adds the tokens routed to each expert to the ``tokens_per_expert_E`` buffer, and an optimizer step pre-hook
moves ``expert_bias_E`` by ``coeff * sign(mean - count)`` (summed over the loss mesh, and over TP under EP), then
zeroes the counts. verl's TorchTitan engine keeps that mechanism as it is. A dense row routes its whole prompt;
reuse routes the prefix once per group, pads suffix rows and runs lockstep fillers, so the module's own count
would differ from dense. ``ExpertCounts`` replaces each MoE forward's increment with a weighted one: phase A's
tokens count once per row of the group (as the FSDP engine's ``schedule.models.moe.logical_stats`` counts router
statistics), phase B's real suffix tokens (the last response token included, which dense also routes) once,
padding and fillers not at all. Outside ``weighted`` (verl's dense chunks) the module counts for itself.

Under TP x EP the MoE shards its tokens on the sequence over the TP ranks: the router's outputs are DTensors
``Shard(1)`` and each rank counts its own slice (torchtitan's pre-hook then sums the counts over TP). The
weights, given for the whole sequence, are sliced the same way (``shard_like``) before they weigh that slice.
A sequence padded at the end for that split (``titan.sequence``) weighs zero past its real tokens (``padded``).

The one schedule hands the weights in through ``ScheduleOptions.count_routing`` (``titan.causal_lm``): phase A's
prefix once per row below the node, suffix rows' real tokens once, fillers and phase C's recomputed forwards not
at all. Contexts nest (a lockstep chunk of zero weight inside a counted phase A): the inner one's weights hold
until it exits, then the outer one's again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from verl_prefix.backend.titan.attention import decoder_layers


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def shard_like(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-token ``weights`` (``[B, L]``, the whole sequence) for the tokens this rank routes: ``ids``'s local
    slice when the router's output is a DTensor sharded on the sequence (TP x EP), else all of them."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(ids, DTensor) or ids.to_local().shape == ids.shape:
        return weights
    mesh = ids.device_mesh
    whole = DTensor.from_local(weights.contiguous(), mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, ids.placements).to_local()  # Replicate -> Shard: a local slice, no traffic


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The ``moe`` modules of torchtitan's MoE decoder blocks, in order (empty for a dense model)."""
    return [layer.moe for layer in decoder_layers(model) if getattr(layer, "moe_enabled", False)]


class ExpertCounts:
    """Hooks on every MoE layer that count routed tokens with per-position weights while ``weighted`` is active."""

    def __init__(self, model: nn.Module) -> None:
        self.moes = moe_layers(model)
        self.weights: torch.Tensor | None = None
        self.real_length: int | None = None  # tokens past it are padding (``padded``)
        self._saved: dict[int, torch.Tensor] = {}
        self._routed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for index, moe in enumerate(self.moes):
            moe.register_forward_pre_hook(self._pre_hook(index))
            moe.router.register_forward_hook(self._router_hook(index))
            moe.register_forward_hook(self._post_hook(index))

    def __bool__(self) -> bool:
        return bool(self.moes)

    @contextmanager
    def weighted(self, weights: torch.Tensor | float) -> Iterator[None]:
        """Count each routed token with ``weights`` (``[B, L]``, broadcast from a scalar): the group size for
        phase A's prefix, 1 for real suffix tokens, 0 for padding and lockstep fillers."""
        outer = self.weights
        self.weights = torch.as_tensor(weights, dtype=torch.float32)
        try:
            yield
        finally:
            self.weights = outer
            self._saved.clear()
            self._routed.clear()

    @contextmanager
    def padded(self, real_length: int) -> Iterator[None]:
        """A model call whose sequences were padded at the end past ``real_length`` tokens: those weigh zero."""
        outer, self.real_length = self.real_length, real_length
        try:
            yield
        finally:
            self.real_length = outer

    def _token_weights(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """``[B, L]`` weights for a call's (global) routed shape: the given ones, zero past ``real_length``."""
        assert self.weights is not None
        weights = self.weights.to(device)
        real = self.real_length
        if real is None or real >= shape[1]:
            return weights.expand(shape)
        if weights.dim() < 2 or weights.shape[-1] != real:
            weights = weights.expand(shape[0], real)
        return torch.nn.functional.pad(weights, (0, shape[1] - real))

    def _pre_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self.weights is not None and module.training:
                self._saved[index] = _local(module.tokens_per_expert_E).detach().clone()

        return hook

    def _router_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.weights is not None and index in self._saved:
                ids = output[1]  # [B, L, K]
                weights = self._token_weights(ids.shape[:2], _local(ids).device)
                self._routed[index] = (_local(ids).detach(), shard_like(weights, ids))

        return hook

    def _post_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            saved = self._saved.pop(index, None)
            if saved is None:
                return
            ids, weights = self._routed.pop(index)  # [B, L, K] and [B, L], this rank's tokens
            chosen = torch.zeros(*ids.shape[:2], saved.numel(), dtype=torch.float32, device=ids.device)
            chosen.scatter_(-1, ids, 1.0)  # one hot per token over its top-k experts (as torchtitan's map)
            counts = (chosen * weights[..., None]).sum(dim=(0, 1))
            with torch.no_grad():
                _local(module.tokens_per_expert_E).copy_(saved + counts.to(saved.dtype))

        return hook
