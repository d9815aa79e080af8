"""Assign samples to data-parallel ranks and mini-batches keeping every uid group whole.

verl's ``_balance_batch`` reorders samples by sequence length alone, which spreads a GRPO group over
several ranks and mini-batches and leaves each rank only part of a prefix to reuse. This planner
packs whole groups into (rank, mini-batch) slots of equal size (the dispatcher cuts the batch into
equal contiguous chunks), balancing the work each slot costs under reuse: a group pays its prompt
once and each suffix against it. Groups larger than a slot, or that no slot can fit, are split
across slots and counted; each part still reuses its prefix on its rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from verl.utils.seqlen_balancing import calculate_workload


@dataclass(frozen=True)
class BalancePlan:
    order: list[int]  # new position -> original sample index; rank r owns a contiguous block
    slot_workload: list[list[float]]  # [rank][mini-batch]
    split_groups: int  # groups spread over more than one slot
    groups: int

    def metrics(self, prefix: str = "prefix/balance") -> dict[str, float]:
        per_rank = [sum(row) for row in self.slot_workload]
        mean = sum(per_rank) / max(len(per_rank), 1)
        return {
            f"{prefix}/groups": float(self.groups),
            f"{prefix}/split_groups": float(self.split_groups),
            f"{prefix}/max_rank_workload_over_mean": max(per_rank) / mean if mean > 0 else 1.0,
        }


def _reuse_workload(prompt_len: int, response_lens: list[int]) -> float:
    """Cost of one group under reuse with verl's workload model: the prompt once, each suffix's margin."""
    lens = torch.tensor([prompt_len] + [prompt_len + s for s in response_lens], dtype=torch.int64)
    work = calculate_workload(lens).tolist()
    return work[0] + sum(w - work[0] for w in work[1:])


def balance_groups(
    prompt_lens: list[int],
    response_lens: list[int],
    uids: list[str],
    dp_size: int,
    mini_batches_per_rank: int = 1,
    splittable: list[bool] | None = None,
) -> BalancePlan:
    """Plan the order of a batch whose size is a multiple of ``dp_size * mini_batches_per_rank``.

    ``splittable`` marks samples that may go anywhere (verl's synthetic padding): they fill the gaps
    whole groups leave. First-fit decreasing by group size, then least-loaded slot: equal-size groups
    that divide the slot size are never split.
    """
    n = len(uids)
    slots = dp_size * mini_batches_per_rank
    if dp_size < 1 or mini_batches_per_rank < 1 or n % slots:
        raise ValueError(f"{n} samples cannot fill {dp_size} ranks x {mini_batches_per_rank} mini-batches equally")
    capacity = n // slots
    splittable = splittable or [False] * n

    groups: dict[str, list[int]] = {}
    loose: list[int] = []
    for i, uid in enumerate(uids):
        (loose if splittable[i] else groups.setdefault(str(uid), [])).append(i)
    units = [
        (rows, _reuse_workload(prompt_lens[rows[0]], [response_lens[i] for i in rows])) for rows in groups.values()
    ]
    units.sort(key=lambda u: (-len(u[0]), -u[1]))
    loose_units = [([i], _reuse_workload(prompt_lens[i], [response_lens[i]])) for i in loose]
    loose_units.sort(key=lambda u: -u[1])

    members: list[list[int]] = [[] for _ in range(slots)]
    work = [0.0] * slots

    def rank_work(slot: int) -> float:
        rank = slot // mini_batches_per_rank
        return sum(work[rank * mini_batches_per_rank : (rank + 1) * mini_batches_per_rank])

    def place(rows: list[int], cost: float, slot: int) -> None:
        members[slot].extend(rows)
        work[slot] += cost

    split = 0
    for rows, cost in units + loose_units:
        fits = [s for s in range(slots) if capacity - len(members[s]) >= len(rows)]
        if fits:
            place(rows, cost, min(fits, key=lambda s: (work[s], rank_work(s), s)))
            continue
        split += 1
        remaining = list(rows)
        while remaining:  # largest free space first keeps the number of parts small
            slot = max(range(slots), key=lambda s: (capacity - len(members[s]), -work[s]))
            take = remaining[: capacity - len(members[slot])]
            remaining = remaining[len(take) :]
            place(take, cost * len(take) / len(rows), slot)

    order = [i for slot in range(slots) for i in members[slot]]
    assert sorted(order) == list(range(n)), "balance plan lost or duplicated samples"
    table = [work[r * mini_batches_per_rank : (r + 1) * mini_batches_per_rank] for r in range(dp_size)]
    return BalancePlan(order=order, slot_workload=table, split_groups=split, groups=len(units))
