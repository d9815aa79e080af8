"""Loss on shared tokens through the engine against verl's stock fsdp2 engine (issue 25, cases b and c): one
mini-batch holds tree rollouts (four responses sharing a stem, branching inside it at two depths; one response
ends on its stem) and per-turn samples (each sample the next one's prefix). Training with KL and entropy on,
each ``loss_agg_mode`` in fp64 (1e-10) and in fp32 (1e-5; the loss mode is a per-call argument of ``ppo_loss``, so
one engine pair per dtype serves them all); forward-only log-probs and entropies. Every comparison
asserts the tree ran with loss-carrying nodes (depth >= 2, shared loss tokens, fewer physical than logical
tokens). The negative control, a shared loss token counted once instead of once per row, must fail. Nodes
run as chains of chunks (``prefix_chunk_tokens``) in fp64, with a control; and the MoE router aux loss (under
``keep`` and ``dormant_prefix=recompute``); recompute per node in fp32 too."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from helpers.precision import promote_fp32_upcasts
from helpers.reuse import assert_infer_matches, assert_reuse_ran, reduced
from helpers.tree_batches import rows_batch, shared_loss_batch, tokens
from verl.workers.utils.losses import ppo_loss

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend import trees
from verl_prefix.harness import verl_engine
from verl_prefix.schedule import executor
from verl_prefix.schedule.tree import loss as tree_loss

VOCAB = 128
TOL = {"float64": 1e-10, "float32": 1e-5}
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
GROUPS = 4  # uid t (the tree rollouts) and c0..c2 (the turns)


def assert_shared_loss_ran(metrics) -> None:
    m = reduced(metrics)
    assert_reuse_ran(m, groups=GROUPS)
    assert m["prefix/tree_depth"] >= 2 and m["prefix/tree_loss_nodes"] >= 4, m
    # the stems (6 + 4 + 4, the first stem from its branch position on) and the earlier turns' responses
    assert m["prefix/tree_shared_loss_tokens"] >= 6 + 4 + 4 + 5 + 4, m
    assert m["prefix/tree_saved_tokens"] > 0


def loss_for(actor_config, mode: str):
    """verl's ``ppo_loss`` under ``mode``. ``seq-mean-token-sum-norm`` divides by each micro-batch's padded
    width unless ``loss_scale_factor`` is set (the stock engine's own result then changes with its split), so it
    runs with verl's documented constant, as ``test_engine_exactness`` does."""
    config = copy.copy(actor_config)
    object.__setattr__(config, "loss_agg_mode", mode)
    if mode.endswith("-norm"):
        object.__setattr__(config, "loss_scale_factor", 16)
    object.__setattr__(config, "global_batch_info", {})
    return functools.partial(ppo_loss, config=config)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen3")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_shared_loss_tokens_match_stock_engine_for_every_loss_agg_mode(model_dir, dtype, monkeypatch):
    # lr 0: every step sees the same weights, so one engine pair serves every mode and the control
    kwargs = dict(dtype=dtype, micro_batch_size_per_gpu=4, use_kl_loss=True, entropy_coeff=0.01, lr=0.0)
    dense, _, actor_config = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs)
    prefix, _, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **kwargs)
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2, min_group_size=1, tree=True, min_shared_tokens=2)
    batch = shared_loss_batch()
    with promote_fp32_upcasts():
        for mode in MODES:
            loss = loss_for(actor_config, mode)
            want = verl_engine.run_train_step(dense, loss, batch, capture_grads=True)
            got = verl_engine.run_train_step(prefix, loss, batch, capture_grads=True)
            worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
            assert worst < TOL[dtype], (mode, worst)
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), mode
            assert_shared_loss_ran(got["metrics"])
        if dtype == "float32":  # recompute per node, loss-carrying nodes rebuilt (fp64: test_tree_dormant_engine)
            prefix.dormant_prefix = "recompute"
            got = verl_engine.run_train_step(prefix, loss, batch, capture_grads=True)
            prefix.dormant_prefix = "keep"
            worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
            assert worst < TOL[dtype], worst
            assert_shared_loss_ran(got["metrics"])
            m = reduced(got["metrics"])
            assert m["prefix/policy/recompute"] == m["prefix/tree_nodes"] > 0 and m["prefix/tree_depth"] >= 2, m
            assert m["prefix/max_saved_for_backward_mib/A"] == 0.0  # no node's phase A kept a graph
        if dtype == "float64":  # forward-only, chunked nodes and the controls once (CPU budget)
            want_infer, got_infer = verl_engine.run_infer(dense, batch), verl_engine.run_infer(prefix, batch)
            assert_infer_matches(want_infer, got_infer, TOL[dtype], groups=GROUPS)
            assert_shared_loss_ran(got_infer["metrics"])
            assert_chunked_nodes_match(prefix, loss, batch, want["grads"])
            control = counted_once(monkeypatch)
            got = verl_engine.run_train_step(prefix, loss, batch, capture_grads=True)
            assert len(control) >= 4, "the control must have withheld some shared values"
            worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
            assert worst > 1e-3, worst


def stem_pairs_batch(seed: int = 1):
    """Tree rollouts alone: four responses share a 6-token stem, then a 4-token stem (rows 0-1) or a 3-token one
    (rows 2-3); rows 0 and 3 end on their stems. Longest first (1, 0, 2, 3), so with two rows per micro-batch the
    tree's micro-batches (a group's planned ones, longest first, split by the node each row hangs on) hold the
    dense engine's consecutive pairs, the partition the router aux loss depends on."""
    gen = torch.Generator().manual_seed(seed)
    rand = functools.partial(tokens, gen, vocab=VOCAB)
    prompt, stem, left, right = rand(10), rand(6), rand(4), rand(3)
    tails = [rand(0), rand(1), rand(1), rand(0)]
    rows = [(prompt, torch.cat([stem, half, tail]), "t") for half, tail in zip([left, left, right, right], tails)]
    return rows_batch(rows, vocab=VOCAB, seed=seed)


def test_shared_loss_tokens_with_the_moe_aux_loss_match_the_dense_path(tiny_model, monkeypatch):
    """Loss on shared tokens with the MoE router aux loss on, fp64, against the engine's dense path (verl's stock
    engine adds no router loss) on the same micro-batch partition: pairs of rows under one stem node, one row of
    each pair ending on its stem. Each node's router statistics count once per row below it; every row's last
    token runs through the routers in its own tail (``own_last``). The control, a node's statistics counted once
    per micro-batch instead of once per row, must fail; a trie with rows ending on a node is refused."""
    model_dir = tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, experts_implementation="eager")
    engines = {}
    for name, reuse in (
        ("dense", PrefixReuseConfig(enable=False)),
        ("tree", PrefixReuseConfig(min_prefix_len=2, min_group_size=1, tree=True, min_shared_tokens=2)),
    ):
        engine, loss_fn, _ = verl_engine.build_verl_engine(
            model_dir,
            backend="prefix_fsdp2",
            dtype="float64",
            micro_batch_size_per_gpu=2,
            use_kl_loss=True,
            entropy_coeff=0.01,
            lr=0.0,
        )
        engine.reuse_config, engine.moe_aux_loss_coef = reuse, 0.5
        engines[name] = (engine, loss_fn)

    dense_runs: list[dict] = []  # lr 0: the dense path's step is the same every time, run once

    def compare() -> tuple[dict, float, float]:
        with promote_fp32_upcasts():
            if not dense_runs:
                dense_runs.append(verl_engine.run_train_step(*engines["dense"], stem_pairs_batch(), capture_grads=True))
            got = verl_engine.run_train_step(*engines["tree"], stem_pairs_batch(), capture_grads=True)
        want = dense_runs[0]
        worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
        return got, worst, want["reduced_metrics"]["moe_aux_loss"]

    got, worst, aux = compare()
    assert worst < 1e-10, worst
    m = got["reduced_metrics"]
    assert m["moe_aux_loss"] == pytest.approx(aux, rel=1e-10) and aux > 0
    assert_reuse_ran(m, groups=1)
    assert m["prefix/tree_depth"] >= 2 and m["prefix/tree_loss_nodes"] >= 2, m
    assert m["prefix/tree_shared_loss_tokens"] >= 6 and m["prefix/tree_saved_tokens"] > 0, m
    gates = [n for n in got["grads"] if n.endswith("mlp.gate.weight")]
    assert gates and all(got["grads"][n].norm() > 0 for n in gates)
    # recompute per node (test_tree_dormant_engine): each node's router sums rebuilt in phase C, counts checked
    engines["tree"][0].dormant_prefix = "recompute"
    got, worst, _ = compare()
    assert worst < 1e-10, worst
    m = got["reduced_metrics"]
    assert m["prefix/policy/recompute"] == m["prefix/tree_nodes"] > 0 and m["prefix/max_recompute_kv_diff"] == 0, m
    engines["tree"][0].dormant_prefix = "keep"
    with pytest.MonkeyPatch.context() as mp:
        real = executor.path_stats
        mp.setattr(executor, "path_stats", lambda path, suffix, copies: real(path, suffix, 1))
        assert compare()[1] > 1e-6
    # without own_last rows 0 and 3 would end on their stems, their last tokens unrouted: refused, never run
    build = trees.build_trie
    monkeypatch.setattr(trees, "build_trie", lambda *a, **k: build(*a, **{**k, "own_last": False}))
    with pytest.raises(RuntimeError, match="no tail to route their last token"):
        compare()


def assert_chunked_nodes_match(prefix, loss, batch, want: dict) -> None:
    """``prefix_chunk_tokens=3``: every node longer than 3 tokens (prompt nodes and loss-carrying stems) runs as
    a chain of chunks, each attending to the earlier chunks' K/V; the same gradients. The control, each later
    chunk positioned as if it started the sequence, must fail."""
    build = trees.build_trie

    def misplaced(*args, **kwargs):
        roots = build(*args, **kwargs)
        for root in roots:
            for node, _ in root.walk():
                node.positions = node.positions - node.start if node.continues else node.positions
        return roots

    def worst() -> tuple[float, dict]:
        got = verl_engine.run_train_step(prefix, loss, batch, capture_grads=True)
        return max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want.items()), got["metrics"]

    whole = prefix.reuse_config
    prefix.reuse_config = dataclasses.replace(whole, prefix_chunk_tokens=3)
    chunked, metrics = worst()
    assert chunked < TOL["float64"], chunked
    assert_shared_loss_ran(metrics)
    assert reduced(metrics)["prefix/tree_node_chunks"] >= 8
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trees, "build_trie", misplaced)
        assert worst()[0] > 1e-3
    prefix.reuse_config = whole


def counted_once(monkeypatch) -> dict:
    """The negative control: each node's log-probs and entropies reach the gradient through the first row that
    takes them only (the same values for the others, without a gradient path)."""
    seen: dict[int, object] = {}  # holding the values: ids of freed ones would be reused
    real = tree_loss.node_slice

    def once(values, first, temperature=1.0):
        log_probs, entropy = real(values, first, temperature)
        if id(values) not in seen:
            seen[id(values)] = values
            return log_probs, entropy
        return log_probs.detach() + 0 * log_probs, entropy.detach() + 0 * entropy if entropy is not None else None

    monkeypatch.setattr(tree_loss, "node_slice", once)
    return seen


def test_rows_of_different_temperatures_under_one_node_run_the_tree():
    """A node whose rows were sampled at different temperatures runs the tree: its values are kept per
    temperature (the exactness against plain HF: ``tests/schedule/test_tree_loss.py``)."""

    from verl_prefix.backend.trees import plan_tree
    from verl_prefix.schedule.grouping import RowLayout, plan_batch

    rows = [torch.tensor([1, 2, 3, 4, 9, 9, 9, 5]), torch.tensor([1, 2, 3, 4, 9, 9, 9, 6])]
    for temperature in (torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.7])):
        layout = RowLayout(rows, [torch.arange(8)] * 2, [4, 4], [4, 4], ["a", "a"], temperature=temperature)
        plan = plan_batch(layout, max_rows=None, max_tokens=None, min_prefix_len=1, min_group_size=1)
        (root,) = plan_tree(layout, plan, 2, group=None)
        assert root.logits_from is not None  # the shared stem 9 9 9 carries loss for both rows
        assert tree_loss.node_temperatures(root, layout) == tuple(sorted({float(t) for t in temperature}))
