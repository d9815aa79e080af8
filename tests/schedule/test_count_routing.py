"""``ScheduleOptions.count_routing``: the weights the one schedule gives an engine's own routing statistics
(torchtitan's expert-load counts, ``backend.titan.moe``) add up to what dense routes, token for token.

Every model call the schedule makes runs inside ``count_routing(weights)``; a forward pre-hook reads the call's
token ids, so each call adds ``weights`` times its tokens to a histogram over the vocabulary. Dense routes every
token of every row once (the last response token too), so the histogram must equal the rows' own, exactly:
one-level reuse, several suffix micro-batches, a chunked prefix with lockstep filler chunks, a lockstep filler
group, phase C's recompute, the tree (``own_last``: every row keeps a tail) and forward-only passes. Negative
controls: the prefix counted once per node, or the last response token left unrouted, give other histograms.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from helpers.layouts import make_layout
from test_schedule_hf import tiny_model

from verl_prefix.schedule import executor
from verl_prefix.schedule.dormant import Dormant
from verl_prefix.schedule.executor import infer_group, train_group
from verl_prefix.schedule.grouping import RowLayout, plan_batch
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.tree import schedule as tree_schedule
from verl_prefix.schedule.tree.trie import build_trie

CPU = torch.device("cpu")
VOCAB = 101


class RoutedTokens:
    """A ``count_routing`` that adds each call's tokens, times their weights, to a histogram; a call outside any
    weighting is recorded as an error (the schedule must weigh every call it makes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.histogram = torch.zeros(VOCAB, dtype=torch.float64)
        self.weights: torch.Tensor | None = None
        self.unweighted = 0
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    @contextlib.contextmanager
    def __call__(self, weights: torch.Tensor | float):
        outer, self.weights = self.weights, torch.as_tensor(weights, dtype=torch.float64)
        try:
            yield
        finally:
            self.weights = outer

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.weights is None:
            self.unweighted += 1
            return
        weights = self.weights.expand(ids.shape)
        self.histogram.index_add_(0, ids.reshape(-1), weights.reshape(-1))


def dense_histogram(layout: RowLayout) -> torch.Tensor:
    """What dense routes: every token of every row once."""
    return torch.bincount(torch.cat(layout.input_ids), minlength=VOCAB).to(torch.float64)


def log_prob_loss(rows, log_probs, entropy):
    return sum(lp.sum() for lp in log_probs)


def _options(counter: RoutedTokens, **kwargs: object) -> ScheduleOptions:
    return ScheduleOptions(device=CPU, count_routing=counter, **kwargs)


def _train_groups(model, layout, options, *, rows=2, policy="keep", prefix_chunks=0) -> None:
    plan = plan_batch(layout, max_rows=rows, max_tokens=None, min_prefix_len=1, min_group_size=1)
    assert plan.groups and not plan.dense_rows
    for group in plan.groups:
        group = dataclasses.replace(group, min_prefix_chunks=prefix_chunks)
        train_group(model, layout, group, log_prob_loss, options, Dormant(policy))


def zero_loss(rows, log_probs, entropy):
    return sum(lp.sum() for lp in log_probs) * 0.0


LAYOUT = [(9, [3, 5, 2]), (6, [4, 1]), (11, [2, 6, 3, 1])]


@pytest.mark.parametrize(
    "case",
    ["one_level", "one_row_micro_batches", "recompute", "chunked_fillers", "chunked_recompute", "fillers_only"],
)
def test_training_routes_what_dense_routes(case):
    model = tiny_model("llama", "sdpa", torch.float64)
    layout = make_layout(LAYOUT, seed=3, vocab=VOCAB)
    counter = RoutedTokens(model)
    kwargs: dict = {}
    if case == "one_row_micro_batches":
        kwargs["rows"] = 1
    if case in ("recompute", "chunked_recompute"):
        kwargs["policy"] = "recompute"
    chunk = 4 if case.startswith("chunked") else None
    if case == "chunked_fillers":
        kwargs["prefix_chunks"] = 5  # more chunks than the longest prefix has: one-token filler chunks
    options = _options(counter, prefix_chunk_tokens=chunk)
    if case == "fillers_only":
        before = counter.histogram.clone()
        plan = plan_batch(layout, max_rows=2, max_tokens=None, min_prefix_len=1, min_group_size=1)
        # a lockstep slot this rank has no group for
        group = dataclasses.replace(plan.groups[0], filler_micro_batches=2)
        train_group(model, layout, group, zero_loss, options.for_fillers(), Dormant("recompute"))
        assert torch.equal(counter.histogram, before), "a filler group stands for no dense token"
        assert counter.unweighted == 0
        return
    _train_groups(model, layout, options, **kwargs)
    assert counter.unweighted == 0, "every schedule model call is weighted"
    assert torch.equal(counter.histogram, dense_histogram(layout))


def test_tree_routes_what_dense_routes():
    """The trie (built ``own_last``: every row keeps a tail that routes its last token): each node's tokens count
    once per row below it, under ``recompute`` too; forward-only likewise."""
    model = tiny_model("llama", "sdpa", torch.float64)
    system = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(0))
    layout = make_layout([(9, [3, 5, 2]), (10, [4, 1]), (11, [2, 6, 3, 1])], seed=4, vocab=VOCAB)
    shared = [torch.cat([system, ids[len(system) :]]) for ids in layout.input_ids]
    layout = dataclasses.replace(layout, input_ids=shared)
    plan = plan_batch(layout, max_rows=2, max_tokens=None, min_prefix_len=1, min_group_size=1, extra_tokens_per_row=1)
    roots = build_trie(layout, plan.groups, min_shared_tokens=2, own_last=True)
    assert len(roots) == 1 and roots[0].children, "the groups share the system block: one root with children"
    for policy in ("keep", "recompute"):
        counter = RoutedTokens(model)
        options = _options(counter)
        tree_schedule.train_tree(model, layout, roots, log_prob_loss, options, lambda node, p=policy: Dormant(p))
        assert counter.unweighted == 0
        assert torch.equal(counter.histogram, dense_histogram(layout)), policy
    counter = RoutedTokens(model)
    tree_schedule.infer_tree(model, layout, roots, _options(counter))
    assert torch.equal(counter.histogram, dense_histogram(layout))


def test_forward_only_routes_what_dense_routes():
    """Forward-only passes count the same tokens (phase A runs to the end: the last layer routes the prefix)."""
    model = tiny_model("llama", "sdpa", torch.float64)
    layout = make_layout(LAYOUT, seed=5, vocab=VOCAB)
    counter = RoutedTokens(model)
    options = _options(counter)
    assert not options.forward_only().exits_early
    plan = plan_batch(layout, max_rows=2, max_tokens=None, min_prefix_len=1, min_group_size=1, extra_tokens_per_row=1)
    for group in plan.groups:
        infer_group(model, layout, group, options)
    assert counter.unweighted == 0
    assert torch.equal(counter.histogram, dense_histogram(layout))


def test_negative_controls_route_other_tokens(monkeypatch):
    """The prefix counted once per node, or suffix rows without their last token, break the equality."""
    model = tiny_model("llama", "sdpa", torch.float64)
    layout = make_layout(LAYOUT, seed=3, vocab=VOCAB)
    node_forward = executor.node_forward
    monkeypatch.setattr(executor, "node_forward", lambda *a, copies, **k: node_forward(*a, copies=min(copies, 1), **k))
    counter = RoutedTokens(model)
    _train_groups(model, layout, _options(counter))
    assert not torch.equal(counter.histogram, dense_histogram(layout))
    monkeypatch.setattr(executor, "node_forward", node_forward)
    monkeypatch.setattr(ScheduleOptions, "routes_last", property(lambda self: False))
    counter = RoutedTokens(model)
    _train_groups(model, layout, _options(counter))
    assert not torch.equal(counter.histogram, dense_histogram(layout))
