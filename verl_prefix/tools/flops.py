"""The FLOP model of dense vs reuse for one GRPO mini-batch, to print beside every measured ratio.

The decoder's model (linear layers per token, attention per query-key pair, the LM head per token with
logits; sliding windows and recurrent layers) lives in ``verl_prefix.schedule.flop_model``, where the engine
prices each mini-batch with it (``prefix/flops_saved_ratio``); this module adds what only the benches price.

A vision-language prompt adds its vision encoder (``vision_encoder_flops``): the stock engine encodes every
row's images, reuse each group's once (phase A), so a group of G rows costs G encodes dense and one reused.
"""

from __future__ import annotations

from verl_prefix.schedule.flop_model import (
    ModelShape,
    config_windows,
    delta_net_per_token,
    dense_flops,
    recurrent_layer_indices,
    reuse_flops,
)


def vision_encoder_flops(vision_config: object, grids: list[tuple[int, int, int]]) -> float:
    """Forward FLOPs of a Qwen-VL vision encoder (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) over images of patch
    grids ``(t, h, w)``: the patch embedding and every block's q/k/v/o and MLP per patch, attention over each
    image's patches (every block counted as full attention: an upper bound for Qwen2.5-VL's windowed blocks),
    and the patch merger (Qwen3-VL's deepstack mergers too) per merged token."""
    width = int(getattr(vision_config, "embed_dim", None) or vision_config.hidden_size)
    mlp = int(getattr(vision_config, "intermediate_size", None) or width * vision_config.mlp_ratio)
    # Qwen2.5-VL's MLP is gated (three matrices); the others' have two
    matrices = 3 if getattr(vision_config, "model_type", "").startswith("qwen2_5_vl") else 2
    out = int(getattr(vision_config, "out_hidden_size", None) or vision_config.hidden_size)
    merge = vision_config.spatial_merge_size
    patch_dim = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    per_patch = 2.0 * patch_dim * width + vision_config.depth * 2.0 * (4 * width * width + matrices * width * mlp)
    merged = width * merge * merge
    mergers = 1 + len(getattr(vision_config, "deepstack_visual_indexes", None) or [])
    per_token = mergers * 2.0 * (merged * merged + merged * out)
    total = 0.0
    for t, h, w in grids:
        patches = t * h * w
        total += patches * per_patch + vision_config.depth * patches * patches * 4.0 * width
        total += patches // (merge * merge) * per_token
    return total


def predicted_speedup(
    shape: ModelShape, groups: list[tuple[int, list[int]]], encoder_flops: list[float] | None = None
) -> float:
    """Dense / reuse FLOPs over ``(prompt_len, response_lens)`` groups, plus each group's vision encoder
    FLOPs (``encoder_flops``, one entry per group: paid once per row dense, once per group reused). Backward
    is ~2x forward on both sides, so the same ratio holds for an update and for a forward-only pass."""
    encoder = encoder_flops or [0.0] * len(groups)
    dense = sum(dense_flops(shape, p, s) + len(s) * e for (p, s), e in zip(groups, encoder))
    reuse = sum(reuse_flops(shape, p, s) + e for (p, s), e in zip(groups, encoder))
    return dense / reuse


__all__ = [
    "ModelShape",
    "config_windows",
    "delta_net_per_token",
    "dense_flops",
    "predicted_speedup",
    "recurrent_layer_indices",
    "reuse_flops",
    "vision_encoder_flops",
]
