"""The depth-first tree schedule (``schedule.tree``, issue 25) against plain HF: groups whose prompts share a
system block (a trie of depth >= 2), training and forward-only, fp64 and fp32; a negative control where a child
attends to its sibling's K/V must fail."""

from __future__ import annotations

import pytest
import torch
from helpers.layouts import VOCAB, token_weights
from helpers.precision import promote_fp32_upcasts
from test_schedule_hf import dense_grads, dense_response_outputs, tiny_model, weighted_loss, worst_relative

from verl_prefix.schedule import tree as tree_schedule
from verl_prefix.schedule.grouping import RowLayout, plan_batch
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.trie import build_trie, trie_stats

CPU = torch.device("cpu")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def shared_system_layout(seed: int = 0) -> RowLayout:
    """3 groups (G = 3, ragged responses) whose prompts are one 12-token system block, then a question of their
    own; groups 0 and 2 also share the question's first 4 tokens (a third level)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=gen)  # noqa: E731
    system, stem = rand(12), rand(4)
    questions = [torch.cat([stem, rand(3)]), rand(5), torch.cat([stem, rand(6)])]
    ids, pos, p_lens, r_lens, uids = [], [], [], [], []
    for g, question in enumerate(questions):
        prompt = torch.cat([system, question])
        for s in (3, 6, 2):
            row = torch.cat([prompt, rand(s)])
            ids.append(row)
            pos.append(torch.arange(len(row)))
            p_lens.append(len(prompt))
            r_lens.append(s)
            uids.append(f"g{g}")
    return RowLayout(ids, pos, p_lens, r_lens, uids)


def tree_plan(layout: RowLayout, rows: int = 2):
    plan = plan_batch(layout, max_rows=rows, max_tokens=None, min_prefix_len=1, min_group_size=1)
    roots = build_trie(layout, plan.groups, min_shared_tokens=2)
    stats = trie_stats(roots)
    assert not plan.dense_rows and stats.depth >= 3, stats
    logical = sum(p + s for p, s in zip(layout.prompt_lens, layout.response_lens))
    physical = stats.node_tokens + sum(layout.response_lens)
    assert physical < logical and stats.node_tokens < stats.prefix_tokens, "the tree must share across groups"
    return roots


def tree_grads(model, layout, weights, **options):
    model.zero_grad()
    roots = tree_plan(layout)
    schedule_options = ScheduleOptions(device=CPU, **options)
    tree_schedule.train_tree(model, layout, roots, weighted_loss(weights), schedule_options)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_tree_matches_dense_training_and_forward_only(dtype):
    model = tiny_model("qwen3", "sdpa", dtype)
    layout = shared_system_layout()
    weights = token_weights(layout, dtype)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        for attention in ("concat", "merged"):
            got = tree_grads(model, layout, weights, calculate_entropy=True, phase_b_attention=attention)
            assert worst_relative(got, want) < TOLERANCE[dtype], attention
        with torch.no_grad():
            want_lp, want_ent = dense_response_outputs(model, layout)
        options = ScheduleOptions(device=CPU, calculate_entropy=True)
        got_out = tree_schedule.infer_tree(model, layout, tree_plan(layout), options)
    for i in range(len(layout)):
        torch.testing.assert_close(got_out[i][0], want_lp[i], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        torch.testing.assert_close(got_out[i][1], want_ent[i], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_negative_control_a_child_attending_to_its_siblings_kv_fails(monkeypatch):
    """Each node's forward sees its path; a schedule that let a node see the previous sibling's K/V too (a flat
    left-to-right chain instead of a tree) must be caught."""
    model = tiny_model("qwen3", "sdpa", torch.float64)
    layout = shared_system_layout()
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        visited: list = []
        join = tree_schedule.join_path

        def leaky_join(path):
            if path and visited and visited[-1] is not path[-1] and len(path) >= 1:
                path = [*path, visited[-1]]  # the last node that ran: for a second child, its sibling
            out = join(path)
            return out

        original_as_leaves = tree_schedule.PrefixKV.as_leaves

        def recording_as_leaves(self, *args, **kwargs):
            leaves = original_as_leaves(self, *args, **kwargs)
            visited.append(leaves)
            return leaves

        monkeypatch.setattr(tree_schedule, "join_path", leaky_join)
        monkeypatch.setattr(tree_schedule.PrefixKV, "as_leaves", recording_as_leaves)
        got = tree_grads(model, layout, weights)
    assert worst_relative(got, want) > 1e-3
