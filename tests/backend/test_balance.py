"""Group-keeping balancing across data-parallel ranks and mini-batches, and (``prefix_reuse.tree``) keeping
groups that share a trie root in one slot."""

from __future__ import annotations

import random

import pytest
import torch

from verl_prefix.backend.trainer.balance import balance_groups
from verl_prefix.backend.trainer.roots import prompt_rows, shared_roots


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


def family_layout(families: list[int], system: int = 40, seed: int = 0):
    """One group of 4 per entry of ``families`` (its family index): a ``system``-token block per family, then
    a question of its own."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [torch.randint(10, 100, (system,), generator=gen) for _ in range(max(families) + 1)]
    prompts, response, uids = [], [], []
    for g, family in enumerate(families):
        question = torch.randint(10, 100, (5 + g,), generator=gen)
        for j in range(4):
            prompts.append(torch.cat([blocks[family], question]))
            response.append(10 + j)
            uids.append(f"g{g}")
    return [len(p) for p in prompts], response, uids, shared_roots(prompts, uids, min_shared_tokens=32)


def families_per_slot(plan, n_slots, uids, families):
    size = len(plan.order) // n_slots
    return [sorted({families[int(uids[i][1:])] for i in plan.order[k * size : (k + 1) * size]}) for k in range(n_slots)]


def test_groups_sharing_a_root_stay_in_one_slot_where_balance_allows():
    families = [0, 1, 0, 1, 0, 1, 0, 1]  # two system prompts, interleaved
    prompt, response, uids, roots = family_layout(families)
    assert {r.tokens for r in roots} == {40} and len({r.key for r in roots}) == 2
    together = balance_groups(prompt, response, uids, dp_size=2, roots=roots)
    assert sorted(families_per_slot(together, 2, uids, families)) == [[0], [1]]
    m = together.metrics()
    assert m["prefix/balance/shared_roots"] == 2 and m["prefix/balance/shared_root_slots"] == 2
    assert m["prefix/balance/shared_roots_kept_together"] == 1 and m["prefix/balance/split_groups"] == 0
    # control: length alone spreads both system prompts over both ranks (each would compute both)
    plain = balance_groups(prompt, response, uids, dp_size=2)
    assert families_per_slot(plain, 2, uids, families) == [[0, 1], [0, 1]]
    # one family larger than a slot: spread evenly, its root once per slot (mini-batches are slots too)
    prompt, response, uids, roots = family_layout([0] * 8)
    spread = balance_groups(prompt, response, uids, dp_size=2, mini_batches_per_rank=2, roots=roots)
    assert spread.metrics()["prefix/balance/shared_root_slots"] == 4 and spread.split_groups == 0


def test_balance_overrides_a_family_that_would_load_one_rank():
    # a family of two long groups and two short loners, slots of two groups: together, one rank holds both
    # long groups; apart, each rank one, which costs less even with the root computed on both ranks
    prompt, response, uids, roots = family_layout([0, 0, 1, 2], system=40)
    response = [2000 if uids[i] in ("g0", "g1") else 1 for i in range(len(uids))]
    roots = [r if uids[i] in ("g0", "g1") else None for i, r in enumerate(roots)]
    plan = balance_groups(prompt, response, uids, dp_size=2, roots=roots)
    assert plan.metrics()["prefix/balance/shared_roots_kept_together"] == 0
    assert families_per_slot(plan, 2, uids, [0, 0, 1, 2]) in ([[0, 1], [0, 2]], [[0, 2], [0, 1]])


def test_shared_roots_need_min_shared_tokens_in_common():
    system = list(range(10, 50))
    prompts = [system + [1, 2], system[:20] + [3] * 30, system + [4], system[:5]]
    roots = shared_roots([torch.tensor(p) for p in prompts], ["a", "b", "c", "d"], min_shared_tokens=32)
    # a and c share the 40-token block; b shares only 20 (< 32: the trie would merge it away); d is too short
    assert roots[0] == roots[2] and roots[0].tokens == 40 and roots[1] is None and roots[3] is None
    padded = torch.tensor([[0, 0, 7, 8, 9], [5, 6, 7, 8, 9]])  # left-padded rows: the tags' prompt_len decides
    rows = prompt_rows(padded, [{"prompt_len": 3}, {"prompt_len": 5}])
    assert [r.tolist() for r in rows] == [[7, 8, 9], [5, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match="min_shared_tokens"):
        shared_roots(prompts, ["a"] * 4, min_shared_tokens=0)
