"""Lockstep fillers for the tree schedule (``schedule.tree.lockstep``): tries of any shapes on two ranks pad to
one sequence of passes, and padding changes nothing a real row sees. The engine-level check (two gloo ranks
whose tries differ, exact against the stock engine) is ``test_tree_engine.py``'s two-rank test."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.layouts import token_weights
from helpers.precision import promote_fp32_upcasts
from hypothesis import given, settings
from hypothesis import strategies as st
from test_schedule_hf import dense_grads, tiny_model, weighted_loss, worst_relative
from test_tree_schedule import shared_system_layout, tree_plan
from test_trie import prompts_strategy, row_paths, trie_of

from verl_prefix.schedule import executor
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.tree import schedule as tree
from verl_prefix.schedule.tree.lockstep import filler_passes, pad_to, trie_shape, union_shapes
from verl_prefix.schedule.tree.schedule import train_tree
from verl_prefix.schedule.tree.trie import execution_signature, trie_stats


def passes(roots) -> str:
    """The model passes (``E``, rows without a tail, runs no model call)."""
    return re.sub("E", "", execution_signature(roots))


@settings(max_examples=60, deadline=None)
@given(
    ranks=st.lists(st.tuples(prompts_strategy, st.integers(1, 3), st.booleans()), min_size=2, max_size=3),
    chunk=st.sampled_from([None, 2]),
)
def test_every_rank_pads_to_the_same_passes_and_its_rows_see_the_same_trie(ranks, chunk):
    tries = [trie_of(p, shared, chunk_tokens=chunk, own_last=last)[2] for p, shared, last in ranks]
    union = union_shapes([trie_shape(roots) for roots in tries])
    before = [(trie_stats(roots), row_paths(roots), passes(roots), list(roots)) for roots in tries]
    plain = [{id(n) for root in roots for n, _ in root.walk() if n.logits_from is None} for roots in tries]
    padded = [pad_to(roots, union) for roots in tries]
    assert len({passes(roots) for roots in padded}) == 1  # one sequence of passes on every rank
    for (stats, rows, own, original), roots, no_loss in zip(before, padded, plain):
        # a node without loss runs the LM head only where a peer's node does: the same passes, F turned L
        promoted = [n for root in original for n, _ in root.walk() if n.lockstep_logits]
        assert all(id(n) in no_loss and n.logits_from == n.end - 1 for n in promoted)
        assert roots[: len(original)] == original and all(root.filler for root in roots[len(original) :])
        assert trie_stats(roots) == stats and row_paths(roots) == rows  # fillers are invisible to real rows
        fillers = [n for root in roots[len(original) :] for n, _ in root.walk()]
        fillers += [f for root in original for n, _ in root.walk() for c in n.filler_children for f, _ in c.walk()]
        assert all(n.filler and n.length == 1 and not n.hanging and not n.groups for n in fillers)
        micro = sum(n.filler_micro_batches for n in fillers) + sum(
            n.filler_micro_batches for root in original for n, _ in root.walk()
        )
        assert filler_passes(roots) == len(fillers) + micro + len(promoted)
        assert len(passes(roots)) == len(own) + 2 * len(fillers) + micro  # each filler node: a forward, a backward


def padded_grads(model, layout, weights, promote: bool = False):
    """The tree schedule over ``layout``'s trie padded to a larger union (more micro-batches per node, a filler
    child under the root, a filler root with children), as a rank whose trie is the smaller one runs it.
    ``promote``: the peer's root runs the LM head, so this rank's root (no loss) runs it too, seeded with zeros."""
    roots = tree_plan(layout)
    own = trie_shape(roots)
    kind, micro, children = own[0]
    assert kind == "F"
    larger = (("L" if promote else kind, micro + 2, (*children, ("F", 1, ()))), ("F", 2, (("F", 1, ()), ("F", 0, ()))))
    padded = pad_to(roots, union_shapes([own, larger]))
    assert padded[0].lockstep_logits == promote and execution_signature(padded)[0] == ("L" if promote else "F")
    # the root's 2 micro-batches, its filler child (a node, 1 micro-batch), the filler root (2), its children (1+1, 1)
    assert filler_passes(padded) == 2 + (1 + 1) + (1 + 2) + (1 + 1) + 1 + promote
    model.zero_grad()
    train_tree(model, layout, padded, weighted_loss(weights), ScheduleOptions(device=torch.device("cpu")))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def case():
    """A tiny fp64 Qwen3, a three-level trie's layout (``test_tree_schedule``) and per-token loss weights."""
    layout = shared_system_layout(responses=(3, 6))
    return tiny_model("qwen3", "sdpa", torch.float64), layout, token_weights(layout, torch.float64)


def test_fillers_add_nothing_to_the_gradients(case):
    """fp64 against plain HF: the padded trie's gradients are the trie's (the fillers' losses are zero and
    they attend to no real node's K/V but through zero-loss suffixes)."""
    model, layout, weights = case
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=False)
        got = padded_grads(model, layout, weights)
    assert worst_relative(got, want) < 1e-10


def test_a_node_running_the_lm_head_for_a_peer_adds_nothing(case, monkeypatch):
    """A real node without loss at a position where a peer rank's node runs the LM head runs it too (over its
    last position, seeded with zeros): the gradients are still plain HF's, and the LM head's gradient is
    there on both ranks' terms. Control: the same logits seeded with ones instead of zeros."""
    model, layout, weights = case
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=False)
        got = padded_grads(model, layout, weights, promote=True)
    assert worst_relative(got, want) < 1e-10
    seeded = executor.seeded_backward

    def ones(kv, seeds, model_, extra=()):
        return seeded(kv, seeds, model_, [(root, torch.ones_like(root)) for root, _ in extra])

    monkeypatch.setattr(executor, "seeded_backward", ones)
    with promote_fp32_upcasts():
        wrong = padded_grads(model, layout, weights, promote=True)
    assert worst_relative(wrong, want) > 1e-3


def test_negative_control_filler_micro_batches_with_a_loss_fail(case, monkeypatch):
    model, layout, weights = case

    def leaking(model_, node, path, options, train):
        for _ in range(node.filler_micro_batches):
            log_probs, _ = executor.suffix_forward(
                model_, executor.join_path(path), tree.filler_suffix(node.end, options), options
            )
            if train:
                options.backward(log_probs[0].sum())  # a filler whose loss is not zeroed

    monkeypatch.setattr(tree, "run_filler_micro_batches", leaking)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=False)
        got = padded_grads(model, layout, weights)
    assert worst_relative(got, want) > 1e-3
