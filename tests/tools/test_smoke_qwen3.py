"""``verl-prefix smoke-data --family qwen3`` (the ``ENGINE=torchtitan`` smoke model): a Qwen3 whose word-level
tokenizer has a one-token newline, which verl's Qwen token builder needs (the Llama smoke tokenizer has none,
which is why the FSDP recipe's model is Llama-style), and questions that never use the newline's id."""

from __future__ import annotations

import json

import pandas as pd
import pytest


def test_qwen3_smoke_model_takes_verls_qwen_token_builder(tmp_path):
    from transformers import AutoTokenizer
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from verl_prefix.tools.cli import main
    from verl_prefix.tools.smoke.text import VOCAB_SIZE

    out = tmp_path / "qwen3"
    assert main(["smoke-data", "--family", "qwen3", "--out", str(out), "--train", "2", "--test", "1"]) == 0
    config = json.loads((out / "model" / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"]) == ("qwen3", VOCAB_SIZE)
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    assert tokenizer.encode("\n", add_special_tokens=False) == [VOCAB_SIZE - 1]
    assert tokenizer.encode("t5 t126", add_special_tokens=False) == [5, 126]  # the words keep their ids
    assert type(create_continuous_token_builder(tokenizer, hf_model_type="qwen3")).__name__.startswith("Qwen")
    questions = " ".join(pd.read_parquet(out / "data" / "train.parquet").extra_info.map(lambda e: e["question"]))
    assert f"t{VOCAB_SIZE - 1}" not in questions.split()  # that id is the newline here

    # the Llama smoke tokenizer has no newline token: verl's Qwen builder refuses it
    from verl_prefix.harness.tiny_models import write_tokenizer

    llama = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "llama", VOCAB_SIZE))
    with pytest.raises(ValueError, match="newline"):
        create_continuous_token_builder(llama, hf_model_type="qwen3")
    assert main(["smoke-data", "--task", "vl", "--family", "qwen3", "--out", str(tmp_path / "vl")]) == 2


def test_agentic_smoke_data_shares_one_system_message(tmp_path):
    """``smoke-data --task agentic``: every prompt (train and test) opens with the same system message of
    ``AGENTIC_SYSTEM_WORDS`` words, then its own question, as ``TASK=agentic`` feeds the tree."""
    from verl_prefix.tools.cli import main
    from verl_prefix.tools.smoke.text import AGENTIC_SYSTEM_WORDS

    out = tmp_path / "agentic"
    assert main(["smoke-data", "--task", "agentic", "--out", str(out), "--train", "3", "--test", "2"]) == 0
    prompts = [p for split in ("train", "test") for p in pd.read_parquet(out / "data" / f"{split}.parquet").prompt]
    systems = {p[0]["content"] for p in prompts}
    assert len(systems) == 1 and len(next(iter(systems)).split()) == AGENTIC_SYSTEM_WORDS
    assert all([m["role"] for m in p] == ["system", "user"] for p in prompts)
    assert len({p[1]["content"] for p in prompts}) == len(prompts)
