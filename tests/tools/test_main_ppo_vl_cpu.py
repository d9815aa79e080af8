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
from helpers.recipe_runs import (
    SMALL_JOB,
    assert_reuse_ran,
    assert_same_rollouts_and_update,
    metrics,
    run_dense_and_prefix,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

STEPS = 2
SMALL = [
    *SMALL_JOB,
    "data.filter_overlong_prompts=false",  # prompts of 60-100 tokens: the processor pass over the set is waste
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    env = {"TASK": "vl", "GPUS_PER_NODE": "1"}
    return run_dense_and_prefix(tmp_path_factory, "vl", steps=STEPS, env=env, args=SMALL)


def test_vl_main_ppo_dense_and_reuse_agree_on_identical_rollouts(runs):
    dense = metrics(runs["dense"] / "metrics_first.jsonl")
    prefix = metrics(runs["prefix"] / "metrics_first.jsonl")
    assert sorted(dense) == sorted(prefix) == list(range(1, STEPS + 1)), (dense.keys(), prefix.keys())
    for step in dense:
        d, p = dense[step], prefix[step]
        assert_same_rollouts_and_update(d, p, step)  # identical rollouts, images included
        assert_reuse_ran(p, step)  # the images in the shared prefix: the encoder ran once per group
        assert p["actor/prefix/vision_encoder_calls"] == p["actor/prefix/groups"], (step, p)
