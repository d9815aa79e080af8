"""Keep data-parallel ranks in lockstep: every FSDP2 forward and backward issues collectives, so all
ranks must run the same sequence of phases even when their groups differ. Ranks agree on the number
of groups, suffix micro-batches per group slot and dense micro-batches, and fill gaps with zero-loss
work on a two-token filler sequence (the same device work verl's synthetic padding samples cost)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from verl_prefix.schedule.chunked import num_chunks
from verl_prefix.schedule.grouping import BatchPlan, GroupPlan, RowLayout


@dataclass(frozen=True)
class LockstepPlan:
    num_groups: int
    micro_batches: list[int]  # per group slot
    num_dense_chunks: int
    prefix_chunks: list[int] = field(default_factory=list)  # per group slot: prefix forwards (chunked prefix)


def agree_on_schedule(
    plan: BatchPlan,
    num_dense_chunks: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    chunk_tokens: int | None = None,
) -> LockstepPlan:
    """Max over ranks of the schedule's shape; a no-op without a process group of size > 1.
    ``chunk_tokens`` (``prefix_chunk_tokens``): ranks also agree on each slot's number of prefix chunks."""
    counts = [len(g.micro_batches) for g in plan.groups]
    chunks = [num_chunks(g.prefix_len, chunk_tokens) for g in plan.groups]
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return LockstepPlan(len(counts), counts, num_dense_chunks, chunks)
    device = device or collective_device(group)
    shape = torch.tensor([len(counts), num_dense_chunks], device=device)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
    num_groups, dense = (int(x) for x in shape.tolist())
    padded = torch.zeros(2, num_groups, dtype=torch.long, device=device)
    padded[0, : len(counts)] = torch.tensor(counts, dtype=torch.long)
    padded[1, : len(chunks)] = torch.tensor(chunks, dtype=torch.long)
    dist.all_reduce(padded, op=dist.ReduceOp.MAX, group=group)
    return LockstepPlan(num_groups, padded[0].tolist(), dense, padded[1].tolist())


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective over ``group`` takes its tensors: CPU for gloo, this rank's device otherwise."""
    backend = dist.get_backend(group)
    if backend == "gloo":
        return torch.device("cpu")
    from verl.utils.device import get_device_id, get_device_name

    return torch.device(get_device_name(), get_device_id())


def filler_group(num_micro_batches: int, prefix_chunks: int = 0) -> tuple[RowLayout, GroupPlan]:
    """A one-row group (prefix of one token, suffix of one) that only exists to issue collectives: the
    slot's agreed suffix micro-batches and (chunked prefix) prefix forwards."""
    layout = RowLayout([torch.zeros(3, dtype=torch.long)], [torch.arange(3)], [2], [1], ["__lockstep_filler__"])
    group = GroupPlan(
        uid="__lockstep_filler__",
        rows=[0],
        prompt_len=2,
        micro_batches=[],
        filler_micro_batches=num_micro_batches,
        min_prefix_chunks=prefix_chunks,
    )
    return layout, group
