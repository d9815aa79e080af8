"""Whether this machine's GPU attention kernels can serve phase B's two-part attention: asked of torch,
never assumed (issue 20 items 5 and 6).

``merged`` on CUDA calls torch's flash op (``aten._scaled_dot_product_flash_attention`` and its backward)
directly, outside sdpa's own dispatcher, so nothing else checks that it runs here. ``cuda_merged_refusal``
asks what sdpa would ask: ``torch.backends.cuda.can_use_flash_attention`` with the call's real query (its
shape, dtype, device and whether it needs a backward), causal and not. A short reason comes back where it
cannot, and ``auto`` then runs concat, counted as ``prefix/phase_b_attention/concat_<reason>``:

- ``kernel_dtype``: not fp16/bf16 (the flash kernels' only dtypes);
- ``kernel_head_dim``: head_dim not a multiple of 8 or above 256;
- ``kernel_rocm``: a ROCm build, whose flash op (AOTriton/CK) returns its LSE in other conventions than the
  merge and the backward here expect;
- ``kernel_impl``: another flash implementation was activated with ``torch.nn.attention.
  activate_flash_attention_impl`` (FA3/FA4 replace the op behind the same name; their LSE and backward are
  not checked here);
- ``kernel_arch``: ``can_use_flash_attention`` says no (pre-Ampere GPUs such as T4 or V100, a build without
  flash attention, ``torch.backends.cuda.enable_flash_sdp(False)``, head_dim above 192 with a backward on
  sm86/sm89, ...).

``verl_prefix.schedule.attention.preflight`` asks the same for a mini-batch before it runs, from the model's head_dim
and compute dtype, and the engine agrees on its answer across data-parallel ranks, so every rank takes the
same path or raises the same error.
"""

from __future__ import annotations

import torch


def is_rocm() -> bool:
    """A ROCm (HIP) build of torch."""
    return getattr(torch.version, "hip", None) is not None


def active_flash_impl() -> str | None:
    """The flash implementation ``torch.nn.attention.activate_flash_attention_impl`` activated, if any
    (torch builds without the registry have none)."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    return current() if current is not None else None


def can_use_flash(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, enable_gqa: bool = False
) -> bool:
    """``torch.backends.cuda.can_use_flash_attention`` on these tensors (no mask, no dropout; GQA only with
    ``enable_gqa``, which a torch before that argument cannot be asked: False there)."""
    params_type = torch.backends.cuda.SDPAParams
    try:
        params = params_type(query, key, value, None, 0.0, causal, enable_gqa)
    except TypeError:  # torch before enable_gqa took six arguments
        if enable_gqa:
            return False
        params = params_type(query, key, value, None, 0.0, causal)
    return bool(torch.backends.cuda.can_use_flash_attention(params, False))


def flash_takes_gqa(query: torch.Tensor, kv_heads: int) -> bool:
    """Whether torch's CUDA flash op runs the suffix part with ``kv_heads`` K/V heads under the query's
    ``[B, Hq, S, d]`` (query head h reads KV head h // groups), so its K/V need no repeat.

    The in-tree flash kernel (FA2's ``mha_fwd``/``mha_bwd``, behind ``aten._scaled_dot_product_flash_attention``
    in torch 2.11 and 2.13 alike) takes ``num_heads_k`` dividing ``num_heads`` and its backward sums dK/dV over
    each group; sdpa itself hands it unrepeated K/V with ``enable_gqa``, after ``can_use_flash_attention``'s
    ``check_batch_size_and_num_heads_dense<supports GQA>``. Asked here the same way, with a K/V of the real
    head count (a view of the query: only its shape, dtype and grad are read)."""
    if kv_heads == query.shape[1]:
        return True
    key = query[:, :kv_heads]
    return can_use_flash(query, key, key, True, enable_gqa=True)


def cuda_merged_refusal(query: torch.Tensor) -> str | None:
    """Why torch's CUDA flash op cannot run phase B's two parts for this query ``[B, H, S, d]``, or None.

    The prefix part runs with equal query and K/V heads (it folds the query heads of a KV group into the query
    length); the suffix part's K/V go in unrepeated where ``flash_takes_gqa`` says the op takes them, a check
    that asks nothing of GQA beyond dividing head counts, else repeated. So the query stands for the K/V here:
    the suffix part is causal and square, the prefix part unmasked."""
    head_dim = query.shape[-1]
    if query.dtype not in (torch.float16, torch.bfloat16):
        return "kernel_dtype"
    if head_dim % 8 or head_dim > 256:
        return "kernel_head_dim"
    if is_rocm():
        return "kernel_rocm"
    if active_flash_impl() is not None:
        return "kernel_impl"
    if not (can_use_flash(query, query, query, True) and can_use_flash(query, query, query, False)):
        return "kernel_arch"
    return None
