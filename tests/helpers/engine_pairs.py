"""One stock/prefix engine pair shared by the tests of a file that vary only what the loss function, the batch
or the reuse config decide (an engine build costs about a CPU-second, a step of the tiny model a tenth).

The pair is built with lr 0, so a step leaves the weights as they were and every test starts from the same
model; the optimizer's update itself is compared by the tests that build their own engines for it
(``test_engine_exactness.test_update_matches_stock_engine`` and its neighbours)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

from helpers.precision import promote_fp32_upcasts
from helpers.reuse import assert_reuse_ran
from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import verl_engine


def build_pair(model_dir: Path, dtype: str) -> tuple:
    """``(stock engine, prefix engine, actor config)`` on ``model_dir``: KL loss and entropy bonus on, lr 0,
    two rows per micro-batch unless a batch says otherwise."""
    knobs = dict(dtype=dtype, lr=0.0, micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01)
    dense, _, actor_config = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **knobs)
    prefix, _, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **knobs)
    return dense, prefix, actor_config


def loss_with(actor_config, policy_loss_mode: str = "vanilla", **fields) -> Callable:
    """verl's ``ppo_loss`` on a copy of the actor config with ``fields`` (and the policy loss mode) set, as
    ``build_verl_engine`` would have built it: its per-step state (``global_batch_info``) starts empty."""
    config, policy = copy.copy(actor_config), copy.copy(actor_config.policy_loss)
    object.__setattr__(policy, "loss_mode", policy_loss_mode)
    for name, value in {**fields, "policy_loss": policy, "global_batch_info": {}}.items():
        object.__setattr__(config, name, value)
    return functools.partial(ppo_loss, config=config)


def worst_relative(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)).item() for n in want)


def compare_on_pair(
    pair: tuple,
    batch,
    *,
    reuse: PrefixReuseConfig | None = None,
    micro_batch_size: int = 2,
    loss_fn: Callable | None = None,
) -> tuple[float, dict, dict]:
    """One step of both engines of ``pair`` on ``batch``; returns (worst gradient relative error, stock result,
    prefix result). Fails unless the prefix engine reused: a silent fallback to dense would match trivially."""
    dense_engine, prefix_engine, actor_config = pair
    prefix_engine.reuse_config = reuse or PrefixReuseConfig(min_prefix_len=2)
    loss_fn = loss_fn or loss_with(actor_config)
    tu.assign_non_tensor(batch, micro_batch_size_per_gpu=micro_batch_size)
    with promote_fp32_upcasts():
        dense = verl_engine.run_train_step(dense_engine, loss_fn, batch, capture_grads=True)
        prefix = verl_engine.run_train_step(prefix_engine, loss_fn, batch, capture_grads=True)
    assert dense["grads"], "the stock engine produced no gradients"
    assert all(torch.isfinite(g).all() for g in dense["grads"].values())
    assert_reuse_ran(prefix["metrics"])
    return worst_relative(prefix["grads"], dense["grads"]), dense, prefix
