"""The token trie (``schedule.tree.trie``, issue 25): its structure from token ids alone, and properties every trie
must keep (a group's prefix is the concatenation of its path; the tree never computes more tokens than one-level
reuse)."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_prefix.schedule.grouping import RowLayout, plan_batch
from verl_prefix.schedule.tree.trie import build_trie, execution_signature, trie_stats


def layout_of(prompts: list[list[int]], responses: int | list[list[list[int]]] = 2) -> RowLayout:
    """Two rows per prompt (uid = prompt index), each with a response of ``responses`` tokens; or, given
    token lists, ``responses[g]`` are group ``g``'s rows' responses."""
    ids, pos, p_lens, r_lens, uids = [], [], [], [], []
    for g, prompt in enumerate(prompts):
        rows = [[7 + r] * responses for r in range(2)] if isinstance(responses, int) else responses[g]
        for response in rows:
            row = torch.tensor(prompt + response)
            ids.append(row)
            pos.append(torch.arange(len(row)))
            p_lens.append(len(prompt))
            r_lens.append(len(response))
            uids.append(f"g{g}")
    return RowLayout(ids, pos, p_lens, r_lens, uids)


def trie_of(prompts: list[list[int]], min_shared: int = 1, responses: int | list = 2, **knobs):
    layout = layout_of(prompts, responses)
    plan = plan_batch(layout, max_rows=None, max_tokens=None, min_prefix_len=1, min_group_size=1)
    return layout, plan, build_trie(layout, plan.groups, min_shared, **knobs)


def paths(roots) -> dict[str, list[int]]:
    """Each group's tail prefix (the rows with a tail) as the tokens of its root-to-node path."""
    return {uid: tokens for uid, (tokens, _) in row_paths(roots, by_uid=True).items()}


def row_paths(roots, by_uid: bool = False) -> dict:
    """Per row (or per uid of rows with a tail): its root-to-node path's tokens and the path's nodes."""
    out: dict = {}

    def visit(node, above, nodes):
        here, path = above + node.ids.tolist(), [*nodes, node]
        for group in node.groups:
            for row in group.rows:
                out[group.uid if by_uid else row] = (here, path)
        for rows in node.ended:
            for row in rows:
                if not by_uid:
                    out[row] = (here, path)
        for child in node.children:
            visit(child, here, path)

    for root in roots:
        visit(root, [], [])
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
    distinct = [[[10 + 2 * g, 7], [11 + 2 * g, 8]] for g in range(len(prompts))]  # no response tokens shared
    layout, plan, roots = trie_of(prompts, min_shared, responses=distinct)
    got = paths(roots)
    for group in plan.groups:
        row = group.rows[0]
        assert got[group.uid] == layout.input_ids[row][: group.prefix_len].tolist()
    check_trie(layout, plan, roots, min_shared)


responses_strategy = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1, max_size=4)


@settings(max_examples=80, deadline=None)
@given(
    prompts=prompts_strategy,
    responses=st.data(),
    min_shared=st.integers(1, 3),
    chunk=st.sampled_from([None, 1, 2, 3]),
    own_last=st.booleans(),
)
def test_rows_sharing_response_tokens_keep_one_label_per_shared_log_prob(
    prompts, responses, min_shared, chunk, own_last
):
    """Responses from a three-token alphabet share stems (tree rollouts) and prompts may continue another row
    (per-turn samples): every row's path is its own tokens, every node log-prob it takes has its own next
    token as label, and the tree never computes more than one-level reuse; also with nodes in chunks
    (``chunk_tokens``) and with every row's last loss position in its tail (``own_last``, the MoE aux)."""
    drawn = [responses.draw(responses_strategy) for _ in prompts]
    layout, plan, roots = trie_of(prompts, min_shared, responses=drawn, chunk_tokens=chunk, own_last=own_last)
    check_trie(layout, plan, roots, min_shared, chunk)
    for root in roots:
        for node, _ in root.walk():
            assert chunk is None or node.length <= chunk
            assert not (own_last and node.ended)
            assert not own_last or all(span.length - 1 > node.end for span in node.hanging.values())


def check_trie(layout, plan, roots, min_shared: int, chunk: int | None = None) -> None:
    got = row_paths(roots)
    assert sorted(got) == sorted(r for g in plan.groups for r in g.rows)
    for row, (tokens, path) in got.items():
        ids, first = layout.input_ids[row].tolist(), layout.prompt_lens[row] - 1
        end = path[-1].end
        assert tokens == ids[:end] and first <= end <= len(ids) - 1 or end == len(ids) - 1, (row, end)
        for node in path:
            for t in range(max(first, node.start), node.end):  # every loss position in a node: its own label
                assert node.logits_from is not None and node.logits_from <= t
                assert node.labels[t - node.logits_from] == ids[t + 1], (row, t)
    stats = trie_stats(roots)
    assert stats.node_tokens + stats.tail_tokens <= stats.prefix_tokens + stats.suffix_tokens  # never more
    assert stats.saved_tokens >= 0
    logical = sum(layout.prompt_lens[r] + layout.response_lens[r] for g in plan.groups for r in g.rows)
    assert stats.node_tokens + stats.tail_tokens <= logical  # physical <= logical
    for root in roots:
        for node, _ in root.walk():
            assert node.length >= 1
            short_ok = any(node.start < span.prompt_len - 1 for span in node.hanging.values())  # a prompt ends on it
            assert node.length >= min_shared or short_ok or chunk is not None
            for child in node.children:
                assert child.start == node.end


def test_shared_stems_and_turns_share_loss_unless_prompt_only():
    """Two rows whose responses share a stem [20, 21, 22] (a loss node, one row ending on it) and a per-turn
    sample that continues the first row; ``share_loss`` off keeps the prompt-only trie; ``own_last`` (the MoE
    aux) still shares the stem but leaves every row a tail holding its last loss position."""
    prompt = [1, 2, 3, 4]
    layout = layout_of([prompt, prompt + [20, 21, 22, 5]], responses=[[[20, 21, 22], [20, 21, 22, 23]], [[6, 7]]])
    plan = plan_batch(layout, max_rows=None, max_tokens=None, min_prefix_len=1, min_group_size=1)
    roots = build_trie(layout, plan.groups, 2)
    stats = trie_stats(roots)
    # the root runs prompt[-1] .. stem[-2] through the LM head for all three rows (row 0 ends there); its child,
    # 22 at position 6, is row 1's last loss position and the turn sample's prompt, which goes on as a tail
    assert stats.loss_nodes == 2 and stats.shared_loss_tokens == 3 + 1 and stats.saved_tokens > 0, stats
    stem, (last,) = roots[0], roots[0].children
    assert (stem.logits_from, stem.end, stem.labels.tolist(), stem.ended) == (3, 6, [20, 21, 22], [[0]])
    assert (last.start, last.end, last.labels.tolist(), last.ended) == (6, 7, [23], [[1]])
    assert execution_signature(roots) == "LLBECEC"
    own_last = build_trie(layout, plan.groups, 2, own_last=True)
    stats = trie_stats(own_last)
    assert stats.loss_nodes >= 1 and stats.shared_loss_tokens >= 2 and stats.saved_tokens > 0, stats
    for node, _ in own_last[0].walk():
        assert not node.ended and all(span.length - 1 > node.end for span in node.hanging.values())
    prompt_only = build_trie(layout, plan.groups, 2, share_loss=False)
    stats = trie_stats(prompt_only)
    assert (
        stats.loss_nodes == 0
        and stats.tail_tokens == stats.suffix_tokens
        and not any(node.ended for root in prompt_only for node, _ in root.walk())
    )


def test_long_nodes_run_as_chains_of_chunks():
    """``chunk_tokens``: every node longer than it becomes a chain of chunks of at most that many tokens, each
    with its own ids, positions and log-prob labels, the last one keeping the node's children and rows; the
    trie's counts are unchanged but for ``node_chunks`` (a chain is one node at one depth)."""
    prompt = [1, 2, 3, 4, 5, 6, 7]
    stems = [[20, 21, 22, 23, 24, 25, 30, 31], [20, 21, 22, 23, 24, 25, 40, 41, 42]]
    layout = layout_of([prompt, prompt + [20, 21, 22, 23]], responses=[stems, [[6, 7], [8, 9]]])
    plan = plan_batch(layout, max_rows=None, max_tokens=None, min_prefix_len=1, min_group_size=1)
    whole, chunked = build_trie(layout, plan.groups, 2), build_trie(layout, plan.groups, 2, chunk_tokens=3)
    before, after = trie_stats(whole), trie_stats(chunked)
    assert before.node_chunks == 0 < after.node_chunks and after == dataclasses.replace(
        before, node_chunks=after.node_chunks, loss_nodes=after.loss_nodes
    )
    assert len(execution_signature(chunked)) > len(execution_signature(whole))
    rows = {}
    for node, _ in chunked[0].walk():
        assert 1 <= node.length <= 3 and torch.equal(node.positions, torch.arange(node.start, node.end))
        row = next(iter(node.rows_below()))
        assert torch.equal(node.ids, layout.input_ids[row][node.start : node.end])
        if node.logits_from is not None:
            assert torch.equal(node.labels, layout.input_ids[row][node.logits_from + 1 : node.end + 1])
        if node.continues:
            assert not any(c.start != node.end for c in node.children)
        rows.update({r: node.end for r in node.hanging})
    assert rows == {r: n.end for n, _ in whole[0].walk() for r in n.hanging}  # every row hangs where it did
