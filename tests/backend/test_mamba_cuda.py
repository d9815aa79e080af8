"""Mamba-2 hybrids on a GPU with ``mamba_ssm``: the stock mixer runs the fused kernels, which compute the recurrence
over every scan chunk, and the schedule scans with the same kernel from the boundary state
(``mamba_chunk_scan_combined(..., initial_states=, return_final_states=True)``, ``schedule.models.mamba``). A tiny
Nemotron-H with 16-token chunks, prompts of 40-60 tokens and responses up to 30: no mini-batch runs dense for its
length (``prefix/fallback_mamba_multichunk``), and the update equals verl's stock engine on the kernels in fp32 up
to their rounding; skipping phase C is far off. The CPU test of the same calls (a stand-in of the kernel) is
``tests/schedule/test_mamba.py::test_fused_path_past_one_chunk_matches_dense``; ``bench/gpu_check.sh`` runs this file.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from helpers.engine_batches import phase_c_skipped
from helpers.hybrids import NEMOTRON_MIXERS
from helpers.reuse import assert_reuse_ran, reduced
from test_engine_exactness import compare_update, grpo_batch
from transformers import AutoModelForCausalLM

from verl_prefix.harness import model_zoo, tiny_models

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or os.environ.get("VERL_PLATFORM") == "cpu"
    or importlib.util.find_spec("mamba_ssm") is None,
    reason="needs a CUDA GPU, VERL_PLATFORM=nvidia and mamba_ssm (the stock mixer's fused kernels)",
)

TOL = 1e-3  # fp32 kernels, the scan split at other chunk boundaries than dense's


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    out = tiny_models.write_tokenizer(tmp_path_factory.mktemp("nemotron_h_cuda"), 128)
    config = model_zoo.tiny_config(
        "nemotron_h", vocab_size=128, hidden_size=64, layers_block_type=["mamba", "mlp", "attention", "mamba"],
        **NEMOTRON_MIXERS, mamba_chunk_size=16, use_mamba_kernels=True, initializer_range=0.1,
        pad_token_id=tiny_models.PAD_ID, bos_token_id=tiny_models.BOS_ID, eos_token_id=tiny_models.EOS_ID,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def test_multi_chunk_sequences_reuse_on_the_fused_kernels(nemotron_dir):
    batch = grpo_batch(prompt_lens=[40, 52, 60], response_len_range=(5, 30))
    knobs = dict(dtype="float32", micro_batch_size_per_gpu=2, use_kl_loss=True)
    grads, _, _, prefix = compare_update(nemotron_dir, batch, **knobs)
    metrics = reduced(prefix["metrics"])
    assert metrics.get("prefix/fallback_mamba_multichunk", 0.0) == 0.0
    assert_reuse_ran(prefix["metrics"], groups=3)
    assert grads < TOL, grads
    with phase_c_skipped():
        skipped, _, _, _ = compare_update(nemotron_dir, batch, **knobs)
    assert skipped > 10 * max(grads, 1e-6), (skipped, grads)
