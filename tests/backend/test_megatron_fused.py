"""prefix_megatron with verl's fused kernels on (``use_fused_kernels=true``, what 6 of verl's 19 Megatron GRPO
recipes set): verl replaces the ``GPTModel``'s forward with its fused linear cross-entropy (log-probs, no logits); the
schedule's calls run megatron-core's own forward and take the log-probs from the logits, the same maths. At TP=2
(no dense rows: verl's fused kernel is Triton's, which a CPU cannot run; ``bench/gpu_check.sh`` runs the fused
pair on a GPU), one-level reuse and the tree against verl's Megatron engine without fused kernels: every
``main_grad``, loss, grad norm and forward-only log-probs in fp32; reuse asserted. Control: the schedule calling
verl's fused forward is refused loudly (it returns no logits), not trained on.
"""

from __future__ import annotations

import pytest
from helpers.engine_batches import MEGATRON_CASES, megatron_cases, phase_c_skipped, shared_system_batch
from helpers.megatron_stack import require_megatron_stack
from helpers.ranks import run_two_ranks
from helpers.reuse import assert_infer_matches, assert_reuse_ran

require_megatron_stack()

TOL = 1e-5  # fp32
CASES = {name: MEGATRON_CASES[name] for name in ("one_level", "tree")}


def _body(rank: int, model_dir: str) -> dict:
    import contextlib

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.backend.megatron import causal_lm
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    loss_fn, _ = ppo_loss(["use_kl_loss=true", "entropy_coeff=0.01", "ppo_micro_batch_size_per_gpu=4"])
    base = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2)
    stock = build_megatron_engine(model_dir, lr=0.0, tensor_parallel_size=2)
    prefix = build_megatron_engine(
        model_dir, backend="prefix_megatron", lr=0.0, prefix_reuse=base, tensor_parallel_size=2, use_fused_kernels=True
    )
    out: dict = {
        "source": prefix.is_mp_src_rank_with_outputs(),
        "fused": prefix.engine_config.use_fused_kernels and "forward_backup" in vars(prefix.causal_lm.gpt),
    }
    batch = shared_system_batch(0, data_parallel=False)
    out.update(megatron_cases(stock, prefix, loss_fn, batch, base, CASES, {"no_phase_c": phase_c_skipped}))
    saved = causal_lm.unfused
    causal_lm.unfused = lambda model: contextlib.nullcontext()  # the control: verl's fused forward in the schedule
    try:
        from helpers.engine_batches import megatron_train_step

        megatron_train_step(prefix, loss_fn, batch)
        out["control"] = "trained"
    except Exception as exc:  # noqa: BLE001 - the control must not train
        out["control"] = type(exc).__name__
    finally:
        causal_lm.unfused = saved
    return out


@pytest.fixture(scope="module")
def ranks(tiny_model) -> dict:
    return run_two_ranks(_body, str(tiny_model("qwen3")), timeout=900)


@pytest.mark.parametrize("case", list(CASES))
def test_fused_kernels_setting_reuses_and_matches(ranks, case):
    for rank, result in ranks.items():
        assert result["fused"], "verl did not install its fused forward: the test proves nothing"
        r = result[case]
        assert r["grads"] > 10 and r["worst"] < TOL, f"rank {rank}: {r['name']} off by {r['worst']:.2e}"
        if result["source"]:
            assert r["loss"][1] == pytest.approx(r["loss"][0], rel=TOL, abs=1e-7)
            assert r["grad_norm"][1] == pytest.approx(r["grad_norm"][0], rel=TOL)
        assert_reuse_ran(r["metrics"], groups=2)
        assert_infer_matches(*r["infer"], TOL, groups=2)
        assert r["no_phase_c"] > 1e-2


def test_schedule_through_verls_fused_forward_is_refused_not_trained(ranks):
    for rank, result in ranks.items():
        assert result["control"] != "trained", rank
