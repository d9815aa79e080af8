"""A real GRPO loop on CPU: verl's v1 trainer and actor workers in a local Ray cluster, 2 ranks over gloo.

Two steps through our trainer mode (``prefix_sync``), ``PrefixActorRolloutRefWorker`` and ``prefix_fsdp2``
must leave the same parameters as verl's stock ``sync`` trainer, ``ActorRolloutRefWorker`` and ``fsdp2``
trained on the same rollouts. SGD makes the comparison sensitive to the gradient itself: its update is
``lr * clipped grad``, while AdamW's first step is about ``lr * sign(grad)`` and would hide scale errors.

The SGD pair trains with a KL loss, as the shipped recipe does (``actor.use_kl_loss=true``): every step
also computes reference log-probs on a ref worker whose engine follows ``actor.strategy`` (``prefix_fsdp2``
for us), with a KL coefficient large enough to move the update. The parameters, the KL term verl logs and
its share of the loss must agree, and our ref pass must have reused prefixes. The AdamW pair and the pair
with two mini-batches per step run without a KL loss (verl then builds no ref worker). Six runs in one
cluster and one set of worker processes (``worker_hosts``): starting a rank's process costs more than a
run's two steps, so the ranks start once and host every run's workers, the stock runs first.
"""

from __future__ import annotations

import pytest
from helpers.reuse import assert_reuse_ran

from verl_prefix.tools.cpu_loop.loop import compare_runs, cpu_grpo_config, local_cluster, run_cpu_grpo, split_groups
from verl_prefix.tools.cpu_loop.workers import worker_hosts

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STEPS = 2
N = 4
PROMPTS = 4


# Two PPO mini-batches per step (2 prompts x N samples each): every rank takes two optimizer steps per
# training step, the second at parameters the first moved. verl's stock balancer would put other samples
# in each mini-batch than ours, so the dense reference (verl's sync trainer, fsdp2) balances by whole groups
# (``+trainer.v1.keep_groups_for_stock_engine=true``: the same slots).
MINI_BATCH_PROMPTS = 2
TWO_MINI_BATCHES = (f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI_BATCH_PROMPTS}",)

KL_COEF = 0.1
KL_OVERRIDES = (
    "actor_rollout_ref.actor.use_kl_loss=true",
    f"actor_rollout_ref.actor.kl_loss_coef={KL_COEF}",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
)
REF = "actor/prefix/ref_log_prob/"


@pytest.fixture(scope="module")
def all_runs(tiny_qwen3_dir):
    common = dict(steps=STEPS, num_prompts=PROMPTS, n=N, world_size=2)
    sgd = dict(optimizer="SGD", lr=0.5, **common)
    # name -> (dense run, prefix run): each side's config (cpu_grpo_config's arguments)
    pairs = {
        "SGD": (dict(sgd, overrides=KL_OVERRIDES), dict(sgd, overrides=KL_OVERRIDES)),
        "AdamW": (dict(optimizer="AdamW", lr=1e-3, **common), dict(optimizer="AdamW", lr=1e-3, **common)),
        "SGD, two mini-batches": (
            dict(sgd, overrides=(*TWO_MINI_BATCHES, "+trainer.v1.keep_groups_for_stock_engine=true")),
            dict(sgd, overrides=TWO_MINI_BATCHES),
        ),
    }
    # every stock run first: none runs in a process where a prefix engine has run
    order = [(name, prefix) for prefix in (False, True) for name in pairs]
    rollouts = {"SGD": "SGD", "AdamW": "AdamW", "SGD, two mini-batches": "SGD"}  # whose rollouts a pair trains on
    # one selection line: verl's own sync trainer and worker, only actor.strategy=prefix_fsdp2 (the SGD rollouts)
    one_line = dict(sgd, overrides=(*KL_OVERRIDES, "trainer.v1.trainer_mode=sync"))
    dense, runs = {}, {}
    with local_cluster():
        configs = [cpu_grpo_config(tiny_qwen3_dir, prefix=p, **pairs[name][p]) for name, p in order]
        configs.append(cpu_grpo_config(tiny_qwen3_dir, prefix=True, **one_line))
        with worker_hosts(configs, world_size=2) as hosts:
            for name, prefix in order:
                replay = dense[rollouts[name]].rollouts if prefix or rollouts[name] != name else None
                run = run_cpu_grpo(
                    tiny_qwen3_dir, prefix=prefix, seed=0, replay=replay, workers=hosts, **pairs[name][prefix]
                )
                if prefix:
                    runs[name] = (dense[name], run)
                else:
                    dense[name] = run
            run = run_cpu_grpo(
                tiny_qwen3_dir, prefix=True, seed=0, replay=dense["SGD"].rollouts, workers=hosts, **one_line
            )
            runs["one line"] = (dense["SGD"], run)
    return runs


@pytest.fixture(scope="module")
def runs(all_runs):
    """The SGD pair, with the KL loss and so a ref worker on each side."""
    return all_runs["SGD"]


def test_with_verls_default_optimizer_the_whole_update_matches(all_runs):
    """AdamW (verl's default): the update over all parameters agrees to 1e-4. Single near-zero-gradient
    tensors may differ more, because Adam's first step divides rounding noise by a tiny |g|."""
    dense, prefix = all_runs["AdamW"]
    for row in compare_runs(dense, prefix):
        assert row["update_rel"] < 1e-4, row


def test_both_runs_went_through_the_selected_trainer_mode_and_engine(runs):
    dense, prefix = runs
    assert (dense.mode, dense.trainer, dense.worker, dense.strategy) == (
        "sync",
        "PPOTrainerSync",
        "ActorRolloutRefWorker",
        "fsdp2",
    )
    assert (prefix.mode, prefix.trainer, prefix.worker, prefix.strategy) == (
        "prefix_sync",
        "PrefixPPOTrainer",
        "PrefixActorRolloutRefWorker",
        "prefix_fsdp2",
    )
    assert len(dense.steps) == len(prefix.steps) == STEPS
    for step in dense.steps:
        assert len(step.groups) == PROMPTS and all(len(g) == N for g in step.groups)
        # GRPO needs reward spread inside a group, or every advantage is zero and nothing is trained
        assert step.metrics["critic/advantages/max"] > 0 > step.metrics["critic/advantages/min"]


def assert_updates_agree(dense, prefix) -> None:
    """Ours against stock after each step, fp32 with SGD: the limits every loop comparison holds."""
    for row in compare_runs(dense, prefix):
        assert row["update_rel"] < 1e-4, row
        assert row["update_rel_worst_tensor"] < 1e-4, row
        assert row["grad_norm_rel"] < 1e-5, row


def test_parameters_match_the_stock_worker_after_each_step(runs):
    dense, prefix = runs
    assert_updates_agree(dense, prefix)
    # the comparison is not vacuous: each step moved the parameters
    before = dense.initial_params
    for step in dense.steps:
        assert max((step.params[k] - before[k]).abs().max().item() for k in before) > 1e-3
        before = step.params


def test_groups_stay_whole_on_their_rank(runs):
    _, prefix = runs
    for step in prefix.steps:
        # 4 groups of 4 over 2 ranks of 8: the balancer can keep every group whole, and must
        assert split_groups(step.rank_uids) == 0, step.rank_uids
        assert step.metrics["actor/prefix/balance/split_groups"] == 0.0
        assert step.metrics["actor/prefix/balance/groups"] == PROMPTS
        # the engine on each rank saw its two whole groups and reused their prefixes, in the update and in
        # the old log-prob pass
        assert_reuse_ran(step.metrics, groups=PROMPTS / 2, namespace="actor/prefix/")
        assert_reuse_ran(step.metrics, groups=PROMPTS / 2, namespace="actor/prefix/old_log_prob/")
        assert step.metrics["actor/prefix/reuse_factor"] > 1.5


def test_one_selection_line_under_verls_own_sync_trainer(all_runs):
    """``actor.strategy=prefix_fsdp2`` alone, under verl's own ``sync`` trainer and worker: the plugin's balancing
    keeps every group whole, reuse runs in the update and the old log-prob pass, and the update is the stock one."""
    dense, prefix = all_runs["one line"]
    assert (prefix.mode, prefix.trainer, prefix.worker, prefix.strategy) == (
        "sync",
        "PPOTrainerSync",
        "ActorRolloutRefWorker",
        "prefix_fsdp2",
    )
    assert_updates_agree(dense, prefix)
    for step in prefix.steps:
        assert split_groups(step.rank_uids) == 0, step.rank_uids
        assert step.metrics["actor/prefix/split_groups"] == 0.0
        assert_reuse_ran(step.metrics, groups=PROMPTS / 2, namespace="actor/prefix/")
        assert_reuse_ran(step.metrics, groups=PROMPTS / 2, namespace="actor/prefix/old_log_prob/")


def test_two_mini_batches_per_step_match_dense(all_runs):
    """Two optimizer steps per training step: state carried between mini-batches (prefix caches, token
    normalisation, lockstep counts) must not leak, and the second update starts where the first left."""
    dense, prefix = all_runs["SGD, two mini-batches"]
    assert (dense.mode, dense.strategy, prefix.mode, prefix.strategy) == (
        "sync",
        "fsdp2",
        "prefix_sync",
        "prefix_fsdp2",
    )
    assert_updates_agree(dense, prefix)
    per_slot = MINI_BATCH_PROMPTS * N // 2  # samples per (rank, mini-batch)
    for d_step, p_step in zip(dense.steps, prefix.steps, strict=True):
        # the same balancer on both sides (uids are fresh per run): each rank, two mini-batches of one whole group
        for uids in d_step.rank_uids + p_step.rank_uids:
            assert len(uids) == 2 * per_slot
            assert [len(set(uids[i : i + per_slot])) for i in range(0, len(uids), per_slot)] == [1, 1]
            assert uids[0] != uids[-1]
        # the engine reports per mini-batch: one group in each of a rank's two mini-batches
        assert_reuse_ran(p_step.metrics, groups=1, namespace="actor/prefix/")
    # the two-step update differs from the one-step update of the same rollouts: the knob took effect (the
    # one-step run's KL term has no gradient at step 1, where the policy is its reference)
    one_step = all_runs["SGD"][0]
    moved = [
        (s2.params[k] - s1.params[k]).norm() for s1, s2 in zip(one_step.steps[:1], dense.steps[:1]) for k in s1.params
    ]
    assert max(moved) > 1e-4


def test_metrics_arrive_with_actor_names(runs):
    dense, prefix = runs
    for step in prefix.steps:
        names = set(step.metrics)
        assert {"actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/entropy"} <= names
        assert {"actor/prefix/logical_tokens", "actor/prefix/physical_tokens", "actor/prefix/time_s/B"} <= names
        assert not [n for n in names if n.startswith("prefix/")], "engine metrics without the actor/ prefix"
    for step in dense.steps:
        assert not [n for n in step.metrics if "prefix/" in n]


def test_the_stand_in_rollout_samples_from_the_current_policy(runs):
    dense, prefix = runs
    for run in (dense, prefix):
        for step in run.steps:
            # verl's own check: the sampler's log-probs against the actor's old log-probs of the same tokens;
            # after step 1 this only holds if the updated weights reached the rollout model
            assert step.metrics["training/rollout_probs_diff_max"] < 1e-5
            assert step.metrics["training/off_policy/trajectory_staleness/max"] == 0


def test_cpu_platform_gives_verl_workers_a_gloo_process_group():
    # verl's default backend string is "cpu:gloo,cpu:gloo" on this platform, which torch rejects
    import verl.utils.distributed as dist_utils
    import verl.workers.engine_workers as engine_workers

    assert engine_workers.initialize_global_process_group_ray is dist_utils.initialize_global_process_group_ray
    assert getattr(dist_utils.initialize_global_process_group_ray, "_verl_prefix_cpu", False)


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
