"""Visual tokens in the shared prefix: a group's images run through the vision encoder once, in phase A.

A vision-language prompt (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE, as verl's FSDP engine feeds them) holds
its images as placeholder tokens whose embeddings the vision encoder computes from the row's pixel values. Every
row of a GRPO group carries the same prompt and the same pixel values, so phase A runs the encoder and the language
model over the prefix once, with the group's visual inputs; phase B's suffix rows are text only. Their
multimodal rotary positions (verl's ``[4, L]`` position ids: the text positions, then the temporal, height and
width axes) continue after the image exactly as in the dense row: they are sliced from the row's own position ids,
never recomputed. Qwen3-VL's deepstack features go to visual positions only, all in the prefix. Phase C
backpropagates into the encoder through the image embeddings, where it trains.

What stays with the caller: which rows share identical visual inputs (``same_visual_inputs``, by content) and
whether every visual token lies in the prefix (``visual_tokens_outside``); a group that fails either runs
dense with its reason.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from verl.utils.transformers_compat import unpack_visual_output

from verl_prefix.schedule.models.hf_forwards import class_forwards, hf_forward, patched_by_verl

# a row's multimodal model inputs (verl's ``multi_modal_inputs`` entry: pixel values, grids...)
VisualInputs = Mapping[str, torch.Tensor]

# model types whose verl forward takes ``[4, B, L]`` positions and visual inputs the way this module feeds them,
# each tested against the stock engine (Qwen2-VL shares verl's Qwen2.5-VL forward, Qwen3-VL-MoE its Qwen3-VL one;
# Qwen3.5 and its MoE have verl's Qwen3.5 forward, their gated delta-nets served by ``schedule.models.recurrent``)
SERVED_VISUAL_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# model types verl feeds through ``verl.models.transformers.qwen2_vl`` (its zero placeholder image for text calls)
QWEN2_VL_FORWARD = ("qwen2_vl", "qwen2_5_vl")
# model types whose verl forward takes ``[4, B, L]`` position ids
MULTIMODAL_ROPE_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")

# config fields naming the placeholder tokens the vision encoder's outputs replace
_VISUAL_TOKEN_FIELDS = ("image_token_id", "video_token_id")


def _config(model: nn.Module) -> object:
    return getattr(model, "config", None)


def is_visual_model(model: nn.Module) -> bool:
    """A model with a vision encoder (its config has a ``vision_config``)."""
    return getattr(_config(model), "vision_config", None) is not None


def visual_model_refusal(model: nn.Module) -> str | None:
    """Why reuse cannot feed this vision-language model's visual inputs (a family not served yet), or None."""
    model_type = getattr(_config(model), "model_type", None)
    if not is_visual_model(model) or model_type in SERVED_VISUAL_MODELS:
        return None
    return f"vision-language model type {model_type!r} is not served yet (served: {', '.join(SERVED_VISUAL_MODELS)})"


def _bypassing_classes(model: nn.Module) -> set[type]:
    return {
        type(m)
        for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "q_proj") and patched_by_verl(type(m))
    }


def attention_bypassed(model: nn.Module) -> bool:
    """Whether the model's attention modules run a forward that calls flash attention directly instead of HF's
    attention function (verl's Qwen2-VL patch) and HF's own forward was not remembered before the patch
    (``hf_forwards.remember_hf_forwards``): phase A could not capture their K/V, nor phase B serve the prefix."""
    return any(hf_forward(cls) is None for cls in _bypassing_classes(model))


@contextmanager
def hf_attention(model: nn.Module) -> Iterator[None]:
    """HF's own attention forward for the block, where verl patched it and it was remembered: the schedule's
    rows are padded, one sequence each, and attend through HF's attention interface (the prefix attention),
    exactly as verl's padded path (no patch) does. verl's forward is back after the block."""
    originals = [(cls, hf_forward(cls)) for cls in _bypassing_classes(model)]
    with class_forwards([(cls, original) for cls, original in originals if original is not None]):
        yield


def uses_multimodal_rope(model: nn.Module) -> bool:
    """Whether the model's forward takes verl's ``[4, B, L]`` position ids (text + 3 rotary axes)."""
    return getattr(_config(model), "model_type", None) in MULTIMODAL_ROPE_MODELS


def visual_token_ids(model: nn.Module) -> tuple[int, ...]:
    """The placeholder token ids whose embeddings come from the vision encoder (none for a text model)."""
    config = _config(model)
    ids = [getattr(config, name, None) for name in _VISUAL_TOKEN_FIELDS] if is_visual_model(model) else []
    return tuple(int(i) for i in ids if i is not None)


def model_positions(model: nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """Batch-first positions (``[B, L]``, or ``[B, 4, L]`` for multimodal rows) in the layout the model's forward
    takes: ``[4, B, L]`` for a multimodal-RoPE model (text positions on every axis for a text-only call, as HF
    expands them), ``[B, L]`` otherwise."""
    if positions.dim() == 3:
        return positions.transpose(0, 1)
    if uses_multimodal_rope(model):
        return positions[None].expand(4, -1, -1)
    return positions


def same_visual_inputs(a: VisualInputs | None, b: VisualInputs | None) -> bool:
    """Whether two rows' visual inputs are identical by content (every key, every value bit for bit)."""
    a, b = a or {}, b or {}
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def visual_tokens_outside(ids: torch.Tensor, prefix_len: int, token_ids: tuple[int, ...]) -> bool:
    """Whether any visual placeholder token of a row lies past its prefix (in ``prompt[-1]`` or the response):
    phase A encodes every image of the group, so every image's tokens must be prefix tokens."""
    if not token_ids:
        return False
    tail = ids[prefix_len:]
    return bool(torch.isin(tail, torch.tensor(token_ids, device=tail.device)).any())


def visual_kwargs(inputs: VisualInputs | None, device: torch.device) -> dict[str, torch.Tensor]:
    """The group's visual inputs as model keyword arguments on ``device`` (empty for a text group)."""
    if not inputs:
        return {}
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def vision_encoder(model: nn.Module) -> nn.Module | None:
    """The model's vision tower (``visual`` on the model or its inner ``model``), or None."""
    for owner in (model, getattr(model, "model", None)):
        tower = getattr(owner, "visual", None) if owner is not None else None
        if isinstance(tower, nn.Module):
            return tower
    return None


@contextmanager
def counting_encoder_calls(model: nn.Module) -> Iterator[list[int]]:
    """Count the vision encoder's forward calls inside the block: ``[calls]`` (0 for a text model)."""
    calls = [0]
    tower = vision_encoder(model)
    if tower is None:
        yield calls
        return

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls[0] += 1

    handle = tower.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


@contextmanager
def text_only_call(model: nn.Module) -> Iterator[None]:
    """Around a model call without visual inputs (phase B, a prefix without images, lockstep fillers).

    verl's Qwen2-VL forward then still runs the vision encoder on a zero placeholder image and adds ``0.0``
    times its mean to the embeddings, so that the encoder's parameters join every call's graph and every rank's
    FSDP collectives match; with transformers 5 the encoder returns an output object, which has no ``mean``.
    Inside this block the encoder's output is its embeddings tensor (verl's ``unpack_visual_output``), as it
    was under transformers 4: the call stays exactly verl's (the embeddings plus an exact zero). Only for the
    families verl feeds that way (``QWEN2_VL_FORWARD``); a call with real images gets the same tensor, which is
    what verl's ``unpack_visual_output`` takes from the output object anyway."""
    tower = vision_encoder(model)
    if tower is None or getattr(_config(model), "model_type", None) not in QWEN2_VL_FORWARD:
        yield
        return

    def hook(module: nn.Module, args: tuple, output: object) -> object:
        if hasattr(output, "pooler_output") and getattr(output, "deepstack_features", None) is None:
            return unpack_visual_output(output)[0]
        return output

    handle = tower.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
