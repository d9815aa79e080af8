"""The collective primitives the agreements use: where a collective's tensors live, and gathers of small Python
payloads. Every function here is a collective over ``group``: every rank of it calls it at the same point."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_distributed(group: Any = None) -> bool:
    """Whether ``group`` has peers to agree with (no collective is issued for a world of one)."""
    return dist.is_initialized() and dist.get_world_size(group) > 1


def collective_device(group: Any = None) -> torch.device:
    """Where a collective over ``group`` takes its tensors: CPU for gloo, this rank's device otherwise."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    from verl.utils.device import get_device_id, get_device_name

    return torch.device(get_device_name(), get_device_id())


def gather_objects(payload: Any, group: Any = None) -> list[tuple[int, Any]]:
    """``(global rank, payload)`` of every rank of ``group``, in rank order, the same list on every rank: one
    object all-gather (two collectives on the wire: the sizes, then the bytes)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not is_distributed(group):
        return [(rank, payload)]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (rank, payload), group=group)
    return gathered


def gather_flagged(payload: Any, group: Any = None) -> list[tuple[int, Any]]:
    """``(global rank, payload)`` of every rank whose ``payload`` is not None, the same list on every rank of
    ``group``, in rank order: one flag all-reduce when every payload is None, then an object all-gather. For
    decisions outside the mini-batch's exchange (once per model; the recompute check inside phase C)."""
    mine = None if payload is None else (dist.get_rank() if dist.is_initialized() else 0, payload)
    if not is_distributed(group):
        return [mine] if mine is not None else []
    flag = torch.tensor([0 if mine is None else 1], device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return []
    return [(rank, value) for rank, value in gather_objects(payload, group) if value is not None]
