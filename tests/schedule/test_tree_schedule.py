"""The depth-first tree schedule (``schedule.tree.schedule``, issue 25) against plain HF in fp64: groups whose prompts
share a system block, two of them a question stem too, and one whose prompt ends inside the tree (its suffixes hang on
an inner node, as a per-turn sample does under the next turn's), training and forward-only, the three phase-B
attentions, ``dormant_prefix=recompute`` per node; the MoE router aux loss (each node's statistics once per row
below it); a negative control where a node attends to its sibling's K/V must fail. fp32 runs through the engine
(``tests/backend/test_tree_engine.py``)."""

from __future__ import annotations

import pytest
import torch
from helpers.layouts import VOCAB, token_weights
from helpers.precision import promote_fp32_upcasts
from test_moe import tiny_moe
from test_schedule_hf import dense_grads, dense_response_outputs, tiny_model, weighted_loss, worst_relative

from verl_prefix.schedule import executor
from verl_prefix.schedule.dormant import Dormant, DormantStats
from verl_prefix.schedule.executor import train_group
from verl_prefix.schedule.grouping import RowLayout, plan_batch
from verl_prefix.schedule.models import moe
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.tree import schedule as tree_schedule
from verl_prefix.schedule.tree.dormant import keep_every_node
from verl_prefix.schedule.tree.trie import build_trie, trie_stats

CPU = torch.device("cpu")


def shared_system_layout(seed: int = 0, responses: tuple[int, ...] = (3, 6, 2)) -> RowLayout:
    """4 groups (G = ``len(responses)``, ragged) whose prompts are one 12-token system block and a question of
    their own; groups 0 and 2 share the question's first 4 tokens (a third level), and group 3's prompt is the
    system block, that stem and one token: its prefix ends on the stem's node, which has children of its own."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=gen)  # noqa: E731
    system, stem = rand(12), rand(4)
    questions = [torch.cat([stem, rand(3)]), rand(5), torch.cat([stem, rand(6)]), torch.cat([stem, rand(1)])]
    ids, pos, p_lens, r_lens, uids = [], [], [], [], []
    for g, question in enumerate(questions):
        prompt = torch.cat([system, question])
        for s in responses:
            row = torch.cat([prompt, rand(s)])
            ids.append(row)
            pos.append(torch.arange(len(row)))
            p_lens.append(len(prompt))
            r_lens.append(s)
            uids.append(f"g{g}")
    return RowLayout(ids, pos, p_lens, r_lens, uids)


def tree_plan(layout: RowLayout, rows: int = 1):
    """The trie over every group (all reuse), asserting it shares: depth 3, an inner node with a group, fewer
    physical than logical tokens."""
    plan = plan_batch(layout, max_rows=rows, max_tokens=None, min_prefix_len=1, min_group_size=1)
    roots = build_trie(layout, plan.groups, min_shared_tokens=2)
    stats = trie_stats(roots)
    assert not plan.dense_rows and stats.depth == 3, stats
    assert any(node.groups and node.children for node, _ in roots[0].walk()), "a group must end on an inner node"
    logical = sum(p + s for p, s in zip(layout.prompt_lens, layout.response_lens))
    physical = stats.node_tokens + sum(layout.response_lens)
    assert physical < logical and stats.node_tokens < stats.prefix_tokens, "the tree must share across groups"
    return roots


def tree_grads(model, layout, weights, policies=keep_every_node, **options):
    model.zero_grad()
    schedule_options = ScheduleOptions(device=CPU, **options)
    tree_schedule.train_tree(model, layout, tree_plan(layout), weighted_loss(weights), schedule_options, policies)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def case():
    """The model, layout, weights and plain-HF gradients (fp64, entropy in the loss) every test compares with."""
    model = tiny_model("qwen3", "sdpa", torch.float64)
    layout = shared_system_layout(responses=(3, 6))  # G = 2 in micro-batches of one row: leaves accumulate
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
    return model, layout, weights, want


def test_tree_matches_dense_training_and_forward_only(case):
    model, layout, weights, want = case
    with promote_fp32_upcasts():
        for attention in ("concat", "merged", "merged_varlen"):  # merged_varlen: the CPU reference packing
            got = tree_grads(model, layout, weights, calculate_entropy=True, phase_b_attention=attention)
            assert worst_relative(got, want) < 1e-10, attention
        # dormant_prefix=recompute per node (schedule.tree.dormant): every node rebuilt in phase C, checked
        stats = DormantStats()
        got = tree_grads(model, layout, weights, lambda node: Dormant("recompute", stats=stats), calculate_entropy=True)
        assert worst_relative(got, want) < 1e-10
        nodes = sum(1 for root in tree_plan(layout) for _ in root.walk())
        assert stats.policies["recompute"] == nodes > 1 and stats.recompute_max_diff == 0.0
        with torch.no_grad():
            want_lp, want_ent = dense_response_outputs(model, layout)
        options = ScheduleOptions(device=CPU, calculate_entropy=True)
        got_out = tree_schedule.infer_tree(model, layout, tree_plan(layout), options)
    for i in range(len(layout)):
        torch.testing.assert_close(got_out[i][0], want_lp[i], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got_out[i][1], want_ent[i], rtol=1e-10, atol=1e-10)


def test_negative_control_a_node_attending_to_its_siblings_kv_fails(case, monkeypatch):
    """Each node's forward (and each group's suffix rows) sees its own path only; a schedule that also let them
    see the K/V of the sibling subtree that ran just before (a left-to-right chain instead of a tree) must be
    caught."""
    model, layout, weights, want = case
    made: list = []  # every node's K/V leaves, in the order the nodes ran
    as_leaves, join = tree_schedule.PrefixKV.as_leaves, tree_schedule.join_path
    leaked = []

    def recording_as_leaves(self, *args, **kwargs):
        made.append(as_leaves(self, *args, **kwargs))
        return made[-1]

    def leaky_join(path):
        if path and made[-1] is not path[-1]:  # a node after its sibling's subtree: the sibling's K/V too
            leaked.append(len(path))
            path = [*path, made[-1]]
        return join(path)

    monkeypatch.setattr(tree_schedule.PrefixKV, "as_leaves", recording_as_leaves)
    for module in (tree_schedule, executor):  # the nodes' forwards and the suffix micro-batches (executor.suffix_step)
        monkeypatch.setattr(module, "join_path", leaky_join)
    with promote_fp32_upcasts():
        got = tree_grads(model, layout, weights, calculate_entropy=True)
    assert leaked, "the control must have leaked a sibling's K/V"
    assert worst_relative(got, want) > 1e-3


def test_moe_aux_counts_each_node_once_per_row():
    """With the router aux loss on, the tree's update equals one-level reuse's on the same suffix partition (the
    aux is a per-micro-batch mean; one-level reuse is checked against dense in ``test_moe``), fp64. Summing the
    nodes' probability-sum leaves with ``stack(...).sum(0)`` gave both leaves one aliased gradient, accumulated
    twice: a 0.7% gradient error here."""
    model = tiny_moe(torch.float64, num_hidden_layers=2)
    layout = shared_system_layout(responses=(3, 5))  # G = 2, two layers: the same paths at half the CPU
    weights = token_weights(layout, torch.float64)
    routers = moe.MoeRouters(model)
    auxes: dict[str, list[float]] = {"one-level": [], "tree": []}

    def run(name):
        def aux_fn(rows, stats):
            aux = routers.loss(stats)
            auxes[name].append(aux.item())
            return 0.5 * stats.tokens / 100 * aux

        model.zero_grad()
        options = ScheduleOptions(device=CPU, routers=routers, aux_fn=aux_fn)
        plan = plan_batch(layout, max_rows=2, max_tokens=None, min_prefix_len=1, min_group_size=1)
        if name == "tree":
            tree_schedule.train_tree(model, layout, tree_plan(layout, rows=2), weighted_loss(weights), options)
        else:
            for group in plan.groups:
                train_group(model, layout, group, weighted_loss(weights), options)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with promote_fp32_upcasts():
        want, got = run("one-level"), run("tree")
    assert sorted(auxes["tree"]) == pytest.approx(sorted(auxes["one-level"]), rel=1e-12)
    assert worst_relative(got, want) < 1e-10
    gates = [n for n in got if n.endswith("mlp.gate.weight")]
    assert gates and all(got[n].norm() > 0 for n in gates)
