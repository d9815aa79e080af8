"""Inputs for a vision-language ``main_ppo`` run on CPU: a tiny Qwen2.5-VL and geometry-shaped image prompts.

``verl-prefix smoke-data --task vl --out DIR`` writes

- ``DIR/model``: a random-init Qwen2.5-VL (``harness.vl.write_tiny_vl_model``: a 2-block vision tower, 14-pixel
  patches merged 2 x 2, a 2-layer decoder) with a local word-level tokenizer that knows Qwen's vision tokens and
  a newline (verl's Qwen builders of the rollout prompt need one), a chat template that renders image blocks as
  ``<|vision_start|><|image_pad|><|vision_end|>``, and an image-only processor (``vl_processor``, remote code:
  run with ``trust_remote_code``);
- ``DIR/data/{train,test}.parquet`` in the layout of verl's ``examples/data_preprocess/geo3k.py``:
  ``data_source`` (``hiyouga/geometry3k``, which verl's default reward routes to its geo3k rule), ``prompt``
  (one user message, ``<image>`` then the question and an instruction), ``images`` (a list of ``{"bytes":
  PNG}``), ``ability``, ``reward_model`` (``{"style": "rule", "ground_truth": ...}``) and ``extra_info``.
  Images are synthetic (random shapes on a plain background) in three sizes, each a multiple of 28 pixels so
  no resizing happens: 16, 24 or 48 visual tokens.

verl's data set opens images with ``qwen_vl_utils``, which a CPU install does not carry; ``SmokeVLDataset``
(``data.custom_cls``) takes the PNG it already decoded instead (the images need no resizing). The reward,
``compute_score`` here, is verl's ``\\boxed{}`` math rule plus the text smoke's shaping term (half the share of
response words found in the question), which a random model can earn.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from verl.utils.dataset.rl_dataset import RLHFDataset

from verl_prefix.tools.smoke.text import shaping_score, write_splits

DATA_SOURCE = "hiyouga/geometry3k"
# every message renders as "<s> " + its blocks + "\n"; an image block as Qwen's three vision tokens
CHAT_TEMPLATE = (
    "{% for message in messages %}<s> {% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif item['type'] == 'text' %} {{ item['text'] }} "
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
)
INSTRUCTION = "t5 t6 t7 t8"  # stands in for geo3k's "think, then put the final answer in \boxed{}"
NEWLINE_ID = 4  # the tokenizer's "\n" (a word-level tokenizer has no newline otherwise)
IMAGE_SIZES = ((112, 112), (112, 168), (168, 224))  # (height, width) in pixels: 16, 24, 48 visual tokens
PATCH, MERGE = 14, 2
_PROCESSOR_FILE = "processing_smoke_vl.py"


def write_vl_tokenizer(dir: str | os.PathLike) -> Path:
    """The word-level tokenizer of the tiny vision-language vocabulary: ``SPECIAL_TOKENS``, ``"\\n"``, words
    ``t5``.., and Qwen's vision tokens at their ids (``harness.vl.VISION_START``..)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from verl_prefix.harness.tiny_models import SPECIAL_TOKENS
    from verl_prefix.harness.vl import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START

    vision = {
        "<|vision_start|>": VISION_START,
        "<|vision_end|>": VISION_END,
        "<|image_pad|>": IMAGE_PAD,
        "<|video_pad|>": VIDEO_PAD,
    }
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab["\n"] = NEWLINE_ID
    vocab.update({f"t{i}": i for i in range(NEWLINE_ID + 1, VISION_START)})
    vocab.update(vision)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_tokens([AddedToken("\n", normalized=False)])  # matched before whitespace splitting drops it
    tok.add_special_tokens([AddedToken(name, normalized=False) for name in vision])
    out = Path(dir)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out)
    return out


def write_smoke_vl_model(out: str | os.PathLike, *, seed: int = 0) -> Path:
    """The tiny Qwen2.5-VL, its tokenizer, chat template and image-only processor in ``out``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from verl_prefix.harness.vl import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, write_tiny_vl_model
    from verl_prefix.tools.smoke.vl_processor import Qwen2_5_VLProcessor

    path = write_tiny_vl_model(out, "qwen2_5_vl", seed=seed)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    write_vl_tokenizer(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    pixels = [h * w for h, w in IMAGE_SIZES]
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, min_pixels=min(pixels), max_pixels=max(pixels)
    )
    Qwen2_5_VLProcessor(image_processor, tokenizer, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    # remote code: AutoProcessor builds the image-only processor (transformers' own needs torchvision)
    (path / _PROCESSOR_FILE).write_text(
        "from verl_prefix.tools.smoke.vl_processor import Qwen2_5_VLProcessor  # noqa\n"
    )
    config_path = path / "processor_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["processor_class"] = "Qwen2_5_VLProcessor"
    config["auto_map"] = {"AutoProcessor": f"{_PROCESSOR_FILE[:-3]}.Qwen2_5_VLProcessor"}
    config_path.write_text(json.dumps(config, indent=2))
    # A random model samples Qwen's vision tokens as often as any word (a trained one never does), and verl
    # reads one in a response as an image placeholder (its rotary index, the engine's layout check): the
    # rollout never samples them. Its log-probs stay those of the unprocessed logits, what the actor computes.
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["suppress_tokens"] = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
    gen_path.write_text(json.dumps(gen, indent=2))
    tok_config_path = path / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    tok_config_path.write_text(json.dumps(tok_config, indent=2))
    return path


def synthetic_image(height: int, width: int, rng: np.random.Generator) -> bytes:
    """A PNG of a few random filled rectangles and lines on a plain background: a stand-in for a diagram."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), tuple(int(c) for c in rng.integers(180, 256, size=3)))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(2, 5))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, width, size=2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, height, size=2))
        color = tuple(int(c) for c in rng.integers(0, 180, size=3))
        if rng.random() < 0.5:
            draw.rectangle((x0, y0, x1, y1), outline=color, width=2)
        else:
            draw.line((x0, y0, x1, y1), fill=color, width=2)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def smoke_vl_rows(
    num: int, *, split: str, question_len: tuple[int, int] = (20, 40), seed: int = 0
) -> list[dict[str, Any]]:
    """``num`` geo3k-shaped rows: an image of one of ``IMAGE_SIZES`` (row ``i`` takes size ``i % 3``) and a
    question of random words (ids 9 and up; 5..8 spell the instruction)."""
    from verl_prefix.harness.vl import TEXT_VOCAB

    rng = np.random.default_rng(seed)
    rows = []
    for index in range(num):
        height, width = IMAGE_SIZES[index % len(IMAGE_SIZES)]
        length = int(rng.integers(question_len[0], question_len[1] + 1))
        question = " ".join(f"t{w}" for w in rng.integers(9, TEXT_VOCAB, size=length))
        answer = str(int(rng.integers(1, 100)))
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"<image>{question} {INSTRUCTION}"}],
                "images": [{"bytes": synthetic_image(height, width, rng)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
            }
        )
    return rows


def write_smoke_vl_data(out: str | os.PathLike, *, train: int = 64, test: int = 8, seed: int = 0) -> Path:
    """``train.parquet`` / ``test.parquet`` under ``out`` (geo3k's columns)."""
    return write_splits(out, smoke_vl_rows, train=train, test=test, seed=seed)


def write_smoke_vl(out: str | os.PathLike, *, train: int = 64, test: int = 8, seed: int = 0) -> dict[str, Path]:
    """Model and data for ``TASK=vl`` of the CPU recipe under ``out``: ``{"model": ..., "data": ...}``."""
    root = Path(out)
    model = root / "model"
    if model.exists():
        shutil.rmtree(model)  # a text smoke model there would leave files the VL one does not overwrite
    return {
        "model": write_smoke_vl_model(model, seed=seed),
        "data": write_smoke_vl_data(root / "data", train=train, test=test, seed=seed),
    }


class SmokeVLDataset(RLHFDataset):
    """verl's RL data set, opening the smoke data's images itself rather than through ``qwen_vl_utils``.

    The rows' PNGs are already decoded by ``RLHFDataset`` (``{"type": "image", "image": PIL image}``) and sized
    in multiples of 28 pixels, so the images ``qwen_vl_utils`` would return are these, in RGB."""

    @classmethod
    def _process_multi_modal_info(
        cls, messages: list[dict], image_patch_size: Any, config: Any
    ) -> tuple[list[Any] | None, None, list[Any] | None]:
        images = [
            item["image"].convert("RGB")
            for message in messages
            if isinstance(message.get("content"), list)
            for item in message["content"]
            if isinstance(item, dict) and item.get("type") == "image"
        ]
        for item in (i for m in messages if isinstance(m.get("content"), list) for i in m["content"]):
            if isinstance(item, dict) and item.get("type") == "video":
                raise ValueError("the smoke vision-language data set has no videos")
        return images or None, None, cls._extract_audio_info(messages)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs: Any
) -> float:
    """verl's ``\\boxed{}`` math rule (1.0 when the last boxed answer is the ground truth), else half the share
    of response words found in the question."""
    from verl.utils.reward_score import math_reward

    if math_reward.compute_score(solution_str, ground_truth) >= 1.0:
        return 1.0
    return shaping_score(solution_str, extra_info)


__all__ = [
    "CHAT_TEMPLATE",
    "DATA_SOURCE",
    "IMAGE_SIZES",
    "SmokeVLDataset",
    "compute_score",
    "smoke_vl_rows",
    "synthetic_image",
    "write_smoke_vl",
    "write_smoke_vl_data",
    "write_smoke_vl_model",
    "write_vl_tokenizer",
]
