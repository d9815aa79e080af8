"""A bad mini-batch on one data-parallel rank stops every rank with the same error naming the samples,
instead of leaving the others waiting in a collective until its timeout (DESIGN trap 15)."""

from __future__ import annotations

import re

import pytest
from helpers.ranks import run_two_ranks

GROUPS = [(9, [3, 2, 4, 1]), (7, [2, 5, 1, 3])]  # 8 rows, prompts long enough to reuse with min_prefix_len=4

# case -> (forward_only, rank whose batch is bad or "both", what every rank's error must say)
CASES = {
    "nan_advantage": (False, 1, r"rank 1 rejected the mini-batch.*samples \[2, 5\] have non-finite advantages"),
    "empty_response_update": (False, 0, r"rank 0 rejected the mini-batch.*samples \[3\] have empty responses"),
    "empty_response": (True, 1, r"rank 1 rejected the mini-batch.*samples \[3\] have empty responses"),
    # rank 1 falls back to dense for its own reason; its bad advantages are still caught before any collective
    "dense_fallback_nan": (False, 1, r"rank 1 rejected the mini-batch.*samples \[6\] have non-finite advantages"),
    "both_ranks": (False, "both", r"2 ranks rejected.*rank 0: samples \[3\] have empty responses.*rank 1: .*`uid`"),
}


def _batch(case: str | None, rank: int):
    import torch
    from helpers.batches import groups_batch, nested, rows_batch
    from verl.utils import tensordict_utils as tu

    batch, prompts, responses, uids = groups_batch(GROUPS, seed=3 + rank)
    bad_rank = CASES[case][1] if case else None
    if bad_rank not in (rank, "both"):
        return batch
    if case in ("nan_advantage", "dense_fallback_nan"):
        rows = [r.clone() for r in batch["advantages"].unbind()]
        bad = [2, 5] if case == "nan_advantage" else [6]
        rows[bad[0]][0] = float("nan")
        rows[bad[-1]][-1] = float("inf")
        batch["advantages"] = nested(rows)
        if case == "dense_fallback_nan":
            tu.assign_non_tensor(batch, calculate_sum_pi_squared=True)
    elif case == "both_ranks" and rank == 1:
        batch = rows_batch(prompts, responses, None, seed=3 + rank)
    elif case in ("empty_response", "empty_response_update", "both_ranks"):
        responses = list(responses)
        responses[3] = torch.zeros(0, dtype=torch.int64)
        batch = rows_batch(prompts, responses, uids, seed=3 + rank)
    return batch


def _body(rank: int, model_dir: str) -> dict:
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import verl_engine

    engine, loss_fn, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", micro_batch_size_per_gpu=2)
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=4)
    results: dict = {}
    for case, (forward_only, _, _) in CASES.items():
        batch = _batch(case, rank)
        try:
            if forward_only:
                verl_engine.run_infer(engine, batch)
            else:
                verl_engine.run_train_step(engine, loss_fn, batch)
            results[case] = {"raised": None}
        except ValueError as exc:
            results[case] = {"raised": type(exc).__name__, "message": str(exc)}
    # after the rejections both ranks are still in lockstep: a good mini-batch trains, with reuse
    good = verl_engine.run_train_step(engine, loss_fn, _batch(None, rank))
    results["good"] = {k: good["reduced_metrics"][k] for k in ("prefix/groups", "prefix/physical_tokens")}
    results["good"]["logical"] = good["reduced_metrics"]["prefix/logical_tokens"]
    # one uid over both prompts on rank 0 only (a per-sample prompt): no error on either rank, both reuse
    from helpers.batches import groups_batch, rows_batch

    _, prompts, responses, uids = groups_batch(GROUPS, seed=3 + rank)
    split = rows_batch(prompts, responses, ["same"] * len(uids) if rank == 0 else uids, seed=3 + rank)
    results["split"] = verl_engine.run_train_step(engine, loss_fn, split)["reduced_metrics"]["prefix/groups"]
    return results


def test_a_bad_batch_on_one_rank_stops_both_with_the_same_error(tiny_model):
    results = run_two_ranks(_body, str(tiny_model("qwen3")), timeout=240)
    for case, (_, _, expected) in CASES.items():
        for rank in range(2):
            got = results[rank][case]
            assert got["raised"] == "BatchRejected", (case, rank, got)
            assert re.search(expected, got["message"]), (case, rank, got["message"])
        assert results[0][case]["message"] == results[1][case]["message"], case
    for rank in range(2):
        assert results[rank]["good"]["prefix/groups"] == 2.0
        assert results[rank]["good"]["prefix/physical_tokens"] < results[rank]["good"]["logical"]
        assert results[rank]["split"] == 2.0  # rank 0's one uid over two prompts: two sub-groups


pytestmark = pytest.mark.timeout(600)


# -- decisions one rank's machine makes (issue 20 item 4): a recompute mismatch, a kernel refusal ------------------


def _trip_on_this_rank(case: str) -> None:
    """What rank 1 alone sees in ``case``: its recompute differs (an MoE top-k flip reads as an infinite
    difference), its GPU refuses torch's flash kernels (pre-Ampere: every merged call), its node has no
    varlen kernel (no flash_attn, torch < 2.10)."""
    from verl_prefix.schedule import dormant
    from verl_prefix.schedule.attention import merged as MA
    from verl_prefix.schedule.attention import varlen as V
    from verl_prefix.schedule.kv import contexts

    if case == "recompute_mismatch":
        dormant.kv_difference = lambda phase_a, recomputed, also=(): float("inf")
    elif case in ("auto_kernel_arch", "merged_kernel_arch"):
        MA.merged_refusal = contexts.merged_refusal = lambda query, kwargs, value_dim=None: "kernel_arch"
    elif case == "varlen_kernel_missing":
        V.varlen_refusal = contexts.varlen_refusal = lambda query, kwargs: "varlen_kernel"
        V.varlen_kernel_problem = lambda: (
            "torch 2.9.1 has no CUDA varlen flash attention and flash_attn does not import"
        )


def _untrip(saved: dict) -> None:
    from verl_prefix.schedule import dormant
    from verl_prefix.schedule.attention import merged as MA
    from verl_prefix.schedule.attention import varlen as V
    from verl_prefix.schedule.kv import contexts

    dormant.kv_difference = saved["kv_difference"]
    MA.merged_refusal = contexts.merged_refusal = saved["merged_refusal"]
    V.varlen_refusal = contexts.varlen_refusal = saved["varlen_refusal"]
    V.varlen_kernel_problem = saved["varlen_kernel_problem"]


# case -> (phase_b_attention, dormant_prefix)
ONE_RANK_CASES = {
    "recompute_mismatch": ("auto", "recompute"),
    "auto_kernel_arch": ("auto", "keep"),
    "merged_kernel_arch": ("merged", "keep"),
    "varlen_kernel_missing": ("merged_varlen", "keep"),
}


def _one_rank_body(rank: int, model_dir: str) -> dict:
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import verl_engine
    from verl_prefix.schedule import dormant
    from verl_prefix.schedule.attention import varlen as V
    from verl_prefix.schedule.kv import contexts

    saved = {
        "kv_difference": dormant.kv_difference,
        "merged_refusal": contexts.merged_refusal,
        "varlen_refusal": V.varlen_refusal,
        "varlen_kernel_problem": V.varlen_kernel_problem,
    }
    results: dict = {}
    for case, (attention, policy) in ONE_RANK_CASES.items():
        engine, loss_fn, _ = verl_engine.build_verl_engine(
            model_dir, backend="prefix_fsdp2", micro_batch_size_per_gpu=2
        )
        engine.reuse_config = PrefixReuseConfig(min_prefix_len=4, phase_b_attention=attention)
        engine.dormant_prefix = policy
        if rank == 1:
            _trip_on_this_rank(case)
        try:
            step = verl_engine.run_train_step(engine, loss_fn, _batch(None, rank))
            metrics = step["reduced_metrics"]
            results[case] = {"raised": None, **{k: v for k, v in metrics.items() if "phase_b_attention" in k}}
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the finding
            results[case] = {"raised": type(exc).__name__, "message": str(exc)}
        finally:
            _untrip(saved)
        # both ranks are still in lockstep afterwards: the same engine trains a good batch, reusing
        engine.reuse_config = PrefixReuseConfig(min_prefix_len=4)
        good = verl_engine.run_train_step(engine, loss_fn, _batch(None, rank))["reduced_metrics"]
        results[case]["good_groups"] = good["prefix/groups"]
    return results


def test_a_decision_one_rank_makes_is_agreed(tiny_model):
    """Two gloo ranks where only rank 1 trips (issue 20 item 4): a recompute mismatch raises the same
    ``RecomputeMismatch`` on both before phase C's backward; a GPU that refuses torch's flash kernels makes
    ``auto`` run concat on BOTH ranks (``concat_kernel_arch``) and an explicit ``merged`` raise the same
    ``KernelRefused`` on both; a node without a varlen kernel stops ``merged_varlen`` on both, naming it. No rank
    is left in a collective, and the next batch trains in lockstep."""
    results = run_two_ranks(_one_rank_body, str(tiny_model("qwen3")), timeout=400)
    for rank in range(2):
        mine = results[rank]
        assert mine["recompute_mismatch"]["raised"] == "RecomputeMismatch", mine["recompute_mismatch"]
        assert re.search(
            r"rank\(s\) 1 .*recomputed prefix K/V differ from phase A's by inf", mine["recompute_mismatch"]["message"]
        )
        auto = mine["auto_kernel_arch"]
        assert auto["raised"] is None, auto
        assert auto["prefix/phase_b_attention/merged"] == 0
        assert auto["prefix/phase_b_attention/concat"] == auto["prefix/phase_b_attention/concat_kernel_arch"] > 0
        merged = mine["merged_kernel_arch"]
        assert merged["raised"] == "KernelRefused", merged
        assert re.search(r"phase_b_attention=merged cannot run .*rank 1: kernel_arch: ", merged["message"])
        varlen = mine["varlen_kernel_missing"]
        assert varlen["raised"] == "KernelRefused", varlen
        assert re.search(
            r"rank 1: varlen_kernel: torch 2.9.1 has no CUDA varlen .* flash_attn does not import", varlen["message"]
        )
        for case in ONE_RANK_CASES:
            assert mine[case]["good_groups"] == 2.0, (case, mine[case])
    for case in ONE_RANK_CASES:
        assert results[0][case].get("message") == results[1][case].get("message"), case
