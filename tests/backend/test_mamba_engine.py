"""A Mamba-2 hybrid (``nemotron_h``: Mamba, MLP, attention, MoE and Mamba blocks) through ``prefix_fsdp2``
against verl's stock ``fsdp2`` engine on the same TensorDict (issue 22): forward-only log-probs/entropy, then
gradients and the update, in fp64 (``helpers.precision.fp64_throughout`` around both engines: the mixers scan
in fp32 otherwise) and in fp32, each asserting reuse ran. The mixers' ``chunk_size`` exceeds every sequence:
transformers' torch scan is the Mamba-2 recurrence within one chunk only (tests/schedule/test_mamba.py)."""

from __future__ import annotations

import pytest
import torch
from helpers.precision import fp64_throughout
from helpers.reuse import assert_infer_matches, assert_reuse_ran
from test_engine_exactness import engines, grpo_batch, worst_relative
from transformers import AutoModelForCausalLM, NemotronHConfig

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend import fallbacks
from verl_prefix.tools import testing as T

VOCAB = 128


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    out = T.write_tokenizer(tmp_path_factory.mktemp("tiny_nemotron_h"), VOCAB)
    torch.manual_seed(0)
    config = NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        layers_block_type=["mamba", "mlp", "attention", "mamba"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=64,
        use_mamba_kernels=False,
        initializer_range=0.2,
        pad_token_id=T.PAD_ID,
        bos_token_id=T.BOS_ID,
        eos_token_id=T.EOS_ID,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


@pytest.mark.parametrize(("dtype", "tol"), [("float64", 1e-10), ("float32", 1e-5)])
def test_update_and_infer_match_stock_engine(nemotron_dir, dtype, tol):
    """One pair of engines per dtype (building them is most of the cost): forward-only (whole and in 2-token
    prefix chunks, shorter than the conv window), then an update with micro-batches of 2 rows (ragged
    suffixes, 3 groups)."""
    (d_engine, d_loss, _), (p_engine, p_loss, _) = engines(
        nemotron_dir, dtype=dtype, micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01
    )
    batch = grpo_batch()
    with fp64_throughout():
        dense = T.run_infer(d_engine, batch, calculate_entropy=True)
        prefix = T.run_infer(p_engine, batch, calculate_entropy=True)
    assert_infer_matches(dense, prefix, tol, groups=3)
    p_engine.reuse_config = PrefixReuseConfig(min_prefix_len=2, prefix_chunk_tokens=2)  # inside the conv window
    with fp64_throughout():
        chunked = T.run_infer(p_engine, batch, calculate_entropy=True)
    assert_infer_matches(dense, chunked, tol, groups=3)
    p_engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)

    before = T.params_of(d_engine)
    with fp64_throughout():
        dense = T.run_train_step(d_engine, d_loss, batch, capture_grads=True)
        prefix = T.run_train_step(p_engine, p_loss, batch, capture_grads=True)
    assert_reuse_ran(prefix["metrics"], groups=3)
    assert worst_relative(prefix["grads"], dense["grads"]) < tol
    d_after, p_after = T.params_of(d_engine), T.params_of(p_engine)
    update = worst_relative({n: p_after[n] - before[n] for n in before}, {n: d_after[n] - before[n] for n in before})
    assert update < 10 * tol


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
