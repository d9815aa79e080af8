"""Keep data-parallel ranks in lockstep: every FSDP2 forward and backward issues collectives, so all ranks must
run the same sequence of phases even when their groups differ. Ranks agree (``mini_batch``) on the number of
group slots, suffix micro-batches and prefix chunks per slot and dense micro-batches: the maximum over ranks of
each; gaps are filled with zero-loss work on a two-token filler sequence (the same device work verl's synthetic
padding samples cost)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from verl_prefix.schedule.chunked import num_chunks
from verl_prefix.schedule.grouping import BatchPlan, GroupPlan, RowLayout

FILLER_UID = "__lockstep_filler__"


@dataclass(frozen=True)
class LockstepPlan:
    """The mini-batch's shape every rank runs: group slots, per slot its suffix micro-batches and prefix
    forwards (a chunked prefix), and dense micro-batches."""

    num_groups: int
    micro_batches: list[int]  # per group slot
    num_dense_chunks: int
    prefix_chunks: list[int] = field(default_factory=list)  # per group slot: prefix forwards (chunked prefix)

    @classmethod
    def of_plan(cls, plan: BatchPlan, num_dense_chunks: int, chunk_tokens: int | None = None) -> LockstepPlan:
        """This rank's own shape (``chunk_tokens``: ``prefix_chunk_tokens``, the prefix forwards per group)."""
        counts = [len(g.micro_batches) for g in plan.groups]
        chunks = [num_chunks(g.prefix_len, chunk_tokens) for g in plan.groups]
        return cls(len(counts), counts, num_dense_chunks, chunks)

    @classmethod
    def busiest(cls, shapes: Sequence[LockstepPlan]) -> LockstepPlan:
        """The slot-by-slot maximum of every rank's shape: what each rank runs, fillers where it has less."""
        num_groups = max(s.num_groups for s in shapes)

        def widest(per_rank: list[list[int]]) -> list[int]:
            return [max((p[k] for p in per_rank if k < len(p)), default=0) for k in range(num_groups)]

        return cls(
            num_groups,
            widest([s.micro_batches for s in shapes]),
            max(s.num_dense_chunks for s in shapes),
            widest([s.prefix_chunks for s in shapes]),
        )


def in_lockstep(group: GroupPlan, num_micro: int, prefix_chunks: int) -> GroupPlan:
    """The same group with the lockstep shape all ranks agreed on for its slot: zero-loss filler micro-batches up
    to ``num_micro``, and at least ``prefix_chunks`` prefix forwards."""
    fillers = max(0, num_micro - len(group.micro_batches))
    return dataclasses.replace(group, filler_micro_batches=fillers, min_prefix_chunks=prefix_chunks)


def filler_group(num_micro_batches: int, prefix_chunks: int = 0) -> tuple[RowLayout, GroupPlan]:
    """A one-row group (prefix of one token, suffix of one) that only exists to issue collectives: the slot's
    agreed suffix micro-batches and (chunked prefix) prefix forwards."""
    layout = RowLayout([torch.zeros(3, dtype=torch.long)], [torch.arange(3)], [2], [1], [FILLER_UID])
    group = GroupPlan(
        uid=FILLER_UID,
        rows=[0],
        prompt_len=2,
        micro_batches=[],
        filler_micro_batches=num_micro_batches,
        min_prefix_chunks=prefix_chunks,
    )
    return layout, group
