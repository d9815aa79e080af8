"""Phase B's two-part attention: suffix queries against ONE shared prefix K/V, plus each row's causal
self-attention, merged by log-sum-exp (DESIGN.md section 5).

The concat path gives every row ``cat(prefix.expand(B), suffix)`` and repeats K/V heads for GQA, so a
micro-batch materialises ``B x query_heads x (P + S)`` keys. Here the prefix part runs all queries of
the micro-batch (rows and the query heads of a KV group folded into the query length) against the
single ``[1, kv_heads, P, d]`` prefix, unmasked, on every device: no per-row copy and no GQA repeat of
the prefix (one cast of it where the kernel's dtype differs from the fp32 leaf's). The suffix part is
plain causal attention per row (right padding is harmless: a real query never sees a later pad); its
own K/V go in unrepeated: the CPU flash op and torch's CUDA flash op both take GQA natively (``native_gqa``;
on CUDA asked of torch, ``kernels.flash_takes_gqa``, and repeated to the query heads only where it says no).
With ``(o1, l1)`` and
``(o2, l2)`` the two parts' outputs and log-sum-exps::

    l = logaddexp(l1, l2),   o = exp(l1 - l) o1 + exp(l2 - l) o2

Flash-style backward ops take ``(grad_out, q, k, v, out, lse)`` and rebuild the softmax as
``exp(q k^T * scale - lse)`` with ``D = rowsum(grad_out * out)``; given the MERGED out and lse, each
part's backward returns that part's exact share of the gradients (ring attention does the same per
K/V block). The LSE the forward ops return carries no autograd, so ``MergedAttention`` owns the
backward, and the prefix part's dK/dV come out summed over rows and query heads.

The prefix part's folded queries are one batch entry of ``Hkv`` heads. Flash attention's backward runs one thread
block per (key block, batch entry, head), each walking every query block in series: a short prefix and few KV heads
(Qwen3-8B: 8) leave most of a GPU's SMs idle behind a long serial walk. On CUDA the backward splits the folded
queries into several batch entries against copies of the prefix K/V (``prefix_backward_splits``: enough blocks for
two waves of the SMs, each entry keeping at least 256 queries) and sums their dK/dV in fp32; the padded queries of
the last entry carry a zero gradient, output and LSE, so they add nothing. The maths is the same; only the sum's
order changes.

Kernels: CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``; fp64, fp32, bf16,
fp16; ``is_causal`` is upper-left, which equals lower-right for the square suffix part), CUDA
``aten._scaled_dot_product_flash_attention`` (+ ``_backward``; fp16/bf16, head_dim a multiple of 8 up
to 256, where ``torch.backends.cuda.can_use_flash_attention`` says it runs: ``kernels.cuda_merged_refusal``).
``merged_refusal`` says why these kernels cannot serve a call; the caller then runs the concat path.
Logit softcapping, attention sinks and sliding windows shorter than the call, which none of them takes,
run ``scored_merged_attention`` instead: the same two parts and merge in plain torch ops (each part's scores
capped before its own log-sum-exp, sinks a third part; a window cuts the prefix to its last ``W - 1``
positions with a banded mask, ``schedule.attention.windows``), no repeat on any device, but the scores materialised.

Unequal head sizes (MLA: DeepSeek-V2/V3, Kimi-K2, value heads of 128 against query/key heads of 192): the
flash ops take one head size for Q, K and V. The narrower side is zero-padded to the wider inside the kernel
calls (``pad_head``): zero columns of Q and K add nothing to ``q k^T``, zero columns of V give zero output
columns, so the real columns are exact; the output and the gradients are sliced back (``unpad_head``) and
the scale is always passed explicitly (a kernel's default, ``1/sqrt(padded size)``, would be wrong when Q
and K are padded). Only the unpadded tensors are saved for backward; the padded copies are transient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from verl_prefix.schedule.attention.kernels import cuda_merged_refusal, flash_takes_gqa
from verl_prefix.schedule.attention.windows import band_keep_mask, banded_prefix_keep, cut_prefix, cut_to_chunk

# kwargs HF attention forwards may carry that the merged kernels do not implement -> refusal reason
_UNSERVED_KWARGS = {"sliding_window": "sliding_window", "softcap": "softcap", "s_aux": "sinks"}


def pad_head(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x [..., d]`` zero-padded at the end of its last dim to ``dim >= d`` (itself when ``d == dim``)."""
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


def unpad_head(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The real ``dim`` columns of a tensor ``pad_head`` widened: its first ones (a view)."""
    return x if x.shape[-1] == dim else x[..., :dim]


def kernel_query(query: torch.Tensor, value_dim: int | None) -> torch.Tensor:
    """A query standing for what the kernels see: ``query`` itself, or a zero query of the padded head size
    where values are wider (``value_dim``) than queries (same dtype, device and ``requires_grad``)."""
    if value_dim is None or value_dim <= query.shape[-1]:
        return query
    return query.new_zeros(*query.shape[:-1], value_dim).requires_grad_(query.requires_grad)


def merged_refusal(query: torch.Tensor, kwargs: dict[str, Any], value_dim: int | None = None) -> str | None:
    """Why this attention call cannot run the merged path (a short reason), or None when it can.
    ``value_dim``: the value head size where it differs from the query's (the kernels run the wider one)."""
    query = kernel_query(query, value_dim)
    for name, reason in _UNSERVED_KWARGS.items():
        if kwargs.get(name) is not None:
            return reason
    if float(kwargs.get("dropout", 0.0) or 0.0) > 0.0:
        return "dropout"
    if query.device.type == "cpu":
        if query.dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            return "kernel_dtype"
        return None
    if query.device.type == "cuda":
        return cuda_merged_refusal(query)  # asks torch whether its flash op runs this query here
    return "kernel_device"


def attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """One part: ``(out, lse, aux)``; ``aux`` is what the device's backward op needs besides them.
    Shapes ``[B, H, L, d]`` with equal head counts; ``lse`` is ``[B, H, L]`` fp32 (fp64 for fp64)."""
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, scale=scale
        )
        return out, lse, ()
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, 0.0, causal, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def attention_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    aux: tuple,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One part's ``(dq, dk, dv)`` given the output and LSE the softmax is to be rebuilt from."""
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, query, key, value, out, lse, 0.0, causal, scale=scale
        )
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, query, key, value, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
    )


SPLIT_WAVES = 2  # blocks for two waves of the SMs
SPLIT_MIN_QUERIES = 256  # queries per batch entry, at least: each thread block walks a useful query length
SPLIT_MAX = 16  # copies of the prefix K/V the backward makes, at most
KEY_BLOCK = 128  # flash attention's backward key block


def prefix_backward_splits(kv_heads: int, prefix_len: int, queries: int, sms: int | None) -> int:
    """Into how many batch entries the prefix part's ``queries`` folded queries go for its backward: enough
    (key block x batch entry x head) blocks for ``SPLIT_WAVES`` waves of ``sms`` SMs, each entry keeping at least
    ``SPLIT_MIN_QUERIES`` queries, at most ``SPLIT_MAX``; 1 without SMs to fill (CPU: ``sms`` None)."""
    if not sms:
        return 1
    blocks = kv_heads * -(-prefix_len // KEY_BLOCK)
    wanted = -(-SPLIT_WAVES * sms // blocks)
    return max(1, min(wanted, queries // SPLIT_MIN_QUERIES, SPLIT_MAX))


def split_folded(x: torch.Tensor, splits: int) -> torch.Tensor:
    """``[1, H, N, ...]`` folded queries (or their grads, outputs, LSEs) -> ``[splits, H, ceil(N / splits), ...]``,
    the last entry zero-padded."""
    if splits == 1:
        return x
    length = -(-x.shape[2] // splits)
    pad = [0, 0] * (x.dim() - 3) + [0, splits * length - x.shape[2]]
    x = F.pad(x, pad) if pad[-1] else x
    return x.reshape(x.shape[1], splits, length, *x.shape[3:]).transpose(0, 1).contiguous()


def join_folded(x: torch.Tensor, total: int) -> torch.Tensor:
    """Inverse of ``split_folded`` (``total``: the folded length before padding)."""
    if x.shape[0] == 1:
        return x
    x = x.transpose(0, 1).reshape(1, x.shape[1], -1, *x.shape[3:])
    return x[:, :, :total]


def prefix_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    aux: tuple,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefix part's backward over its folded queries ``[1, Hkv, N, d]``, split into batch entries where
    ``prefix_backward_splits`` says so; dK/dV summed over the entries in fp32."""
    kv_heads, total = query.shape[1], query.shape[2]
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else None
    splits = prefix_backward_splits(kv_heads, key.shape[2], total, sms)
    if splits == 1:
        return attention_backward(grad, query, key, value, out, lse, aux, False, scale)
    length = -(-total // splits)
    if aux:  # the CUDA op's (cum_q, cum_k, max_q, max_k, seed, offset): the query length is the entry's now
        aux = (aux[0], aux[1], length, *aux[3:])
    keys, values = (t.expand(splits, -1, -1, -1).contiguous() for t in (key, value))
    parts = [split_folded(t, splits) for t in (grad, query, out, lse)]
    dq, dk, dv = attention_backward(parts[0], parts[1], keys, values, parts[2], parts[3], aux, False, scale)
    acc = torch.promote_types(dk.dtype, torch.float32)
    dk, dv = (t.to(acc).sum(0, keepdim=True).to(t.dtype) for t in (dk, dv))
    return join_folded(dq, total), dk, dv


def fold_queries(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, S, ...]`` -> ``[1, kv_heads, B * groups * S, ...]``: each KV head's queries from every
    row and every query head of its group (HF's ``repeat_kv`` order: query head h uses KV head h // groups)."""
    rows, heads, length = x.shape[:3]
    groups = heads // kv_heads
    x = x.reshape(rows, kv_heads, groups, length, *x.shape[3:]).transpose(0, 1)
    return x.reshape(1, kv_heads, rows * groups * length, *x.shape[4:])


def unfold_queries(x: torch.Tensor, rows: int, heads: int) -> torch.Tensor:
    """Inverse of ``fold_queries``."""
    kv_heads, total = x.shape[1:3]
    length = total // (rows * (heads // kv_heads))
    x = x.reshape(kv_heads, rows, heads // kv_heads, length, *x.shape[3:]).transpose(0, 1)
    return x.reshape(rows, heads, length, *x.shape[4:])


def merge(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of two attention parts over disjoint keys, in at least fp32."""
    lse = torch.logaddexp(lse1, lse2)
    acc = torch.promote_types(out1.dtype, torch.float32)
    weight1 = (lse1 - lse).exp().unsqueeze(-1).to(acc)
    weight2 = (lse2 - lse).exp().unsqueeze(-1).to(acc)
    out = weight1 * out1.to(acc) + weight2 * out2.to(acc)
    return out.to(out1.dtype), lse


def add_query_grads(dq_prefix: torch.Tensor, dq_suffix: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dQ of the two parts summed in at least fp32 and rounded to ``dtype`` once (as one kernel's would be)."""
    acc = torch.promote_types(dtype, torch.float32)
    return (dq_prefix.to(acc) + dq_suffix.to(acc)).to(dtype)


def backward_stats(
    out: torch.Tensor, lse: torch.Tensor, parts: tuple[tuple[torch.Tensor, torch.Tensor], ...]
) -> list[torch.Tensor]:
    """What each part's backward rebuilds its softmax from: the MERGED output and LSE for both parts.
    (A part's own ``(o_i, l_i)`` would give each part's gradient as if it were the only one.)"""
    return [out, lse, out, lse]


def native_gqa(query: torch.Tensor, kv_heads: int | None = None) -> bool:
    """Whether the suffix part's kernel takes K/V with ``kv_heads`` heads under the query's (query head h reads
    KV head h // groups, and its backward returns dK/dV summed over each group), so that they go in unrepeated
    and are saved for backward at ``Hkv`` heads, not ``Hq``. The CPU flash op does, forward and backward
    (tests/schedule/test_merged_attention.py checks it against sdpa with repeated heads); torch's CUDA flash op
    does where ``kernels.flash_takes_gqa`` says so (torch >= 2.5's GQA check: 2.11 and 2.13 both). Where it
    does not, the suffix K/V are repeated: ``B x (Hq - Hkv) x S x d`` more K and V per layer."""
    if query.device.type == "cpu":
        return True
    return query.device.type == "cuda" and flash_takes_gqa(query, query.shape[1] if kv_heads is None else kv_heads)


def forward_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype the forward kernels run in. On CPU, half-precision queries run both parts in fp32: the
    parts' outputs then reach the log-sum-exp merge unrounded and the merged output is rounded to the
    compute dtype once, as a single sdpa call rounds it (rounding each part first doubles the rounding).
    The prefix leaf is fp32 already and the suffix is short, so the upcasts are cheap; the CPU forward
    kernel measured as fast in fp32 as in bf16 (its backward not: that stays in the compute dtype).
    On CUDA the flash kernels are half precision only: each part's output is rounded, the merge is fp32."""
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return query.dtype


class MergedAttention(torch.autograd.Function):
    """``softmax(q [pk; sk]^T * scale) [pv; sv]`` with the suffix part causal, from two kernel calls.

    q ``[B, Hq, S, d]``; prefix_k/v ``[1, Hkv, P, d]`` / ``[1, Hkv, P, dv]`` in any dtype (the fp32 leaves;
    their grads come back in it); suffix_k/v ``[B, Hkv, S, d]`` / ``[B, Hkv, S, dv]`` in q's dtype (repeated to
    ``Hq`` heads where ``native_gqa`` is False). Returns ``[B, Hq, S, dv]`` in q's dtype. The forward runs in
    ``forward_dtype``, the backward in q's dtype. Where ``dv != d`` both kernels run at ``max(d, dv)``
    (``pad_head``) and the output and gradients are sliced back (``unpad_head``).
    """

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        prefix_key: torch.Tensor,
        prefix_value: torch.Tensor,
        suffix_key: torch.Tensor,
        suffix_value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        rows, heads = query.shape[:2]
        kv_heads = prefix_key.shape[1]
        work = forward_dtype(query)
        value_dim = prefix_value.shape[-1]
        dim = max(query.shape[-1], value_dim)
        with torch.autocast(query.device.type, enabled=False):
            q = pad_head(query.to(work), dim)
            pk, pv = pad_head(prefix_key.to(work), dim), pad_head(prefix_value.to(work), dim)
            out1, lse1, aux1 = attention_forward(fold_queries(q, kv_heads), pk, pv, False, scale)
            out1, lse1 = unfold_queries(out1, rows, heads), unfold_queries(lse1, rows, heads)
            sk, sv = pad_head(suffix_key.to(work), dim), pad_head(suffix_value.to(work), dim)
            out2, lse2, aux2 = attention_forward(q, sk, sv, True, scale)
            out, lse = merge(out1, lse1, out2, lse2)
            out = unpad_head(out, value_dim).to(query.dtype).contiguous()  # the one rounding to the compute dtype
        saved = backward_stats(out, lse, ((out1, lse1), (out2, lse2)))
        ctx.save_for_backward(query, prefix_key, prefix_value, suffix_key, suffix_value, *saved)
        ctx.aux, ctx.scale = (aux1, aux2), scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        query, prefix_key, prefix_value, suffix_key, suffix_value, out_p, lse_p, out_s, lse_s = ctx.saved_tensors
        rows, heads = query.shape[:2]
        kv_heads = prefix_key.shape[1]
        dtype = query.dtype
        head_dim, value_dim = query.shape[-1], prefix_value.shape[-1]
        dim = max(head_dim, value_dim)
        grad = pad_head(grad.contiguous().to(dtype), dim)
        q, out_p, out_s = pad_head(query, dim), pad_head(out_p, dim), pad_head(out_s, dim)
        with torch.autocast(query.device.type, enabled=False):
            dq_p, dk_p, dv_p = prefix_backward(
                fold_queries(grad, kv_heads),
                fold_queries(q, kv_heads),
                pad_head(prefix_key.to(dtype), dim),
                pad_head(prefix_value.to(dtype), dim),
                fold_queries(out_p, kv_heads),
                fold_queries(lse_p, kv_heads),
                ctx.aux[0],
                ctx.scale,
            )
            dq_s, dk_s, dv_s = attention_backward(
                grad,
                q,
                pad_head(suffix_key, dim),
                pad_head(suffix_value, dim),
                out_s,
                lse_s,
                ctx.aux[1],
                True,
                ctx.scale,
            )
            dq = unpad_head(add_query_grads(unfold_queries(dq_p, rows, heads), dq_s, dtype), head_dim)
        dk_p, dv_p = unpad_head(dk_p, head_dim).to(prefix_key.dtype), unpad_head(dv_p, value_dim).to(prefix_value.dtype)
        return dq, dk_p, dv_p, unpad_head(dk_s, head_dim), unpad_head(dv_s, value_dim), None


def cap_scores(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Logit softcapping as Gemma-2's eager attention and flash-attn's ``softcap`` apply it:
    ``softcap * tanh(scores / softcap)``, before any mask. ``None`` (or 0, flash-attn's "off") is the identity."""
    if not softcap:
        return scores
    return torch.tanh(scores / softcap) * softcap


def scored_part(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    softcap: float | None,
    keep: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One part's ``(out, lse)`` in plain torch ops (autograd's own backward), scores capped before the
    part's own log-sum-exp. ``keep``: a boolean mask broadcast over the scores (None: every key). A query that
    keeps no key of this part (a sliding window past the prefix) gets ``out = 0`` and ``lse = -inf``, exactly,
    and no gradient: its scores are swapped for zeros before the softmax, so no ``-inf - -inf`` reaches autograd."""
    scores = cap_scores(torch.matmul(query, key.transpose(-1, -2)) * scale, softcap)
    if keep is None:
        lse = torch.logsumexp(scores, dim=-1)
        return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), value), lse
    scores = scores.masked_fill(~keep, float("-inf"))
    empty = torch.isneginf(scores.detach().amax(dim=-1))
    scores = scores.masked_fill(empty.unsqueeze(-1), 0.0)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), value)
    return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))


def scored_merged_attention(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    window: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The two-part attention with logit softcapping, attention sinks, a sliding window and/or attention chunks,
    which no fused kernel here takes: each part's scores are built in plain torch ops (at least fp32) and capped
    before the part's own log-sum-exp, so the merge stays exact; sinks (one logit per query head, no value) are a
    third part of the merge. Same layout and GQA handling as ``MergedAttention`` (prefix queries folded against the ONE
    prefix, suffix K/V shared by a KV group's query heads by broadcasting: no repeat on any device), but the
    scores are materialised: ``B x Hq x S x (P + S)`` in fp32 per layer, saved for backward.

    ``window`` (a sliding window shorter than the call, ``schedule.attention.windows``): the prefix part attends to a
    view of the prefix's last ``W - 1`` positions with a banded mask (queries past the band keep no prefix key: their
    part is empty, ``lse = -inf``, and the merge gives it weight 0), the suffix part is causal within the
    window; the scores are then ``B x Hq x S x (W - 1 + S)`` whatever the prefix length. ``chunk`` (a chunked
    layer whose chunks the call crosses, ``schedule.attention.windows.active_chunk``): the prefix part keeps the
    positions of the chunk holding the first suffix position (none when the prefix ends on a chunk boundary), each part
    masked to its query's own chunk (absolute positions: the prefix's length is the first query's)."""
    rows, heads, length, dim = query.shape
    offset = prefix_key.shape[2]  # the first suffix query's absolute position
    kv_heads = prefix_key.shape[1]  # value heads may be narrower or wider than dim: plain matmuls take either
    work = torch.promote_types(query.dtype, torch.float32)
    q = query.to(work)
    grouped = q.reshape(rows, kv_heads, heads // kv_heads, length, dim)
    suffix_keep = band_keep_mask(length, length, offset, window, chunk, query.device)  # causal, window, chunk
    out, lse = scored_part(
        grouped, suffix_key.to(work).unsqueeze(2), suffix_value.to(work).unsqueeze(2), scale, softcap, suffix_keep
    )
    out, lse = out.reshape(*query.shape[:3], -1), lse.reshape(query.shape[:3])
    prefix_keep = None
    if window is not None:
        prefix_key, prefix_value = cut_prefix(prefix_key, window), cut_prefix(prefix_value, window)
        prefix_keep = banded_prefix_keep(length, prefix_key.shape[2], window, query.device)
    if chunk is not None:
        prefix_key, prefix_value = cut_to_chunk(prefix_key, offset, chunk), cut_to_chunk(prefix_value, offset, chunk)
        cut = prefix_key.shape[2]
        in_chunk = band_keep_mask(length, length + cut, offset, None, chunk, query.device)[0, 0, :, :cut]
        prefix_keep = in_chunk if prefix_keep is None else prefix_keep[:, prefix_keep.shape[1] - cut :] & in_chunk
    if prefix_keep is not None:
        prefix_keep = prefix_keep.repeat(rows * (heads // kv_heads), 1)  # folded query r is row position r % length
    if prefix_key.shape[2] > 0:
        out1, lse1 = scored_part(
            fold_queries(q, kv_heads), prefix_key.to(work), prefix_value.to(work), scale, softcap, prefix_keep
        )
        out, lse = merge(unfold_queries(out1, rows, heads), unfold_queries(lse1, rows, heads), out, lse)
    if sinks is not None:
        total = torch.logaddexp(lse, sinks.to(work).reshape(1, heads, 1))
        out = out * torch.exp(lse - total).unsqueeze(-1)
    return out.to(query.dtype)


def merged_attention(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    scaling: float | None = None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """HF layout in, HF layout out: query ``[B, Hq, S, d]``, prefix K/V ``[1, Hkv, P, d]``, suffix K/V
    ``[B, Hkv, S, d]`` (values may have another head size ``dv``) -> ``[B, S, Hq, dv]`` in the query's dtype.
    A prefix leaf held in fp32 goes in as it is (no per-micro-batch copy is saved for backward) and its
    gradient comes back in fp32. ``softcap``
    (Gemma-2's ``attn_logit_softcapping``) or ``sinks`` (``s_aux``, one logit per query head) run
    ``scored_merged_attention`` (plain torch ops, any device and dtype), and so does a sliding ``window``
    shorter than the call (``schedule.attention.windows.active_window``; the fused kernels take no mask) or chunks the
    call crosses (``active_chunk``); otherwise the
    device's flash kernels (``MergedAttention``)."""
    heads, kv_heads = query.shape[1], suffix_key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} KV heads")
    groups = heads // kv_heads
    dtype = query.dtype
    if softcap or sinks is not None or window is not None or chunk is not None:
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        suffix_key, suffix_value = suffix_key.to(dtype), suffix_value.to(dtype)
        out = scored_merged_attention(
            query, prefix_key, prefix_value, suffix_key, suffix_value, scale, softcap, sinks, window, chunk
        )
        return out.transpose(1, 2).contiguous()
    suffix_key, suffix_value = suffix_key.to(dtype), suffix_value.to(dtype)
    if groups > 1 and not native_gqa(query, kv_heads):
        suffix_key = suffix_key.repeat_interleave(groups, dim=1)
        suffix_value = suffix_value.repeat_interleave(groups, dim=1)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = MergedAttention.apply(query, prefix_key, prefix_value, suffix_key, suffix_value, scale)
    return out.transpose(1, 2).contiguous()
