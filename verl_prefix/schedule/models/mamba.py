"""Mamba-2 mixers under reuse: a continuation forward that starts from the state at the prefix boundary.

transformers' Mamba-2 mixers (Nemotron-H, Bamba, Granite-4 hybrid) continue no *multi-token* forward from a
state on their torch path: it starts the chunked SSD scan from zeros and pads the depthwise convolution with
zeros; only the single-token decode path reads a cache. Their multi-chunk torch scan is also wrong: it sums
the inter-chunk decays over the target chunk instead of the source one (``(decay_chunk * states).sum(dim=2)``),
so on the torch path a sequence longer than ``chunk_size`` is not the Mamba-2 recurrence (the CUDA kernels
are). The schedule therefore runs served mixers through ``continue_forward``: the mixer's own ``in_proj``,
``conv1d`` weights, activation, ``dt_bias``/``A_log``/``D``, gated norm and ``out_proj`` in the order and
dtypes of its torch path, with the SSD scan written out with an initial state (``ssd_scan``, the minimal
discrete SSD of the Mamba-2 paper). Within one chunk it computes what the mixer computes (checked in fp64
against the dense model in tests/schedule/test_mamba.py); the conv context is the last ``kernel - 1``
pre-convolution inputs.

On a GPU with ``mamba_ssm`` loaded the stock mixer takes its fused kernels instead (``takes_fast_path``), which
compute the recurrence over every chunk. ``continue_forward`` then scans with the same kernel through its own state
arguments (``mamba_chunk_scan_combined(..., initial_states=, return_final_states=True)``, ``fused_chunk_scan``),
the dt limit as the fused path applies it, and no sequence length runs dense (``single_chunk_limit`` counts torch-path
mixers only). The tests run that branch on CPU with a stand-in of the kernel's call (the token-by-token recurrence);
``bench/gpu_check.sh`` runs it against the stock engine on the kernels.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.bamba import modeling_bamba
from transformers.models.granitemoehybrid import modeling_granitemoehybrid
from transformers.models.lfm2 import modeling_lfm2
from transformers.models.lfm2_moe import modeling_lfm2_moe
from transformers.models.nemotron_h import modeling_nemotron_h

# Mamba-2 mixers whose torch forward ``continue_forward`` reproduces (tests/schedule/test_mamba.py). Nemotron-H
# clamps ``dt`` below by ``time_step_min`` only; Bamba and Granite-4 clamp it to ``time_step_limit``.
MIXERS: tuple[type[nn.Module], ...] = (
    modeling_nemotron_h.NemotronHMamba2Mixer,
    modeling_bamba.BambaMixer,
    modeling_granitemoehybrid.GraniteMoeHybridMambaLayer,
)
_CLAMP_MIN_ONLY = (modeling_nemotron_h.NemotronHMamba2Mixer,)
# LFM2's gated short convolutions (``B * x`` through a depthwise causal conv, gated by ``C``): the conv context
# is all that crosses the boundary (their state slot holds an empty tensor)
SHORT_CONVS: tuple[type[nn.Module], ...] = (modeling_lfm2.Lfm2ShortConv, modeling_lfm2_moe.Lfm2MoeShortConv)

OnEnd = Callable[[torch.Tensor, torch.Tensor], None]


def is_stateless_block(module: nn.Module) -> bool:
    """A Nemotron-H MLP or MoE block: a decoder layer without a token mixer, so nothing of it crosses the
    prefix boundary (phase A records an empty state for it, so the prefix counts as complete)."""
    return isinstance(module, modeling_nemotron_h.NemotronHBlock) and module.block_type in ("mlp", "moe")


def served_mamba_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a Mamba-2 mixer (or LFM2 short conv) the schedule continues from a boundary
    state: one of ``MIXERS`` / ``SHORT_CONVS`` running transformers' own forward; a Mamba-2 mixer on its torch path
    or on ``mamba_ssm``'s kernels (``takes_fast_path``), a short conv on its torch path only (no ``causal_conv1d``)."""
    cls = next((c for c in MIXERS + SHORT_CONVS if isinstance(module, c)), None)
    if cls is None or getattr(type(module).forward, "__module__", None) != cls.__module__:
        return False
    if isinstance(module, MIXERS):
        return True
    return not getattr(sys.modules[cls.__module__], "is_fast_path_available", False)


def takes_fast_path(module: nn.Module) -> bool:
    """Whether the stock Mamba-2 mixer runs ``mamba_ssm``'s fused CUDA kernels (transformers' own test: the fast
    path loaded and the projection on CUDA), which compute the recurrence over every chunk."""
    fast = getattr(sys.modules[type(module).__module__], "is_fast_path_available", False)
    return bool(fast) and module.in_proj.weight.is_cuda


def fused_chunk_scan() -> Callable:
    """``mamba_ssm``'s chunked scan, the kernel the stock mixer's fused path runs."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return mamba_chunk_scan_combined


def single_chunk_limit(model: nn.Module) -> int | None:
    """The longest sequence on which a served Mamba-2 mixer's torch path is the recurrence: its smallest
    ``chunk_size`` (None without served Mamba-2 mixers). Past it transformers' multi-chunk scan, which the stock
    engine runs, differs from the recurrence the schedule computes (``continue_forward``), so such a mini-batch
    runs dense to stay equal to the stock engine (``fallbacks.length_fallback_reason``)."""
    sizes = [
        int(m.chunk_size)
        for m in model.modules()
        if served_mamba_layer(m) and not isinstance(m, SHORT_CONVS) and not takes_fast_path(m)
    ]
    return min(sizes) if sizes else None


class Continuation:
    """One Mamba-2 mixer call's ``cache_params`` inside the schedule: where it starts and where its end goes.

    ``conv`` ``[rows or 1, conv_dim, kernel - 1]`` and ``state`` ``[rows or 1, heads, head_dim, d_state]``: the
    boundary it continues from (None: from nothing, phase A's first chunk). ``on_end(conv, state)``: receives
    the call's end conv context and SSM state (graph-attached), or None to drop them."""

    def __init__(
        self, module: nn.Module, conv: torch.Tensor | None, state: torch.Tensor | None, on_end: OnEnd | None
    ) -> None:
        self.module = module
        self.conv = conv
        self.state = state
        self.on_end = on_end


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` -> ``[..., T, T]``: ``out[i, j] = x[j+1] + ... + x[i]`` for ``i >= j``, ``-inf`` above."""
    length = x.shape[-1]
    rep = x[..., None].expand(*x.shape, length)
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(rep.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~keep, -torch.inf)


def ssd_scan(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, chunk: int, initial: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 recurrence ``h_t = exp(a_t) h_(t-1) + x_t b_t^T``, ``y_t = h_t c_t``, chunked.

    ``x`` ``[B, L, H, P]`` (already times ``dt``), ``a`` ``[B, L, H]`` (``A * dt``), ``b``/``c`` ``[B, L, H, N]``,
    ``initial`` ``[B, H, P, N]`` or None (zeros). Returns ``y`` ``[B, L, H, P]`` and the final state."""
    batch, length, heads, head_dim = x.shape
    pad = (chunk - length % chunk) % chunk
    # one dtype, the promotion transformers' elementwise products apply (an fp64 ``dt`` makes the scan fp64)
    dtype = torch.promote_types(torch.promote_types(x.dtype, a.dtype), torch.promote_types(b.dtype, c.dtype))
    x, a, b, c = (t.to(dtype) for t in (x, a, b, c))

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(batch, -1, chunk, *t.shape[2:])

    x, a, b, c = chunks(x), chunks(a), chunks(b), chunks(c)
    a = a.permute(0, 3, 1, 2)  # [B, H, chunks, chunk]
    a_cumsum = torch.cumsum(a, dim=-1)
    within = torch.exp(segment_sum(a))
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", c, b, within, x)
    decay_states = torch.exp(a_cumsum[..., -1:] - a_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, decay_states, x)
    if initial is None:
        initial = torch.zeros_like(states[:, 0])
    states = torch.cat([initial[:, None].to(states.dtype), states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(a_cumsum[..., -1], (1, 0))))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final = new_states[:, :-1], new_states[:, -1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, states, torch.exp(a_cumsum))
    y = (y_diag + y_off).reshape(batch, -1, heads, head_dim)[:, :length]
    return y, final


def _masked(x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[1] <= 1:
        return x
    return (x * attention_mask[:, :, None]).to(x.dtype)


def continue_forward(
    module: nn.Module, hidden_states: torch.Tensor, cache: Continuation, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The mixer's torch forward (projection, causal conv, SSD scan, gated norm, output projection) from
    ``cache``'s boundary; hands its end conv context and SSM state to ``cache.on_end``."""
    batch, length, _ = hidden_states.shape
    dtype = hidden_states.dtype
    heads, head_dim, n = module.num_heads, module.head_dim, module.ssm_state_size
    projected = module.in_proj(_masked(hidden_states, attention_mask))
    groups_state = module.n_groups * n
    d_mlp = (projected.shape[-1] - 2 * module.intermediate_size - 2 * groups_state - heads) // 2
    _, _, gate, xbc, dt = projected.split([d_mlp, d_mlp, module.intermediate_size, module.conv_dim, heads], dim=-1)

    # the depthwise causal conv over the context and this call's inputs, unpadded: ``length`` outputs
    xbc = xbc.transpose(1, 2)
    width = module.conv_kernel_size - 1
    if cache.conv is None:
        context = xbc.new_zeros(batch, xbc.shape[1], width)
    else:
        context = cache.conv.to(xbc.dtype).expand(batch, -1, -1)
    full = torch.cat([context, xbc], dim=-1)
    # copies, not views: the boundary holds ``kernel - 1`` columns, not the whole call's inputs (which a
    # dormant policy moves off the device or drops)
    end_conv = full[:, :, full.shape[-1] - width :].clone()
    conv = module.conv1d
    xbc = F.conv1d(full, conv.weight, conv.bias, 1, 0, conv.dilation, conv.groups)
    xbc = _masked(module.act(xbc.transpose(1, 2)), attention_mask)
    x, b, c = torch.split(xbc, [module.intermediate_size, groups_state, groups_state], dim=-1)

    a = -torch.exp(module.A_log.float())
    dt = F.softplus(dt + module.dt_bias)
    fast = takes_fast_path(module)
    if fast:  # the fused path clamps to time_step_limit where one is set, as its dt_limit
        low, high = module.time_step_limit
        if (low, high) != (0.0, float("inf")):
            dt = torch.clamp(dt, low, high)
    elif isinstance(module, _CLAMP_MIN_ONLY):
        dt = torch.clamp(dt, module.time_step_min)
    else:
        dt = torch.clamp(dt, module.time_step_limit[0], module.time_step_limit[1])
    x = x.reshape(batch, length, -1, head_dim).float()
    b = b.reshape(batch, length, -1, n).float().repeat_interleave(heads // module.n_groups, dim=2)
    c = c.reshape(batch, length, -1, n).float().repeat_interleave(heads // module.n_groups, dim=2)
    d_residual = module.D[..., None] * x
    state = None if cache.state is None else cache.state.expand(batch, -1, -1, -1)
    if fast:  # mamba_ssm's kernel from the boundary state, its final state out (fp32 inside)
        scan = fused_chunk_scan()
        initial = None if state is None else state.float().contiguous()
        y, final = scan(
            x.contiguous(), dt.float().contiguous(), a, b.contiguous(), c.contiguous(), module.chunk_size,
            initial_states=initial, return_final_states=True,
        )  # fmt: skip
    else:
        y, final = ssd_scan(x * dt[..., None], a.to(x.dtype) * dt, b, c, module.chunk_size, state)
    if cache.on_end is not None:
        cache.on_end(end_conv, final.clone())
    y = (y + d_residual).reshape(batch, length, -1)
    return module.out_proj(module.norm(y, gate).to(dtype))


def conv_width(module: nn.Module) -> int:
    """``kernel - 1``: the conv context columns a continuation of ``module`` needs."""
    return (module.L_cache if isinstance(module, SHORT_CONVS) else module.conv_kernel_size) - 1


def continue_short_conv(
    module: nn.Module, hidden_states: torch.Tensor, cache: Continuation, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """LFM2's short conv (``slow_forward``: ``out_proj(C * conv(B * x))``) over its conv context; hands its end
    context (and an empty state) to ``cache.on_end``."""
    batch = hidden_states.shape[0]
    b, c, x = module.in_proj(_masked(hidden_states, attention_mask)).transpose(-1, -2).chunk(3, dim=-2)
    bx = b * x
    width = conv_width(module)
    if cache.conv is None:
        context = bx.new_zeros(batch, bx.shape[1], width)
    else:
        context = cache.conv.to(bx.dtype).expand(batch, -1, -1)
    full = torch.cat([context, bx], dim=-1)
    conv = module.conv
    out = F.conv1d(full, conv.weight, conv.bias, 1, 0, conv.dilation, conv.groups)
    if cache.on_end is not None:
        cache.on_end(full[:, :, full.shape[-1] - width :].clone(), full.new_zeros(1, 0, 0, 0))
    return module.out_proj((c * out).transpose(-1, -2).contiguous())


def continuing(original: Callable) -> Callable:
    """A mixer forward that runs ``continue_forward`` (``continue_short_conv``) when called with a
    ``Continuation`` as ``cache_params`` (LFM2: ``past_key_values``)."""

    def forward(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> object:
        cache = kwargs.get("cache_params", kwargs.get("past_key_values"))
        if not isinstance(cache, Continuation):
            return original(hidden_states, *args, **kwargs)
        if isinstance(cache.module, SHORT_CONVS):
            return continue_short_conv(cache.module, hidden_states, cache, kwargs.get("attention_mask"))
        return continue_forward(cache.module, hidden_states, cache, kwargs.get("attention_mask"))

    return forward


@contextmanager
def continuation_mode(
    model: nn.Module,
    make: Callable[[nn.Module, torch.Tensor, object], Continuation],
    on_stateless: Callable[[nn.Module, object], None],
) -> Iterator[None]:
    """While active, every served Mamba-2 mixer whose decoder block is called with a prefix context
    (``prefix_ctx``) runs under ``make(mixer, hidden_states, ctx)``: the block's ``past_key_values`` (which
    each family's block hands its mixer as ``cache_params``) is that continuation. A block without a token
    mixer (``is_stateless_block``) called with one calls ``on_stateless(block, ctx)`` first."""
    blocks = [(block, mixer) for block in model.modules() for mixer in block.children() if served_mamba_layer(mixer)]

    def hook_for(mixer: nn.Module) -> Callable:
        def hook(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            ctx = kwargs.get("prefix_ctx")
            if ctx is None:
                return None
            if kwargs.get("past_key_values") is not None:
                raise RuntimeError("prefix reuse runs Mamba mixers without a cache; the model was called with one")
            hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            kwargs["past_key_values"] = make(mixer, hidden_states, ctx)
            return args, kwargs

        return hook

    def stateless_hook(block: nn.Module, args: tuple, kwargs: dict) -> None:
        ctx = kwargs.get("prefix_ctx")
        if ctx is not None:
            on_stateless(block, ctx)

    handles = [block.register_forward_pre_hook(hook_for(mixer), with_kwargs=True) for block, mixer in blocks]
    if blocks:
        handles += [
            m.register_forward_pre_hook(stateless_hook, with_kwargs=True)
            for m in model.modules()
            if is_stateless_block(m)
        ]
    for _, mixer in blocks:
        mixer.forward = continuing(type(mixer).forward.__get__(mixer))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for _, mixer in blocks:
            del mixer.forward
