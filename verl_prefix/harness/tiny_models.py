"""Tiny random-init causal LMs of the families the tests and benchmarks use, with a local tokenizer: model
directories that verl's ``HFModelConfig`` loads like any checkpoint (``write_tiny_model``, ``write_tokenizer``).
Token ids below ``len(SPECIAL_TOKENS)`` are the special tokens (``PAD_ID``, ``BOS_ID``, ``EOS_ID``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "deepseek_v3",
    "gemma4_text",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    "gemma3_text",
    "gpt_oss",
)
_MOE_FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_5_moe_text", "qwen3_next")
# hybrids whose gated delta-net layers are sized like the attention ones (``layer_types`` via ``extra_config``)
_DELTA_NET_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


def _family_config(family: str, head_dim: int, hidden_size: int, vocab_size: int, experts: tuple[int, int]) -> dict:
    """Config fields a family needs to be tiny (beyond the common ones): DeepSeek-V3's MLA (query/key heads of
    ``head_dim``, half of it RoPE, value heads of ``head_dim // 2``, one KV head per query head) and MoE after
    one dense layer; Gemma-4's per-layer inputs and global heads shrunk (its defaults build 200M parameters)
    and a window longer than any test sequence."""
    if family == "deepseek_v3":
        return dict(
            qk_rope_head_dim=head_dim // 2,
            qk_nope_head_dim=head_dim // 2,
            v_head_dim=head_dim // 2,
            kv_lora_rank=hidden_size // 2,
            q_lora_rank=None,
            n_routed_experts=experts[0],
            num_experts_per_tok=experts[1],
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            n_shared_experts=1,
            moe_intermediate_size=hidden_size // 2,
        )
    if family == "gemma4_text":
        return dict(
            head_dim=head_dim,
            global_head_dim=2 * head_dim,
            vocab_size_per_layer_input=vocab_size,
            hidden_size_per_layer_input=8,
            sliding_window=4096,
        )
    return {}


def write_tiny_model(
    dir: str | os.PathLike,
    family: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 128,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.1,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    seed: int = 0,
    experts_implementation: str | None = None,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write a random-init HF causal LM plus a local tokenizer, loadable with no network.

    A large-ish ``initializer_range`` keeps next-token distributions away from uniform so that
    log-prob and gradient comparisons are not trivially satisfied. Dropout is always 0.
    ``experts_implementation`` (MoE only) is written into ``config.json``: transformers defaults to
    ``grouped_mm``, which has no fp64 kernel; ``"eager"`` loads everywhere. ``extra_config`` is passed
    to the config last (a sliding window, ``rope_parameters``...), so it wins. ``gemma3_text`` (sliding and
    full layers) and ``gpt_oss`` (alternating sliding layers, attention sinks, MoE) get their defaults' large
    windows and head dims scaled down to the tiny model: a window of 16, ``head_dim = hidden / heads``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in _FAMILIES:
        raise ValueError(f"family must be one of {_FAMILIES}, got {family!r}")
    out = write_tokenizer(dir, vocab_size)

    head_dim = hidden_size // num_heads
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        attention_dropout=0.0,
        initializer_range=initializer_range,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    if family in ("qwen3", "qwen3_moe", "gemma3_text", "gpt_oss", *_DELTA_NET_FAMILIES):
        kwargs["head_dim"] = head_dim
    if family in _DELTA_NET_FAMILIES:
        kwargs.update(
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            linear_num_key_heads=num_kv_heads,
            linear_num_value_heads=num_heads,
        )
    if family in ("qwen3_5_moe_text", "qwen3_next"):  # every layer sparse, with a shared expert
        kwargs.update(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=intermediate_size or hidden_size // 2,
            shared_expert_intermediate_size=intermediate_size or hidden_size // 2,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    if family == "gemma3_text":
        kwargs.update(query_pre_attn_scalar=head_dim, sliding_window=16)
    if family == "gpt_oss":
        kwargs.update(num_local_experts=num_experts, num_experts_per_tok=num_experts_per_tok, sliding_window=16)
    if family == "qwen3_moe":
        kwargs.update(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=intermediate_size or hidden_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    if family == "mistral":
        kwargs["sliding_window"] = None  # Mistral's config defaults to a 4096 window; tests choose their own
    if family == "deepseek_v3":
        kwargs["num_key_value_heads"] = num_heads  # MLA: a K/V head per query head
    kwargs.update(_family_config(family, head_dim, hidden_size, vocab_size, (num_experts, num_experts_per_tok)))
    kwargs.update(extra_config or {})
    config = AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    # verl reads "architectures" from config.json; make sure it is there.
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("architectures"), f"config.json for {family} has no architectures"
    if experts_implementation is not None:
        if family not in _MOE_FAMILIES:
            raise ValueError("experts_implementation applies to mixture-of-experts families only")
        cfg["experts_implementation"] = experts_implementation
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_tokenizer(dir: str | os.PathLike, vocab_size: int) -> Path:
    """A local word-level tokenizer of ``vocab_size`` ids (``SPECIAL_TOKENS`` first) in ``dir``; returns ``dir``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError("vocab_size must leave room for ordinary tokens")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out)
    return out
