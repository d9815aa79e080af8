"""prefix_megatron on multi-latent attention (DeepSeek-V3's MLA on megatron-core) against verl's Megatron engine on the
same batch and weights, fp32, gloo: a tiny DeepSeek-V3 (q and kv LoRA ranks, a 8-wide rotary part, YaRN as
Megatron-Bridge builds it) with dense MLPs (its MoE layers are the router's business, ``test_megatron_moe.py``).

MLA's ``core_attention`` takes post-RoPE per-head keys and values of their own widths (q/k 16, v 8), so phase A
keeps them as it keeps GQA's; its rotary embedding lives in every layer's attention, each shifted by the call's first
position. At TP=2 (heads split) and DP=2 (rank 1 with dense singletons): one-level reuse, the tree, a chunked
prefix, merged attention; every ``main_grad``, loss, grad norm, forward-only log-probs; reuse asserted. Negative
controls: phase C skipped, phase B's RoPE one position late.
"""

from __future__ import annotations

import pytest
from helpers.engine_batches import (
    MEGATRON_CASES,
    megatron_cases,
    phase_c_skipped,
    shared_system_batch,
    suffix_rope_late,
)
from helpers.megatron_stack import require_megatron_stack
from helpers.ranks import run_two_ranks
from helpers.reuse import assert_infer_matches, assert_reuse_ran

require_megatron_stack()

TOL = 1e-5  # fp32
CASES = {name: MEGATRON_CASES[name] for name in ("one_level", "tree", "chunked", "merged")}
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "dp2": dict()}
# MLA with every MLP dense; DeepSeek-V3's expert bias off (its routers have no layer to run in)
MODEL = dict(extra_config={"first_k_dense_replace": 2, "q_lora_rank": 16})
OVERRIDES = {"attention_backend": "local", "moe_router_enable_expert_bias": False}


def _body(rank: int, model_dir: str, name: str) -> dict:
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    layout = dict(LAYOUTS[name], override_transformer_config=OVERRIDES)
    loss_fn, _ = ppo_loss(["use_kl_loss=true", "ppo_micro_batch_size_per_gpu=4"])
    base = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2)
    stock = build_megatron_engine(model_dir, lr=0.0, **layout)
    prefix = build_megatron_engine(model_dir, backend="prefix_megatron", lr=0.0, prefix_reuse=base, **layout)
    assert stock.tf_config.multi_latent_attention
    batch = shared_system_batch(stock.get_data_parallel_rank(), "tensor_parallel_size" not in LAYOUTS[name])
    controls = {"no_phase_c": phase_c_skipped, "rope_late": suffix_rope_late}
    out: dict = {"source": prefix.is_mp_src_rank_with_outputs()}
    out.update(megatron_cases(stock, prefix, loss_fn, batch, base, CASES, controls))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    from verl_prefix.harness.tiny_models import write_tiny_model

    model_dir = str(write_tiny_model(tmp_path_factory.mktemp("tiny_mla"), "deepseek_v3", **MODEL))
    runs = {name: run_two_ranks(_body, model_dir, name, timeout=900) for name in LAYOUTS}
    return {(name, rank): result for name, run in runs.items() for rank, result in run.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_mla_update_and_log_probs_match_verl_megatron_engine(ranks, layout, case):
    for rank in (0, 1):
        result = ranks[layout, rank]
        r = result[case]
        groups = 2 if layout == "tp2" or rank == 0 else 1
        assert r["grads"] > 10 and r["worst"] < TOL, f"rank {rank}: {r['name']} off by {r['worst']:.2e}"
        if result["source"]:
            assert r["loss"][1] == pytest.approx(r["loss"][0], rel=TOL, abs=1e-7)
            assert r["grad_norm"][1] == pytest.approx(r["grad_norm"][0], rel=TOL)
        assert_reuse_ran(r["metrics"], groups=groups)
        assert_infer_matches(*r["infer"], TOL, groups=groups)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mla_negative_controls_fail(ranks, layout):
    for rank in (0, 1):
        for case in ("one_level", "tree"):
            r = ranks[layout, rank][case]
            assert r["no_phase_c"] > 1e-2, f"rank {rank} {layout}/{case}: skipping phase C changed nothing"
            assert r["rope_late"] > 1e-3, f"rank {rank} {layout}/{case}: phase B's RoPE a position late passed"
