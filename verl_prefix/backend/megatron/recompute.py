"""megatron-core's activation recompute under the schedule (``recompute_granularity`` full or selective).

megatron-core recomputes through ``tensor_parallel.checkpoint`` (whole layers under ``full``, uniform or block, any
``recompute_num_layers``; core attention, the MLP and MoE layers under ``selective``) and ``CheckpointWithoutOutput``
(selective layer norms, MoE activations, MLA's up-projections, shared experts): each runs its function under
``no_grad`` in the forward and once more in backward. Two schedule calls need more than that:

- **phase A** (a prefix, a chunk of one, a trie node): its captured K/V must keep their graph until phase C, so inside
  such a call every checkpoint runs its function straight, keeping the graph (as megatron-core itself does during
  CUDA-graph warm-up). The prefix's graph is the schedule's to hold (``dormant_prefix``: keep, recompute, offload).
- **phase B** (suffix micro-batches): the recompute runs in backward, after the call returned, where the attention
  hook, the RoPE offset and the prefix K/V leaves are no longer active: the recomputed function re-enters the call's
  state first (``schedule_call``'s ``enter``), so the recomputed attention reads the same prefix leaves and their
  dK/dV accumulate exactly as they would without recompute.

Outside a schedule call (verl's dense rows, fillers, forward-only passes) megatron-core's functions run unchanged.
``install`` wraps them once per process.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from verl_prefix.backend.megatron.config import MEGATRON_REUSE_OFF

_MARK = "_verl_prefix_recompute"
_ACTIVE = threading.local()  # the schedule call whose forward is running, if any


@dataclass(frozen=True)
class ScheduleCall:
    """A schedule call's recompute state: ``keep_graph`` (phase A: run checkpoints straight), ``enter`` (what the
    recomputed forward re-enters in backward: the attention hook, the RoPE offset)."""

    keep_graph: bool
    enter: Callable[[], AbstractContextManager]


@contextmanager
def schedule_call(keep_graph: bool, enter: Callable[[], AbstractContextManager]) -> Iterator[None]:
    """The block is one schedule call's forward (the caller has entered ``enter()`` around it already)."""
    outer = getattr(_ACTIVE, "call", None)
    _ACTIVE.call = ScheduleCall(keep_graph, enter)
    try:
        yield
    finally:
        _ACTIVE.call = outer


def _current() -> ScheduleCall | None:
    return getattr(_ACTIVE, "call", None)


def _reentering(function: Callable, call: ScheduleCall) -> Callable:
    """``function`` that, run outside the call (megatron-core's recompute in backward), re-enters its state first."""

    @functools.wraps(function)
    def run(*args: Any) -> Any:
        if _current() is not None:
            return function(*args)  # the forward itself, still inside the call
        with call.enter(), schedule_call(call.keep_graph, call.enter):
            return function(*args)

    return run


def install() -> None:
    """Wrap megatron-core's recompute entry points (idempotent; nothing changes outside a schedule call)."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom.checkpoint, _MARK, False):
        return
    stock_checkpoint = mrandom.checkpoint

    @functools.wraps(stock_checkpoint)
    def checkpoint(function: Callable, distribute_saved_activations: bool, *args: Any) -> Any:
        call = _current()
        if call is None:
            return stock_checkpoint(function, distribute_saved_activations, *args)
        if call.keep_graph:
            return function(*args)
        return stock_checkpoint(_reentering(function, call), distribute_saved_activations, *args)

    setattr(checkpoint, _MARK, True)
    mrandom.checkpoint = tensor_parallel.checkpoint = checkpoint

    without_output = mrandom.CheckpointWithoutOutput
    stock_wo_checkpoint = without_output.checkpoint
    stock_discard = without_output.discard_output_and_register_recompute

    @functools.wraps(stock_wo_checkpoint)
    def wo_checkpoint(self: Any, run_function: Callable, *args: Any) -> Any:
        call = _current()
        self._verl_prefix_straight = call is not None and call.keep_graph
        if call is None:
            return stock_wo_checkpoint(self, run_function, *args)
        if call.keep_graph:
            return run_function(*args)
        return stock_wo_checkpoint(self, _reentering(run_function, call), *args)

    @functools.wraps(stock_discard)
    def discard(self: Any, hook_tensor: Any) -> None:
        if getattr(self, "_verl_prefix_straight", False):
            return  # the outputs were computed with their graph: nothing to release or recompute
        stock_discard(self, hook_tensor)

    without_output.checkpoint = wo_checkpoint
    without_output.discard_output_and_register_recompute = discard


def recompute_refusal(tf_config: Any, aux_counted: bool) -> str | None:
    """Why reuse cannot run megatron-core's recompute on this model, or None (no recompute, or served)."""
    granularity = getattr(tf_config, "recompute_granularity", None)
    if granularity is None:
        return None
    override = "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=null"
    if getattr(tf_config, "fp8", None) or getattr(tf_config, "fp4", None):
        return (
            f"prefix_megatron: recompute_granularity={granularity!r} with fp8/fp4 recomputes through "
            f"TransformerEngine's te_checkpoint, not run under reuse yet; set {override}, or {MEGATRON_REUSE_OFF}"
        )
    if aux_counted:
        return (
            f"prefix_megatron: recompute_granularity={granularity!r} with the MoE router aux loss or z-loss: the "
            "schedule takes a suffix call's terms from its router logits in the forward, which recompute runs "
            f"without a graph; set {override}, the aux loss and z-loss off (moe_router_load_balancing_type=none, as "
            f"verl's Megatron-Bridge loader sets it; moe_z_loss_coeff=null), or {MEGATRON_REUSE_OFF}"
        )
    return None
