"""Shared worker processes for a series of CPU-loop runs: a run gets the slot of its own config, once, or a clear
error (the runs themselves are in test_grpo_loop_ray.py, which shares one set of ranks across its six runs)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl_prefix.tools.cpu_loop.workers import RunWorkers, WorkerHosts, plain_config


def _config(lr: float):
    return OmegaConf.create({"actor_rollout_ref": {"actor": {"optim": {"lr": lr}}}})


def test_a_run_takes_the_slot_of_its_config_once():
    slots = [RunWorkers(actor=f"actor{i}", ref=None, names={"actor": "W"}) for i in range(3)]
    hosts = WorkerHosts([plain_config(_config(lr)) for lr in (0.5, 1e-3, 0.5)], slots, [False] * 3)
    assert hosts.reserve(_config(1e-3)) == 1
    # two runs with the same config: each gets its own slot, in order
    assert [hosts.reserve(_config(0.5)), hosts.reserve(_config(0.5))] == [0, 2]
    with pytest.raises(ValueError, match="no unused worker slot"):
        hosts.reserve(_config(0.5))  # every slot of that config is used


def test_a_config_no_slot_holds_is_refused():
    hosts = WorkerHosts([plain_config(_config(0.5))], [RunWorkers("a", None, {"actor": "W"})], [False])
    with pytest.raises(ValueError, match="pass every run's cpu_grpo_config"):
        hosts.reserve(_config(0.25))
    assert hosts.reserve(_config(0.5)) == 0  # the refusal took nothing
