"""``prefix_reuse.tree`` through the engine against verl's stock fsdp2 engine (issue 25): groups whose prompts
share a system block (a trie of depth 2: system block -> each group's question -> its G suffixes), training in
fp64 and fp32, forward-only in fp64; every comparison asserts the tree ran (depth >= 2, fewer physical than logical
tokens, the system block computed once)."""

from __future__ import annotations

import pytest
import torch
from helpers.precision import promote_fp32_upcasts
from helpers.reuse import assert_infer_matches, assert_reuse_ran, reduced

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend.config import PrefixFSDPEngineConfig
from verl_prefix.backend.trainer.balance import balance_groups
from verl_prefix.backend.trainer.roots import shared_roots
from verl_prefix.backend.trees import plan_tree
from verl_prefix.harness import grpo_batches, verl_engine
from verl_prefix.schedule.grouping import RowLayout, plan_batch

VOCAB = 128
GRAD_TOL = {"float64": 1e-10, "float32": 1e-5}
SYSTEM = 24


def system_batch(seed: int = 3, prompt_lens: tuple[int, ...] = (5, 9, 4, 7)):
    """``len(prompt_lens)`` groups of G = 3 whose prompts are one 24-token system block, then 4-9 tokens of their
    own."""
    return grpo_batches.make_grpo_batch(
        num_groups=len(prompt_lens),
        group_size=3,
        prompt_lens=list(prompt_lens),
        response_len_range=(1, 6),
        vocab_size=VOCAB,
        seed=seed,
        use_kl=True,
        calculate_entropy=True,
        shared_system=SYSTEM,
    )


def tree_reuse(**overrides) -> PrefixReuseConfig:
    return PrefixReuseConfig(min_prefix_len=2, tree=True, min_shared_tokens=8, **overrides)


def assert_tree_ran(metrics, groups: int = 4) -> None:
    m = reduced(metrics)
    assert_reuse_ran(m, groups=groups)
    assert m["prefix/tree_depth"] >= 2 and m["prefix/tree_nodes"] == groups + 1, m
    assert m["prefix/tree_shared_tokens/level1"] == SYSTEM
    assert m["prefix/tree_saved_tokens"] == (groups - 1) * SYSTEM


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen3")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_tree_update_and_log_probs_match_stock_engine(model_dir, dtype):
    kwargs = dict(dtype=dtype, micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01)
    dense, d_loss, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs)
    prefix, p_loss, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **kwargs)
    prefix.reuse_config = tree_reuse()
    batch = system_batch()
    with promote_fp32_upcasts():
        want = verl_engine.run_train_step(dense, d_loss, batch, capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
    assert worst < GRAD_TOL[dtype]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert_tree_ran(got["metrics"])
    if dtype == "float64":  # forward-only once: it shares every line of phase A/B with training (CPU budget)
        with promote_fp32_upcasts():
            want_infer = verl_engine.run_infer(dense, system_batch())
            got_infer = verl_engine.run_infer(prefix, system_batch())
        assert_infer_matches(want_infer, got_infer, GRAD_TOL[dtype], groups=4)
        assert_tree_ran(got_infer["metrics"])


def test_tree_knob_refuses_what_it_does_not_serve():
    with pytest.raises(ValueError, match="min_shared_tokens"):
        PrefixReuseConfig(min_shared_tokens=0)
    # dormant policies apply per node (test_tree_dormant_engine): no longer refused
    config = PrefixFSDPEngineConfig(prefix_reuse=PrefixReuseConfig(tree=True), dormant_prefix="recompute")
    assert config.prefix_reuse.tree and config.dormant_prefix == "recompute"


def _two_rank_body(rank: int, model_dir: str, seeds: list[int]) -> dict:
    from helpers.precision import promote_fp32_upcasts

    from verl_prefix.harness import grpo_batches, verl_engine

    # lr 0: every step starts from the same weights, so the last steps compare with one stock step
    kwargs = dict(dtype="float64", lr=0.0, micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01)
    dense, d_loss, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs)
    prefix, p_loss, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **kwargs)
    prefix.reuse_config = tree_reuse()
    out = {}
    # the rows the balancer placed on this rank (one system prompt's two groups): the same trie shape on both
    # ranks (other tokens), so the tree runs; then rank 1's prompts share no system block: its trie (two roots)
    # differs in shape from rank 0's (one root, two children), so each pads to the union with lockstep fillers
    # (rank 0 a filler root, rank 1 two filler children) and both still run the tree, exact.
    same = system_batch(seed=seeds[rank], prompt_lens=(5, 9))
    differ = system_batch(seed=5, prompt_lens=(5, 9))
    if rank == 1:
        differ = grpo_batches.make_grpo_batch(
            num_groups=2,
            group_size=3,
            prompt_lens=[29, 33],
            response_len_range=(1, 6),
            vocab_size=VOCAB,
            seed=6,
            use_kl=True,
            calculate_entropy=True,
        )
    worst = lambda got, want: max(  # noqa: E731
        ((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items()
    )
    with promote_fp32_upcasts():
        want = verl_engine.run_train_step(dense, d_loss, same, capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, same, capture_grads=True)
        out["worst"], out["same"] = worst(got, want), got["reduced_metrics"]
        want = verl_engine.run_train_step(dense, d_loss, differ, capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, differ, capture_grads=True)
        out["worst_differ"], out["differ"] = worst(got, want), got["reduced_metrics"]
        # recompute per node (test_tree_dormant_engine) on tries of different shapes: a filler standing where the
        # peer's real node recomputes runs its forward again too and joins that node's agreed check
        prefix.dormant_prefix = "recompute"
        got = verl_engine.run_train_step(prefix, p_loss, differ, capture_grads=True)
        out["worst_recompute"], out["recompute"] = worst(got, want), got["reduced_metrics"]
        # auto, with estimates that differ between the ranks (``auto_budget``): on its own rank 0 keeps every node,
        # rank 1 recomputes both roots; the per-position agreement makes rank 0 recompute its root and the filler
        # root at rank 1's second root's position. Both ranks count their model passes (input embeddings).
        prefix.dormant_prefix, prefix.dormant_prefix_budget_bytes = "auto", auto_budget(prefix.module)
        passes = []
        hook = prefix.module.get_input_embeddings().register_forward_hook(lambda *_: passes.append(1))
        try:
            got = verl_engine.run_train_step(prefix, p_loss, differ, capture_grads=True)
        finally:
            hook.remove()
        out["worst_auto"], out["auto"], out["auto_passes"] = worst(got, want), got["reduced_metrics"], len(passes)
        # nodes that differ in kind at one position: rank 0's groups share a 10-token response stem (their nodes
        # run the LM head), rank 1's do not; rank 1's nodes there run it too, seeded with zeros, and both run
        # the tree (before, the mini-batch ran one-level reuse)
        prefix.dormant_prefix = "keep"
        kinds = grpo_batches.make_grpo_batch(
            num_groups=2,
            group_size=3,
            prompt_lens=[5, 9],
            response_len_range=(1, 6),
            vocab_size=VOCAB,
            seed=8,
            use_kl=True,
            calculate_entropy=True,
            shared_system=SYSTEM,
            response_stems=(10,) if rank == 0 else (),
        )
        want = verl_engine.run_train_step(dense, d_loss, kinds, capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, kinds, capture_grads=True)
        out["worst_kinds"], out["kinds"] = worst(got, want), got["reduced_metrics"]
    return out


def auto_budget(model) -> int:
    """A ``dormant_prefix_budget_bytes`` between the estimates of the two-rank test's nodes: rank 0's system block
    (24 tokens) and its questions (4 and 8 tokens, after it) fit; rank 1's roots (its two 28- and 32-token
    prompts, without their last token) do not."""
    from verl_prefix.schedule.dormant import estimate_prefix_graph

    fits = max(estimate_prefix_graph(model, SYSTEM).total, estimate_prefix_graph(model, 8, context=SYSTEM).total)
    over = estimate_prefix_graph(model, 28).total
    assert fits < over
    return (fits + over) // 2


def placed_family_seeds() -> list[int]:
    """Two system prompts (batches of seeds 3 and 4, two groups each), their groups interleaved as one
    global batch: the balancer with ``shared_roots`` puts each system prompt's groups on one rank (by length
    alone each rank would hold both). The seed of the family each rank received."""
    families = {seed: system_batch(seed=seed, prompt_lens=(5, 9)) for seed in (3, 4)}
    samples = []  # (family seed, prompt, response length, uid), groups interleaved A0 B0 A1 B1
    for g in range(2):
        for seed, batch in families.items():
            rows = range(3 * g, 3 * g + 3)
            prompts, responses = batch["prompts"].unbind(), batch["responses"].unbind()
            samples += [(seed, prompts[i], len(responses[i]), batch["uid"][i]) for i in rows]
    prompts, uids = [s[1] for s in samples], [s[3] for s in samples]
    args = ([len(p) for p in prompts], [s[2] for s in samples], uids)
    plan = balance_groups(*args, dp_size=2, roots=shared_roots(prompts, uids, tree_reuse().min_shared_tokens))
    placed = [{samples[i][0] for i in plan.order[r * 6 : (r + 1) * 6]} for r in range(2)]
    assert sorted(map(sorted, placed)) == [[3], [4]], placed
    plain = balance_groups(*args, dp_size=2)
    assert [{samples[i][0] for i in plain.order[r * 6 : (r + 1) * 6]} for r in range(2)] == [{3, 4}, {3, 4}]
    return [next(iter(p)) for p in placed]


def test_two_ranks_run_the_tree_in_lockstep_with_fillers_where_their_tries_differ(tiny_model):
    """Placement and lockstep: each rank gets one system prompt's groups (the balancer), computes that block
    once (``tree_shared_tokens/level1`` is one block, the trie one root) and matches the stock engine; then
    tries of different shapes run the tree on both ranks, padded with zero-loss fillers, and match too, under
    ``keep``, under ``dormant_prefix=recompute`` per node (fillers recomputing where the peer's nodes do) and
    under ``auto`` with a budget one rank's roots exceed and the other's nodes fit: the agreed positions, not
    each rank's own estimates, decide, so both run the same passes (counted); and tries whose nodes differ in
    kind at one position (one rank's run the LM head over a shared response stem), exact on both ranks."""
    from helpers.ranks import run_two_ranks

    results = run_two_ranks(_two_rank_body, str(tiny_model("qwen3")), placed_family_seeds())
    for rank in range(2):
        assert results[rank]["worst"] < 1e-10
        assert_tree_ran(results[rank]["same"], groups=2)
        assert results[rank]["same"]["prefix/tree_lockstep_fillers"] == 0.0
        assert results[rank]["worst_differ"] < 1e-10 and results[rank]["worst_recompute"] < 1e-10
        recompute = results[rank]["recompute"]
        assert recompute["prefix/policy/recompute"] == recompute["prefix/tree_nodes"] > 0, recompute  # real nodes
        assert recompute["prefix/tree_lockstep_fillers"] > 0 and recompute["prefix/max_recompute_kv_diff"] == 0.0
        metrics = results[rank]["differ"]
        assert metrics["prefix/tree_nodes"] > 0
        assert_reuse_ran(metrics)
    for rank, loss_nodes in ((0, 2), (1, 0)):
        kinds = results[rank]["kinds"]
        assert results[rank]["worst_kinds"] < 1e-10, rank
        assert_reuse_ran(kinds, groups=2)  # the stems are saved too on rank 0: no assert_tree_ran's token count
        assert kinds["prefix/tree_depth"] == 2 and kinds["prefix/tree_shared_tokens/level1"] == SYSTEM, kinds
        assert kinds["prefix/tree_loss_nodes"] == loss_nodes, kinds
    assert results[1]["kinds"]["prefix/tree_lockstep_fillers"] >= 2  # its two question nodes ran the LM head too
    # rank 0: one root with two children, plus a filler root of two filler children (rank 1's second root and
    # its micro-batches); rank 1: two roots, the first padded with rank 0's two children as fillers
    zero, one = results[0]["differ"], results[1]["differ"]
    assert zero["prefix/tree_nodes"] == 3 and zero["prefix/tree_depth"] == 2, zero
    assert one["prefix/tree_nodes"] == 2 and one["prefix/tree_depth"] == 1, one
    assert zero["prefix/tree_lockstep_fillers"] > 0 and one["prefix/tree_lockstep_fillers"] > 0
    # auto: rank 0's estimates all fit, rank 1's two roots do not; the agreed positions make rank 0 recompute its
    # root (a peer recomputes that position) and run its filler root's forward again, so both ran the same passes
    zero, one = results[0]["auto"], results[1]["auto"]
    assert results[0]["worst_auto"] < 1e-10 and results[1]["worst_auto"] < 1e-10
    assert zero["prefix/policy/recompute"] == 1 and zero["prefix/policy/keep"] == 2, zero
    assert zero["prefix/policy_reason/peer_recompute"] == 1 and "prefix/policy_reason/over_budget_cpu" not in zero
    assert one["prefix/policy/recompute"] == 2 and one["prefix/policy_reason/over_budget_cpu"] == 2, one
    assert "prefix/policy/keep" not in one and zero["prefix/max_recompute_kv_diff"] == 0.0, one
    assert results[0]["auto_passes"] == results[1]["auto_passes"] > 0
    for m in (zero, one):
        assert m["prefix/tree_nodes"] > 0 and m["prefix/tree_lockstep_fillers"] > 0, m
        assert_reuse_ran(m)


def test_no_model_or_batch_is_refused_by_the_planner():
    """No model is refused (Ulysses: ``test_tree_ulysses_engine.py``; sliding windows and recurrent layers:
    ``test_tree_families_engine.py``; images: ``test_tree_multimodal_engine.py``). A batch with visual inputs
    for a model without a vision encoder is an error, not a trie over placeholder tokens."""
    rows = [torch.arange(6), torch.arange(6)]
    layout = RowLayout(rows, [torch.arange(6)] * 2, [4, 4], [2, 2], ["a", "b"])
    plan = plan_batch(layout, max_rows=None, max_tokens=None, min_prefix_len=1, min_group_size=1)
    roots = plan_tree(layout, plan, 1, group=None)
    assert len(roots) == 1 and sorted(roots[0].rows_below()) == [0, 1]  # two uids, one row: one node
    visual = RowLayout(
        rows, [torch.arange(6)] * 2, [4, 4], [2, 2], ["a", "b"], visual=[{"pixel_values": rows[0]}, None]
    )
    with pytest.raises(ValueError, match="no vision encoder"):
        plan_tree(visual, plan, 1, group=None)
