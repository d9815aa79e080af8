"""The prefix contexts: what attention does with a group's prefix K/V in each phase.

``CaptureContext`` (phase A) records each layer's K/V while the prefix attends causally to itself, and ends the
forward early (``kv.container.PrefixCaptured``) once nothing later is needed; ``ChunkCaptureContext`` does the
same for a later chunk of a chunked prefix, which attends to the earlier chunks' K/V as a suffix row does;
``ServeContext`` (phase B) serves the prefix K/V read-only to a suffix micro-batch through merged, concat or
packed (``merged_varlen``) attention, nothing stored across calls (DESIGN.md trap 1). They reach HF's attention
as the ``prefix_ctx`` keyword, through the prefix attention of ``kv.seam``, which calls their ``attend``; the
masks and attention helpers they run (``causal_keep_mask``, ``sdpa_lower_right``, ``scored_attention``) live
here too.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from verl_prefix.schedule.attention.keywords import (
    AttentionKeywordRefused,
    scored_keywords,
)
from verl_prefix.schedule.attention.merged import cap_scores, merged_attention, merged_refusal
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
from verl_prefix.schedule.kv.container import PrefixCaptured, PrefixKV
from verl_prefix.schedule.models.recurrent import (
    BoundaryCache,
    RecurrentState,
    capturing_cache,
    serving_cache,
)
from verl_prefix.schedule.models.structure import last_source_layer
from verl_prefix.schedule.ulysses import Ulysses

logger = logging.getLogger(__name__)

# ``prefix_reuse.phase_b_attention``: how a suffix micro-batch attends to the prefix
PHASE_B_ATTENTION = ("auto", "merged", "concat", "merged_varlen")
# what served one layer of a phase-B micro-batch (``ServeContext.layer_paths``): ``_window`` marks a sliding window
# shorter than the call's keys (``schedule.attention.windows``), served banded over the prefix's last W - 1 positions;
# ``_chunk`` a chunked-attention layer whose chunks the call crosses, served over the prefix's last L % C positions
LAYER_PATHS = ("merged", "merged_window", "merged_chunk", "concat", "concat_window", "concat_chunk", "merged_varlen")
# the refusals of merged attention already logged (once per process each)
_LOGGED_REFUSALS: set[str] = set()


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
