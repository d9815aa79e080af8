"""The forward-only passes' ``prefix/...`` metrics reach the trainer's metrics, which verl would drop.

The end-to-end check (read back from wandb after real GRPO steps) is in ``test_demo_wandb.py``; these
cover the pieces: reading a worker's output, wrapping and restoring the worker group's method, and
which worker group each pass goes through.
"""

from __future__ import annotations

import pytest
from transfer_queue.metadata import KVBatchMeta
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from verl_prefix.backend.trainer.modes import PrefixPPOTrainer, forward_only_telemetry, prefix_metrics_of


def worker_output(per_rank: dict[str, list[float]]) -> KVBatchMeta:
    """What ``compute_log_prob`` returns through TransferQueue: one metrics copy per collecting rank,
    each all-gathered over the data-parallel group (a list per rank of per-mini-batch lists)."""
    metrics = {key: [[v] for v in values] for key, values in per_rank.items()}
    metrics.update({"loss": 1.0, "perf/cpu_memory_used_gb": 3.0})
    return KVBatchMeta(keys=["a", "b"], tags=[{}, {}], partition_id="train", extra_info={"metrics": [metrics, metrics]})


def test_prefix_metrics_are_reduced_like_verl_actor_metrics():
    output = worker_output(
        {
            "prefix/time_s/A": [0.1, 0.3],
            "prefix/max_time_s/A": [0.1, 0.3],
            "prefix/max_rss_mib/A": [5.0, 7.0],
            "prefix/fallback_short_prefix": [0.0, 2.0],
        }
    )
    got = prefix_metrics_of(output, "actor/prefix/old_log_prob/")
    assert got == pytest.approx(
        {
            "actor/prefix/old_log_prob/time_s/A": 0.2,  # mean over ranks
            "actor/prefix/old_log_prob/max_time_s/A": 0.3,  # slowest rank
            "actor/prefix/old_log_prob/max_rss_mib/A": 7.0,
            "actor/prefix/old_log_prob/fallback_short_prefix": 1.0,
        }
    )


def test_outputs_without_prefix_metrics_add_nothing():
    assert prefix_metrics_of(None, "x/") == {}
    assert prefix_metrics_of(KVBatchMeta(keys=[], tags=[], partition_id="train"), "x/") == {}
    assert prefix_metrics_of(worker_output({}), "x/") == {}


class WorkerGroup:
    """Binds its remote methods as instance attributes, as verl's ``RayWorkerGroup`` does."""

    def __init__(self, output: KVBatchMeta) -> None:
        self.calls = 0

        def compute_log_prob(batch: object) -> KVBatchMeta:
            self.calls += 1
            return output

        self.compute_log_prob = compute_log_prob


def test_the_wrapper_collects_and_then_restores_the_method():
    output = worker_output({"prefix/time_s/A": [0.5, 0.5]})
    group = WorkerGroup(output)
    original = group.compute_log_prob
    metrics: dict = {}
    with forward_only_telemetry(group, "compute_log_prob", metrics, "actor/prefix/old_log_prob/"):
        assert group.compute_log_prob("batch") is output  # the trainer gets the worker's own output
    assert group.compute_log_prob is original and group.calls == 1
    assert metrics == {"actor/prefix/old_log_prob/time_s/A": 0.5}
    with pytest.raises(RuntimeError), forward_only_telemetry(group, "compute_log_prob", metrics, "p/"):
        raise RuntimeError("a failing step")
    assert group.compute_log_prob is original


@pytest.mark.parametrize("ref_in_actor", [False, True])
def test_each_pass_is_collected_from_the_worker_group_verl_calls(monkeypatch, ref_in_actor):
    actor = WorkerGroup(worker_output({"prefix/time_s/A": [1.0, 1.0]}))
    ref = WorkerGroup(worker_output({"prefix/time_s/A": [2.0, 2.0]}))
    ref.compute_ref_log_prob = ref.compute_log_prob
    trainer = object.__new__(PrefixPPOTrainer)
    trainer.actor_rollout_wg, trainer.ref_policy_wg, trainer.ref_in_actor = actor, ref, ref_in_actor

    # verl's own methods call these worker-group methods (trainer_base._compute_*_log_prob)
    def old_log_prob(self, batch, metrics):
        return self.actor_rollout_wg.compute_log_prob(batch)

    def ref_log_prob(self, batch, metrics):
        wg = self.actor_rollout_wg if self.ref_in_actor else self.ref_policy_wg
        return wg.compute_log_prob(batch) if self.ref_in_actor else wg.compute_ref_log_prob(batch)

    monkeypatch.setattr(PPOTrainerSync, "_compute_old_log_prob", old_log_prob)
    monkeypatch.setattr(PPOTrainerSync, "_compute_ref_log_prob", ref_log_prob)
    metrics: dict = {}
    trainer._compute_old_log_prob("batch", metrics)
    trainer._compute_ref_log_prob("batch", metrics)
    assert metrics["actor/prefix/old_log_prob/time_s/A"] == 1.0
    assert metrics["actor/prefix/ref_log_prob/time_s/A"] == (1.0 if ref_in_actor else 2.0)
