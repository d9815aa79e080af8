"""``prefix_megatron`` at pipeline parallelism 2 (two stages over gloo, fp32) against verl's own Megatron engine at
the same layout (its own pipelined schedule), on the same batch and weights.

Every stage runs the one schedule on its own layers; its model call receives the previous stage's hidden states and
hands its own on (``distributed.stages``), dense rows and a peer's lockstep fillers run as pipeline micro-batches.
Per stage, every parameter's gradient as megatron-core's DDP accumulates it (``main_grad`` after
``finalize_model_grads``), the last stage's loss and grad norm, the forward-only log-probs; reuse asserted on every
stage. Cases: one-level, the token trie, a chunked prefix, merged phase B, ``dormant_prefix=recompute``, and
megatron-core's full recompute. Negative controls: phase C skipped on every stage, phase B's RoPE one position late.
Layouts on two ranks: PP=2, and PP=2 with virtual stages (``virtual_pipeline_model_parallel_size=2``: two model chunks
per rank of a 4-layer model, a sequence going around the ring of ranks twice; verl's engine runs megatron-core's
interleaved schedule), there also with verl's dynamic batch size, and a tiny Qwen3-MoE with expert bias under virtual
stages (both chunks' routers counted exactly as verl's engine counts them). On four ranks (about a minute each, kept out
of the e2e tier, whose ``main_ppo`` launches would share the host's memory with them): PP=2 x DP=2, with and without
virtual stages (data-parallel rank 1 with dense rows and lockstep fillers through the pipeline), PP=2 x TP=2 with
sequence parallelism (``run_qwen3_8b_megatron.sh`` scaled down), a tiny Qwen3-MoE at PP=2 x TP=2 (sequence parallel) x
EP=2 with DeepSeek-V3's expert bias, full recompute and offload (the DeepSeek-V3 671B, Moonlight and Qwen3-235B recipes
scaled down; verl's loader turns the aux loss off), where every stage's expert load counts equal verl's engine's
exactly, and the same with virtual stages and softmax routing (``run_qwen3_30b_a3b_megatron.sh`` scaled down). Rows are
aligned to the TP size (verl's engine pads each row to it under sequence parallelism, and its routers count that
padding; reuse counts real tokens only). With reuse off the engine trains as verl's (every refusal tells users to do
that, and that advice must run: verl's engine returns ``{}`` on every stage but the last, which the driver passes
through)."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_batches import (
    MEGATRON_CASES,
    compare_steps,
    inferred,
    megatron_cases,
    megatron_counted_step,
    megatron_train_step,
    phase_c_skipped,
    shared_system_batch,
    suffix_rope_late,
)
from helpers.megatron_stack import require_megatron_stack
from helpers.ranks import run_ranks, run_two_ranks
from helpers.reuse import assert_reuse_ran

require_megatron_stack()

TOL = 1e-5  # fp32
TWO = {k: MEGATRON_CASES[k] for k in ("one_level", "tree")}
# the large MoE recipes scaled down (run_deepseek_v3_671b / run_moonlight_16b_a3b / run_qwen3_235b_a22b_megatron.sh):
# PP=2 x TP=2 (sequence parallel, as verl sets it at TP > 1) x EP=2 (expert TP 1), DeepSeek-V3's expert bias
# (sigmoid scores; Qwen3-235B's softmax routing without it is the same path less the counts), megatron-core's full
# recompute, offload; verl's loader turns the aux loss off
MOE_RECIPE = dict(
    tensor_parallel_size=2,
    sequence_parallel=True,
    expert_model_parallel_size=2,
    expert_tensor_parallel_size=1,
    param_offload=True,
    optimizer_offload=True,
    override_transformer_config={
        "attention_backend": "local",
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0,  # counted, not moved: each engine's later log-probs route alike
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
)
# run_qwen3_30b_a3b_megatron.sh scaled down: virtual stages (two model chunks per rank, a 4-layer model) at PP=2 x TP=2
# (sequence parallel) x EP=2, softmax routing (the aux loss off, as verl's loader sets it), full recompute, offload
VPP_MOE_RECIPE = dict(
    MOE_RECIPE,
    virtual_pipeline_model_parallel_size=2,
    override_transformer_config={
        k: v for k, v in MOE_RECIPE["override_transformer_config"].items() if "router" not in k
    },
)
FOUR_LAYERS = dict(num_layers=4)  # two virtual stages of one layer on each of two ranks
VPP_BIAS = dict(
    virtual_pipeline_model_parallel_size=2,
    override_transformer_config={
        "attention_backend": "local",
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0,
    },
)
# name -> (ranks, layout, cases, tiny model family, its size)
LAYOUTS = {
    "pp2": (2, dict(), MEGATRON_CASES, "qwen3", {}),
    "pp2_vpp2": (2, dict(virtual_pipeline_model_parallel_size=2), MEGATRON_CASES, "qwen3", FOUR_LAYERS),
    # expert bias counted over a rank's two chunks' routers (DeepSeek-V3's balancing under virtual stages)
    "pp2_vpp2_bias": (2, VPP_BIAS, TWO, "qwen3_moe", FOUR_LAYERS),
    "pp2_dp2": (4, dict(), TWO, "qwen3", {}),
    "pp2_vpp2_dp2": (4, dict(virtual_pipeline_model_parallel_size=2), TWO, "qwen3", FOUR_LAYERS),
    "pp2_tp2": (4, dict(tensor_parallel_size=2, sequence_parallel=True), TWO, "qwen3", {}),
    "pp2_tp2_ep2_moe": (4, MOE_RECIPE, TWO, "qwen3_moe", {}),
    "pp2_vpp2_tp2_ep2_moe": (4, VPP_MOE_RECIPE, TWO, "qwen3_moe", FOUR_LAYERS),
}
CONTROLS = {"no_phase_c": phase_c_skipped, "rope_late": suffix_rope_late}


def _reuse_body(rank: int, model_dir: str, name: str) -> dict:
    import dataclasses

    from megatron.core import parallel_state as mpu

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import verl_engine
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    world, layout, cases, _, _ = LAYOUTS[name]
    loss_fn, _ = ppo_loss(["use_kl_loss=true", "entropy_coeff=0.01", "ppo_micro_batch_size_per_gpu=4"])
    base = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2)
    pp = dict(pipeline_model_parallel_size=2, **layout)
    stock = build_megatron_engine(model_dir, lr=0.0, **pp)
    prefix = build_megatron_engine(model_dir, backend="prefix_megatron", lr=0.0, prefix_reuse=base, **pp)
    data_parallel = stock.get_data_parallel_size() > 1
    dp_rank = stock.get_data_parallel_rank()
    # verl pads each row to a multiple of the TP size under sequence parallelism and its routers count that padding:
    # aligned rows leave none (reuse counts real tokens only)
    batch = shared_system_batch(dp_rank, data_parallel, aligned=layout.get("tensor_parallel_size", 1))
    if layout.get("param_offload"):  # verl's worker context loads on entry and offloads on exit
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(batch, disable_auto_offload=False)
    out: dict = {
        "stage": mpu.get_pipeline_model_parallel_rank(),
        "dp_rank": dp_rank,
        "last": stock.is_mp_src_rank_with_outputs(),  # where verl's engine reports loss, grad norm, log-probs
    }
    out.update(megatron_cases(stock, prefix, loss_fn, batch, base, cases, CONTROLS))
    if prefix.expert_counts is not None:  # the load counts finalize_model_grads moves the expert bias by
        want = megatron_counted_step(stock, loss_fn, batch)
        for case in cases:
            prefix.reuse_config = dataclasses.replace(base, **cases[case][0])
            got = megatron_counted_step(prefix, loss_fn, batch)
            out[case]["counts"] = (want["counts"], got["counts"])
    if name == "pp2_vpp2":  # verl's dynamic batch size (the PP recipes set it): micro-batches by a token budget
        dynamic = dict(pp, use_dynamic_bsz=True, max_token_len_per_gpu=48, infer_max_token_len_per_gpu=48)
        stock_dynamic = build_megatron_engine(model_dir, lr=0.0, **dynamic)
        prefix_dynamic = build_megatron_engine(
            model_dir, backend="prefix_megatron", lr=0.0, prefix_reuse=base, **dynamic
        )
        out["dynamic"] = megatron_cases(stock_dynamic, prefix_dynamic, loss_fn, batch, base, TWO, {})
    if name == "pp2":  # megatron-core's full recompute under pipeline stages (phase B's re-entered in backward)
        over = {"attention_backend": "local", "recompute_granularity": "full", "recompute_method": "uniform"}
        recomputing = build_megatron_engine(
            model_dir, backend="prefix_megatron", lr=0.0, prefix_reuse=base, pipeline_model_parallel_size=2,
            override_transformer_config={**over, "recompute_num_layers": 1},
        )  # fmt: skip
        recomputing.reuse_config = dataclasses.replace(base)
        want = megatron_train_step(stock, loss_fn, batch)
        out["full_recompute"] = compare_steps(want, megatron_train_step(recomputing, loss_fn, batch))
        out["full_recompute"]["infer"] = (
            inferred(verl_engine.run_infer(stock, batch)),
            inferred(verl_engine.run_infer(recomputing, batch)),
        )
    return out


def _model(tiny_model, name: str) -> str:
    _, _, _, family, size = LAYOUTS[name]
    return str(tiny_model(family, **size))


@pytest.fixture(scope="module")
def two_ranks(tiny_model) -> dict:
    names = [n for n, spec in LAYOUTS.items() if spec[0] == 2]
    return {n: run_two_ranks(_reuse_body, _model(tiny_model, n), n, timeout=900) for n in names}


@pytest.fixture(scope="module")
def four_ranks(tiny_model) -> dict:
    names = [n for n, spec in LAYOUTS.items() if spec[0] == 4]
    return {n: run_ranks(_reuse_body, _model(tiny_model, n), n, world=4, timeout=1500) for n in names}


def _check(results: dict, name: str, case: str) -> None:
    for rank, result in results.items():
        r = result[case]
        groups = 2 if not result["dp_rank"] else 1
        assert r["grads"] > 3 and r["worst"] < TOL, (name, rank, case, r["name"], r["worst"])
        assert_reuse_ran(r["metrics"], groups=groups)  # every stage reports the last stage's outputs
        if result["last"]:
            assert r["loss"][1] == pytest.approx(r["loss"][0], rel=TOL, abs=1e-7), (name, rank, case)
            assert r["grad_norm"][1] == pytest.approx(r["grad_norm"][0], rel=TOL), (name, rank, case)
            want, got = r["infer"]
            for key in ("response_log_probs", "response_entropy"):
                diff = (got[key].values() - want[key].values()).abs().max().item()
                assert diff < TOL, (name, rank, case, key, diff)
        if "counts" in r:  # expert bias: every stage's routers counted as verl's engine counts them
            want, got = r["counts"]
            assert len(want) == len(got) > 0 and all(w.sum() > 0 for w in want), (name, rank, case)
            assert all(torch.equal(g, w) for w, g in zip(want, got)), (name, rank, case, want, got)
        if case in ("one_level", "tree"):
            assert r["no_phase_c"] > 1e-2, (name, rank, case, "skipping phase C passed")
            assert r["rope_late"] > 1e-3, (name, rank, case, "phase B's RoPE a position late passed")


@pytest.mark.parametrize("case", list(MEGATRON_CASES))
@pytest.mark.parametrize("name", ["pp2", "pp2_vpp2"])
def test_pipeline_stages_reuse_exactly(two_ranks, name, case):
    assert sorted(r["stage"] for r in two_ranks[name].values()) == [0, 1]
    _check(two_ranks[name], name, case)


@pytest.mark.parametrize("case", list(TWO))
def test_virtual_stages_count_expert_bias_over_every_chunk(two_ranks, case):
    """Expert bias under virtual stages: every router of a rank's chunks counted as verl's engine counts them."""
    _check(two_ranks["pp2_vpp2_bias"], "pp2_vpp2_bias", case)
    for result in two_ranks["pp2_vpp2_bias"].values():
        want, _ = result[case]["counts"]
        assert want[0].shape[0] == 2, want  # the rank's two chunks' routers, one row each, all counted


def test_virtual_stages_with_dynamic_batch_size(two_ranks):
    """verl's dynamic batch size (``use_dynamic_bsz``, which the Qwen3-8B, Qwen3-235B and DeepSeek-V3 Megatron
    recipes set) under virtual pipeline stages: verl's engine packs its micro-batches by a token budget, the
    schedule its suffix micro-batches; exact all the same, one-level and tree."""
    for rank, result in two_ranks["pp2_vpp2"].items():
        for case in TWO:
            r = result["dynamic"][case]
            assert r["worst"] < TOL, (rank, case, r["name"], r["worst"])
            assert_reuse_ran(r["metrics"], groups=2)
            if result["last"]:
                want, got = r["infer"]
                diff = (got["response_log_probs"].values() - want["response_log_probs"].values()).abs().max().item()
                assert diff < TOL, (rank, case, diff)


def test_pipeline_stages_with_megatron_full_recompute(two_ranks):
    for rank, result in two_ranks["pp2"].items():
        r = result["full_recompute"]
        assert r["worst"] < TOL, (rank, r["name"], r["worst"])
        assert_reuse_ran(r["metrics"], groups=2)


@pytest.mark.parametrize("name", [n for n, spec in LAYOUTS.items() if spec[0] == 4])
def test_pipeline_stages_with_data_or_tensor_parallelism(four_ranks, name):
    results = four_ranks[name]
    assert sorted(r["stage"] for r in results.values()) == [0, 0, 1, 1]
    for case in LAYOUTS[name][2]:
        _check(results, name, case)
    if "dp2" in name:  # data-parallel rank 1's singletons ran dense through the pipeline, its peer filled in
        for result in results.values():
            m = result["one_level"]["metrics"]
            assert m.get("prefix/fallback_short_prefix", 0.0) == (4.0 if result["dp_rank"] else 0.0)


def _off_body(rank: int, model_dir: str) -> dict:
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import verl_engine
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    loss_fn, _ = ppo_loss(["ppo_micro_batch_size_per_gpu=4"])
    stock = build_megatron_engine(model_dir, lr=0.0, pipeline_model_parallel_size=2)
    off = build_megatron_engine(
        model_dir, backend="prefix_megatron", lr=0.0, pipeline_model_parallel_size=2,
        prefix_reuse=PrefixReuseConfig(enable=False),
    )  # fmt: skip
    batch = shared_system_batch(0, False)
    want, got = megatron_train_step(stock, loss_fn, batch), megatron_train_step(off, loss_fn, batch)
    infer_want, infer_got = verl_engine.run_infer(stock, batch), verl_engine.run_infer(off, batch)
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items() if g.norm() > 0)
    log_probs = None
    if infer_want["log_probs"] is not None:
        log_probs = (infer_got["log_probs"].values() - infer_want["log_probs"].values()).abs().max().item()
    refused = None
    try:  # a refusal's advice (reuse off) must run: context parallelism is still refused
        build_megatron_engine(
            model_dir, backend="prefix_megatron", lr=0.0, pipeline_model_parallel_size=2, context_parallel_size=2
        )
    except ValueError as error:
        refused = str(error)
    return {
        "last_stage": off.is_mp_src_rank_with_outputs(),
        "grads": (len(want["grads"]), sorted(got["grads"]) == sorted(want["grads"]), worst),
        "loss": (want["loss"], got["loss"]),
        "grad_norm": (want["grad_norm"], got["grad_norm"]),
        "log_probs": log_probs,
        "refused": refused,
    }


def test_pipeline_stages_with_reuse_off_train_as_verls_engine(tiny_model):
    results = run_two_ranks(_off_body, str(tiny_model("qwen3")), timeout=600)
    assert [results[r]["last_stage"] for r in (0, 1)] == [False, True]
    for rank, result in results.items():
        count, same_names, worst = result["grads"]
        assert count > 0 and same_names and worst < 1e-6, (rank, result["grads"])
        refused = result["refused"]
        assert "context_parallel_size=2" in refused and "prefix_reuse.enable=false" in refused
    first, last = results[0], results[1]
    assert first["loss"] == (None, None) and first["log_probs"] is None  # verl's engine: nothing before the last
    assert last["loss"][0] == pytest.approx(last["loss"][1], rel=1e-6, abs=1e-9)
    assert last["grad_norm"][0] > 0 and last["grad_norm"][1] == pytest.approx(last["grad_norm"][0], rel=1e-6)
    assert last["log_probs"] < 1e-6
