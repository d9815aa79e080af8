"""verl's own ``main_ppo`` on CPU with ``prefix_megatron`` at TP=2 (``ENGINE=megatron`` of
``recipes/grpo_cpu_smoke.sh``), against verl's own Megatron engine on identical rollouts.

The tiny Qwen3 of ``verl-prefix smoke-data --family qwen3``, GSM8K-shaped prompts; megatron-core through the CPU
platform layer (fp32, the local attention spec, sequence parallelism on at TP=2 as verl sets it, gloo),
Megatron-Bridge's loader, the distributed optimizer, packed (THD) rows; the ``hf`` rollout fed by the Megatron engine's
weight sync (``get_per_tensor_param``: TP shards gathered, HF names, fp32). Two launches side by side, each in its own
local Ray cluster with two actor ranks sharing one model over TP=2: verl's engine (``sync`` + ``megatron``, registered
for cpu by the plugin's ``VERL_PREFIX_MEGATRON_CPU`` opt-in) and the prefix run: that same stock launch plus exactly one
line, ``actor_rollout_ref.actor.strategy=prefix_megatron`` (verl's Megatron actor and reference configs keep ``strategy:
megatron`` on their engine configs; the plugin's selection swaps in ``prefix_megatron`` for both, and the metrics show
reuse in the update and in the reference pass), two steps each, 2 prompts x 4 samples in one mini-batch. The hf rollout
seeds each request from its prompt and count, so both runs draw the same samples at step 1; step 2's come from weights
that agree to AdamW's rounding, and draw the same too (asserted: same rewards and lengths)."""

from __future__ import annotations

import importlib.util

import pytest
from helpers.recipe_runs import SMALL_JOB, assert_engine_twins_agree, run_dense_and_prefix

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 is an optional dependency (scripts/setup.sh)")
if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge 0.3.1 is an optional dependency (scripts/setup.sh)", allow_module_level=True)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

STEPS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_dense_and_prefix(
        tmp_path_factory,
        "mcore",
        steps=STEPS,
        env={"ENGINE": "megatron"},
        args=SMALL_JOB,
        one_line="actor_rollout_ref.actor.strategy=prefix_megatron",
    )


def test_megatron_main_ppo_one_line_reuses_and_agrees_with_verl_engine(runs):
    assert_engine_twins_agree(runs, STEPS)
