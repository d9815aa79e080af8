"""Packed rows of a decoder that builds its attention masks without the position ids (transformers 5.10.4's
GPT-OSS, Afmoe, OPT, Bloom...): under verl's remove-padding layout each packed sequence would attend to the ones
before it (eager / sdpa), which verl's stock engine computes. prefix_fsdp2 runs the rows that go through verl's
forward (dense chunks: here four singletons beside two groups) padded instead, one sequence a row, as reuse runs
its groups: its update and log-probs equal the stock engine's padded layout (the correct model), in fp64.
Controls: the stock engine's packed layout is the wrong model here, and prefix_fsdp2 with the unpacking switched
off computes it too.
"""

from __future__ import annotations

import pytest
import torch
from helpers.engine_pairs import worst_relative
from helpers.precision import promote_fp32_upcasts
from helpers.reuse import assert_reuse_ran, reduced
from verl.utils import tensordict_utils as tu

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend import model_checks
from verl_prefix.harness import grpo_batches, tiny_models, verl_engine

TOL = 1e-9  # fp64
ENGINE = dict(dtype="float64", attn_implementation="eager", micro_batch_size_per_gpu=4, use_kl_loss=True)


def _batch():
    groups = grpo_batches.make_grpo_batch(
        num_groups=2, group_size=4, prompt_lens=[12, 9], response_len_range=(3, 8), vocab_size=128, seed=3, use_kl=True
    )
    singles = grpo_batches.make_grpo_batch(
        num_groups=4, group_size=1, prompt_lens=6, response_len_range=(3, 8), vocab_size=128, seed=4, use_kl=True
    )
    return tu.concat_tensordict([groups, singles])


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return tiny_models.write_tiny_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", experts_implementation="eager")


def _step(model_dir, backend: str, remove_padding: bool) -> dict:
    engine, loss_fn, _ = verl_engine.build_verl_engine(
        model_dir, backend=backend, use_remove_padding=remove_padding, **ENGINE
    )
    if backend == "prefix_fsdp2":
        engine.reuse_config = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2)
    with promote_fp32_upcasts():
        infer = verl_engine.run_infer(engine, _batch())
        step = verl_engine.run_train_step(engine, loss_fn, _batch(), capture_grads=True)
    return {"log_probs": infer["response_log_probs"].values(), **step, "engine": engine}


@pytest.fixture(scope="module")
def runs(gpt_oss_dir) -> dict:
    return {
        "padded": _step(gpt_oss_dir, "fsdp2", remove_padding=False),
        "packed": _step(gpt_oss_dir, "fsdp2", remove_padding=True),
        "prefix": _step(gpt_oss_dir, "prefix_fsdp2", remove_padding=True),
    }


def test_dense_rows_run_padded_and_match_the_padded_stock_engine(runs):
    want, got = runs["padded"], runs["prefix"]
    assert got["engine"].unpacked_dense_rows == "GptOssModel"
    assert_reuse_ran(got["metrics"], groups=2)
    assert reduced(got["metrics"])["prefix/fallback_small_group"] == 4.0  # the singletons ran dense
    assert worst_relative(got["grads"], want["grads"]) < TOL
    torch.testing.assert_close(got["log_probs"], want["log_probs"], rtol=TOL, atol=TOL)


def test_packed_rows_are_the_wrong_model_here(runs, gpt_oss_dir, monkeypatch):
    """The control: the stock engine's packed layout differs from its padded one (sequences attend across), and so
    does prefix_fsdp2 with the unpacking off."""
    assert (runs["packed"]["log_probs"] - runs["padded"]["log_probs"]).abs().max() > 1e-3
    monkeypatch.setattr(model_checks, "packed_masks_without_positions", lambda model: None)
    off = _step(gpt_oss_dir, "prefix_fsdp2", remove_padding=True)
    assert off["engine"].unpacked_dense_rows is None
    assert worst_relative(off["grads"], runs["padded"]["grads"]) > 1e-4


@pytest.mark.parametrize(
    "family, flagged",
    [("gpt_oss", "GptOssModel"), ("qwen3", None), ("llama", None), ("gemma3_text", None), ("qwen3_5_text", None)],
)
def test_which_decoders_build_masks_without_positions(family, flagged):
    from verl_prefix.harness import model_zoo

    model = model_zoo.build(family)
    model.config._attn_implementation = "eager"
    assert model_checks.packed_masks_without_positions(model) == flagged
    model.config._attn_implementation = "flash_attention_2"  # varlen attention reads the position ids itself
    assert model_checks.packed_masks_without_positions(model) is None
