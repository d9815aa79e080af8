"""The token trie (``schedule.trie``, issue 25): its structure from token ids alone, and properties every trie
must keep (a group's prefix is the concatenation of its path; the tree never computes more tokens than one-level
reuse)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_prefix.schedule.grouping import RowLayout, plan_batch
from verl_prefix.schedule.trie import build_trie, execution_signature, trie_stats


def layout_of(prompts: list[list[int]], responses: int = 2) -> RowLayout:
    """Two rows per prompt (uid = prompt index), each with a response of ``responses`` tokens."""
    ids, pos, p_lens, r_lens, uids = [], [], [], [], []
    for g, prompt in enumerate(prompts):
        for r in range(2):
            row = torch.tensor(prompt + [7 + r] * responses)
            ids.append(row)
            pos.append(torch.arange(len(row)))
            p_lens.append(len(prompt))
            r_lens.append(responses)
            uids.append(f"g{g}")
    return RowLayout(ids, pos, p_lens, r_lens, uids)


def trie_of(prompts: list[list[int]], min_shared: int = 1):
    layout = layout_of(prompts)
    plan = plan_batch(layout, max_rows=None, max_tokens=None, min_prefix_len=1, min_group_size=1)
    return layout, plan, build_trie(layout, plan.groups, min_shared)


def paths(roots) -> dict[str, list[int]]:
    """Each group's prefix as the tokens of its root-to-node path."""
    out: dict[str, list[int]] = {}

    def visit(node, above):
        here = above + node.ids.tolist()
        for group in node.groups:
            out[group.uid] = here
        for child in node.children:
            visit(child, here)

    for root in roots:
        visit(root, [])
    return out


def test_system_block_shared_by_every_group_is_one_root():
    system = [1, 2, 3, 4, 5]
    _, plan, roots = trie_of([system + [10, 11, 0], system + [12, 13, 0], system + [10, 14, 0]])
    assert len(roots) == 1 and roots[0].ids.tolist() == system
    assert [c.ids.tolist() for c in roots[0].children] == [[10], [12, 13]]  # g0 and g2 share token 10
    assert [c.ids.tolist() for c in roots[0].children[0].children] == [[11], [14]]
    stats = trie_stats(roots)
    assert (stats.nodes, stats.depth, stats.shared_tokens) == (5, 3, (5, 1, 0))
    assert stats.node_tokens == 5 + 1 + 1 + 1 + 2 < stats.prefix_tokens == 21
    assert execution_signature(roots) == "FFFBCFBCCFBCC"


def test_short_shared_node_merges_into_its_children_and_disjoint_prompts_are_one_level():
    system = [1, 2, 3, 4, 5]
    _, _, roots = trie_of([system + [10, 11, 0], system + [12, 13, 0], system + [10, 14, 0]], min_shared=2)
    assert [c.ids.tolist() for c in roots[0].children] == [[10, 11], [10, 14], [12, 13]]
    _, plan, roots = trie_of([[1, 2, 0], [3, 4, 0]], min_shared=1)
    assert [r.groups for r in roots] == [[g] for g in plan.groups] and not any(r.children for r in roots)
    assert trie_stats(roots).depth == 1


def test_a_token_at_another_position_is_another_token():
    layout = layout_of([[1, 2, 3, 0], [1, 2, 3, 0]])
    for i in (2, 3):
        layout.position_ids[i][1:] += 5  # g1: same ids, positions shifted after the first token
    plan = plan_batch(layout, max_rows=None, max_tokens=None, min_prefix_len=1, min_group_size=1)
    roots = build_trie(layout, plan.groups, 1)
    assert roots[0].ids.tolist() == [1] and len(roots[0].children) == 2


prompts_strategy = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=8).map(lambda p: p + [0]), min_size=1, max_size=6
)


@settings(max_examples=60, deadline=None)
@given(prompts=prompts_strategy, min_shared=st.integers(1, 4))
def test_every_prefix_is_its_path_and_the_tree_never_computes_more(prompts, min_shared):
    layout, plan, roots = trie_of(prompts, min_shared)
    got = paths(roots)
    for group in plan.groups:
        row = group.rows[0]
        assert got[group.uid] == layout.input_ids[row][: group.prefix_len].tolist()
    stats = trie_stats(roots)
    assert stats.node_tokens <= stats.prefix_tokens  # never more than one-level reuse
    assert stats.node_tokens <= sum(len(g.rows) * g.prefix_len for g in plan.groups)  # physical <= logical
    for root in roots:
        for node, _ in root.walk():
            assert node.length >= 1
            below = node.subtree_groups()
            assert node.length >= min_shared or node.groups or len(below) == 1 or not node.children
            for child in node.children:
                assert child.start == node.end
