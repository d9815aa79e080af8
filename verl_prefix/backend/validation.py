"""Data-parallel ranks agree that a mini-batch is valid before any collective of it.

A rank that raises between two collectives leaves its peers waiting until the collective timeout
(DESIGN trap 15). So each rank checks its own batch locally, catching the error; the ranks all-reduce one
flag over the data-parallel group; when any rank's batch is bad, the messages are gathered and every rank
raises the same ``BatchRejected`` naming each bad rank and its samples.

What is checked (``check_batch``), on every path while reuse is enabled:

- always: every sample has a prompt and a response token, and (updates) finite advantages and a
  ``loss_mask``. The stock engine trains an empty response as nothing and turns a non-finite advantage
  into a skipped optimizer step with one warning; here both are errors, whichever path the batch takes;
- when this rank would reuse (no local fallback reason): every sample has a ``uid``. A rank that falls back
  to dense for its own reason does not need uids, so it does not check them; its peers still do, and any
  rejection stops every rank. Samples that share a uid but not their prompt are no error: they reuse in
  sub-groups of identical prompts (``grouping.split_uid_groups``; too small a sub-group runs dense as
  ``prompt_mismatch``).

With ``prefix_reuse.enable=false`` the engine is the stock one and checks nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_prefix.backend.inputs import row_layout, row_lengths
from verl_prefix.backend.lockstep import collective_device
from verl_prefix.schedule.grouping import RowLayout, split_uid_groups, validate_rows

T = TypeVar("T")


class BatchRejected(ValueError):
    """Raised on every data-parallel rank when any rank's mini-batch is invalid (message names the samples)."""


def check_batch(data: TensorDict, *, forward_only: bool, reuse: bool) -> RowLayout | None:
    """This rank's checks, no collectives; returns the row layout when the batch would reuse.

    ``reuse`` says whether this rank would run the A/B/C schedule (no local fallback reason): only then are
    uids needed and checked.
    """
    advantages = None
    if not forward_only:
        if "loss_mask" not in data.keys():
            raise ValueError("the mini-batch has no `loss_mask`; an update needs it to normalise the loss")
        advantages = data["advantages"]
        advantages = advantages.to_padded_tensor(0.0) if advantages.is_nested else advantages
    if not reuse:
        prompt_lens, response_lens = row_lengths(data)
        validate_rows(prompt_lens, response_lens, advantages)
        return None
    layout = row_layout(data)
    validate_rows(layout.prompt_lens, layout.response_lens, advantages)
    return split_uid_groups(layout)


def agree_on_validity(check: Callable[[], T], group: Any = None) -> T:
    """Run ``check`` on this rank and agree with every data-parallel rank on the outcome.

    Must be the first collective of the mini-batch on every rank. Returns ``check()``'s value when every
    rank's check passed; otherwise raises ``BatchRejected`` on every rank, chained to this rank's own error.
    """
    error: Exception | None = None
    result: Any = None
    try:
        result = check()
    except Exception as exc:  # any local failure must reach the peers before they enter a collective
        error = exc
    rejections = _gather_rejections(error, group)
    if rejections:
        raise BatchRejected(_describe(rejections)) from error
    return result


def _message(error: Exception) -> str:
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"


def _gather_rejections(error: Exception | None, group: Any) -> list[tuple[int, str]]:
    """``(global rank, message)`` of every rank whose check failed; one flag all-reduce when none did."""
    return gather_flagged(None if error is None else _message(error), group)


def gather_flagged(payload: Any, group: Any = None) -> list[tuple[int, Any]]:
    """``(global rank, payload)`` of every rank whose ``payload`` is not None, the same list on every rank of
    ``group``, in rank order: one flag all-reduce when every payload is None, then an object all-gather.
    A collective: every rank of ``group`` must call it at the same point."""
    mine = None if payload is None else (dist.get_rank() if dist.is_initialized() else 0, payload)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [mine] if mine is not None else []
    flag = torch.tensor([0 if mine is None else 1], device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return []
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return [entry for entry in gathered if entry is not None]


def _describe(rejections: list[tuple[int, str]]) -> str:
    if len(rejections) == 1:
        rank, message = rejections[0]
        return f"rank {rank} rejected the mini-batch (every data-parallel rank stops): {message}"
    details = "; ".join(f"rank {rank}: {message}" for rank, message in rejections)
    return f"{len(rejections)} ranks rejected the mini-batch (every data-parallel rank stops): {details}"
