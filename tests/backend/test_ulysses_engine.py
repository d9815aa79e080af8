"""``prefix_fsdp2`` with Ulysses sequence parallelism (``ulysses_sequence_parallel_size=2``) on gloo ranks.

verl's stock Ulysses path only wraps flash attention, so on CPU the reference is the engine without
sequence parallelism on the same mini-batches (the same maths): the stock ``fsdp2`` engine, or, with the
MoE router aux loss (which the stock engine lacks), ``prefix_fsdp2`` itself without SP, whose aux is
checked against dense HF elsewhere. A sequence-parallel group holds one data-parallel rank's mini-batch
on each of its ranks; the reference runs one such mini-batch part per rank (groups whole), so both see
the same global batch and the same micro-batch partition."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.ranks import run_ranks
from helpers.reuse import assert_reuse_ran

VOCAB = 128
# Four reference ranks' parts of four rows each, in micro-batches of 2. Prompts of 9, 6, 12 tokens and
# 7/10 (part 3 holds two groups of two): prefixes of 8, 5, 11, 6 and 9, three not divisible by sp=2.
# With four ranks the two SP groups' mini-batches hold 2 groups (2+2 micro-batches) and 3 groups (2+1+1):
# each fills in for the other (lockstep over the DP x SP mesh).
PROMPTS = [[9], [6], [12], [7, 10]]


def _part(index: int, short_prefix: bool = False):
    """One reference rank's mini-batch of four rows."""
    from verl_prefix.harness import grpo_batches

    prompts = [2] if short_prefix and index == 0 else PROMPTS[index]
    return grpo_batches.make_grpo_batch(
        num_groups=len(prompts),
        group_size=4 // len(prompts),
        prompt_lens=prompts,
        response_len_range=(1, 7),
        vocab_size=VOCAB,
        seed=20 + index,
        global_batch_size=16,
    )


def _rows(nested, start: int, count: int) -> list:
    return list(nested.unbind())[start : start + count]


def _body(
    rank: int, model_dir: str, world: int, sp: int, dtype: str, aux: bool, short_prefix: bool, chunks: int = 0
) -> dict:
    from helpers.precision import promote_fp32_upcasts
    from verl.utils import tensordict_utils as tu

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import verl_engine

    parts = [_part(i, short_prefix) for i in range(world)]
    dp_rank = rank // sp
    mine = tu.concat_tensordict(parts[dp_rank * sp : (dp_rank + 1) * sp])  # this SP group's mini-batch
    reuse = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2, prefix_chunk_tokens=chunks)
    kwargs = dict(dtype=dtype, micro_batch_size_per_gpu=2, entropy_coeff=0.01, use_remove_padding=True)
    ref_backend = "prefix_fsdp2" if aux else "fsdp2"
    ref, ref_loss, _ = verl_engine.build_verl_engine(model_dir, backend=ref_backend, **kwargs)
    got_engine, got_loss, _ = verl_engine.build_verl_engine(
        model_dir,
        backend="prefix_fsdp2",
        overrides=[f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}"],
        **kwargs,
    )
    got_engine.reuse_config = reuse
    if chunks:  # one chunk's graph at a time: phase C rebuilds each before its backward
        got_engine.dormant_prefix = "recompute"
    if aux:
        ref.reuse_config = reuse
        ref.moe_aux_loss_coef = got_engine.moe_aux_loss_coef = 0.01
    assert got_engine.use_ulysses_sp and got_engine.get_data_parallel_size() == world // sp
    with promote_fp32_upcasts():
        try:
            got = verl_engine.run_train_step(got_engine, got_loss, mine, capture_grads=True)
        except ValueError as error:
            return {"error_message": str(error)}
        want = verl_engine.run_train_step(ref, ref_loss, parts[rank], capture_grads=True)
        got_infer = verl_engine.run_infer(got_engine, mine)
        want_infer = verl_engine.run_infer(ref, parts[rank])
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
    offset = (rank % sp) * len(parts[rank])  # this rank's part inside its SP group's mini-batch
    infer = 0.0
    for key in ("response_log_probs", "response_entropy"):
        for a, b in zip(_rows(got_infer[key], offset, len(parts[rank])), want_infer[key].unbind()):
            infer = max(infer, ((a - b).abs().max() / b.abs().max().clamp(min=1)).item())
    return {
        "worst": worst,
        "infer": infer,
        "grad_norm": (got["grad_norm"], want["grad_norm"]),
        "metrics": got["reduced_metrics"],
        "infer_metrics": verl_engine.reduce_step_metrics(got_infer["metrics"]),
        "want_metrics": want["reduced_metrics"],
    }


CASES = {
    # id: (world, sp, model kwargs, dtype, aux)
    "sp2-fp64": (2, 2, dict(family="qwen3"), "float64", False),
    "sp2-fp32": (2, 2, dict(family="qwen3"), "float32", False),
    "sp2-kv1-below-sp": (2, 2, dict(family="qwen3", num_kv_heads=1), "float64", False),
    "sp2-moe-aux": (2, 2, dict(family="qwen3_moe", experts_implementation="eager"), "float64", True),
    "dp2xsp2": (4, 2, dict(family="qwen3"), "float32", False),
    "sp2-chunked-recompute": (2, 2, dict(family="qwen3"), "float64", False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ulysses_reuse_matches_the_engine_without_sequence_parallelism(tiny_model, case):
    world, sp, model, dtype, aux = CASES[case]
    model_dir = tiny_model(**model)
    chunks = 4 if "chunked" in case else 0  # prefixes of 8, 5, 11, 6 in chunks of 4: 2, 2, 3, 2 chunks
    results = run_ranks(_body, str(model_dir), world, sp, dtype, aux, False, chunks, world=world, timeout=540)
    tol = 1e-10 if dtype == "float64" else 1e-5
    for rank in range(world):
        r = results[rank]
        assert r["worst"] < tol, (rank, r["worst"])
        assert r["infer"] < tol, (rank, r["infer"])  # relative to the largest |log-prob| (at least 1)
        if rank % sp == 0:  # verl reports the grad norm on the first rank of each SP group only
            assert r["grad_norm"][0] == pytest.approx(r["grad_norm"][1], rel=tol * 10)
        for metrics in (r["metrics"], r["infer_metrics"]):
            dp_rank = rank // sp
            assert_reuse_ran(metrics, groups=sum(len(p) for p in PROMPTS[dp_rank * sp : (dp_rank + 1) * sp]))
            assert metrics["prefix/sp/size"] == sp
            assert metrics["prefix/sp/all_to_all_mib"] > 0
            assert not [k for k in metrics if k.startswith("prefix/fallback_") and metrics[k]], metrics
        if chunks:
            assert r["metrics"]["prefix/chunked_groups"] == 2 and r["metrics"]["prefix/prefix_chunks"] == 4
        if world == 4 and rank < sp:  # the SP group with two groups ran a filler group for the other's third
            assert r["metrics"]["prefix/time_s/lockstep"] > 0
        if aux:  # the reference splits the SP group's mini-batch over its ranks: its mean over them
            peers = range(rank - rank % sp, rank - rank % sp + sp)
            want = sum(results[p]["want_metrics"]["moe_aux_loss"] for p in peers) / sp
            assert r["metrics"]["moe_aux_loss"] == pytest.approx(want, rel=tol * 10)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or os.environ.get("VERL_PLATFORM") == "cpu",
    reason="needs two CUDA GPUs and VERL_PLATFORM=nvidia (bench/gpu_check.sh runs it where they exist)",
)
def test_ulysses_reuse_on_two_gpus(tiny_model):
    """The same comparison on NCCL and CUDA kernels (fp32 sdpa: the reference without SP, as on CPU)."""
    results = run_ranks(_body, str(tiny_model("qwen3")), 2, 2, "float32", False, False, world=2, cuda=True)
    for rank in range(2):
        assert results[rank]["worst"] < 1e-4 and results[rank]["infer"] < 1e-4, results[rank]
        assert_reuse_ran(results[rank]["metrics"], groups=2)


@pytest.mark.parametrize("world", [2, 4])
def test_dense_rows_under_ulysses_without_flash_attention_are_an_error(tiny_model, world):
    """A group with a 2-token prompt cannot reuse; verl's dense Ulysses path would attend within each
    rank's slice under sdpa, so every rank raises a clear error instead of training on it. With four ranks
    only the first SP group has that row: the other raises too (it would have filled in for it) instead
    of waiting in a collective."""
    results = run_ranks(_body, str(tiny_model("qwen3")), world, 2, "float64", False, True, world=world)
    for rank in range(world):
        message = results[rank]["error_message"]
        assert "attn_implementation='sdpa'" in message
        assert ("short_prefix" if rank < 2 else "another rank's rows") in message


def test_dense_rows_are_refused_only_where_verls_ulysses_path_is_wrong():
    """verl's dense Ulysses path all-to-alls inside flash attention only: dense rows are fine there."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from verl_prefix.backend.fallbacks import dense_under_ulysses_error

    model = AutoModelForCausalLM.from_config(
        Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    for implementation, refused in (("sdpa", True), ("eager", True), ("flash_attention_2", False)):
        model.config._attn_implementation = implementation
        error = dense_under_ulysses_error(model, "short_prefix")
        assert (error is not None) == refused, implementation
        if refused:
            assert f"attn_implementation={implementation!r}" in error and "short_prefix" in error


pytestmark = pytest.mark.timeout(900)
