"""Tiny DeepSeek-V4 models (eager only in transformers) with every length below the tests' prompts (DESIGN trap 19):
compression rates 8 and 4, a 16-token window, the low-rank projections and the indexer shrunk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from verl_prefix.harness import model_zoo as Z
from verl_prefix.harness.tiny_models import write_tokenizer

HCA, CSA = "heavily_compressed_attention", "compressed_sparse_attention"
SIZES = {
    "compress_rates": {HCA: 8, CSA: 4},
    "sliding_window": 16,
    "q_lora_rank": 16,
    "o_lora_rank": 16,
    "o_groups": 2,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 4,
}


def build(layer_types: list[str], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A random-init tiny DeepSeek-V4 of ``layer_types``, eager attention and experts, in train mode."""
    config = Z.tiny_config("deepseek_v4", "eager", layer_types=layer_types, **SIZES)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    return model.to(dtype).train()


def write(dir: str | os.PathLike, layer_types: list[str], dtype: torch.dtype = torch.float64) -> Path:
    """``build`` saved with a local tokenizer, loadable by verl's engines; experts eager in ``config.json``
    (transformers' default grouped_mm has no fp64 kernel)."""
    out = write_tokenizer(dir, Z.VOCAB)
    build(layer_types, dtype).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["experts_implementation"] = "eager"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
