"""Group-keeping balancing across data-parallel ranks and mini-batches."""

from __future__ import annotations

import random

import pytest

from verl_prefix.backend.balance import balance_groups


def layout(groups: list[tuple[int, list[int]]], padding: int = 0):
    prompt, response, uids, loose = [], [], [], []
    for g, (p, responses) in enumerate(groups):
        for s in responses:
            prompt.append(p)
            response.append(s)
            uids.append(f"g{g}")
            loose.append(False)
    for _ in range(padding):
        prompt.append(3)
        response.append(1)
        uids.append("pad")
        loose.append(True)
    return prompt, response, uids, loose


def slots_of(plan, n_slots, uids):
    size = len(plan.order) // n_slots
    return [[uids[i] for i in plan.order[k * size : (k + 1) * size]] for k in range(n_slots)]


def test_equal_groups_are_never_split_and_load_is_balanced():
    rng = random.Random(0)
    groups = [(rng.randint(100, 2000), [rng.randint(10, 500) for _ in range(8)]) for _ in range(16)]
    prompt, response, uids, loose = layout(groups)
    plan = balance_groups(prompt, response, uids, dp_size=4, mini_batches_per_rank=2, splittable=loose)
    assert plan.split_groups == 0
    for slot in slots_of(plan, 8, uids):
        assert len(slot) == 16 and all(slot.count(u) in (0, 8) for u in set(slot))
    assert plan.metrics()["prefix/balance/max_rank_workload_over_mean"] < 1.3


def test_shuffled_groups_come_out_whole():
    prompt, response, uids, loose = layout([(50, [5] * 4), (60, [6] * 4), (70, [7] * 4), (80, [8] * 4)])
    perm = list(range(16))
    random.Random(1).shuffle(perm)
    shuffled = [[field[i] for i in perm] for field in (prompt, response, uids, loose)]
    plan = balance_groups(*shuffled[:3], dp_size=2, splittable=shuffled[3])
    assert plan.split_groups == 0
    for slot in slots_of(plan, 2, shuffled[2]):
        assert all(slot.count(u) == 4 for u in set(slot))


def test_padding_fills_the_gaps_and_group_count_need_not_divide_ranks():
    # 3 groups of 4 over 2 ranks of 8: the padding samples fill the third group's partner slot
    prompt, response, uids, loose = layout([(40, [4] * 4), (50, [5] * 4), (60, [6] * 4)], padding=4)
    plan = balance_groups(prompt, response, uids, dp_size=2, splittable=loose)
    assert plan.split_groups == 0
    pads = [slot.count("pad") for slot in slots_of(plan, 2, uids)]
    assert sorted(pads) == [0, 4]


def test_a_group_larger_than_a_slot_is_split_and_counted():
    prompt, response, uids, loose = layout([(40, [4] * 8), (50, [5] * 8)])
    plan = balance_groups(prompt, response, uids, dp_size=4, splittable=loose)  # slots of 4
    assert plan.split_groups == 2
    assert sorted(plan.order) == list(range(16))


def test_impossible_shapes_are_refused():
    with pytest.raises(ValueError, match="cannot fill"):
        balance_groups([5] * 6, [1] * 6, ["a"] * 6, dp_size=4)
