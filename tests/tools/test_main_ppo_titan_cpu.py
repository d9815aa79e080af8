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
from helpers.recipe_runs import SMALL_JOB, assert_engine_twins_agree, run_dense_and_prefix

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is an optional dependency (scripts/setup.sh installs it)")
pytest.importorskip("triton", reason="torchtitan 0.3.0's model stack imports triton (scripts/setup.sh installs it)")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

STEPS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_dense_and_prefix(tmp_path_factory, "titan", steps=STEPS, env={"ENGINE": "torchtitan"}, args=SMALL_JOB)


def test_titan_main_ppo_tp2_reuse_agrees_with_verl_engine(runs):
    assert_engine_twins_agree(runs, STEPS)
