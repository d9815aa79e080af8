"""Recurrent (linear-attention) layers under reuse: what crosses the prefix boundary is their state, not K/V.

A gated delta-net layer (Qwen3.5) carries two things from one token to the next: its recurrent state
``[heads, d_k, d_v]`` and the last ``kernel - 1`` inputs of its depthwise causal convolution. Phase A records
both after the prefix; phase B starts every suffix row from them (broadcast over the rows, no per-row copy of
the recurrent state); phase C seeds the prefix backward with their accumulated gradients, as it does dK/dV.

The state reaches the layer through HF's own continuation path: the layer reads ``cache_params`` and, when it
"has previous state", prepends the conv context and passes the recurrent state as ``initial_state``. A forward
pre-hook (``recurrent_state_mode``) hands each served layer a ``BoundaryCache`` built by the prefix context
riding in the forward kwargs (``prefix_ctx``), so non-reentrant checkpointing replays it. The cache never
writes into what it serves: HF's single-token path copies into the conv state in place, so that path gets a
fresh copy; the multi-token path only reads it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from transformers.models.olmo_hybrid import modeling_olmo_hybrid
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_next import modeling_qwen3_next

from verl_prefix.schedule.models import mamba
from verl_prefix.schedule.models.hf_forwards import hf_forward

# The recurrent token mixers the schedule serves: HF's Qwen3.5 (dense and MoE) and Qwen3-Next gated delta-nets
# with their torch kernels (``torch_chunk_gated_delta_rule`` with an ``initial_state`` and the conv as
# ``nn.Conv1d``), whose continuation path is checked against the dense model in tests/schedule/test_recurrent.py.
# Qwen3-Next differs only before the convolution (fused ``in_proj_qkvz``/``in_proj_ba`` projections regrouped per
# key head); its cache interface, conv context and kernel contract are Qwen3.5's. OLMo-Hybrid convolves q, k and v
# separately and keeps per-layer lists in its cache (``SplitConvCache``); its decoder layer calls the mixer
# without the forward keywords, so the prefix context reaches it from the decoder layer's call (``_stash``).
# Mamba-2 mixers (Nemotron-H, Bamba, Granite-4 hybrid) and LFM2's short convs: ``schedule.models.mamba``.
SERVED_CLASSES: tuple[type[nn.Module], ...] = (
    modeling_qwen3_5.Qwen3_5GatedDeltaNet,
    modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet,
    modeling_qwen3_next.Qwen3NextGatedDeltaNet,
    modeling_olmo_hybrid.OlmoHybridGatedDeltaNet,
)
SERVED_KERNELS = (
    modeling_qwen3_5.torch_chunk_gated_delta_rule,
    modeling_qwen3_5_moe.torch_chunk_gated_delta_rule,
    modeling_qwen3_next.torch_chunk_gated_delta_rule,
    modeling_olmo_hybrid.torch_chunk_gated_delta_rule,
)

# Class names of recurrent token mixers in transformers' hybrid families (Mamba/Mamba-2 mixers, short
# convolutions, gated delta-nets, lightning attention, RG-LRU): a model holding one the schedule does not
# serve cannot reuse (its suffixes would start from nothing).
_RECURRENT_NAME = re.compile(r"(Mamba|Mixer$|ShortConv|GatedDeltaNet|LightningAttention|Rglru|RecurrentBlock|LSTM)")


@dataclass
class RecurrentState:
    """One recurrent layer's state after the prefix: ``conv`` ``[1, conv_dim, kernel - 1]`` (the last
    pre-convolution inputs, zero-padded on the left for a prefix shorter than that) and ``state``
    ``[1, heads, d_k, d_v]``. ``conv_dtype``: the dtype the convolution computes in (the leaves may be held
    in a wider one for fp32 gradient accumulation; the conv context is cast back, an exact round trip)."""

    conv: torch.Tensor
    state: torch.Tensor
    conv_dtype: torch.dtype

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv, self.state


def is_recurrent_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a recurrent token mixer of some hybrid family (served or not)."""
    return bool(_RECURRENT_NAME.search(type(module).__name__))


def served_recurrent_layer(module: nn.Module) -> bool:
    """Whether the reuse schedule carries this recurrent layer's state across the prefix boundary exactly.

    True for the Qwen3.5 (dense or MoE) and Qwen3-Next gated delta-nets running transformers' own forward with its
    torch kernels or fla's chunked rule (``fla_chunk_kernel``); False for any other recurrent mixer, for
    ``causal_conv1d``'s fused convolution (its one-token update has no autograd) and under verl's patched
    forward unless HF's was remembered before the patch (``hf_forwards``; the schedule runs it). Mamba-2 mixers
    (Nemotron-H, Bamba, Granite-4 hybrid) and LFM2's short convs: ``mamba.served_mamba_layer``."""
    if mamba.served_mamba_layer(module) or mamba.is_stateless_block(module):
        return True
    if not isinstance(module, SERVED_CLASSES):
        return False
    # verl's monkey patch for ``qwen3_5``/``qwen3_5_moe`` checkpoints swaps in its own forward, which continues no
    # multi-token forward from a state: transformers' own serves, remembered before the patch (``hf_forwards``)
    forward = hf_forward(type(module))
    if getattr(forward, "__module__", None) != next(c for c in SERVED_CLASSES if isinstance(module, c)).__module__:
        return False
    kernel = getattr(module, "chunk_gated_delta_rule", None)
    fused_conv = getattr(module, "causal_conv1d_fn", None) is not None or any(
        type(m).__module__.startswith("fla.") and isinstance(m, nn.Conv1d) for m in module.children()
    )  # causal_conv1d's, or fla's ShortConvolution (OLMo-Hybrid on CUDA): not checked here
    return (kernel in SERVED_KERNELS or fla_chunk_kernel(kernel)) and not fused_conv


def fla_chunk_kernel(kernel: object) -> bool:
    """Whether ``kernel`` is flash-linear-attention's chunked gated delta rule (what transformers runs on CUDA when
    ``fla`` is installed): its backward returns the initial state's gradient (``dh0``), so a multi-token call
    continues from a state leaf exactly. fla's one-token ``fused_recurrent_gated_delta_rule`` raises in backward:
    under grad a one-token call runs this chunked kernel instead (``_hook``)."""
    module = getattr(kernel, "__module__", None) or ""
    return getattr(kernel, "__name__", None) == "chunk_gated_delta_rule" and module.startswith("fla.")


def recurrent_layers(model: nn.Module) -> dict[int, nn.Module]:
    """``{layer index: module}`` for every recurrent token mixer of ``model`` (served or not), and, in a model
    with one, every decoder block without a token mixer (``mamba.is_stateless_block``: its state is empty)."""
    layers = {int(m.layer_idx): m for m in model.modules() if is_recurrent_layer(m) and hasattr(m, "layer_idx")}
    if layers:
        layers.update({int(m.layer_idx): m for m in model.modules() if mamba.is_stateless_block(m)})
    return layers


def unserved_recurrent_reason(model: nn.Module) -> str | None:
    """Why reuse cannot serve ``model``'s recurrent layers (one line naming them), or None."""
    unserved = sorted({type(m).__name__ for m in recurrent_layers(model).values() if not served_recurrent_layer(m)})
    if not unserved:
        return None
    return (
        f"recurrent layers {unserved} are not served by prefix reuse (served: Qwen3.5 and Qwen3-Next gated "
        "delta-nets with transformers' torch kernels or fla's chunked rule, and the Nemotron-H/Bamba/Granite-4 "
        "Mamba-2 mixers and LFM2 short convs on transformers' torch path); their state at the prefix boundary "
        "would be lost"
    )


def recurrent_refusal(
    model: nn.Module,
    *,
    ulysses: bool = False,
    phase_b_attention: str = "auto",
    dormant_policy: str = "keep",
) -> str | None:
    """Why the schedule cannot run ``model`` with these settings because of its recurrent layers, or None.

    The engine asks it at initialisation (unserved layers: dense with the reason; unserved settings: an
    error, ``backend.fsdp.refusals.recurrent_settings_error``) and the schedule again before each group's phase A
    (a ``ValueError``): what is not served is refused here rather than found inside a layer. Models without
    recurrent layers are never refused. Every dormant policy serves recurrent layers (``dormant_policy`` is
    kept for callers): ``recompute`` re-derives and checks the states like K/V, ``offload`` moves phase A's
    saved activations and leaves the boundary states (small copies, ``schedule.models.mamba``/HF's own) where they
    are, as it leaves the K/V."""
    if not recurrent_layers(model):
        return None
    reason = unserved_recurrent_reason(model)
    if reason is not None:
        return reason
    unserved = {
        "Ulysses sequence parallelism (each rank would run a recurrent layer over its own slice of the "
        "sequence, from a zero state)": ulysses,
        "phase_b_attention=merged_varlen (its packed suffix row would carry one row's recurrent state into the "
        "next)": phase_b_attention == "merged_varlen",
    }
    refused = [what for what, on in unserved.items() if on]
    if refused:
        return f"{', '.join(refused)} with recurrent (linear-attention) layers: not served"
    return None


class BoundaryCache:
    """What a served recurrent layer sees as ``cache_params`` inside the reuse schedule.

    Serving (``conv``/``state`` given): the layer continues from them; every write-back is dropped.
    Capturing (``on_capture`` given): the layer starts from nothing, and what it writes back at the end of
    the prefix is handed to ``on_capture(RecurrentState)`` (graph-attached, the roots phase C seeds).
    ``width``: ``kernel - 1``, the conv columns a continuation needs."""

    def __init__(
        self,
        layer_idx: int,
        width: int,
        conv: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        on_capture: Callable[[RecurrentState], None] | None = None,
    ) -> None:
        self.layer_idx = layer_idx
        self.width = width
        self.conv_states = conv
        self.recurrent_states = state
        self.on_capture = on_capture
        self.layers = {layer_idx: self}  # HF reads ``cache_params.layers[layer_idx].conv_states``
        self._written_conv: torch.Tensor | None = None

    def has_previous_state(self, layer_idx: int | None = None) -> bool:
        return self.conv_states is not None

    def update_conv_state(self, conv_state: torch.Tensor, layer_idx: int) -> None:
        # HF hands the last ``kernel`` columns (left zero-padded); a continuation reads the last ``width``
        self._written_conv = conv_state[:, :, conv_state.shape[-1] - self.width :]

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int) -> None:
        if self.on_capture is not None:
            # the single-token path wrote its new conv context into the served copy in place instead
            conv = self._written_conv if self._written_conv is not None else self.conv_states
            # copies: a view would keep a saved activation's whole storage on the device (``offload``)
            self.on_capture(RecurrentState(conv=conv.clone(), state=state.clone(), conv_dtype=conv.dtype))


class _LayerSlot:
    """``cache.<list>[layer_idx]`` for one layer (OLMo-Hybrid's cache keeps per-layer lists): reads give ``value``,
    writes go to ``on_set`` (dropped without one)."""

    def __init__(self, value: torch.Tensor | None, on_set: Callable[[torch.Tensor], None] | None = None) -> None:
        self.value, self.on_set = value, on_set

    def __getitem__(self, layer_idx: int) -> torch.Tensor | None:
        return self.value

    def __setitem__(self, layer_idx: int, value: torch.Tensor) -> None:
        if self.on_set is not None:
            self.on_set(value)


class SplitConvCache:
    """``BoundaryCache`` for OLMo-Hybrid's interface: separate q/k/v conv contexts (``conv_states_q/k/v``) and the
    recurrent state in per-layer lists, written by assignment. The boundary's conv context is the three
    concatenated along channels (``splits``: their widths), so a ``RecurrentState`` looks as for Qwen3.5."""

    def __init__(
        self,
        splits: tuple[int, int, int],
        conv: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        on_capture: Callable[[RecurrentState], None] | None = None,
    ) -> None:
        parts = conv.split(list(splits), dim=1) if conv is not None else (None, None, None)
        self.serving = conv is not None
        self.on_capture = on_capture
        self._written: dict[str, torch.Tensor] = {}
        slots = [_LayerSlot(p, partial(self._written.__setitem__, n)) for n, p in zip("qkv", parts)]
        self.conv_states_q, self.conv_states_k, self.conv_states_v = slots
        self.recurrent_states = _LayerSlot(state, self._state_written)

    def has_previous_state(self, layer_idx: int | None = None) -> bool:
        return self.serving

    def _state_written(self, state: torch.Tensor) -> None:
        if self.on_capture is not None:  # the conv contexts are written first
            conv = torch.cat([self._written[n] for n in "qkv"], dim=1)
            self.on_capture(RecurrentState(conv=conv, state=state, conv_dtype=conv.dtype))


def _splits(module: nn.Module) -> tuple[int, int, int] | None:
    """OLMo-Hybrid's q/k/v conv widths, or None for a mixer with one conv over the concatenated q/k/v."""
    if not hasattr(module, "q_conv1d"):
        return None
    return (module.key_dim, module.key_dim, module.value_dim)


def serving_cache(
    module: nn.Module,
    boundary: RecurrentState,
    hidden_states: torch.Tensor,
    on_capture: Callable[[RecurrentState], None] | None = None,
) -> BoundaryCache:
    """The cache a suffix micro-batch's layer continues from: ``boundary`` broadcast over its rows (views of
    the leaves, so their gradients accumulate there). HF's single-token path writes its conv state in
    place, so one-token calls get a copy of the conv context (``rows x conv_dim x (kernel - 1)``).
    ``on_capture``: a later prefix chunk continues from the earlier chunks' state and records its own."""
    rows, seq_len = hidden_states.shape[:2]
    conv = boundary.conv.to(boundary.conv_dtype).expand(rows, -1, -1)
    if seq_len == 1:
        conv = conv.clone()
    state = boundary.state.expand(rows, -1, -1, -1)
    if fla_chunk_kernel(
        getattr(module, "chunk_gated_delta_rule", None)
    ):  # a Triton kernel reads rows by stride: no stride-0 views
        state = state.contiguous()
    width = mamba.conv_width(module)
    if _splits(module) is not None:
        return SplitConvCache(_splits(module), conv=conv, state=state, on_capture=on_capture)
    return BoundaryCache(module.layer_idx, width, conv=conv, state=state, on_capture=on_capture)


def capturing_cache(module: nn.Module, on_capture: Callable[[RecurrentState], None]) -> BoundaryCache:
    """The cache phase A's layer writes its end-of-prefix state to (it starts from nothing)."""
    if _splits(module) is not None:
        return SplitConvCache(_splits(module), on_capture=on_capture)
    return BoundaryCache(module.layer_idx, mamba.conv_width(module), on_capture=on_capture)


def _hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    ctx = kwargs.get("prefix_ctx") or _STASHED.get(module)
    if ctx is None:
        return None
    if kwargs.get("cache_params") is not None:
        raise RuntimeError("prefix reuse runs recurrent layers without a cache; the model was called with one")
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    kwargs["cache_params"] = ctx.recurrent_cache(module, hidden_states)
    if hidden_states.shape[1] == 1 and torch.is_grad_enabled() and fla_chunk_kernel(module.chunk_gated_delta_rule):
        # transformers runs a one-token call with a state through fla's fused recurrent kernel, which has no
        # backward: under grad it runs the chunked kernel (the same recurrence, one token) until the call returns
        _SWAPPED[module] = module.recurrent_gated_delta_rule
        module.recurrent_gated_delta_rule = module.chunk_gated_delta_rule
    return args, kwargs


# one-token kernels swapped for the duration of a call (``_hook``), restored by ``_restore``
_SWAPPED: dict[nn.Module, Callable] = {}
# a mixer's prefix context taken from its decoder layer's call, for layers that do not pass keywords on
_STASHED: dict[nn.Module, object] = {}


def _stash(mixer: nn.Module) -> tuple[Callable, Callable]:
    """Hooks for ``mixer``'s decoder layer: keep the prefix context of its call for the mixer (a checkpointed
    layer's replay runs them again), drop it when the call returns."""

    def keep(layer: nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("prefix_ctx") is not None:
            _STASHED[mixer] = kwargs["prefix_ctx"]

    def drop(layer: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        _STASHED.pop(mixer, None)

    return keep, drop


def _restore(module: nn.Module, args: tuple, output: object) -> None:
    if module in _SWAPPED:
        module.recurrent_gated_delta_rule = _SWAPPED.pop(module)


def mamba_continuation(mixer: nn.Module, hidden_states: torch.Tensor, ctx: object) -> mamba.Continuation:
    """A Mamba-2 mixer's cache for one call: where the prefix context says it starts (``ctx.recurrent_cache``,
    as for a gated delta-net) and where its end state goes (a ``RecurrentState`` for the context)."""
    cache = ctx.recurrent_cache(mixer, hidden_states)
    record = cache.on_capture
    on_end = None if record is None else lambda conv, state: record(RecurrentState(conv, state, conv.dtype))
    return mamba.Continuation(mixer, cache.conv_states, cache.recurrent_states, on_end)


def record_empty_state(block: nn.Module, ctx: object) -> None:
    """Phase A (capture contexts have a ``recorder``): a block without a token mixer ends the prefix in an
    empty state (``[1, 0, 0]`` and ``[1, 0, 0, 0]``, no graph): nothing to serve in B, nothing to seed in C."""
    recorder = getattr(ctx, "recorder", None)
    if recorder is not None:
        weight = next(block.parameters())
        empty = weight.new_zeros(1, 0, 0).detach()
        recorder(block)(RecurrentState(empty, empty.reshape(1, 0, 0, 0), empty.dtype))


# fla's backend dispatch (fla >= 0.5: ``fla.backends``) may send ``chunk_gated_delta_rule`` to another kernel than the
# Triton one the schedule was built and checked against: FlashQLA (package ``flash_qla``, TileLang) takes SM90/SM100
# fp16/bf16 calls with K = V = 128, Qwen3.5's shape, wherever the package is installed. Its initial-state gradient
# and state layout are not what ``test_recurrent_cuda.py`` checked; each such backend is turned off by its
# environment switch, which fla reads at every call, for the duration of the schedule.
FLA_BACKEND_PINS = {"FLA_FLASH_QLA": "0"}


@contextmanager
def fla_triton_backend() -> Iterator[None]:
    """Keep fla's dispatch on its Triton chunked kernel (``FLA_BACKEND_PINS``) until the block ends, then restore
    the switches as they were (a user's own setting included): the reuse schedule's calls and their backward
    (autograd keeps the kernel its forward chose) run the kernel whose initial-state gradient was checked."""
    saved = {name: os.environ.get(name) for name in FLA_BACKEND_PINS}
    os.environ.update(FLA_BACKEND_PINS)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def recurrent_state_mode(model: nn.Module) -> Iterator[None]:
    """For the duration of the reuse schedule, every served recurrent layer called with a prefix context
    takes its ``cache_params`` from it (``kv.contexts.CaptureContext`` / ``ServeContext.recurrent_cache``);
    Mamba-2 mixers and short convs through their decoder block (``mamba.continuation_mode``). Layers on fla's
    kernels run its Triton chunked rule meanwhile (``fla_triton_backend``)."""
    served = [m for m in model.modules() if isinstance(m, SERVED_CLASSES) and served_recurrent_layer(m)]
    handles = [m.register_forward_pre_hook(_hook, with_kwargs=True) for m in served]
    handles += [m.register_forward_hook(_restore, always_call=True) for m in served]
    for parent in model.modules():
        for child in parent.children():
            if any(child is m for m in served):
                keep, drop = _stash(child)
                handles.append(parent.register_forward_pre_hook(keep, with_kwargs=True))
                handles.append(parent.register_forward_hook(drop, with_kwargs=True, always_call=True))
    fla = any(fla_chunk_kernel(getattr(m, "chunk_gated_delta_rule", None)) for m in served)
    try:
        with (
            fla_triton_backend() if fla else nullcontext(),
            mamba.continuation_mode(model, mamba_continuation, record_empty_state),
        ):
            yield
    finally:
        for handle in handles:
            handle.remove()
