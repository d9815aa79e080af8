"""verl's own ``main_ppo`` on CPU with image prompts: ``TASK=vl`` of ``recipes/grpo_cpu_smoke.sh``, dense and
with reuse, on identical rollouts.

The tiny Qwen2.5-VL and geo3k-shaped data of ``verl-prefix smoke-data --task vl`` (one synthetic image of 16,
24 or 48 visual tokens per prompt), the ``hf`` rollout generating from the images. Two launches side by side,
each in its own local Ray cluster with one actor rank: the dense twin (``sync`` + ``fsdp2``) and the prefix
run (``prefix_sync`` + ``prefix_fsdp2``), two steps each, the smallest batch that still forms groups (2
prompts x 4 samples, one mini-batch). The hf rollout seeds each request from its prompt, its images and its
count, so both runs draw the same samples at step 1; step 2's samples come from weights that agree to
AdamW's rounding, and draw the same too (asserted: same rewards and lengths).
"""

from __future__ import annotations

import pytest
from helpers.recipe_runs import finish_recipe, metrics, ray_tmpdir, start_recipe, stop

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

STEPS = 2
# the smallest job that forms groups: 2 prompts x 4 samples, one mini-batch, one micro-batch
SMALL = [
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "data.filter_overlong_prompts=false",  # prompts of 60-100 tokens: the processor pass over the set is waste
    "trainer.save_freq=-1",  # no checkpoint: the metrics are the comparison (the last value of a key wins)
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both launches started together, each waited for: ``{"dense": (out, log), "prefix": (out, log)}``."""
    procs = {}
    try:
        for mode in ("dense", "prefix"):
            out = tmp_path_factory.mktemp(f"vl_{mode}")
            env = {"TASK": "vl", "GPUS_PER_NODE": "1", "RAY_TMPDIR": ray_tmpdir(f"vl_{mode}")}
            procs[mode] = (start_recipe(out, mode=mode, steps=STEPS, save_at=STEPS, env=env, args=SMALL), out)
        return {mode: (out, finish_recipe(proc, out)) for mode, (proc, out) in procs.items()}
    finally:
        for proc, _ in procs.values():
            stop(proc)


def test_vl_main_ppo_dense_and_reuse_agree_on_identical_rollouts(runs):
    dense = metrics(runs["dense"][0] / "metrics_first.jsonl")
    prefix = metrics(runs["prefix"][0] / "metrics_first.jsonl")
    assert sorted(dense) == sorted(prefix) == list(range(1, STEPS + 1)), (dense.keys(), prefix.keys())
    for step in dense:
        d, p = dense[step], prefix[step]
        assert "actor/prefix/groups" not in d  # the stock engine
        # identical rollouts: the same rewards, prompts (images included) and responses
        for key in ("critic/score/mean", "response_length/mean", "prompt_length/mean", "prompt_length/max"):
            assert d[key] == pytest.approx(p[key], rel=1e-6), (step, key)
        assert abs(p["actor/grad_norm"] - d["actor/grad_norm"]) <= 1e-4 * abs(d["actor/grad_norm"]), step
        assert d["actor/grad_norm"] > 0, step  # the groups have reward spread: the update is not zero
        # the sampler's log-probs are the actor's, images included, in both runs
        assert d["training/rollout_probs_diff_max"] < 1e-4 and p["training/rollout_probs_diff_max"] < 1e-4, step
        # reuse ran, the images in the shared prefix: the encoder ran once per group
        assert p["actor/prefix/groups"] > 0, (step, p)
        assert p["actor/prefix/physical_tokens"] < p["actor/prefix/logical_tokens"], (step, p)
        assert p["actor/prefix/vision_encoder_calls"] == p["actor/prefix/groups"], (step, p)
        assert p["actor/prefix/old_log_prob/groups"] > 0, (step, p)
        assert not any(k.startswith("actor/prefix/fallback_") and v > 0 for k, v in p.items()), (step, p)
