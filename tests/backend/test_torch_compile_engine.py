"""verl's ``use_torch_compile=true`` (its default: ``torch.compile`` of the entropy function every log-prob pass calls)
under reuse, on CPU: inductor compiles there too. A tiny Qwen3 in fp32, prefix_fsdp2 against verl's stock fsdp2
engine compiled the same way: every parameter's gradient and the forward-only log-probs and entropies within fp32's
rounding, reuse asserted, and both engines' entropy functions compiled and called (dynamo's own counters). In the
e2e tier: the first compile builds C++ kernels (tens of seconds on two cores, more on a cold cache)."""

from __future__ import annotations

import pytest
from helpers.reuse import assert_infer_matches, assert_reuse_ran, reduced

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import grpo_batches, verl_engine

pytestmark = pytest.mark.e2e

TOL = 1e-5  # fp32
COMPILE = ["actor_rollout_ref.actor.fsdp_config.use_torch_compile=true"]


def _batch():
    return grpo_batches.make_grpo_batch(
        num_groups=2, group_size=4, prompt_lens=[9, 12], response_len_range=(1, 7), vocab_size=128, seed=3,
        use_kl=True, calculate_entropy=True,
    )  # fmt: skip


def test_compiled_entropy_function_reuses_and_matches_the_stock_engine(tiny_qwen3_dir):
    import torch._dynamo.utils as dynamo_utils

    args = dict(dtype="float32", micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01, lr=0.0)
    dense = verl_engine.build_verl_engine(tiny_qwen3_dir, backend="fsdp2", overrides=COMPILE, **args)
    prefix = verl_engine.build_verl_engine(tiny_qwen3_dir, backend="prefix_fsdp2", overrides=COMPILE, **args)
    for engine in (dense[0], prefix[0]):  # torch.compile's wrapper, not verl's plain function
        assert getattr(engine.compute_entropy_from_logits, "_torchdynamo_orig_callable", None) is not None
    prefix[0].reuse_config = PrefixReuseConfig(min_prefix_len=2)
    before = dynamo_utils.counters["stats"]["calls_captured"]
    want = verl_engine.run_train_step(dense[0], dense[1], _batch(), capture_grads=True)
    got = verl_engine.run_train_step(prefix[0], prefix[1], _batch(), capture_grads=True)
    assert dynamo_utils.counters["stats"]["calls_captured"] > before, "the compiled entropy function never ran"
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items() if g.norm() > 0)
    assert worst < TOL, worst
    assert_reuse_ran(reduced(got["metrics"]), groups=2)
    want_infer = verl_engine.run_infer(dense[0], _batch(), calculate_entropy=True)
    got_infer = verl_engine.run_infer(prefix[0], _batch(), calculate_entropy=True)
    assert_infer_matches(want_infer, got_infer, TOL, groups=2)
