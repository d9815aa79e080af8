"""A Mamba-2 hybrid (``nemotron_h``: Mamba, MLP, attention and Mamba blocks) through ``prefix_fsdp2`` against
verl's stock ``fsdp2`` engine on the same TensorDict (issue 22): forward-only log-probs/entropy, then gradients
and the update in fp64 (``helpers.precision.fp64_throughout`` around both engines: the mixers scan in fp32
otherwise) with ragged suffixes in micro-batches of 2, 1 and G rows and 2-token prefix chunks (every chunk
boundary inside the 3-token convolution window); two data-parallel ranks; G = 16 single-row micro-batches in
fp32 (1e-5) and bf16 (within 1.5x the stock engine's own bf16 error against its fp32 run). Each asserts reuse
ran. The mixers' ``chunk_size`` exceeds every sequence: transformers' torch scan is the Mamba-2 recurrence within
one chunk only (tests/schedule/test_mamba.py)."""

from __future__ import annotations

import pytest
import torch
from helpers.hybrids import NEMOTRON_MIXERS
from helpers.precision import fp64_throughout
from helpers.ranks import run_two_ranks
from helpers.reuse import assert_infer_matches, assert_reuse_ran
from test_cuda import assert_bf16_within_stocks_own, bf16_outputs
from test_engine_exactness import engines, grpo_batch, worst_relative
from test_recurrent_engine import assert_partitions_match, assert_ranks_matched, two_rank_step
from transformers import AutoModelForCausalLM

from verl_prefix.backend import fallbacks
from verl_prefix.harness import model_zoo, tiny_models, verl_engine

VOCAB = 128
# 4 Mamba heads of 8, d_state 8 in 2 groups, conv kernel 4, one scan chunk as long as the longest sequence (every
# call pads to a whole chunk, in both engines: a longer chunk only costs time)
NEMOTRON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    layers_block_type=["mamba", "mlp", "attention", "mamba"],
    **NEMOTRON_MIXERS,
    mamba_chunk_size=20,
    initializer_range=0.2,
    pad_token_id=tiny_models.PAD_ID,
    bos_token_id=tiny_models.BOS_ID,
    eos_token_id=tiny_models.EOS_ID,
)


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    out = tiny_models.write_tokenizer(tmp_path_factory.mktemp("tiny_nemotron_h"), VOCAB)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(model_zoo.tiny_config("nemotron_h", **NEMOTRON)).save_pretrained(out)
    return out


def test_fp64_update_partitions_and_chunks_match_stock_engine(nemotron_dir):
    """One pair of engines: forward-only, an update in micro-batches of 2 rows (3 groups, ragged suffixes), then
    gradients in micro-batches of 1 row, then of G = 4 rows over 2-token prefix chunks (each chunk boundary
    inside the 3-token conv window). Both engines took the same update, so each later step compares the same
    model. (Forward-only over chunks: tests/schedule/test_mamba.py.)"""
    (d_engine, d_loss, _), (p_engine, p_loss, _) = engines(
        nemotron_dir, dtype="float64", micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01
    )
    batch = grpo_batch()
    with fp64_throughout():
        dense = verl_engine.run_infer(d_engine, batch, calculate_entropy=True)
        assert_infer_matches(dense, verl_engine.run_infer(p_engine, batch, calculate_entropy=True), 1e-10, groups=3)
        before = verl_engine.params_of(d_engine)
        want = verl_engine.run_train_step(d_engine, d_loss, batch, capture_grads=True)
        got = verl_engine.run_train_step(p_engine, p_loss, batch, capture_grads=True)
        assert_reuse_ran(got["metrics"], groups=3)
        assert worst_relative(got["grads"], want["grads"]) < 1e-10
        d_after, p_after = verl_engine.params_of(d_engine), verl_engine.params_of(p_engine)
        moved = lambda after: {n: after[n] - before[n] for n in before}  # noqa: E731
        assert worst_relative(moved(p_after), moved(d_after)) < 1e-9
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-10)

        assert_partitions_match((d_engine, d_loss), (p_engine, p_loss), ((1, None), (4, 2)))


def _fp64(dense, prefix):
    return fp64_throughout()


def _two_rank_body(rank: int, model_dir: str) -> dict:
    return two_rank_step(rank, model_dir, _fp64)


def test_two_ranks_match_stock_engine_fp64(nemotron_dir):
    """Two data-parallel ranks (gloo, FSDP2 over both) with different group structure: rank 1 runs one group
    under reuse and four short-prompt singletons dense, so the ranks' Mamba-state phases run in lockstep."""
    assert_ranks_matched(run_two_ranks(_two_rank_body, str(nemotron_dir)))


def test_fp32_and_bf16_single_row_micro_batches(nemotron_dir):
    """G = 16 single-row micro-batches (prefix 14, suffixes of 2-6 tokens): fp32 reuse matches the fp32 stock
    engine at 1e-5 (log-probs and gradients); in bf16 (verl's mixed precision) reuse's error against the fp32
    stock run (mean |log-prob| error, the gradients' relative error) is within 1.5x the bf16 stock engine's own,
    as ``test_cuda`` judges bf16 on a GPU."""
    batch = grpo_batch(num_groups=1, group_size=16, prompt_lens=[14], response_len_range=(2, 6), use_kl=False)
    reference = bf16_outputs(nemotron_dir, "fsdp2", batch, bf16=False)
    fp32 = bf16_outputs(nemotron_dir, "prefix_fsdp2", batch, bf16=False)
    assert_reuse_ran(fp32[2], groups=1)
    torch.testing.assert_close(fp32[0], reference[0], rtol=1e-5, atol=1e-5)
    assert worst_relative(fp32[1], reference[1]) < 1e-5
    assert_bf16_within_stocks_own(nemotron_dir, batch, reference, groups=1)


def test_sequences_past_the_mixers_chunk_run_dense_with_their_reason(nemotron_dir):
    """Past one ``chunk_size`` transformers' torch scan (what the stock engine runs) is not the recurrence reuse
    computes: such a mini-batch runs dense (``mamba_multichunk``), one that fits a chunk reuses."""
    batch = grpo_batch()
    longest = int(batch["input_ids"].offsets().diff().max())
    fits = AutoModelForCausalLM.from_pretrained(nemotron_dir)
    assert fits.config.chunk_size >= longest
    assert fallbacks.length_fallback_reason(fits, batch) is None
    short = AutoModelForCausalLM.from_pretrained(nemotron_dir, chunk_size=longest - 1)
    assert fallbacks.length_fallback_reason(short, batch) == "mamba_multichunk"
