"""Capture a group's prefix K/V once (phase A) and serve it read-only to suffix micro-batches (phase B).

Both directions go through one attention function registered with HF's ``AttentionInterface``. The
prefix context travels as a forward kwarg (``prefix_ctx``), not through ``past_key_values``: HF's
gradient checkpointing drops caches inside checkpointed layers but keeps kwargs, so the same code is
exact with non-reentrant checkpointing (DESIGN.md trap 8). Nothing here stores K/V across calls the
way ``DynamicCache.update`` does (trap 1): a serve context returns ``cat(prefix.expand(B), new)``.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.models.llama import modeling_llama

from verl_prefix.schedule.attention.keywords import (
    AttentionKeywordRefused,
    check_attention_keywords,
    dense_keywords,
    scored_keywords,
)
from verl_prefix.schedule.attention.merged import cap_scores, merged_attention, merged_refusal
from verl_prefix.schedule.attention.positions import absolute_positions
from verl_prefix.schedule.attention.varlen import Packing, merged_varlen_attention, varlen_refusal
from verl_prefix.schedule.attention.windows import (
    active_chunk,
    active_window,
    attention_chunk,
    band_keep_mask,
    chunk_cut_length,
    cut_length,
    cut_prefix,
    cut_to_chunk,
)
from verl_prefix.schedule.models.hf_forwards import hf_causal_forward, hf_recurrent
from verl_prefix.schedule.models.multimodal import hf_attention, vision_encoder
from verl_prefix.schedule.models.recurrent import (
    BoundaryCache,
    RecurrentState,
    capturing_cache,
    recurrent_state_mode,
    serving_cache,
)
from verl_prefix.schedule.models.structure import last_source_layer
from verl_prefix.schedule.ulysses import ShardedAttentionModule, Ulysses

if TYPE_CHECKING:
    from verl_prefix.schedule.models.moe import RouterStats

logger = logging.getLogger(__name__)

# ``prefix_reuse.phase_b_attention``: how a suffix micro-batch attends to the prefix
PHASE_B_ATTENTION = ("auto", "merged", "concat", "merged_varlen")
# what served one layer of a phase-B micro-batch (``ServeContext.layer_paths``): ``_window`` marks a sliding window
# shorter than the call's keys (``schedule.attention.windows``), served banded over the prefix's last W - 1 positions;
# ``_chunk`` a chunked-attention layer whose chunks the call crosses, served over the prefix's last L % C positions
LAYER_PATHS = ("merged", "merged_window", "merged_chunk", "concat", "concat_window", "concat_chunk", "merged_varlen")
_LOGGED_REFUSALS: set[str] = set()

# Attention implementations the prefix attention can wrap, and the name it is registered under.
# flash-attention models get their own name, since flash attention applies keywords sdpa ignores (softcap,
# sinks: ``attention.keywords``); their maths otherwise run through torch's sdpa: phase B's keys are
# ``cat(prefix, suffix)`` per row, which sdpa takes with a bottom-right causal bias (its own flash kernel
# on CUDA, exact elsewhere).
PREFIX_ATTENTION_NAMES = {
    "sdpa": "verl_prefix_sdpa",
    "eager": "verl_prefix_eager",
    "flash_attention_2": "verl_prefix_flash",
    "flash_attention_3": "verl_prefix_flash",
}


class PrefixCaptured(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised after the last layer's K/V is captured: the rest of the prefix forward feeds nothing."""


def _eager_for(module: nn.Module) -> Callable:
    """The model family's own eager attention (identical maths across Llama/Qwen2/Qwen3)."""
    family = sys.modules.get(type(module).__module__)
    return getattr(family, "eager_attention_forward", modeling_llama.eager_attention_forward)


def causal_keep_mask(query_len: int, prefix_len: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[1, 1, query_len, prefix_len + query_len]`` mask: every query sees the whole prefix
    and the suffix causally. Right padding needs no key mask: a valid query never sees a later pad."""
    suffix = torch.ones(query_len, query_len, dtype=torch.bool, device=device).tril()
    prefix = torch.ones(query_len, prefix_len, dtype=torch.bool, device=device)
    return torch.cat([prefix, suffix], dim=1)[None, None]


def prefix_causal_bias(query_len: int, key_len: int) -> torch.Tensor:
    """``causal_keep_mask(query_len, key_len - query_len)`` as torch's bottom-right causal bias, which
    sdpa runs without materialising (flash on CUDA)."""
    return causal_lower_right(query_len, key_len)


def _as_eager_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Eager attention adds its mask to the scores: 0 where kept, the dtype's minimum elsewhere (trap 6)."""
    additive = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return additive.masked_fill(~keep, torch.finfo(dtype).min)


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
        """Every boundary tensor: two per layer (``layer_tensors``), then the router probability sum if any."""
        out = [t for layer in range(len(self.keys)) for t in self.layer_tensors(layer)]
        if self.router_stats is not None:
            out.append(self.router_stats.prob_sum)
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


class CaptureContext:
    """Phase A: record each layer's K/V while the prefix runs causally over itself."""

    def __init__(
        self,
        num_layers: int,
        early_exit: bool,
        ready: Callable[[], bool] = lambda: True,
        ulysses: Ulysses | None = None,
        length: int | None = None,
        sources: dict[int, int] | None = None,
        recurrent_layers: Iterable[int] = (),
    ) -> None:
        self.kv = PrefixKV(num_layers, recurrent_layers)
        # KV-shared layers (``structure.kv_sources``) compute no K/V: phase A may stop after the last one that does
        self.sources = sources or {}
        self.last_layer = last_source_layer(num_layers, self.sources)
        self.early_exit = early_exit
        # early exit at the last K/V only once nothing else phase A needs is still to come (MoE routers)
        self.ready = ready
        # under sequence parallelism attention sees the padded whole prefix; the K/V kept are its real part
        self.ulysses = ulysses
        self.length = length

    def attend(
        self,
        module: nn.Module,
        base: Callable,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer = module.layer_idx
        # A checkpointed layer re-runs in backward; the first capture is the one the graph holds, and
        # only the first pass decides the early exit (a recompute must replay what the forward did).
        first = self.kv.keys[layer] is None
        if first:
            end = key.shape[2] if self.length is None else self.length
            self.kv.keys[layer], self.kv.values[layer] = key[:, :, :end], value[:, :, :end]
            self.kv.captured_with_grad[layer] = torch.is_grad_enabled()
            if layer not in self.sources:
                self.kv.last_source = getattr(module, "wrapped", module)
            if layer == self.last_layer:
                self.kv.share(self.sources)
        if first and self.early_exit and self.kv.complete and self.ready():
            self.kv.interrupted = getattr(module, "wrapped", module)  # the real module under a head-shard view
            raise PrefixCaptured
        return self._attention(module, base, query, key, value, **kwargs)

    def recurrent_cache(self, module: nn.Module, hidden_states: torch.Tensor) -> BoundaryCache:
        """A recurrent layer runs the prefix from nothing and writes its end state here."""
        return capturing_cache(module, self.recorder(module))

    def recorder(self, module: nn.Module) -> Callable[[RecurrentState], None]:
        """Keeps a recurrent layer's end-of-prefix state (the first pass only: a checkpointed layer's
        recompute replays it); early exit as after an attention layer's K/V."""
        layer = module.layer_idx

        def record(boundary: RecurrentState) -> None:
            if self.kv.recurrent[layer] is not None:
                return
            self.kv.recurrent[layer] = boundary
            self.kv.captured_with_grad[layer] = torch.is_grad_enabled()
            if self.early_exit and self.kv.complete and self.ready():
                self.kv.interrupted = module
                raise PrefixCaptured

        return record

    def key_span(self, query_len: int) -> int:
        """How many keys the last real query of a ``query_len``-query call sees (itself included)."""
        return query_len if self.length is None else self.length

    @property
    def query_offset(self) -> int:
        """The absolute position of the call's first query: the prefix starts the sequence."""
        return 0

    def _attention(
        self, module: nn.Module, base: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prefix (or its first chunk) attends causally to itself, within the layer's sliding window when
        it is shorter than the prefix and within its attention chunks when the prefix crosses one
        (``schedule.attention.windows``; the prefix starts at position 0)."""
        length = query.shape[2]
        window = active_window(kwargs.get("sliding_window"), self.key_span(length))
        chunk = active_chunk(attention_chunk(module), self.key_span(length))
        scored = base is sdpa_attention_forward and scored_keywords(kwargs)
        if base is sdpa_attention_forward and not scored and window is None and chunk is None:
            return base(module, query, key, value, None, **kwargs)  # a single unpadded row: the causal fast path
        keep = band_keep_mask(length, length, 0, window, chunk, query.device)
        if scored:
            return scored_attention(module, query, key, value, keep, **kwargs)
        mask = keep if base is sdpa_attention_forward else _as_eager_mask(keep, query.dtype)
        return base(module, query, key, value, mask, **kwargs)


class ChunkCaptureContext(CaptureContext):
    """Phase A in chunks: a later chunk records its own K/V like ``CaptureContext`` and attends to the
    earlier chunks' K/V (held as leaves) exactly as a suffix row attends to the prefix in phase B: the
    chunk is one row of ``query_len`` real tokens (padded at the end to the SP size under sequence
    parallelism), which is also how ``merged_varlen`` packs it."""

    def __init__(
        self,
        num_layers: int,
        early_exit: bool,
        earlier: PrefixKV,
        query_len: int,
        device: torch.device,
        attention: str = "auto",
        ready: Callable[[], bool] = lambda: True,
        ulysses: Ulysses | None = None,
        refusal: str | None = None,
        sources: dict[int, int] | None = None,
    ) -> None:
        # under sequence parallelism attention sees the chunk padded to the SP size; its real K/V are kept
        real = query_len if ulysses is not None else None
        super().__init__(
            num_layers, early_exit, ready, ulysses, real, sources, recurrent_layers=earlier.recurrent_layers
        )
        padded = query_len if ulysses is None else ulysses.padded(query_len)
        self.serve = ServeContext(
            earlier, padded, device, attention, ulysses=ulysses, row_lengths=[query_len], refusal=refusal
        )

    def key_span(self, query_len: int) -> int:
        return self.serve.prefix.length + super().key_span(query_len)

    @property
    def query_offset(self) -> int:
        """A later chunk starts right after the earlier chunks' K/V."""
        return self.serve.query_offset

    def recurrent_cache(self, module: nn.Module, hidden_states: torch.Tensor) -> BoundaryCache:
        """A recurrent layer continues from the previous chunk's state (leaves) and records its own."""
        if self.ulysses is not None:
            raise NotImplementedError("recurrent layers under Ulysses (recurrent.recurrent_refusal refuses it first)")
        boundary = self.serve.prefix.recurrent[module.layer_idx]
        return serving_cache(module, boundary, hidden_states, on_capture=self.recorder(module))

    def _attention(
        self, module: nn.Module, base: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.serve.attend(module, base, query, key, value, **kwargs)


class ServeContext:
    """Phase B: a suffix micro-batch attends to the prefix; nothing is stored.

    ``attention`` (``prefix_reuse.phase_b_attention``): ``merged`` runs two-part attention against the one
    shared prefix K/V (``attention.merged``) and raises where it cannot; ``concat`` attends to
    ``cat(prefix.expand(B), suffix)`` (the reference path); ``auto`` runs merged where its kernels serve
    the call (sdpa/flash models) and concat elsewhere, recording why in ``refusals``; ``merged_varlen``
    runs the same two-part attention on the rows' real tokens packed without padding
    (``attention.varlen``; flash-attn varlen on CUDA) and raises where it cannot. ``row_lengths``: each
    row's real token count (``SuffixBatch.tokens.sum(1)``), which ``merged_varlen`` needs; the attention
    call must see the ``query_len``-wide rows these lengths describe. ``refusal``: why the merged kernels
    cannot serve on some data-parallel rank, agreed by every rank before the mini-batch
    (``ScheduleOptions.phase_b_refusal``): ``auto`` runs concat for it, so every rank takes the same path.

    A layer whose sliding window is shorter than the call's keys (``windows.active_window``) is served by merged
    (the banded two-part attention in plain torch ops) or concat over the prefix's last ``W - 1`` positions;
    ``merged_varlen`` raises for it (the engine refuses windowed models with it at initialisation).
    ``layer_paths`` records what served each layer (``LAYER_PATHS``)."""

    def __init__(
        self,
        prefix: PrefixKV,
        query_len: int,
        device: torch.device,
        attention: str = "auto",
        *,
        ulysses: Ulysses | None = None,
        row_lengths: torch.Tensor | list[int] | None = None,
        refusal: str | None = None,
    ) -> None:
        if attention not in PHASE_B_ATTENTION:
            raise ValueError(f"phase_b_attention must be one of {PHASE_B_ATTENTION}, got {attention!r}")
        self.prefix = prefix
        self.ulysses = ulysses  # query_len is then the padded whole suffix width attention sees
        self.query_len = query_len
        self.device = device
        self.attention = attention
        self.row_lengths = row_lengths
        self.refusal = refusal
        self.merged_calls = 0
        self.varlen_calls = 0
        self.refusals: set[str] = set()
        # layer -> the phase-B attention that served it in this micro-batch (``LAYER_PATHS``)
        self.layer_paths: dict[int, str] = {}
        self._window_keeps: dict[tuple[int | None, int | None], torch.Tensor] = {}

    @functools.cached_property
    def packing(self) -> Packing:
        """Where the rows' real tokens go in the packed layout, with the prefix part's offsets (built once per
        micro-batch: no layer copies an offset to the device)."""
        return Packing.from_lengths(self.row_lengths, self.query_len, self.device, self.prefix.length)

    def _varlen_refusal(
        self, query: torch.Tensor, value_dim: int, kwargs: dict, window: int | None, chunk: int | None
    ) -> None:
        if window is not None:
            reason = "sliding_window"  # the engine refuses windowed models with merged_varlen at initialisation
        elif chunk is not None:
            reason = "chunked_attention"  # refused at initialisation too (its packed kernels take no mask)
        else:  # a window covering every key of the call changes nothing
            served = {k: v for k, v in kwargs.items() if k != "sliding_window"}
            reason = self.refusal or varlen_refusal(query, served, value_dim)
        if reason is None and self.row_lengths is None:
            reason = "no_row_lengths"
        if reason is None and query.shape[2] != self.query_len:
            reason = "width"  # attention sees another width than the context was built for
        if reason is not None:
            raise ValueError(
                "actor_rollout_ref.actor."
                f"prefix_reuse.phase_b_attention=merged_varlen cannot serve this attention call ({reason}); "
                "use auto (merged, falls back to concat), merged or concat"
            )

    @functools.cached_property
    def keep(self) -> torch.Tensor:
        """The explicit mask eager attention adds (sdpa takes it as a causal bias instead)."""
        return causal_keep_mask(self.query_len, self.prefix.length, self.device)

    def window_keep(self, window: int | None, chunk: int | None = None) -> torch.Tensor:
        """Concat's mask under a sliding window and/or attention chunks: the rows' queries over
        ``cat(cut prefix, suffix)`` (the prefix cut to its last ``W - 1`` positions, ``windows.cut_prefix``, and to
        the chunk holding the first suffix position, ``windows.cut_to_chunk``), bottom-right aligned."""
        if (window, chunk) not in self._window_keeps:
            length = self.prefix.length
            cut = length if window is None else cut_length(length, window)
            cut = cut if chunk is None else min(cut, chunk_cut_length(length, chunk))
            keys = cut + self.query_len
            self._window_keeps[(window, chunk)] = band_keep_mask(
                self.query_len, keys, length, window, chunk, self.device
            )
        return self._window_keeps[(window, chunk)]

    def key_span(self, query_len: int) -> int:
        """How many keys the longest real row's last query sees: the prefix and the row (under Ulysses the
        attention width is padded past the rows' real tokens, ``row_lengths`` says how far they reach)."""
        if self.ulysses is None or self.row_lengths is None:
            return self.prefix.length + query_len
        return self.prefix.length + self.longest_row

    @property
    def query_offset(self) -> int:
        """The absolute position of the rows' first query (``[prompt[-1]] + response`` starts right after the
        prefix's K/V)."""
        return self.prefix.length

    @functools.cached_property
    def longest_row(self) -> int:
        """The longest row's real token count (read once per micro-batch, and only where a window asks)."""
        return max(int(n) for n in self.row_lengths)

    def recurrent_cache(self, module: nn.Module, hidden_states: torch.Tensor) -> BoundaryCache:
        """A recurrent layer's rows all continue from the prefix's state (``recurrent.serving_cache``)."""
        return serving_cache(module, self.prefix.recurrent[module.layer_idx], hidden_states)

    def _merged_refusal(
        self, base: Callable, query: torch.Tensor, value_dim: int, kwargs: dict, banded: bool
    ) -> str | None:
        if self.attention == "concat":
            return "concat"
        if self.refusal is not None:
            reason = self.refusal  # the kernels' refusal every rank agreed on before the schedule
        elif scored_keywords(kwargs) or banded:
            reason = None  # softcap/sinks/a window/chunks: merged's maths in plain torch ops, which need no kernel
        else:
            # a window covering every key of the call changes nothing (the kernels take none)
            reason = merged_refusal(query, {k: v for k, v in kwargs.items() if k != "sliding_window"}, value_dim)
        if reason is None and self.attention == "auto" and base is not sdpa_attention_forward:
            reason = "eager"  # the model asked for eager attention's numerics; merged is sdpa's maths
        if reason is not None and self.attention == "merged":
            raise ValueError(
                "actor_rollout_ref.actor."
                f"prefix_reuse.phase_b_attention=merged cannot serve this attention call ({reason}); "
                "use auto (falls back to concat) or concat"
            )
        return reason

    def attend(
        self,
        module: nn.Module,
        base: Callable,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer = module.layer_idx
        prefix_key, prefix_value = self.prefix.keys[layer], self.prefix.values[layer]
        window = active_window(kwargs.get("sliding_window"), self.key_span(query.shape[2]))
        chunk = active_chunk(attention_chunk(module), self.key_span(query.shape[2]))
        windowed = "_window" if window is not None else "_chunk" if chunk is not None else ""
        if self.attention == "merged_varlen":
            self._varlen_refusal(query, value.shape[-1], kwargs, window, chunk)
            self.varlen_calls += 1
            self.layer_paths[layer] = "merged_varlen"
            out = merged_varlen_attention(
                query, prefix_key, prefix_value, key, value, self.packing, kwargs.get("scaling")
            )
            return out, None
        reason = self._merged_refusal(base, query, value.shape[-1], kwargs, window is not None or chunk is not None)
        if reason is None:
            self.merged_calls += 1
            self.layer_paths[layer] = "merged" + windowed
            out = merged_attention(
                query,
                prefix_key,
                prefix_value,
                key,
                value,
                kwargs.get("scaling"),
                softcap=kwargs.get("softcap"),
                sinks=kwargs.get("s_aux"),
                window=window,
                chunk=chunk,
            )
            return out, None
        if reason != "concat":
            self.refusals.add(reason)
            if reason not in _LOGGED_REFUSALS:
                _LOGGED_REFUSALS.add(reason)
                logger.warning("phase B runs concat attention instead of merged: %s", reason)
        self.layer_paths[layer] = "concat" + windowed
        rows = key.shape[0]
        keep = self.keep
        if window is not None:  # only the last W - 1 prefix positions can be seen: a view, dK/dV land in place
            prefix_key, prefix_value = cut_prefix(prefix_key, window), cut_prefix(prefix_value, window)
        if chunk is not None:  # only the chunk holding the first suffix position: a view (possibly empty)
            length = self.prefix.length
            prefix_key = cut_to_chunk(prefix_key, length, chunk)
            prefix_value = cut_to_chunk(prefix_value, length, chunk)
        if window is not None or chunk is not None:
            keep = self.window_keep(window, chunk)
        # leaves may be held in fp32 (fp32 dK/dV accumulation): attend in the suffix's dtype
        key = torch.cat([prefix_key.to(key.dtype).expand(rows, -1, -1, -1), key], dim=2)
        value = torch.cat([prefix_value.to(value.dtype).expand(rows, -1, -1, -1), value], dim=2)
        if base is sdpa_attention_forward and scored_keywords(kwargs):
            return scored_attention(module, query, key, value, keep, **kwargs)
        if base is sdpa_attention_forward and window is None and chunk is None:
            return sdpa_lower_right(module, query, key, value, **kwargs)
        if base is sdpa_attention_forward:  # an explicit banded mask (torch's memory-efficient kernel on CUDA)
            return base(module, query, key, value, keep, **kwargs)
        return base(module, query, key, value, _as_eager_mask(keep, query.dtype), **kwargs)


def sdpa_lower_right(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """HF's sdpa attention with the mask ``causal_keep_mask`` spells out, given as a bottom-right causal
    bias: the queries are the last ``query_len`` of the keys, each sees every key up to its own. On CUDA
    torch runs it with its flash kernel (an explicit mask would force the memory-efficient one) without
    building the mask; elsewhere it materialises exactly that mask. K/V heads are repeated for GQA
    first, as HF does whenever a mask is given."""
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    bias = prefix_causal_bias(query.shape[2], key.shape[2])
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def scored_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keep: torch.Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention with logit softcapping and/or sinks, which torch's sdpa does not take, in plain torch ops:
    scores (at least fp32) capped as ``softcap * tanh(s / softcap)``, then the boolean ``keep`` mask
    (``causal_keep_mask``), sinks as one more logit per query head with no value, softmax, values; the output
    rounded to the query's dtype once. What flash attention computes for these keywords; K/V heads repeated
    for GQA and the scores materialised (``B x Hq x S x K``), as eager attention does. ``dropout`` must be 0
    (``attention.keywords`` refuses any other rate before a context attends)."""
    if dropout:
        raise AttentionKeywordRefused("dropout", dropout, "scored attention has no dropout")
    groups = query.shape[1] // key.shape[1]
    work = torch.promote_types(query.dtype, torch.float32)
    key, value = repeat_kv(key.to(work), groups), repeat_kv(value.to(work), groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = cap_scores(torch.matmul(query.to(work), key.transpose(-1, -2)) * scale, softcap)
    scores = scores.masked_fill(~keep, float("-inf"))
    if s_aux is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sinks = s_aux.to(work).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs, value).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _make_prefix_attention(base_kind: str) -> Callable:
    def prefix_attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: object,
    ) -> tuple:
        ctx = kwargs.pop("prefix_ctx", None)
        if ctx is None:
            raise RuntimeError(
                "verl_prefix attention was called without a prefix context: the model's attention "
                "implementation was left switched to prefix mode outside the reuse schedule"
            )
        # every keyword is honoured or refused (``attention.keywords``); flash models' maths run through
        # sdpa, or through ``scored_attention`` where flash applies what sdpa cannot (softcap, sinks)
        base = _eager_for(module) if base_kind == "eager" else sdpa_attention_forward
        kwargs = dense_keywords(base_kind, kwargs)
        if base_kind != "eager" and scored_keywords(kwargs) and "scored" not in _LOGGED_REFUSALS:
            _LOGGED_REFUSALS.add("scored")
            logger.warning(
                "prefix attention applies softcap/sinks as %s attention does, in plain torch ops: exact, but the "
                "scores are materialised (batch x heads x queries x keys in fp32 per layer)",
                base_kind,
            )
        ulysses = ctx.ulysses
        if ulysses is None:
            check_attention_keywords(module, kwargs)
            return ctx.attend(module, base, query, key, value, **kwargs)
        if kwargs.get("s_aux") is not None:
            reason = "attention sinks under Ulysses (one sink per head, not split into head shards)"
            raise AttentionKeywordRefused("s_aux", kwargs["s_aux"], reason)
        query, key, value = ulysses.heads_in(query, key, value)
        shard = ShardedAttentionModule(module, query.shape[1], key.shape[1])
        check_attention_keywords(shard, kwargs)
        out, weights = ctx.attend(shard, base, query, key, value, **kwargs)
        return ulysses.heads_out(out), weights

    prefix_attention.__name__ = f"verl_prefix_{base_kind}_attention"
    return prefix_attention


AttentionInterface.register("verl_prefix_sdpa", _make_prefix_attention("sdpa"))
AttentionInterface.register("verl_prefix_eager", _make_prefix_attention("eager"))
AttentionInterface.register("verl_prefix_flash", _make_prefix_attention("flash"))


def _configs_of(model: nn.Module) -> list:
    """Every distinct config object whose ``_attn_implementation`` the decoder's attention modules read. A vision
    encoder's config is not one (its attention is bidirectional and runs dense, in phase A), nor a composite
    vision-language config: setting its attention implementation switches every sub-config's."""
    tower = vision_encoder(model)
    inside = {id(m) for m in tower.modules()} if tower is not None else set()
    seen: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if id(module) in inside or getattr(config, "vision_config", None) is not None:
            continue
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def base_attention_implementation(model: nn.Module) -> str:
    configs = _configs_of(model)
    if not configs:
        raise ValueError(f"{type(model).__name__} has no HF config with an attention implementation")
    return configs[0]._attn_implementation or "eager"


@contextmanager
def prefix_attention_mode(model: nn.Module) -> Iterator[None]:
    """Switch attention to the prefix-aware wrapper for the duration of the reuse schedule.

    Every backward that may recompute a checkpointed layer runs inside this context, so a recompute
    never sees the plain kernel with a prefix-length mismatch. Served recurrent layers take their state
    from the prefix context meanwhile (``recurrent.recurrent_state_mode``).
    """
    configs = _configs_of(model)
    originals = [c._attn_implementation for c in configs]
    try:
        for config, original in zip(configs, originals):
            name = PREFIX_ATTENTION_NAMES.get(original or "eager")
            if name is None:
                raise ValueError(f"prefix reuse does not support attn_implementation={original!r}")
            config._attn_implementation = name
        # HF's delta-net/decoder-layer and attention forwards where verl patched them
        with (
            hf_recurrent(model),
            hf_causal_forward(model),
            recurrent_state_mode(model),
            hf_attention(model),
            absolute_positions(model),
        ):
            yield
    finally:
        for config, original in zip(configs, originals):
            config._attn_implementation = original
