"""Inputs for running ``python -m verl.trainer.main_ppo`` on CPU: a tiny model and GSM8K-shaped data.

``verl-prefix smoke-data --out DIR`` writes

- ``DIR/model``: a random-init Llama-style model and its local word-level tokenizer
  (``tiny_models.write_tiny_model``), plus a chat template, because verl's agent loop builds every prompt with
  ``apply_chat_template``; with ``--family qwen3`` a Qwen3 of the same size (what the TorchTitan engines take:
  torchtitan has a qwen3 model and no Llama of Qwen's layout), whose tokenizer also has a newline token;
  ``--family qwen3_5``: Qwen3.5's decoder (``qwen3_5_text``: a gated delta-net layer, then a full-attention
  one); ``--family gpt_oss``: GPT-OSS (a 16-token sliding-window layer, then a full one, attention sinks, 4
  experts, 2 per token). Both keep the word-level tokenizer: verl's agent loop builds their prompts with its
  generic and GPT-OSS token builders, which need no newline token;
- ``DIR/data/train.parquet`` and ``DIR/data/test.parquet`` in verl's RL dataset format, the columns
  ``examples/data_preprocess/gsm8k.py`` writes: ``data_source``, ``prompt`` (chat messages), ``ability``,
  ``reward_model`` (``{"style": "rule", "ground_truth": ...}``) and ``extra_info``
  (``split``, ``index``, ``question``, ``answer``). Questions are a few hundred tokens of the tokenizer's words.
  ``--task agentic``: every prompt opens with one system message of ``AGENTIC_SYSTEM_WORDS`` words (a system
  prompt and tool schemas every question shares: what ``prefix_reuse.tree`` computes once per rank).

The reward is rule-based, ``compute_score`` here (``reward.custom_reward_function.path`` points at this file):
verl's own GSM8K rule (``verl.utils.reward_score.gsm8k``, 1.0 for a ``#### <answer>`` line matching the ground
truth) plus a shaping term a random-init model can earn, half the fraction of response words that occur in
the question, so that GRPO groups have reward spread and the first update is not zero.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

DATA_SOURCE = "verl_prefix/gsm8k_smoke"
# Every message renders as "<s> content "; the word-level tokenizer maps each word to one id.
CHAT_TEMPLATE = "{% for message in messages %}{{ '<s> ' + message['content'] + ' ' }}{% endfor %}"
INSTRUCTION = "t4 t5 t6 t7"  # stands in for GSM8K's "Let's think step by step and output ..." suffix
VOCAB_SIZE = 128
# the ``agentic`` task's shared system message, in words (one token each)
AGENTIC_SYSTEM_WORDS = 64


def newline_tokenizer(dir: str | os.PathLike, vocab_size: int) -> Path:
    """The word-level tokenizer of ``tiny_models.write_tokenizer`` with ``"\\n"`` as its last id instead of a word:
    verl's Qwen token builders need a newline that encodes to one token."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from verl_prefix.harness.tiny_models import SPECIAL_TOKENS

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size - 1)})
    vocab["\n"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_tokens([AddedToken("\n", normalized=False)])  # matched before whitespace splitting drops it
    out = Path(dir)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out)
    return out


FAMILIES = ("llama", "qwen3", "qwen3_5", "gpt_oss")
# smoke family -> (``tiny_models`` family, its extra config): Qwen3.5's decoder needs a full-attention layer beside
# its delta-net one in two layers (its default puts one in every fourth)
_TINY = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_5": ("qwen3_5_text", {"layer_types": ["linear_attention", "full_attention"]}),
    "gpt_oss": ("gpt_oss", {}),
}


def write_smoke_model(out: str | os.PathLike, *, seed: int = 0, family: str = "llama") -> Path:
    """The tiny model and tokenizer the CPU recipe trains (0.1M parameters, 128-word vocabulary).

    Llama-style by default: verl's agent loop picks its token builder by ``model_type``, and the Qwen builders
    expect Qwen's newline token, which a word-level tokenizer does not have. ``family="qwen3"`` (the TorchTitan
    engines' smoke model) gives the tokenizer one, at the last id (``newline_tokenizer``). ``"qwen3_5"`` is
    Qwen3.5's text decoder (``qwen3_5_text``, which no builder of verl's names: the generic one) and ``"gpt_oss"``
    GPT-OSS (its builder only formats tool turns), both with the plain word-level tokenizer.
    """
    from verl_prefix.harness.tiny_models import write_tiny_model

    if family not in FAMILIES:
        raise ValueError(f"the smoke model is one of {FAMILIES}, got {family!r}")
    tiny, extra = _TINY[family]
    path = write_tiny_model(
        out, tiny, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=seed, extra_config=extra
    )
    if family == "qwen3":
        newline_tokenizer(path, VOCAB_SIZE)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    return path


def smoke_rows(
    num: int,
    *,
    split: str,
    vocab_size: int = VOCAB_SIZE,
    question_len: tuple[int, int] = (200, 320),
    seed: int = 0,
    system_words: int = 0,
) -> list[dict[str, Any]]:
    """``num`` GSM8K-shaped rows of random words (ids 8 and up; 4..7 spell the instruction); with
    ``system_words``, each prompt opens with one system message of that many words, the same in every row and
    split (drawn from its own seed)."""
    rng = np.random.default_rng(seed)
    words = np.random.default_rng(10_000).integers(8, vocab_size, size=system_words)
    system = [{"role": "system", "content": " ".join(f"t{w}" for w in words)}] if system_words else []
    rows = []
    for index in range(num):
        length = int(rng.integers(question_len[0], question_len[1] + 1))
        question = " ".join(f"t{w}" for w in rng.integers(8, vocab_size, size=length))
        answer = str(int(rng.integers(0, 1000)))
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [*system, {"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "question": question, "answer": f"#### {answer}"},
            }
        )
    return rows


def write_splits(
    out: str | os.PathLike, make_rows: Callable[..., list[dict]], *, train: int, test: int, seed: int
) -> Path:
    """``train.parquet`` / ``test.parquet`` under ``out``, each split's rows from ``make_rows(num, split=, seed=)``
    with its own seed (the text and the vision-language smoke data alike)."""
    import pandas as pd

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    for split, num, offset in (("train", train, 0), ("test", test, 1)):
        pd.DataFrame(make_rows(num, split=split, seed=seed * 2 + offset)).to_parquet(path / f"{split}.parquet")
    return path


def write_smoke_data(
    out: str | os.PathLike,
    *,
    train: int = 64,
    test: int = 8,
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
    system_words: int = 0,
) -> Path:
    """``train.parquet`` / ``test.parquet`` under ``out`` (verl's RL dataset columns), words below ``vocab_size``;
    ``system_words``: a system message every prompt shares (``smoke_rows``)."""
    rows = functools.partial(smoke_rows, vocab_size=vocab_size, system_words=system_words)
    return write_splits(out, rows, train=train, test=test, seed=seed)


def write_smoke(
    out: str | os.PathLike,
    *,
    train: int = 64,
    test: int = 8,
    seed: int = 0,
    family: str = "llama",
    system_words: int = 0,
) -> dict[str, Path]:
    """Model and data for the CPU recipe under ``out``: ``{"model": out/model, "data": out/data}``. The qwen3
    model's last id is the newline, which the questions then leave out."""
    root = Path(out)
    words = VOCAB_SIZE - 1 if family == "qwen3" else VOCAB_SIZE
    data = write_smoke_data(
        root / "data", train=train, test=test, seed=seed, vocab_size=words, system_words=system_words
    )
    return {"model": write_smoke_model(root / "model", seed=seed, family=family), "data": data}


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs: Any
) -> float:
    """verl's GSM8K rule (1.0 when correct), else half the share of response words found in the question."""
    from verl.utils.reward_score import gsm8k

    if gsm8k.compute_score(solution_str, ground_truth) >= 1.0:
        return 1.0
    return shaping_score(solution_str, extra_info)


def shaping_score(solution_str: str, extra_info: dict | None) -> float:
    """Half the share of response words found in the question: a reward a random-init model can earn, so GRPO
    groups have reward spread and the first update is not zero."""
    words = solution_str.split()
    question = set(str((extra_info or {}).get("question", "")).split())
    if not words or not question:
        return 0.0
    return 0.5 * sum(w in question for w in words) / len(words)


__all__ = [
    "CHAT_TEMPLATE",
    "DATA_SOURCE",
    "FAMILIES",
    "VOCAB_SIZE",
    "compute_score",
    "newline_tokenizer",
    "shaping_score",
    "smoke_rows",
    "write_smoke",
    "write_smoke_data",
    "write_smoke_model",
    "write_splits",
]
