"""verl's own ``main_ppo`` on CPU under the trainer modes besides ``sync``, with ``actor.strategy=prefix_fsdp2`` as
the only selection: ``trainer.v1.trainer_mode=colocate_async`` and the legacy trainer (``trainer.use_v1=false``).

Each mode runs twice (``recipes/grpo_cpu_smoke.sh``, one step on two data-parallel ranks): the stock twin
(``fsdp2``) and the prefix run, which must reuse, keep every group whole (``actor/prefix/split_groups`` 0) and,
under the legacy trainer, match the stock twin's rollouts and gradient norm (colocate_async's twins sample
different rollouts). ``sync`` runs in ``test_main_ppo_cpu.py`` and the CPU GRPO loop (``test_grpo_loop_ray.py``).
``separate_async`` needs a standalone rollout pool beside the trainer's ranks
(``actor_rollout_ref.hybrid_engine=false``, ``rollout.nnodes``/``rollout.n_gpus_per_node``): its balancing is the same
wrapped method, tested at the trainer level in ``tests/backend/test_trainer_balance.py``. It does not run end to end on
CPU (tried 2026-12-05 through ``recipes/grpo_cpu_smoke.sh`` with those keys and
``trainer.v1.separate_async.parameter_sync_step=1``): the standalone replicas take the actor's weights through a
checkpoint engine, and verl 0.9.1 has none for CPU.
``PPOTrainerSeparateAsync.__init__`` (``verl/trainer/ppo/v1/trainer_separate_async.py``, line 68) refuses the
in-worker one, ``AssertionError: please use nccl/nixl/mooncake, etc. backend for separate async training`` with
``checkpoint_engine.backend=naive``; with ``nccl`` the actor's ``init_model`` stops in
``CheckpointEngineRegistry.get`` (``verl/checkpoint_engine/base.py``, line 98): ``Checkpoint engine nccl not
registered, registered backends: ['naive']``, every other backend's module failing to import (``cupy`` for nccl,
nixl and delta_sharded; ``vllm`` for hccl; ``mooncake``; ``checkpoint_engine`` for kimi), and each of them moves
weights over NCCL, HCCL or RDMA, not gloo. Running it would take a gloo (or object-store) checkpoint engine
registered through ``checkpoint_engine.custom_backend_module``, and the ``hf`` rollout's standalone replicas
receiving weights from it (today its server takes them only from the adapter inside the actor workers, the naive
path). The GPU recipe runs it (``TRAINER=separate_async bash recipes/grpo_qwen3_prefix.sh``: a standalone vLLM pool,
NCCL weight sync), its overrides validated against verl's config in ``test_recipe_overrides.py``."""

from __future__ import annotations

import pytest
from helpers.recipe_runs import (
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
def test_mode_keeps_groups_whole_and_reuses(tmp_path_factory, mode):
    env = {"GPUS_PER_NODE": "2"}  # two data-parallel ranks: verl's own balancing would split the groups
    runs = run_dense_and_prefix(tmp_path_factory, mode, steps=1, env=env, args=("trainer.save_freq=-1", *MODES[mode]))
    dense = metrics(runs["dense"] / "metrics_first.jsonl")
    prefix = metrics(runs["prefix"] / "metrics_first.jsonl")
    assert sorted(dense) == sorted(prefix) == [1], (dense.keys(), prefix.keys())
    d, p = dense[1], prefix[1]
    assert p["actor/prefix/groups"] > 0 and p["actor/prefix/physical_tokens"] < p["actor/prefix/logical_tokens"], p
    assert not any(k.startswith("actor/prefix/fallback_") and v > 0 for k, v in p.items()), p
    assert p["actor/prefix/split_groups"] == 0.0 and p["actor/prefix/balance/groups"] >= 2.0, p
    if mode == "legacy":
        # the legacy trainer rolls out as the stock twin does: the same samples, the same gradient norm. It does not
        # hand the forward-only passes' telemetry back (verl's RayPPOTrainer computes them inline)
        assert_same_rollouts_and_update(d, p, 1)
    else:
        # colocate_async samples its warm-up batch concurrently: the twins' rollouts differ, so only reuse (the
        # forward-only passes' too) and whole groups are compared, not the update
        assert p["actor/prefix/old_log_prob/groups"] > 0, p
        assert p["actor/prefix/old_log_prob/physical_tokens"] < p["actor/prefix/old_log_prob/logical_tokens"], p
        assert d["actor/grad_norm"] > 0 and p["actor/grad_norm"] > 0
