"""The GRPO loop with a KL loss: verl's reference policy runs too, on our engine's forward-only reuse path.

The shipped recipe trains with ``actor.use_kl_loss=true``, so every step also computes reference
log-probs on a ref worker whose engine follows ``actor.strategy`` (``prefix_fsdp2`` for us). Two steps
of ours against verl's stock ``sync`` + ``fsdp2`` on the same replayed rollouts, with SGD as in
``test_grpo_loop_ray.py``, and a KL coefficient large enough to move the update: the parameters, the
KL term verl logs and its share of the loss must agree, and our ref pass must have reused prefixes.
"""

from __future__ import annotations

import pytest
from helpers.reuse import assert_reuse_ran
from test_grpo_loop_ray import assert_updates_agree

from verl_prefix.tools.cpu_loop import local_cluster, run_cpu_grpo

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STEPS = 2
KL_COEF = 0.1
KL_OVERRIDES = (
    "actor_rollout_ref.actor.use_kl_loss=true",
    f"actor_rollout_ref.actor.kl_loss_coef={KL_COEF}",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
)
REF = "actor/prefix/ref_log_prob/"


@pytest.fixture(scope="module")
def runs(tiny_qwen3_dir):
    common = dict(
        steps=STEPS, num_prompts=4, n=4, world_size=2, seed=0, optimizer="SGD", lr=0.5, overrides=KL_OVERRIDES
    )
    with local_cluster():
        dense = run_cpu_grpo(tiny_qwen3_dir, prefix=False, **common)
        prefix = run_cpu_grpo(tiny_qwen3_dir, prefix=True, replay=dense.rollouts, **common)
    return dense, prefix


def test_each_trainer_built_its_ref_worker(runs):
    dense, prefix = runs
    assert (dense.worker, dense.ref_worker) == ("ActorRolloutRefWorker", "ActorRolloutRefWorker")
    assert (prefix.worker, prefix.ref_worker) == ("PrefixActorRolloutRefWorker", "PrefixActorRolloutRefWorker")
    for run in runs:
        assert len(run.steps) == STEPS
        for step in run.steps:
            assert step.metrics["actor/kl_coef"] == KL_COEF
            assert step.metrics["timing_s/ref"] > 0


def test_parameters_match_the_stock_worker_with_kl_loss(runs):
    assert_updates_agree(*runs)


def test_kl_loss_agrees_and_enters_the_loss(runs):
    dense, prefix = runs
    first = [run.steps[0].metrics["actor/kl_loss"] for run in runs]
    # step 1 trains the reference weights themselves: both passes see the same policy
    assert all(abs(kl) < 1e-6 for kl in first), first
    for got, want in zip(prefix.steps, dense.steps, strict=True):
        kl, kl_want = got.metrics["actor/kl_loss"], want.metrics["actor/kl_loss"]
        assert abs(kl - kl_want) <= 1e-4 * abs(kl_want) + 1e-9, (got.step, kl, kl_want)
    for run in runs:
        kl = run.steps[1].metrics["actor/kl_loss"]
        assert kl > 1e-4, kl  # one SGD step moved the policy away from the reference
        # verl's loss is pg_loss + kl_loss_coef * kl_loss (no entropy term): the KL term is in the update
        metrics = run.steps[1].metrics
        assert metrics["actor/loss"] - metrics["actor/pg_loss"] == pytest.approx(KL_COEF * kl, rel=1e-3)


def test_our_ref_pass_reused_the_prefixes(runs):
    _, prefix = runs
    for step in prefix.steps:
        m = step.metrics
        assert_reuse_ran(m, groups=2, namespace=REF)  # 4 prompts over 2 ranks, each group whole on its rank
        assert_reuse_ran(m, groups=2, namespace="actor/prefix/")  # the update
        assert m[REF + "time_s/A"] > 0, step.step
        assert m[REF + "reuse_factor"] > 1, step.step
        # the ref engine saw the same batch as the old-log-prob pass, so it did the same work
        assert m[REF + "logical_tokens"] == m["actor/prefix/old_log_prob/logical_tokens"], step.step


def test_the_stock_run_logs_no_prefix_metrics(runs):
    dense, _ = runs
    for step in dense.steps:
        assert not [k for k in step.metrics if k.startswith("actor/prefix/")], step.step
