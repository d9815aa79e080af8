"""Phase B's two-part attention on packed suffixes (``prefix_reuse.phase_b_attention: merged_varlen``).

The same maths as ``attention.merged`` (prefix part unmasked against the ONE shared prefix K/V, suffix
part causal per row, merged by log-sum-exp, each part's backward called with the merged output and LSE),
but the suffix tokens are packed without padding to ``[T, H, d]`` with ``cu_seqlens`` (the rows' real
token counts, MoE's extra last token included), flash-attn's varlen layout:

- suffix part: ``T`` packed queries, causal self-attention within each row (``cu_seqlens`` both sides);
- prefix part: all ``T`` packed queries as ONE sequence against the ``P`` prefix keys, no mask. Both
  kernels take GQA natively (query head ``h`` reads KV head ``h // groups``), so nothing is repeated.

LSEs are ``[H, T]`` fp32 (flash-attn's varlen layout; fp64 for fp64 on CPU). Pad positions are neither
computed nor saved for backward; their output is zero (no real position reads a pad: causal, right-padded).

Kernels, with one signature (``VarlenKernels``), chosen per device by ``kernels_for``:
- CUDA, torch's own (``TORCH``, preferred): ``aten::_flash_attention_forward/_backward`` with ``cum_seq_q/k``,
  the ops ``torch.nn.attention.varlen`` calls; used where that module exists (torch >= 2.10; the GPU stack's
  torch 2.11 and this repo's 2.13 both ship it) in a CUDA build with flash attention. Called through the aten
  ops, not ``varlen_attn``, because the backward must be given the merged output and LSE.
- CUDA, flash-attn (``FLASH_ATTN``, the fallback where torch has no varlen attention):
  ``flash_attn.flash_attn_interface._flash_attn_varlen_forward/_backward``, a private API whose signature
  changed at 2.7 (before it the forward returned 8 values and took ``window_size`` as a tuple), so only
  flash-attn >= 2.7 is used; an older one is refused with its version named (``varlen_kernel_problem``).
- CPU (``REFERENCE``): ``reference_varlen_forward``/``_backward``, per-sequence calls of
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), so the packing, unpacking and merge
  code runs in CI. It is a reference, not a fast path: ``B + 1`` kernel calls per layer.

Both CUDA kernels are fp16/bf16 with head_dim a multiple of 8 up to 256 and take GQA natively; neither has
run here (no GPU): ``tests/schedule/test_varlen_attention.py`` checks the dispatch and the calls with mocks on
CPU and has CUDA tests that skip without a GPU.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_prefix.schedule.attention import merged as MA

FLASH_ATTN_MIN_VERSION = (2, 7)


@functools.cache
def flash_attn_version() -> str | None:
    """The installed flash-attn's version, or None where it does not import (a missing or broken install,
    e.g. built against another CUDA, both mean "not there")."""
    try:
        import flash_attn
    except Exception:  # noqa: BLE001
        return None
    return str(getattr(flash_attn, "__version__", "0"))


def version_tuple(version: str) -> tuple[int, int]:
    """``"2.8.3"`` -> ``(2, 8)``; anything unreadable -> ``(0, 0)``."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


@functools.cache
def torch_varlen_available() -> bool:
    """torch's own varlen flash attention runs here: ``torch.nn.attention.varlen`` exists (torch >= 2.10), the
    aten flash op takes ``cum_seq_q/k``, and the build is CUDA (not ROCm) with flash attention."""
    if getattr(torch.version, "hip", None) is not None:
        return False
    try:
        importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        return False
    forward = getattr(torch.ops.aten, "_flash_attention_forward", None)
    backward = getattr(torch.ops.aten, "_flash_attention_backward", None)
    if forward is None or backward is None or "cum_seq_q" not in str(forward.default._schema):
        return False
    return bool(torch.backends.cuda.is_flash_attention_available())


def varlen_kernel_problem() -> str | None:
    """Why no CUDA varlen kernel serves here (one line naming the versions), or None when one does."""
    if torch_varlen_available():
        return None
    version = flash_attn_version()
    want = ".".join(map(str, FLASH_ATTN_MIN_VERSION))
    lacks = f"torch {torch.__version__} has no CUDA varlen flash attention (torch.nn.attention.varlen, torch >= 2.10)"
    if version is None:
        return f"{lacks} and flash_attn does not import: install torch >= 2.10 or flash-attn >= {want}"
    if version_tuple(version) < FLASH_ATTN_MIN_VERSION:
        return (
            f"{lacks} and flash-attn {version} is older than {want}, whose private varlen API "
            f"(_flash_attn_varlen_forward/_backward) this path calls: upgrade flash-attn or torch"
        )
    if flash_attn_functions() is None:
        return f"{lacks} and flash-attn {version} lacks _flash_attn_varlen_forward/_backward"
    return None


def flash_attn_functions() -> tuple[Callable, Callable] | None:
    """flash-attn's ``(_flash_attn_varlen_forward, _flash_attn_varlen_backward)``, or None."""
    if flash_attn_version() is None:
        return None
    from flash_attn import flash_attn_interface as fa

    forward = getattr(fa, "_flash_attn_varlen_forward", None)
    backward = getattr(fa, "_flash_attn_varlen_backward", None)
    return (forward, backward) if forward is not None and backward is not None else None


def varlen_refusal(query: torch.Tensor, kwargs: dict[str, Any], value_dim: int | None = None) -> str | None:
    """Why this attention call cannot run the varlen path (a short reason), or None when it can.
    ``value_dim``: the value head size where it differs from the query's (the kernels run the wider one)."""
    reason = MA.merged_refusal(query, kwargs, value_dim)
    if reason is not None or query.device.type == "cpu":
        return reason
    if kernels_for(query.device) is None:
        return "varlen_kernel"  # varlen_kernel_problem() says which library is missing or too old
    return None  # merged_refusal already asked torch whether its flash kernels run this dtype/head_dim here


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without blocking the host: on CUDA through pinned memory with a
    non-blocking copy (a pageable copy synchronises the stream), elsewhere an ordinary ``to``."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass(frozen=True)
class Packing:
    """Where a right-padded ``[B, S]`` micro-batch's real tokens go in the packed ``[T]`` layout.

    Everything a layer needs is built here once per micro-batch, on the host, and copied to the device without
    a sync: ``cu_seqlens``, ``index`` (the gather/scatter positions, so no layer gathers by a boolean mask,
    whose nonzero count the host would wait for, forward and backward) and the one-sequence offsets of the
    prefix part (``whole``, cached per length). A layer then runs with no device-to-host sync of its own."""

    mask: torch.Tensor  # [B, S] bool: real tokens (each row's first ``lengths[b]``)
    cu_seqlens: torch.Tensor  # [B + 1] int32 on the tokens' device: row b is ``cu[b]:cu[b + 1]``
    lengths: tuple[int, ...]
    width: int  # S
    index: torch.Tensor | None = None  # [T] int64 on the tokens' device: packed token t is flat position index[t]
    _wholes: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.index is None:  # built from a mask directly (tests): one nonzero, here, not in a layer
            object.__setattr__(self, "index", self.mask.flatten().nonzero().flatten())

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    def whole(self, length: int) -> torch.Tensor:
        """``cu_seqlens`` of one sequence of ``length`` tokens on the packing's device (``[0, T]`` for the
        prefix part's queries, ``[0, P]`` for its keys), built at its first use in the micro-batch."""
        found = self._wholes.get(length)
        if found is None:
            found = to_device(torch.tensor([0, length], dtype=torch.int32), self.cu_seqlens.device)
            self._wholes[length] = found
        return found

    @classmethod
    def from_lengths(
        cls, lengths: torch.Tensor | list[int], width: int, device: torch.device, prefix_len: int | None = None
    ) -> Packing:
        """From each row's real token count (``SuffixBatch.tokens.sum(1)``), ``1 <= length <= width``;
        ``prefix_len``: the prefix part's offsets (``whole``) are built here too."""
        counts = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
        if not counts or min(counts) < 1 or max(counts) > width:
            raise ValueError(f"row lengths must lie in 1..{width}, got {counts}")
        cu = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        mask = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]
        index = torch.cat([torch.arange(n) + row * width for row, n in enumerate(counts)])
        packing = cls(to_device(mask, device), to_device(cu, device), tuple(counts), width, to_device(index, device))
        for length in (sum(counts), prefix_len) if prefix_len is not None else ():
            packing.whole(length)
        return packing


def gather_packed(x: torch.Tensor, packing: Packing) -> torch.Tensor:
    """``[B, S, ...]`` -> the real tokens ``[T, ...]`` by ``packing.index`` (``index_select``: no host sync,
    forward or backward, where a boolean mask would need its nonzero count)."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, packing.index)


def scatter_packed(x: torch.Tensor, packing: Packing) -> torch.Tensor:
    """Packed ``[T, ...]`` -> ``[B, S, ...]``, zero at pad positions (``index_copy``: no host sync)."""
    rows = len(packing.lengths)
    full = x.new_zeros(rows * packing.width, *x.shape[1:])
    return full.index_copy(0, packing.index, x).view(rows, packing.width, *x.shape[1:])


def _spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[L, H, d]`` -> ``[1, H, L, d]`` (a view), the CPU op's layout."""
    return x.transpose(0, 1).unsqueeze(0)


def reference_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's varlen forward on CPU: q ``[Tq, Hq, d]``, k/v ``[Tk, Hkv, d]`` -> ``(out [Tq, Hq, d],
    lse [Hq, Tq])``, one CPU flash call per sequence. ``causal`` is upper-left per sequence (equal to
    flash-attn's lower-right where a sequence's query and key lengths agree, the only causal use here)."""
    out = q.new_zeros(q.shape)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=lse_dtype, device=q.device)
    for (qs, qe), (ks, ke) in zip(_spans(cu_seqlens_q), _spans(cu_seqlens_k)):
        if qe == qs:
            continue
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(  # noqa: E741
            _heads_first(q[qs:qe]), _heads_first(k[ks:ke]), _heads_first(v[ks:ke]), 0.0, causal, scale=softmax_scale
        )
        out[qs:qe] = o[0].transpose(0, 1)
        lse[:, qs:qe] = l[0]
    return out, lse


def reference_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn's varlen backward on CPU: ``(dq, dk, dv)`` shaped like ``(q, k, v)``, the softmax rebuilt
    from the given ``out`` and ``lse [Hq, Tq]``; dK/dV summed over each KV head's query heads."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (qs, qe), (ks, ke) in zip(_spans(cu_seqlens_q), _spans(cu_seqlens_k)):
        if qe == qs:
            continue
        g_q, g_k, g_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _heads_first(dout[qs:qe]),
            _heads_first(q[qs:qe]),
            _heads_first(k[ks:ke]),
            _heads_first(v[ks:ke]),
            _heads_first(out[qs:qe]),
            lse[:, qs:qe].unsqueeze(0),
            0.0,
            causal,
            scale=softmax_scale,
        )
        dq[qs:qe] = g_q[0].transpose(0, 1)
        dk[ks:ke] += g_k[0].transpose(0, 1)
        dv[ks:ke] += g_v[0].transpose(0, 1)
    return dq, dk, dv


def _check_lse(lse: torch.Tensor, q: torch.Tensor, name: str) -> torch.Tensor:
    if lse.shape != (q.shape[1], q.shape[0]):  # flash-attn < 2.4 returned [B, H, max_seqlen_q]
        raise RuntimeError(f"{name}'s varlen LSE is {tuple(lse.shape)}, not [heads, tokens]: unsupported version")
    return lse


def aten_flash_ops() -> tuple[Callable, Callable]:
    """``(aten::_flash_attention_forward, aten::_flash_attention_backward)``: the ops torch's varlen attention
    runs (CUDA kernels; the schemas exist in every build)."""
    return torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward


def torch_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's varlen flash forward (``aten::_flash_attention_forward`` with ``cum_seq_q/k``, as
    ``torch.nn.attention.varlen`` calls it): ``(out [Tq, Hq, d], lse [Hq, Tq] fp32)``."""
    q, k, v = (x.contiguous() for x in (q, k, v))
    out, lse = aten_flash_ops()[0](
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False, scale=softmax_scale
    )[:2]
    return out, _check_lse(lse, q, "torch")


def torch_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's varlen flash backward (``aten::_flash_attention_backward``): ``(dq, dk, dv)``. No dropout, so
    the RNG state is zeros and the last tensor unused, exactly as ``torch.nn.attention.varlen`` passes them."""
    q, k, v = (x.contiguous() for x in (q, k, v))
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = aten_flash_ops()[1](
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, 0.0, causal, rng_state, unused, scale=softmax_scale,
    )  # fmt: skip
    return dq, dk, dv


def flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn >= 2.7's ``_flash_attn_varlen_forward`` (it returns ``out, lse, S_dmask, rng_state``)."""
    functions = flash_attn_functions()
    if functions is None:
        raise RuntimeError(f"merged_varlen on CUDA: {varlen_kernel_problem()}")
    q, k, v = (x.contiguous() for x in (q, k, v))
    out, lse, _, _ = functions[0](
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        causal=causal,
    )
    return out, _check_lse(lse, q, "flash_attn")


def flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn >= 2.7's ``_flash_attn_varlen_backward`` (writes dq, dk, dv in place), deterministic where
    ``torch.use_deterministic_algorithms`` asks for it (torch's own flash backward reads the same flag)."""
    functions = flash_attn_functions()
    if functions is None:
        raise RuntimeError(f"merged_varlen on CUDA: {varlen_kernel_problem()}")
    q, k, v = (x.contiguous() for x in (q, k, v))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    functions[1](
        dout.contiguous(),
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=torch.are_deterministic_algorithms_enabled(),  # its dK/dV atomics otherwise vary run to run
    )
    return dq, dk, dv


@dataclass(frozen=True)
class VarlenKernels:
    """One varlen attention implementation. ``forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, softmax_scale, causal) -> (out [Tq, Hq, d], lse [Hq, Tq])``; ``backward(dout, q, k, v, out,
    lse, <the same>) -> (dq, dk, dv)``, the softmax rebuilt from the given ``out`` and ``lse``."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


REFERENCE = VarlenKernels("reference", reference_varlen_forward, reference_varlen_backward)
TORCH = VarlenKernels("torch", torch_varlen_forward, torch_varlen_backward)
FLASH_ATTN = VarlenKernels("flash_attn", flash_attn_varlen_forward, flash_attn_varlen_backward)


def kernels_for(device: torch.device) -> VarlenKernels | None:
    """The varlen kernels for ``device``: the CPU reference; on CUDA torch's own where it has them, else
    flash-attn >= 2.7; None where neither (``varlen_kernel_problem`` says why) or on other devices."""
    if device.type == "cpu":
        return REFERENCE
    if device.type != "cuda":
        return None
    if torch_varlen_available():
        return TORCH
    if varlen_kernel_problem() is None:
        return FLASH_ATTN
    return None


def _kernels(device: torch.device) -> VarlenKernels:
    chosen = kernels_for(device)
    if chosen is None:
        raise RuntimeError(f"merged_varlen on {device.type}: {varlen_kernel_problem() or 'no varlen kernel'}")
    return chosen


def _prefix_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``[1, Hkv, P, d]`` prefix leaf as ``[P, Hkv, d]`` in ``dtype``: a view on CPU where no cast is
    needed (the reference kernel transposes it back), else one contiguous copy (flash-attn's layout)."""
    rows = t[0].transpose(0, 1)
    if rows.dtype == dtype and rows.device.type == "cpu":
        return rows
    return torch.empty(rows.shape, dtype=dtype, device=rows.device).copy_(rows)


def merge_packed(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``MA.merge`` in the varlen layout: outputs ``[T, H, d]``, LSEs ``[H, T]`` (returned contiguous)."""
    out, lse = MA.merge(out1, lse1.t(), out2, lse2.t())
    return out, lse.t().contiguous()


class MergedVarlenAttention(torch.autograd.Function):
    """``MergedAttention`` on packed suffixes: q ``[T, Hq, d]``; prefix_k/v ``[1, Hkv, P, d]`` in any dtype
    (the fp32 leaves; their grads come back in it); suffix_k/v ``[T, Hkv, d]`` in q's dtype; rows given by
    ``packing`` (its offsets are already on the device: no layer builds or reads one on the host). Returns
    ``[T, Hq, d]`` in q's dtype. Forward in ``MA.forward_dtype``, backward in q's."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        prefix_key: torch.Tensor,
        prefix_value: torch.Tensor,
        suffix_key: torch.Tensor,
        suffix_value: torch.Tensor,
        packing: Packing,
        scale: float,
    ) -> torch.Tensor:
        total, prefix_len = query.shape[0], prefix_key.shape[2]
        work = MA.forward_dtype(query)
        kernels = _kernels(query.device)
        cu_q, cu_p = packing.whole(total), packing.whole(prefix_len)
        cu_seqlens, max_len = packing.cu_seqlens, packing.max_len
        value_dim = prefix_value.shape[-1]
        dim = max(query.shape[-1], value_dim)  # unequal head sizes (MLA): both run padded, as in MA
        with torch.autocast(query.device.type, enabled=False):
            q = MA.pad_head(query.to(work), dim)
            pk, pv = (MA.pad_head(_prefix_rows(t, work), dim) for t in (prefix_key, prefix_value))  # [P, Hkv, d]
            out1, lse1 = kernels.forward(q, pk, pv, cu_q, cu_p, total, prefix_len, scale, False)
            sk, sv = MA.pad_head(suffix_key.to(work), dim), MA.pad_head(suffix_value.to(work), dim)
            out2, lse2 = kernels.forward(q, sk, sv, cu_seqlens, cu_seqlens, max_len, max_len, scale, True)
            out, lse = merge_packed(out1, lse1, out2, lse2)
            out = MA.unpad_head(out, value_dim).to(query.dtype).contiguous()  # the one rounding to the compute dtype
        saved = MA.backward_stats(out, lse, ((out1, lse1), (out2, lse2)))
        ctx.save_for_backward(query, prefix_key, prefix_value, suffix_key, suffix_value, *saved)
        ctx.packing, ctx.scale, ctx.kernels = packing, scale, kernels
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        query, prefix_key, prefix_value, suffix_key, suffix_value, out_p, lse_p, out_s, lse_s = ctx.saved_tensors
        total, prefix_len = query.shape[0], prefix_key.shape[2]
        dtype = query.dtype
        head_dim, value_dim = query.shape[-1], prefix_value.shape[-1]
        dim = max(head_dim, value_dim)
        grad = MA.pad_head(grad.contiguous().to(dtype), dim)
        q, out_p, out_s = MA.pad_head(query, dim), MA.pad_head(out_p, dim), MA.pad_head(out_s, dim)
        sk, sv = MA.pad_head(suffix_key, dim), MA.pad_head(suffix_value, dim)
        packing = ctx.packing
        cu_q, cu_p, cu_seqlens, max_len = (
            packing.whole(total),
            packing.whole(prefix_len),
            packing.cu_seqlens,
            packing.max_len,
        )
        with torch.autocast(query.device.type, enabled=False):
            pk, pv = (MA.pad_head(_prefix_rows(t, dtype), dim) for t in (prefix_key, prefix_value))
            dq_p, dk_p, dv_p = ctx.kernels.backward(
                grad, q, pk, pv, out_p, lse_p, cu_q, cu_p, total, prefix_len, ctx.scale, False
            )
            dq_s, dk_s, dv_s = ctx.kernels.backward(
                grad, q, sk, sv, out_s, lse_s, cu_seqlens, cu_seqlens, max_len, max_len, ctx.scale, True,
            )  # fmt: skip
            dq = MA.unpad_head(MA.add_query_grads(dq_p, dq_s, dtype), head_dim)
        dk_p = MA.unpad_head(dk_p, head_dim).transpose(0, 1).unsqueeze(0).to(prefix_key.dtype).contiguous()
        dv_p = MA.unpad_head(dv_p, value_dim).transpose(0, 1).unsqueeze(0).to(prefix_value.dtype).contiguous()
        return dq, dk_p, dv_p, MA.unpad_head(dk_s, head_dim), MA.unpad_head(dv_s, value_dim), None, None


def merged_varlen_attention(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    packing: Packing,
    scaling: float | None = None,
) -> torch.Tensor:
    """HF layout in, HF layout out, as ``merged.merged_attention``: query ``[B, Hq, S, d]``, prefix K/V
    ``[1, Hkv, P, d]``, suffix K/V ``[B, Hkv, S, d]`` (values may have another head size ``dv``: padded to the
    wider inside, as in ``merged.merged_attention``) -> ``[B, S, Hq, dv]``, zero at pad positions. Only the
    ``packing``'s real tokens reach the kernels (and what they save for backward), gathered and scattered by its
    precomputed index (``gather_packed``/``scatter_packed``): no host sync in the layer, forward or backward."""
    rows, heads, width = query.shape[:3]
    kv_heads = suffix_key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} KV heads")
    if packing.mask.shape != (rows, width):
        raise ValueError(f"packing is for {tuple(packing.mask.shape)} tokens, attention sees {(rows, width)}")
    dtype = query.dtype
    q = gather_packed(query.transpose(1, 2), packing)  # [T, Hq, d]
    sk = gather_packed(suffix_key.to(dtype).transpose(1, 2), packing)
    sv = gather_packed(suffix_value.to(dtype).transpose(1, 2), packing)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = MergedVarlenAttention.apply(q, prefix_key, prefix_value, sk, sv, packing, scale)
    return scatter_packed(out, packing)  # [B, S, Hq, d], pads zero
