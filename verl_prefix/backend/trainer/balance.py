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

from verl_prefix.backend.trainer.roots import SharedRoot


@dataclass(frozen=True)
class BalancePlan:
    order: list[int]  # new position -> original sample index; rank r owns a contiguous block
    slot_workload: list[list[float]]  # [rank][mini-batch]
    split_groups: int  # groups spread over more than one slot
    groups: int
    shared_roots: int = 0  # families of groups that share a trie root (``roots``)
    root_slots: int = 0  # (slot, family) pairs: how many times the shared roots run
    roots_kept_together: bool = False  # the family-keeping placement was chosen (balance allowed it)

    def metrics(self, prefix: str = "prefix/balance") -> dict[str, float]:
        per_rank = [sum(row) for row in self.slot_workload]
        mean = sum(per_rank) / max(len(per_rank), 1)
        return {
            f"{prefix}/groups": float(self.groups),
            f"{prefix}/split_groups": float(self.split_groups),
            f"{prefix}/max_rank_workload_over_mean": max(per_rank) / mean if mean > 0 else 1.0,
            f"{prefix}/shared_roots": float(self.shared_roots),
            f"{prefix}/shared_root_slots": float(self.root_slots),
            f"{prefix}/shared_roots_kept_together": float(self.roots_kept_together),
        }


def _reuse_workload(prompt_len: int, response_lens: list[int]) -> float:
    """Cost of one group under reuse with verl's workload model: the prompt once, each suffix's margin."""
    lens = torch.tensor([prompt_len] + [prompt_len + s for s in response_lens], dtype=torch.int64)
    work = calculate_workload(lens).tolist()
    return work[0] + sum(w - work[0] for w in work[1:])


def _workload(tokens: int) -> float:
    return float(calculate_workload(torch.tensor([tokens], dtype=torch.int64))[0])


@dataclass
class _Unit:
    rows: list[int]
    cost: float
    family: int | None  # SharedRoot.key: the slot that holds another group of it computes the root once
    saving: float  # what the shared root costs: saved by every group of the family after the first in a slot


class _Slots:
    """The (rank, mini-batch) slots being filled, with the work each costs under the tree schedule."""

    def __init__(self, count: int, capacity: int, mini_batches_per_rank: int) -> None:
        self.capacity = capacity
        self.per_rank = mini_batches_per_rank
        self.members: list[list[int]] = [[] for _ in range(count)]
        self.work = [0.0] * count
        self.families: list[set[int]] = [set() for _ in range(count)]

    def free(self, slot: int) -> int:
        return self.capacity - len(self.members[slot])

    def rank_work(self, slot: int) -> float:
        rank = slot // self.per_rank
        return sum(self.work[rank * self.per_rank : (rank + 1) * self.per_rank])

    def place(self, unit: _Unit, rows: list[int], slot: int) -> None:
        cost = unit.cost * len(rows) / len(unit.rows)
        if unit.family is not None:
            if unit.family in self.families[slot]:
                cost -= unit.saving * len(rows) / len(unit.rows)
            self.families[slot].add(unit.family)
        self.members[slot].extend(rows)
        self.work[slot] += cost

    def max_rank_work(self) -> float:
        return max(self.rank_work(r * self.per_rank) for r in range(len(self.work) // self.per_rank))


def _fill(units: list[_Unit], slots: int, capacity: int, mini_batches_per_rank: int, affinity: bool) -> tuple:
    """Greedy placement: whole units in the least-loaded slot with room (with ``affinity``, a slot that already
    holds the unit's family first); a unit no slot fits is split, largest free space first."""
    state = _Slots(slots, capacity, mini_batches_per_rank)
    split = 0
    for unit in units:
        fits = [s for s in range(slots) if state.free(s) >= len(unit.rows)]
        homes = [s for s in fits if affinity and unit.family in state.families[s]]
        if fits:
            state.place(unit, unit.rows, min(homes or fits, key=lambda s: (state.work[s], state.rank_work(s), s)))
            continue
        split += 1
        remaining = list(unit.rows)
        while remaining:  # largest free space first keeps the number of parts small
            slot = max(range(slots), key=lambda s: (state.free(s), -state.work[s]))
            take = remaining[: state.free(slot)]
            remaining = remaining[len(take) :]
            state.place(unit, take, slot)
    return state, split


def balance_groups(
    prompt_lens: list[int],
    response_lens: list[int],
    uids: list[str],
    dp_size: int,
    mini_batches_per_rank: int = 1,
    splittable: list[bool] | None = None,
    roots: list[SharedRoot | None] | None = None,
) -> BalancePlan:
    """Plan the order of a batch whose size is a multiple of ``dp_size * mini_batches_per_rank``.

    ``splittable`` marks samples that may go anywhere (verl's synthetic padding): they fill the gaps
    whole groups leave. First-fit decreasing by group size, then least-loaded slot: equal-size groups
    that divide the slot size are never split. ``roots`` (``roots.shared_roots``, with ``prefix_reuse.tree``)
    names the groups that share a trie root: a family's groups go to a slot that already holds the family
    wherever one has room, so its root runs once per slot, unless that plan's busiest rank costs more than
    the plan without it (both costed with each slot's shared roots counted once).
    """
    n = len(uids)
    slots = dp_size * mini_batches_per_rank
    if dp_size < 1 or mini_batches_per_rank < 1 or n % slots:
        raise ValueError(f"{n} samples cannot fill {dp_size} ranks x {mini_batches_per_rank} mini-batches equally")
    if roots is not None and len(roots) != n:
        raise ValueError(f"{len(roots)} roots for {n} samples")
    capacity = n // slots
    splittable = splittable or [False] * n

    groups: dict[str, list[int]] = {}
    loose: list[int] = []
    for i, uid in enumerate(uids):
        (loose if splittable[i] else groups.setdefault(str(uid), [])).append(i)
    units = []
    for rows in groups.values():
        root = roots[rows[0]] if roots is not None else None
        cost = _reuse_workload(prompt_lens[rows[0]], [response_lens[i] for i in rows])
        units.append(_Unit(rows, cost, root.key if root else None, _workload(root.tokens) if root else 0.0))
    family_size: dict[int, tuple[int, float]] = {}
    for unit in units:
        if unit.family is not None:
            rows, cost = family_size.get(unit.family, (0, 0.0))
            family_size[unit.family] = (rows + len(unit.rows), cost + unit.cost)

    def order(unit: _Unit) -> tuple:  # families biggest first, each family's groups together
        rows, cost = family_size.get(unit.family, (len(unit.rows), unit.cost))
        return (-rows, -cost, -1 if unit.family is None else unit.family, -len(unit.rows), -unit.cost)

    units.sort(key=order)
    loose_units = [_Unit([i], _reuse_workload(prompt_lens[i], [response_lens[i]]), None, 0.0) for i in loose]
    loose_units.sort(key=lambda u: -u.cost)

    state, split = _fill(units + loose_units, slots, capacity, mini_batches_per_rank, affinity=False)
    kept = False
    if family_size:
        together, together_split = _fill(units + loose_units, slots, capacity, mini_batches_per_rank, affinity=True)
        if together.max_rank_work() <= state.max_rank_work():
            state, split, kept = together, together_split, True

    order_out = [i for slot in range(slots) for i in state.members[slot]]
    assert sorted(order_out) == list(range(n)), "balance plan lost or duplicated samples"
    table = [state.work[r * mini_batches_per_rank : (r + 1) * mini_batches_per_rank] for r in range(dp_size)]
    return BalancePlan(
        order=order_out,
        slot_workload=table,
        split_groups=split,
        groups=len(units),
        shared_roots=len(family_size),
        root_slots=sum(len(f) for f in state.families),
        roots_kept_together=kept,
    )
