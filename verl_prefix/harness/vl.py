"""Tiny vision-language models and image-prompt GRPO batches for tests: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and
Qwen3-VL-MoE through verl's own paths.

The model is random-init from a config (a vision tower of a couple of blocks, hidden 32, 14-pixel patches, 16
for Qwen3-VL, merged 2 x 2, and a tiny text decoder) with a local word-level tokenizer whose last ids are Qwen's
vision tokens. A batch's images are real pixel tensors in the layout Qwen's image processor produces
(``[patches, 3 * 2 * patch * patch]`` per image, with ``image_grid_thw``), and every row's ``[4, L]`` position ids
are computed by verl's own ``get_rope_index`` exactly as verl's data set does (text positions, then the three
rotary axes).
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from verl_prefix.harness.grpo_batches import make_grpo_batch
from verl_prefix.harness.tiny_models import BOS_ID, EOS_ID, PAD_ID, write_tokenizer

# the last ids of a tiny vocabulary: <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 124, 125, 126, 127
VL_VOCAB = 128
TEXT_VOCAB = VISION_START  # ordinary text tokens lie below the vision tokens
MERGE, TEMPORAL, CHANNELS = 2, 2, 3
# the patch size of each family (Qwen2-VL, Qwen2.5-VL: 14 pixels; Qwen3-VL, Qwen3.5 and their MoEs: 16)
PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_vl_moe": 16, "qwen3_5": 16, "qwen3_5_moe": 16}
# the families whose rotary index is verl's Qwen3-VL one (the others use its Qwen2-VL one); Qwen3.5's is the same
# for images (verl's agent loop calls the model's own, which also splits videos into frames)
QWEN3_VL_ROPE = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# Qwen3.5's hybrid decoders: gated delta-net (linear attention) layers around one full-attention layer
QWEN3_5 = ("qwen3_5", "qwen3_5_moe")
QWEN3_5_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]


def patch_dim(family: str) -> int:
    """One patch's pixel values, flattened as the image processor does: channels x frames x patch x patch."""
    return CHANNELS * TEMPORAL * PATCH[family] ** 2


def write_tiny_vl_model(
    dir: str | os.PathLike,
    family: str = "qwen2_5_vl",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_depth: int = 2,
    vision_hidden: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_experts: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = VL_VOCAB,
    vision_heads: int = 2,
    tie_word_embeddings: bool = False,
) -> Path:
    """A random-init vision-language model of ``family`` (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl`` or
    ``qwen3_vl_moe``, the Qwen3-VL ones with deepstack features feeding the first decoder layer; the MoE ones with
    ``num_experts`` experts, two per token, in every layer; ``qwen3_5``/``qwen3_5_moe``: gated delta-net, full
    attention, gated delta-net layers (``num_layers`` ignored), a quarter of each head rotary as in Qwen3.5's
    checkpoints, no deepstack) and its tokenizer in ``dir``; returns ``dir``. The decoder has ``heads`` query and
    ``kv_heads`` KV heads, an MLP of ``intermediate_size`` (twice the width by default) and ``vocab_size`` ids
    (at least ``VL_VOCAB``; the vision tokens keep their ids), the tower ``vision_heads`` heads: the bench's
    larger shapes; tests keep the defaults. ``tie_word_embeddings``: the LM head shares the embedding's weight."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    if family not in PATCH:
        raise ValueError(f"family must be one of {sorted(PATCH)}, got {family!r}")
    if vocab_size < VL_VOCAB:
        raise ValueError(f"vocab_size must be at least {VL_VOCAB} (the vision tokens' ids), got {vocab_size}")
    out = write_tokenizer(dir, vocab_size)
    rotary = 0.5 if family in QWEN3_5 else 1.0  # the rotated fraction of each head
    half = int(hidden_size // heads * rotary) // 2  # the rotary half-dimension, over temporal/height/width
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    rope = {"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0}
    if family in QWEN3_5:
        rope["partial_rotary_factor"] = rotary
        num_layers = len(QWEN3_5_LAYER_TYPES)
    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        attention_dropout=0.0,
        initializer_range=0.1,
        rope_parameters=rope,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=tie_word_embeddings,
    )
    vision = dict(
        depth=vision_depth,
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_heads=vision_heads,
        patch_size=PATCH[family],
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        in_channels=CHANNELS,
        out_hidden_size=hidden_size,
        initializer_range=0.1,
    )
    if family == "qwen2_5_vl":
        vision.update(window_size=2 * MERGE * PATCH[family], fullatt_block_indexes=[vision_depth - 1])
    elif family == "qwen2_vl":  # Qwen2-VL names the tower's width embed_dim and its output width hidden_size
        del vision["intermediate_size"], vision["out_hidden_size"]
        vision.update(embed_dim=vision_hidden, hidden_size=hidden_size, mlp_ratio=2)
    else:
        text.update(head_dim=hidden_size // heads)
        rope["mrope_interleaved"] = True
        vision.update(num_position_embeddings=64)
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        vision.update(deepstack_visual_indexes=[0])
    if family in QWEN3_5:
        text.update(
            layer_types=QWEN3_5_LAYER_TYPES,
            linear_key_head_dim=hidden_size // heads,
            linear_value_head_dim=hidden_size // heads,
            linear_num_key_heads=kv_heads,
            linear_num_value_heads=heads,
        )
    if family == "qwen3_5_moe":
        text.update(
            num_experts=num_experts,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            shared_expert_intermediate_size=hidden_size,
            router_aux_loss_coef=0.001,
        )
    if family == "qwen3_vl_moe":
        text.update(
            num_experts=num_experts,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            decoder_sparse_step=1,
            router_aux_loss_coef=0.001,
        )
    config = AutoConfig.for_model(
        family,
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).to(dtype).save_pretrained(out)
    if family in ("qwen3_vl_moe", "qwen3_5_moe"):  # grouped-matmul experts take no fp64: the per-expert loop does
        cfg = json.loads((out / "config.json").read_text())
        cfg["experts_implementation"] = "eager"
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def image_inputs(sizes: list[tuple[int, int]], seed: int, family: str = "qwen2_5_vl") -> dict[str, torch.Tensor]:
    """Random pixel patches for images of ``sizes`` (patch grid height x width, each a multiple of the merge),
    concatenated as Qwen's image processor does: ``pixel_values [patches, patch_dim]`` and ``image_grid_thw``."""
    return visual_inputs([(1, h, w) for h, w in sizes], [], seed, family)


def visual_inputs(
    images: list[tuple[int, int, int]], videos: list[tuple[int, int, int]], seed: int, family: str = "qwen2_5_vl"
) -> dict[str, torch.Tensor]:
    """Random pixel patches for images and videos of patch grids ``(t, h, w)``, in the processor's layout:
    ``pixel_values``/``image_grid_thw`` and ``pixel_values_videos``/``video_grid_thw`` (and, as Qwen2.5-VL's
    processor gives them, ``second_per_grid_ts``)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for items, pixels, grid in (
        (images, "pixel_values", "image_grid_thw"),
        (videos, "pixel_values_videos", "video_grid_thw"),
    ):
        if not items:
            continue
        grids = torch.tensor(items, dtype=torch.long)
        out[pixels] = torch.randn(int(grids.prod(dim=1).sum()), patch_dim(family), generator=g)
        out[grid] = grids
    if videos and family == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.ones(len(videos))
    return out


def _processor_view() -> Any:
    """What verl's ``get_rope_index`` functions read from a processor: the merge size and the vision token ids."""
    ids = {"<|image_pad|>": IMAGE_PAD, "<|video_pad|>": VIDEO_PAD, "<|vision_start|>": VISION_START}
    return types.SimpleNamespace(
        image_processor=types.SimpleNamespace(merge_size=MERGE),
        tokenizer=types.SimpleNamespace(convert_tokens_to_ids=ids.__getitem__),
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
    )


def vl_positions(ids: torch.Tensor, inputs: dict[str, torch.Tensor] | None, family: str = "qwen2_5_vl") -> torch.Tensor:
    """A row's ``[4, L]`` position ids as verl's data set builds them: text positions, then verl's
    ``get_rope_index`` of the family (temporal, height, width); a text row's rotary axes are its text positions."""
    if family in QWEN3_VL_ROPE:
        from verl.models.transformers.qwen3_vl import get_rope_index
    else:
        from verl.models.transformers.qwen2_vl import get_rope_index

    inputs = inputs or {}
    rotary = get_rope_index(
        _processor_view(),
        ids,
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
        second_per_grid_ts=inputs.get("second_per_grid_ts"),
        attention_mask=torch.ones_like(ids),
    )
    return torch.cat([torch.arange(len(ids))[None], rotary])


def make_vl_grpo_batch(
    *,
    images: list[list[tuple[int, ...]]],
    group_size: int,
    text_before: int = 3,
    text_after: int = 4,
    response_len_range: tuple[int, int] = (2, 7),
    seed: int = 0,
    family: str = "qwen2_5_vl",
    pixel_seeds: list[int] | None = None,
    **kwargs: Any,
) -> TensorDict:
    """A GRPO mini-batch whose prompts hold images: group ``g`` has ``images[g]`` (patch grids ``(h, w)`` of
    images, ``(t, h, w)`` of videos; an empty list is a text group, its rows carrying verl's empty
    ``multi_modal_inputs``). A prompt is ``text_before`` text tokens, each image (then each video) as
    ``<|vision_start|>`` + its merged patches' ``<|image_pad|>`` (``<|video_pad|>``) tokens + ``<|vision_end|>``
    (for Qwen3-VL and Qwen3.5 each video frame so),
    then ``text_after`` text tokens. Every row carries its group's pixel values (the same tensors' contents),
    drawn from ``pixel_seeds[g]`` where given (groups with one seed and the same first items hold the same first
    images, by content: what ``prefix_reuse.tree`` shares across groups);
    ``kwargs`` go to ``make_grpo_batch`` (losses, temperature...), which draws responses and advantages."""
    base = make_grpo_batch(
        num_groups=len(images),
        group_size=group_size,
        prompt_lens=text_before + text_after,
        response_len_range=response_len_range,
        vocab_size=TEXT_VOCAB,
        seed=seed,
        **kwargs,
    )
    ids, positions, prompts, entries = [], [], [], []
    for i, (row, prompt) in enumerate(zip(base["input_ids"].unbind(), base["prompts"].unbind())):
        items = images[i // group_size]
        stills = [(1, *size) for size in items if len(size) == 2]
        videos = [size for size in items if len(size) == 3]
        pixel_seed = pixel_seeds[i // group_size] if pixel_seeds is not None else 1000 * seed + i // group_size
        inputs = visual_inputs(stills, videos, pixel_seed, family) if items else None
        # Qwen3-VL and Qwen3.5 mark each video frame on its own (their rotary index splits a video per frame)
        frames = [(1, h, w) for t, h, w in videos for _ in range(t)] if family in QWEN3_VL_ROPE else videos
        vision = [
            torch.tensor([VISION_START] + [pad] * (t * h * w // MERGE**2) + [VISION_END], dtype=torch.long)
            for pad, grids in ((IMAGE_PAD, stills), (VIDEO_PAD, frames))
            for t, h, w in grids
        ]
        new_prompt = torch.cat([prompt[:text_before], *vision, prompt[text_before:]])
        full = torch.cat([new_prompt, row[len(prompt) :]])
        prompts.append(new_prompt)
        ids.append(full)
        positions.append(vl_positions(full, inputs, family))
        entries.append({k: v.clone() for k, v in inputs.items()} if inputs else {})
    batch = base.copy()
    batch["prompts"] = torch.nested.as_nested_tensor(prompts, layout=torch.jagged)
    batch["input_ids"] = torch.nested.as_nested_tensor(ids, layout=torch.jagged)
    # ragged along the last dim ([B, 4, j]) even when every row has the same length, where ``as_nested_tensor``
    # would make the 4 rotary axes the ragged dim (what verl's ``maybe_fix_3d_position_ids`` then breaks)
    offsets = torch.tensor([0, *torch.tensor([p.shape[1] for p in positions]).cumsum(0).tolist()])
    batch["position_ids"] = torch.nested.nested_tensor_from_jagged(torch.cat(positions, dim=1), offsets, jagged_dim=2)
    batch["multi_modal_inputs"] = NonTensorStack(*entries)
    return batch
