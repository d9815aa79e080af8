"""verl's own ``main_ppo`` on CPU with ``prefix_reuse.tree``: ``TASK=agentic`` of ``recipes/grpo_cpu_smoke.sh``
(every prompt behind one 64-word system message), the dense twin (``sync`` + ``fsdp2``) and the tree
(``prefix_sync`` + ``prefix_fsdp2``, ``tree=true``) on identical rollouts.

Two steps each, 2 prompts x 4 samples, one mini-batch: the trie's root is the system message, computed once for
both groups in the update and in the old and reference log-prob passes (the ref engine reads the actor's
``prefix_reuse``); the gradient norms agree with the stock engine's to 1e-4 relative."""

from __future__ import annotations

import pytest
from helpers.recipe_runs import (
    SMALL_JOB,
    assert_reuse_ran,
    assert_same_rollouts_and_update,
    metrics,
    run_dense_and_prefix,
)

from verl_prefix.tools.smoke.text import AGENTIC_SYSTEM_WORDS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

STEPS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    env = {"TASK": "agentic", "GPUS_PER_NODE": "1"}
    return run_dense_and_prefix(tmp_path_factory, "agentic", steps=STEPS, env=env, args=SMALL_JOB)


def test_tree_main_ppo_matches_the_stock_twin_and_computes_the_system_message_once(runs):
    dense = metrics(runs["dense"] / "metrics_first.jsonl")
    tree = metrics(runs["prefix"] / "metrics_first.jsonl")
    assert sorted(dense) == sorted(tree) == list(range(1, STEPS + 1)), (dense.keys(), tree.keys())
    for step in dense:
        d, t = dense[step], tree[step]
        assert_same_rollouts_and_update(d, t, step)
        assert_reuse_ran(t, step)
        for space in ("actor/prefix/", "actor/prefix/old_log_prob/", "actor/prefix/ref_log_prob/"):
            assert t[f"{space}tree_depth"] >= 2, (step, space, t)
            # the system message (and the template's opening) is one root shared by both groups
            assert t[f"{space}tree_shared_tokens/level1"] >= AGENTIC_SYSTEM_WORDS, (step, space, t)
            assert t[f"{space}tree_saved_tokens"] >= AGENTIC_SYSTEM_WORDS, (step, space, t)
