"""Loss on shared tokens (``schedule.tree.loss``, issue 25) against plain HF in fp64: tree rollouts whose
responses share a stem and branch at two depths (one response ends where another goes on: a row without a
tail), and per-turn samples where each sample is the next one's prefix; training with entropy in the loss (rows
one per micro-batch, so the node leaves accumulate) and forward-only. Through the engine against the stock fsdp2
engine, with the negative control (a shared token counted once instead of once per row):
``tests/backend/test_tree_loss_engine.py``."""

from __future__ import annotations

import pytest
import torch
from helpers.layouts import VOCAB, token_weights
from helpers.precision import promote_fp32_upcasts
from helpers.tree_batches import per_turn_rows
from test_schedule_hf import dense_grads, dense_response_outputs, tiny_model, weighted_loss, worst_relative

from verl_prefix.schedule.grouping import RowLayout, plan_batch
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.tree import schedule as tree_schedule
from verl_prefix.schedule.tree.trie import build_trie, trie_stats

CPU = torch.device("cpu")


def shared_loss_layout(seed: int = 0) -> RowLayout:
    """Tree rollouts (uid ``t``): a 9-token prompt, four responses sharing a 4-token stem, then two 3-token
    stems (rows 0-1, rows 2-3); row 0 ends on its stem (no tail), the others go on. Per-turn samples (uids
    ``c0..c2``): turn k's prompt is turn k-1's prompt and response, then a user turn."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=gen)  # noqa: E731
    prompt, stem, left, right = rand(9), rand(4), rand(3), rand(3)
    responses = [
        torch.cat([stem, left]),
        torch.cat([stem, left, rand(2)]),
        torch.cat([stem, right, rand(3)]),
        torch.cat([stem, right, rand(1)]),
    ]
    rows = [(prompt, r, "t") for r in responses]
    rows += per_turn_rows(rand, 6, [(0, 4), (3, 3), (2, 4)])
    ids = [torch.cat([p, r]) for p, r, _ in rows]
    return RowLayout(
        ids,
        [torch.arange(len(x)) for x in ids],
        [len(p) for p, _, _ in rows],
        [len(r) for _, r, _ in rows],
        [u for _, _, u in rows],
    )


def tree_plan(layout: RowLayout):
    """The trie over every row, asserting it shares loss tokens: depth >= 2, nodes that run the LM head, a row
    without a tail, fewer physical than logical tokens."""
    plan = plan_batch(layout, max_rows=1, max_tokens=None, min_prefix_len=1, min_group_size=1)
    roots = build_trie(layout, plan.groups, min_shared_tokens=2)
    stats = trie_stats(roots)
    assert not plan.dense_rows and stats.depth >= 3 and stats.loss_nodes >= 4, stats
    assert stats.shared_loss_tokens >= 4 + 3 + 3 + 4 + 3, stats  # stems and the earlier turns' responses
    assert sum(len(rows) for root in roots for node, _ in root.walk() for rows in node.ended) == 3  # row 0, c0, c1
    logical = sum(p + s for p, s in zip(layout.prompt_lens, layout.response_lens))
    physical = stats.node_tokens + stats.tail_tokens
    assert physical < logical and stats.saved_tokens > 0, (physical, logical, stats)
    return roots


@pytest.fixture(scope="module")
def case():
    model = tiny_model("qwen3", "sdpa", torch.float64)
    layout = shared_loss_layout()
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
    return model, layout, weights, want


def tree_grads(model, layout, weights):
    model.zero_grad()
    options = ScheduleOptions(device=CPU, calculate_entropy=True)
    tree_schedule.train_tree(model, layout, tree_plan(layout), weighted_loss(weights), options)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_shared_loss_tokens_match_dense_training_and_forward_only(case):
    model, layout, weights, want = case
    with promote_fp32_upcasts():
        assert worst_relative(tree_grads(model, layout, weights), want) < 1e-10
        with torch.no_grad():
            want_lp, want_ent = dense_response_outputs(model, layout)
            got = tree_schedule.infer_tree(model, layout, tree_plan(layout), ScheduleOptions(CPU, True))
    assert sorted(got) == list(range(len(layout)))
    for i in range(len(layout)):
        torch.testing.assert_close(got[i][0], want_lp[i], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[i][1], want_ent[i], rtol=1e-10, atol=1e-10)


def test_a_temperature_divides_the_nodes_logits_as_the_tails(case):
    """Forward-only at temperature 0.7 (every row, fp32 as verl holds it): the nodes' log-probs as plain HF's
    logits divided by it give them."""
    import dataclasses

    model, layout, _, _ = case
    hot = dataclasses.replace(layout, temperature=torch.full((len(layout),), 0.7))
    with promote_fp32_upcasts(), torch.no_grad():
        got = tree_schedule.infer_tree(model, hot, tree_plan(hot), ScheduleOptions(CPU))
        for i, (ids, p) in enumerate(zip(layout.input_ids, layout.prompt_lens)):
            logits = model(input_ids=ids[None], use_cache=False).logits[0, p - 1 : -1] / float(hot.temperature[i])
            want = torch.log_softmax(logits, dim=-1).gather(-1, ids[p:, None]).squeeze(-1)
            torch.testing.assert_close(got[i][0], want, rtol=1e-10, atol=1e-10)


def test_rows_of_different_temperatures_under_one_node(case):
    """Rows sampled at different temperatures share stems (rows 0 and 1 at 0.7 and 1.3 under one 3-token stem,
    every tree-rollout row under the 4-token one): each node keeps its values per temperature and each row
    takes its own, training (entropy in the loss) and forward-only against plain HF in fp64. Control: a node
    dividing by its first row's temperature only."""
    import dataclasses

    from verl_prefix.schedule.tree import loss as tree_loss

    model, layout, weights, _ = case
    mixed = dataclasses.replace(layout, temperature=torch.tensor([0.7, 1.3, 1.0, 0.7, 1.0, 0.9, 1.0]))
    with promote_fp32_upcasts():
        want = dense_grads(model, mixed, weights, with_entropy=True)
        assert worst_relative(tree_grads(model, mixed, weights), want) < 1e-10
        with torch.no_grad():
            want_lp, want_ent = dense_response_outputs(model, mixed)
            got = tree_schedule.infer_tree(model, mixed, tree_plan(mixed), ScheduleOptions(CPU, True))
    for i in range(len(mixed)):
        torch.testing.assert_close(got[i][0], want_lp[i], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[i][1], want_ent[i], rtol=1e-10, atol=1e-10)
    temperatures = [tree_loss.node_temperatures(n, mixed) for r in tree_plan(mixed) for n, _ in r.walk()]
    assert max(len(t) for t in temperatures) == 3, temperatures  # the 4-token stem: 0.7, 1.0 and 1.3

    original = tree_loss.node_temperatures
    try:
        tree_loss.node_temperatures = lambda node, lay: original(node, lay)[:1]  # every row takes the first's
        tree_loss.node_slice = _first_temperature(tree_loss.node_slice)
        with promote_fp32_upcasts():
            wrong = tree_grads(model, mixed, weights)
    finally:
        tree_loss.node_temperatures = original
        tree_loss.node_slice = _first_temperature.original
    assert worst_relative(wrong, want) > 1e-4


def _first_temperature(node_slice):
    """``node_slice`` that hands every row the node's first temperature's values (the control)."""
    _first_temperature.original = node_slice
    return lambda values, first, temperature=1.0: node_slice(values, first, values.temperatures[0])
