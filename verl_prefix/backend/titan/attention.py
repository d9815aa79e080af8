"""Phase A capture and phase B serving at torchtitan's ``layers.{i}.attention.inner_attention``.

That module receives post-norm, post-RoPE q/k/v as ``[B, L, heads, head_dim]``, under TP already this rank's
head shard, so what is captured and served is the local shard: dK/dV stay on the rank that owns the heads
and phase C backpropagates through the rank's own projections (their TP collectives run as in dense).
Phase B attends each row's queries to ``cat(prefix_leaf.expand(B), row_kv)`` with a flex block mask whose key
length is ``P - 1 + S`` (flex expresses query length != key length): every prefix key, then the row's own
keys causally. On CPU the platform layer computes that mask densely (``titan.platform``); on CUDA the flex
kernel runs it.

The third mode, ``scheduling``, hands each layer's q/k/v to the schedule's own attention instead
(``kv.contexts.CaptureContext`` / ``ServeContext.attend``, which ``titan.causal_lm`` passes as ``prefix_ctx``): local
shards transposed to HF's ``[B, heads, L, head_dim]`` layout, with an ``AttentionShim`` (``kv.shim``) carrying
what ``attend`` reads off an HF attention module; the output goes back as the kind of tensor torchtitan handed in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from verl_prefix.schedule.kv.container import PrefixCaptured, PrefixKV
from verl_prefix.schedule.kv.shim import AttentionShim


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """torchtitan's decoder blocks, in order (``model.layers`` is a ModuleDict keyed by index)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("prefix_torchtitan: the model has no `layers`; only torchtitan decoders are served")
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _like(leaf: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``leaf`` (this rank's local shard) as the kind of tensor ``ref`` is: a DTensor on ``ref``'s mesh."""
    from torch.distributed.tensor import DTensor

    if isinstance(ref, DTensor):
        return DTensor.from_local(leaf, ref.device_mesh, ref.placements, run_check=False)
    return leaf


def causal_mask(length: int, device: torch.device) -> BlockMask:
    """Phase A: the prefix attends to itself causally."""

    def causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return kv <= q

    return create_block_mask(causal, 1, None, length, length, device=device)


def suffix_mask(batch: int, prefix_len: int, suffix_len: int, device: torch.device) -> BlockMask:
    """Phase B: suffix query ``q`` keeps every prefix key and its row's keys up to itself."""

    def keep(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (kv < prefix_len) | (kv - prefix_len <= q)

    return create_block_mask(keep, batch, None, suffix_len, prefix_len + suffix_len, device=device)


class InnerAttentionHooks:
    """Wraps every layer's ``inner_attention``: pass-through (dense), capture (phase A) or serve (phase B)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = decoder_layers(model)
        self.mode: str | None = None
        self.early_exit = False
        self.keep: int | None = None
        self.kv: PrefixKV | None = None
        self.ctx: Any = None  # the schedule's prefix context (``scheduling``)
        self.real_length: int | None = None  # ``scheduling`` a sequence padded past it (``titan.sequence``)
        for index, layer in enumerate(self.layers):
            inner = layer.attention.inner_attention
            if getattr(inner, "_verl_prefix_hook", None) is not None:
                raise RuntimeError("prefix_torchtitan: inner attention is hooked twice")
            original = inner.forward
            inner.forward = functools.partial(self._forward, index, original)
            inner._verl_prefix_hook = self

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @contextmanager
    def capturing(self, prefix: PrefixKV, early_exit: bool, keep: int | None = None) -> Iterator[PrefixKV]:
        """Phase A: record every layer's K/V (graph-attached, ``[1, kv_heads, P-1, head_dim]`` local shards);
        with ``early_exit`` the forward stops right after the last layer's K/V. ``keep``: the first positions
        to record when the prefix was padded at the end (``titan.sequence``)."""
        self.early_exit, self.keep = early_exit, keep
        try:
            with self._mode("capture", prefix):
                yield prefix
        except PrefixCaptured:
            pass
        finally:
            self.early_exit, self.keep = False, None
        if not prefix.complete:
            missing = [i for i in range(self.num_layers) if not prefix.captured(i)]
            raise RuntimeError(f"prefix_torchtitan: phase A did not capture K/V of layers {missing}")

    @contextmanager
    def serving(self, leaves: PrefixKV) -> Iterator[None]:
        """Phase B: every layer attends to the prefix leaves before the rows' own keys."""
        with self._mode("serve", leaves):
            yield

    @contextmanager
    def scheduling(self, ctx: Any, real_length: int | None = None) -> Iterator[None]:
        """A forward of the one schedule: every layer attends through ``ctx.attend`` (phase A's capture, phase B's
        serve, a chunk over earlier chunks' leaves), which owns the K/V, early exit included. ``real_length``:
        the sequences were padded at the end past it (TP x EP, ``titan.sequence``); ``ctx`` sees the real
        positions only (causal: no real token reads the padding) and the padding's attention output is zero."""
        self.ctx, self.real_length = ctx, real_length
        try:
            with self._mode("schedule", None):
                yield
        finally:
            self.ctx, self.real_length = None, None

    def _attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Any) -> torch.Tensor:
        real = self.real_length
        ql, kl, vl = (_local(t)[:, :real].transpose(1, 2) for t in (q, k, v))
        shim = AttentionShim(index, ql.shape[1] // kl.shape[1], self.layers[index].attention)
        out, _ = self.ctx.attend(shim, sdpa_attention_forward, ql, kl, vl, scaling=scale)
        extra = _local(q).shape[1] - out.shape[1]
        if extra:
            out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, extra))
        return _like(out, q)  # [B, L, heads, head_dim], as torchtitan's inner attention returns it

    @contextmanager
    def _mode(self, mode: str, kv: PrefixKV | None) -> Iterator[None]:
        if self.mode is not None:
            raise RuntimeError(f"prefix_torchtitan: {mode} inside {self.mode}")
        self.mode, self.kv = mode, kv
        try:
            yield
        finally:
            self.mode, self.kv = None, None

    def _forward(
        self, index: int, original: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        if self.mode == "schedule":
            return self._attend(index, q, k, v, kwargs.get("scale"))
        if self.mode == "capture":
            assert self.kv is not None
            self.kv.keys[index] = _local(k)[:, : self.keep].transpose(1, 2)
            self.kv.values[index] = _local(v)[:, : self.keep].transpose(1, 2)
            self.kv.captured_with_grad[index] = torch.is_grad_enabled()
            # phase C starts inside this layer: its FSDP unit must be unsharded then (executor.unshard_cut_short)
            self.kv.last_source = self.layers[index].attention
            if self.early_exit and index == self.num_layers - 1:
                # the last layer's attention output, MLP, final norm and LM head over the prefix feed nothing;
                # every TP rank stops here alike (before the row-parallel output projection's collective)
                self.kv.interrupted = self.layers[index].attention
                raise PrefixCaptured()
        elif self.mode == "serve":
            assert self.kv is not None
            keys, values = self.kv.layer_tensors(index)
            batch = q.shape[0]
            pk = _like(keys.transpose(1, 2).to(_local(k).dtype), k)
            pv = _like(values.transpose(1, 2).to(_local(v).dtype), v)
            k = torch.cat([pk.expand(batch, -1, -1, -1), k], dim=1)
            v = torch.cat([pv.expand(batch, -1, -1, -1), v], dim=1)
        return original(q, k, v, **kwargs)
