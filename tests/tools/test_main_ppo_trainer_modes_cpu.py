"""verl's own ``main_ppo`` on CPU under the trainer modes besides ``sync``, with ``actor.strategy=prefix_fsdp2`` as
the only selection: ``trainer.v1.trainer_mode=colocate_async`` and the legacy trainer (``trainer.use_v1=false``).

Each mode runs twice on identical rollouts (``recipes/grpo_cpu_smoke.sh``, one step, 2 prompts x 4 samples, one
mini-batch): the stock twin (``fsdp2``) and the prefix run, which must reuse in the update and the old log-prob
pass, keep every group whole (``actor/prefix/split_groups`` 0) and match the stock gradient norm. ``sync`` runs
in ``test_main_ppo_cpu.py`` and the CPU GRPO loop (``test_grpo_loop_ray.py``). ``separate_async`` needs a
standalone rollout pool beside the trainer's ranks (``trainer.hybrid_engine=false``, verl's separate rollout
resources): its balancing is the same wrapped method, tested at the trainer level in
``tests/backend/test_trainer_balance.py``."""

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

MODES = {
    "colocate_async": ("trainer.v1.trainer_mode=colocate_async",),
    "legacy": ("trainer.use_v1=false",),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mode_keeps_groups_whole_and_matches_the_stock_twin(tmp_path_factory, mode):
    env = {"GPUS_PER_NODE": "2"}
    runs = run_dense_and_prefix(tmp_path_factory, mode, steps=1, env=env, args=(*SMALL_JOB, *MODES[mode]))
    dense = metrics(runs["dense"] / "metrics_first.jsonl")
    prefix = metrics(runs["prefix"] / "metrics_first.jsonl")
    assert sorted(dense) == sorted(prefix) == [1], (dense.keys(), prefix.keys())
    d, p = dense[1], prefix[1]
    assert_same_rollouts_and_update(d, p, 1)
    assert_reuse_ran(p, 1)
    assert p["actor/prefix/split_groups"] == 0.0, p
    assert p["actor/prefix/balance/groups"] == 2.0, p
