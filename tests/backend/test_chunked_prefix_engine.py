"""Chunked prefix (``prefix_reuse.prefix_chunk_tokens``) through the engine against verl's stock fsdp2
engine: keep, recompute and offload (CPU stand-in store) in fp64 and fp32 with chunk sizes that do and
do not divide the prefixes; forward-only passes; checkpointing with the MoE aux loss; two ranks whose
groups need different numbers of chunks (lockstep filler chunks)."""

from __future__ import annotations

import pytest
from helpers.precision import promote_fp32_upcasts
from helpers.ranks import run_two_ranks
from test_dormant_policies_engine import (
    check_reuse_ran,
    grpo_batch,
    rank_batch,
    set_policy,
    stock_step,
    worst_relative,
)

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import verl_engine

TOL = {"float64": 1e-10, "float32": 1e-5}


def check_chunked(metrics: dict, chunks: float) -> None:
    assert metrics["prefix/prefix_chunks"] == chunks > 0


# prefixes of 8, 4 and 11 tokens (prompts 9, 5, 12): chunks of 4 divide two of them, chunks of 3 none
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("policy", ["keep", "recompute", "offload", "auto"])
def test_chunked_prefix_matches_stock_fsdp2(tiny_model, policy, dtype):
    model_dir = tiny_model("qwen3")
    batch = grpo_batch()
    want = stock_step(model_dir, dtype)
    with promote_fp32_upcasts():
        for chunk_tokens, chunks in ((4, 2.0 + 3.0), (3, 3.0 + 2.0 + 4.0)):
            prefix, p_loss, _ = verl_engine.build_verl_engine(
                model_dir, backend="prefix_fsdp2", dtype=dtype, micro_batch_size_per_gpu=2
            )
            prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2, prefix_chunk_tokens=chunk_tokens)
            set_policy(prefix, policy, 1 if policy == "auto" else None)  # auto: nothing fits, recompute (CPU)
            got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
            assert worst_relative(got["grads"], want["grads"]) < TOL[dtype], chunk_tokens
            check_reuse_ran(got["reduced_metrics"], "recompute" if policy == "auto" else policy, 3.0)
            check_chunked(got["reduced_metrics"], chunks)


def test_forward_only_chunks_match_stock_fsdp2(tiny_model):
    model_dir = tiny_model("qwen3")
    batch = grpo_batch()
    stock, _, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", dtype="float64", micro_batch_size_per_gpu=2)
    prefix, _, _ = verl_engine.build_verl_engine(
        model_dir, backend="prefix_fsdp2", dtype="float64", micro_batch_size_per_gpu=2
    )
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2, prefix_chunk_tokens=3)
    with promote_fp32_upcasts():
        want = verl_engine.run_infer(stock, batch)
        got = verl_engine.run_infer(prefix, batch)
    for key in ("response_log_probs", "response_entropy"):
        for a, b in zip(got[key].unbind(), want[key].unbind()):
            assert (a - b).abs().max().item() < 1e-10, key
    metrics = verl_engine.reduce_step_metrics(got["metrics"])
    assert metrics["prefix/groups"] == 3.0 and metrics["prefix/physical_tokens"] < metrics["prefix/logical_tokens"]


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_chunks_with_checkpointing_and_moe_aux(tiny_model, policy):
    """Checkpointing and the MoE router aux loss together, fp64: chunked against the whole prefix (keep)
    on the same batch and partition (the aux is a per-micro-batch mean, so only equal partitions compare)."""
    model_dir = tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, experts_implementation="eager")
    batch = grpo_batch()
    results = {}
    for name, chunk_tokens in (("whole", None), ("chunked", 3)):
        engine, loss_fn, _ = verl_engine.build_verl_engine(
            model_dir, backend="prefix_fsdp2", dtype="float64", micro_batch_size_per_gpu=2, gradient_checkpointing=True
        )
        engine.reuse_config = PrefixReuseConfig(min_prefix_len=2, prefix_chunk_tokens=chunk_tokens)
        engine.moe_aux_loss_coef = 0.5
        set_policy(engine, "keep" if name == "whole" else policy)
        with promote_fp32_upcasts():
            results[name] = verl_engine.run_train_step(engine, loss_fn, batch, capture_grads=True)
    check_chunked(results["chunked"]["reduced_metrics"], 9.0)
    for result in results.values():
        assert result["reduced_metrics"]["moe_aux_loss"] > 0
    assert worst_relative(results["chunked"]["grads"], results["whole"]["grads"]) < 1e-10
    gates = [n for n in results["chunked"]["grads"] if n.endswith("mlp.gate.weight")]
    assert gates and all(results["chunked"]["grads"][n].norm() > 0 for n in gates)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_chunked_prefix_through_merged_varlen_matches_stock_fsdp2(tiny_model, policy, dtype):
    """``phase_b_attention=merged_varlen`` with chunks of 3 (issue 20 item 3): every later chunk attends to the
    earlier chunks as one packed varlen row, the suffixes as packed rows; stock fsdp2's gradients."""
    model_dir = tiny_model("qwen3", num_kv_heads=2)
    batch = grpo_batch()
    want = stock_step(model_dir, dtype)
    prefix, p_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="prefix_fsdp2", dtype=dtype, micro_batch_size_per_gpu=2
    )
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2, prefix_chunk_tokens=3, phase_b_attention="merged_varlen")
    set_policy(prefix, policy)
    with promote_fp32_upcasts():
        got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
    assert worst_relative(got["grads"], want["grads"]) < TOL[dtype]
    metrics = got["reduced_metrics"]
    check_reuse_ran(metrics, policy, 3.0)
    check_chunked(metrics, 3.0 + 2.0 + 4.0)
    assert metrics["prefix/phase_b_attention/merged_varlen"] > 0 == metrics["prefix/phase_b_attention/concat"]


def _rank_body(rank: int, model_dir: str, policy: str, chunk_tokens: int = 8, attention: str = "auto") -> dict:
    kwargs = dict(dtype="float64", micro_batch_size_per_gpu=2, gradient_checkpointing=True)
    batch = rank_batch(rank)
    dense, d_loss, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs)
    prefix, p_loss, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **kwargs)
    prefix.reuse_config = PrefixReuseConfig(
        min_prefix_len=4, prefix_chunk_tokens=chunk_tokens, phase_b_attention=attention
    )
    set_policy(prefix, policy)
    with promote_fp32_upcasts():
        want = verl_engine.run_train_step(dense, d_loss, batch, capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
        infer_want = verl_engine.run_infer(dense, batch)
        infer_got = verl_engine.run_infer(prefix, batch)
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
    worst_lp = max(
        (a - b).abs().max().item()
        for a, b in zip(infer_got["response_log_probs"].unbind(), infer_want["response_log_probs"].unbind())
    )
    return {"worst": worst, "worst_lp": worst_lp, "metrics": got["reduced_metrics"]}


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_two_ranks_with_different_chunk_counts(tiny_model, policy):
    """Rank 0: prefixes of 39 (5 chunks of 8) and 4 tokens; rank 1: one prefix of 11 (2 chunks), then a
    filler group slot and dense singletons. Each slot runs the larger count on both ranks (filler
    chunks); a mismatch would hang in FSDP2's collectives."""
    results = run_two_ranks(_rank_body, str(tiny_model("qwen3")), policy)
    for rank in range(2):
        assert results[rank]["worst"] < 1e-10, rank
        assert results[rank]["worst_lp"] < 1e-10, rank
    assert results[0]["metrics"]["prefix/prefix_chunks"] == 5.0  # slot 1 (4-token prefix) runs whole on both
    assert results[1]["metrics"]["prefix/prefix_chunks"] == 5.0  # its 2-chunk group padded to rank 0's 5


def test_two_ranks_merged_varlen_where_one_rank_holds_only_filler_chunks(tiny_model):
    """Chunks of 12 with ``merged_varlen`` (issue 20 item 3): rank 0's 39-token prefix runs 4 chunks, the later
    three attending to the earlier ones through the varlen path; rank 1's 11-token prefix is one chunk plus three
    one-token filler chunks, none of which reaches that path. Before the chunk context had row lengths, rank 0
    raised at its second chunk and rank 1 was left in FSDP2's collectives; now both finish, exact (fp64)."""
    results = run_two_ranks(_rank_body, str(tiny_model("qwen3")), "keep", 12, "merged_varlen")
    for rank in range(2):
        assert results[rank]["worst"] < 1e-10, rank
        assert results[rank]["worst_lp"] < 1e-10, rank
        metrics = results[rank]["metrics"]
        assert metrics["prefix/prefix_chunks"] == 4.0, rank  # rank 1: 1 real chunk + 3 fillers
        assert metrics["prefix/phase_b_attention/merged_varlen"] > 0 == metrics["prefix/phase_b_attention/concat"]


pytestmark = pytest.mark.timeout(900)
