"""verl's own ``main_ppo`` on CPU with ``prefix_torchtitan`` at TP=2 (``ENGINE=torchtitan`` of
``recipes/grpo_cpu_smoke.sh``), against verl's own TorchTitan engine on identical rollouts.

The tiny Qwen3 of ``verl-prefix smoke-data --family qwen3`` (torchtitan has no flavor of its shapes: the engine
factories register one in each Ray worker), GSM8K-shaped prompts, the ``hf`` rollout fed by the TorchTitan
engine's weight sync (TP shards gathered, HF names from torchtitan's adapter, fp32). Two launches side by side,
each in its own local Ray cluster with two actor ranks sharing one model over TP=2: verl's engine (``sync`` +
``torchtitan``) and the prefix run (``prefix_sync`` + ``prefix_torchtitan``, the reference policy on
``prefix_torchtitan`` too), two steps each, 2 prompts x 4 samples in one mini-batch. The hf rollout seeds each
request from its prompt and count, so both runs draw the same samples at step 1; step 2's come from weights
that agree to AdamW's rounding, and draw the same too (asserted: same rewards and lengths).
"""

from __future__ import annotations

import pytest
from helpers.recipe_runs import finish_recipe, metrics, ray_tmpdir, start_recipe, stop

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is an optional dependency (scripts/setup.sh installs it)")
pytest.importorskip("triton", reason="torchtitan 0.3.0's model stack imports triton (scripts/setup.sh installs it)")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

STEPS = 2
# the smallest job that forms groups: 2 prompts x 4 samples, one mini-batch
SMALL = [
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "trainer.save_freq=-1",  # no checkpoint: the metrics are the comparison (the last value of a key wins)
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both launches started together, each waited for: ``{"dense": out, "prefix": out}``."""
    procs = {}
    try:
        for mode in ("dense", "prefix"):
            out = tmp_path_factory.mktemp(f"titan_{mode}")
            env = {"ENGINE": "torchtitan", "RAY_TMPDIR": ray_tmpdir(f"titan_{mode}")}
            procs[mode] = (start_recipe(out, mode=mode, steps=STEPS, save_at=STEPS, env=env, args=SMALL), out)
        for proc, out in procs.values():
            finish_recipe(proc, out)
        return {mode: out for mode, (_, out) in procs.items()}
    finally:
        for proc, _ in procs.values():
            stop(proc)


def test_titan_main_ppo_tp2_reuse_agrees_with_verl_engine(runs):
    dense = metrics(runs["dense"] / "metrics_first.jsonl")
    prefix = metrics(runs["prefix"] / "metrics_first.jsonl")
    assert sorted(dense) == sorted(prefix) == list(range(1, STEPS + 1)), (dense.keys(), prefix.keys())
    for step in dense:
        d, p = dense[step], prefix[step]
        assert "actor/prefix/groups" not in d  # verl's own engine
        # identical rollouts: the same rewards, prompts and responses
        for key in ("critic/score/mean", "response_length/mean", "prompt_length/mean", "prompt_length/max"):
            assert d[key] == pytest.approx(p[key], rel=1e-6), (step, key)
        assert abs(p["actor/grad_norm"] - d["actor/grad_norm"]) <= 1e-4 * abs(d["actor/grad_norm"]), step
        assert p["actor/pg_loss"] == pytest.approx(d["actor/pg_loss"], rel=1e-4, abs=1e-6), step
        assert d["actor/grad_norm"] > 0, step  # the groups have reward spread: the update is not zero
        # the weight sync from TP=2 hands the rollout the actor's weights (fp32): the sampler's log-probs are
        # the actor's in both runs
        assert d["training/rollout_probs_diff_max"] < 1e-4 and p["training/rollout_probs_diff_max"] < 1e-4, step
        # reuse ran in the update and in both forward-only passes (old log-probs, the reference policy)
        assert p["actor/prefix/groups"] > 0, (step, p)
        assert p["actor/prefix/physical_tokens"] < p["actor/prefix/logical_tokens"], (step, p)
        assert p["actor/prefix/old_log_prob/groups"] > 0 and p["actor/prefix/ref_log_prob/groups"] > 0, (step, p)
        assert not any(k.startswith("actor/prefix/fallback_") and v > 0 for k, v in p.items()), (step, p)
    # after one update the policy has moved from the reference: both reference passes see it alike
    assert dense[2]["actor/kl_loss"] > 0
    assert prefix[2]["actor/kl_loss"] == pytest.approx(dense[2]["actor/kl_loss"], rel=1e-4)
