"""Dormant-prefix policies per tree node (``prefix_reuse.tree`` with ``dormant_prefix``) through the engine,
against verl's stock fsdp2 engine, on one mini-batch that holds both shapes: two groups behind a shared system
block (depth 2) and tree rollouts with loss on shared stems (loss-carrying nodes, whose log-probs phase C
rebuilds under ``recompute``). fp64 (1e-10) here: ``recompute``, ``offload`` (the CPU stand-in store of
``helpers.offload``) and ``auto`` (a budget between the nodes' estimates); ``recompute`` in fp32 (1e-5) runs in
``test_tree_loss_engine`` (its batch: groups sharing earlier turns, stems with loss). Each asserts the tree ran
(depth >= 2, the system block once, loss-carrying nodes, fewer physical than logical tokens) and the policy ran
per node. Negative controls: phase C rebuilding a node without its ancestors' K/V is stopped by the recompute
check, and without the check the gradients are wrong. The memory statement, measured in bytes: what the path's
nodes hold for backward while phase B runs (``max_saved_for_backward_held_in_B_mib``), keep against recompute."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from helpers import offload as O
from helpers.engine_pairs import loss_with, worst_relative
from helpers.precision import promote_fp32_upcasts
from helpers.reuse import assert_reuse_ran, reduced
from helpers.tree_batches import rows_batch, tokens
from verl.utils import tensordict_utils as tu

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend.distributed import once as agreement
from verl_prefix.harness import verl_engine
from verl_prefix.schedule import dormant as D
from verl_prefix.schedule.tree import schedule as tree

VOCAB = 128
TOL = {"float64": 1e-10}
SYSTEM = 24
REUSE = PrefixReuseConfig(min_prefix_len=2, min_group_size=1, tree=True, min_shared_tokens=2)
STOCK: dict[int, dict] = {}  # the stock engine's step, per engine pair


def dormant_batch(seed: int = 0):
    """Groups ``s0`` and ``s1`` (G = 3): a 24-token system block, then a question of 5 or 9 tokens. Tree
    rollouts ``t``: a 10-token prompt; four responses share a 6-token stem (one node with the prompt), then two
    4-token stems; row 0 ends on its stem."""
    gen = torch.Generator().manual_seed(seed)
    rand = functools.partial(tokens, gen, vocab=VOCAB)
    system = rand(SYSTEM)
    rows = []
    for g, question in enumerate((5, 9)):
        prompt = torch.cat([system, rand(question)])
        rows += [(prompt, rand(n), f"s{g}") for n in (2, 4, 3)]
    prompt, stem, left, right = rand(10), rand(6), rand(4), rand(4)
    for half, tail in zip((left, left, right, right), (0, 2, 1, 3)):
        rows.append((prompt, torch.cat([stem, half, rand(tail)]), "t"))
    batch = rows_batch(rows, vocab=VOCAB, seed=seed)
    tu.assign_non_tensor(batch, micro_batch_size_per_gpu=2)
    return batch


def step(engine, actor_config) -> dict:
    with promote_fp32_upcasts():
        return verl_engine.run_train_step(engine, loss_with(actor_config), dormant_batch(), capture_grads=True)


def run_tree(pair: tuple, policy: str, budget: int | None = None, reuse: PrefixReuseConfig = REUSE) -> tuple:
    """The prefix engine of ``pair`` under ``policy``: (worst relative gradient error against the stock engine,
    reduced metrics), asserting the tree ran with both shapes."""
    dense, prefix, actor_config = pair
    if id(dense) not in STOCK:
        STOCK[id(dense)] = step(dense, actor_config)
    prefix.reuse_config = reuse
    prefix.dormant_prefix = D.validate_policy(policy, budget)
    prefix.dormant_prefix_budget_bytes = budget
    prefix.offload_store_factory = O.RecordingStore
    got = step(prefix, actor_config)
    m = reduced(got["metrics"])
    assert_reuse_ran(m, groups=3)
    assert m["prefix/tree_depth"] >= 2 and m["prefix/tree_shared_tokens/level1"] == SYSTEM, m
    assert m["prefix/tree_loss_nodes"] >= 3 and m["prefix/tree_shared_loss_tokens"] >= 6 + 4 + 4, m
    return worst_relative(got["grads"], STOCK[id(dense)]["grads"]), m


def ran_per_node(m: dict, policy: str) -> float:
    """Every node ran under ``policy`` (``prefix/policy/<name>`` counts nodes under the tree)."""
    nodes = m[f"prefix/policy/{policy}"]
    assert nodes == m["prefix/tree_nodes"] > 0, m
    assert not [k for k in m if k.startswith("prefix/policy/") and k != f"prefix/policy/{policy}"], m
    return nodes


def test_recompute_per_node_matches_stock_engine(engine_pairs):
    """Every node's phase A keeps no graph; phase C rebuilds it (loss-carrying nodes' log-probs and entropies
    too), gives back exactly phase A's K/V and values, and seeds it (fp32: ``test_tree_loss_engine``). The same
    batch under keep: the bytes a path holds for backward during phase B, measured; with chunked nodes (and
    merged_varlen), the bytes phase C rebuilds at once."""
    pair = engine_pairs("float64")
    worst, m = run_tree(pair, "recompute")
    assert worst < TOL["float64"], worst
    ran_per_node(m, "recompute")
    assert m["prefix/max_recompute_kv_diff"] == 0.0, m
    assert m["prefix/max_saved_for_backward_mib/A"] == 0.0  # no node's phase A kept a graph
    worst, kept = run_tree(pair, "keep")
    assert worst < TOL["float64"], worst
    held = {p: x[f"prefix/max_saved_for_backward_held_in_B_mib/{p}"] for p, x in (("keep", kept), ("recompute", m))}
    assert 0 < held["recompute"] < 0.6 * held["keep"], held
    # chunked nodes: each chunk a node with its own policy, so phase C rebuilds one chunk's graph at a time; and
    # phase_b_attention=merged_varlen (its CPU reference packing; torch's varlen kernels on CUDA, test_cuda):
    # every node's forward (rebuilt ones too) one packed row over its ancestors' K/V, every suffix micro-batch packed
    reuse = dataclasses.replace(REUSE, prefix_chunk_tokens=4, phase_b_attention="merged_varlen")
    worst, chunked = run_tree(pair, "recompute", reuse=reuse)
    assert worst < TOL["float64"], worst
    assert chunked["prefix/tree_node_chunks"] > 0 and chunked["prefix/max_recompute_kv_diff"] == 0.0, chunked
    assert chunked["prefix/policy/recompute"] > chunked["prefix/tree_nodes"] == m["prefix/tree_nodes"], chunked
    graph_c = "prefix/max_saved_for_backward_mib/C"
    assert 0 < chunked[graph_c] < 0.6 * m[graph_c], (chunked[graph_c], m[graph_c])
    assert chunked["prefix/phase_b_attention/merged_varlen"] > 0, chunked
    assert chunked["prefix/phase_b_attention/merged"] == chunked["prefix/phase_b_attention/concat"] == 0, chunked


def test_offload_and_auto_per_node(engine_pairs):
    """offload: a store per node, none moving a parameter or holding anything in phase B. auto: a budget the two
    roots' estimates exceed and every other node's fits: the roots recompute, the rest keep."""
    pair = engine_pairs("float64")
    O.RecordingStore.instances.clear()
    worst, m = run_tree(pair, "offload")
    assert worst < TOL["float64"], worst
    assert len(O.RecordingStore.instances) == ran_per_node(m, "offload")
    assert m["prefix/offloaded_mib"] >= m["prefix/offload_restored_mib"] > 0
    for store in O.RecordingStore.instances:
        found = O.claims(store, pair[1].module)
        assert found["parameter_bytes_moved"] == found["storages_moved_twice"] == found["resident_in_b"] == 0

    # the two roots (the system block; the rollouts' prompt and stem, 15 tokens, 6 of them through the LM head)
    # estimate above every other node (questions of 4 and 8 tokens, branches of 4 through the LM head)
    model = pair[1].module
    estimate = lambda n, logits=0: D.estimate_prefix_graph(model, n, logit_positions=logits).total  # noqa: E731
    big, small = min(estimate(SYSTEM), estimate(15, 6)), max(estimate(8), estimate(4, 4))
    assert small < big
    worst, m = run_tree(pair, "auto", budget=(small + big) // 2)
    assert worst < TOL["float64"], worst
    assert m["prefix/policy/recompute"] == 2.0 and m["prefix/policy/keep"] == m["prefix/tree_nodes"] - 2 == 4, m
    assert m["prefix/policy_reason/over_budget_cpu"] == 2.0


def test_negative_controls_rebuild_without_ancestors(engine_pairs, monkeypatch):
    """Phase C rebuilds each node as if it were a root (no ancestors' K/V): the recompute check stops the step
    before any backward; with the check skipped the gradients are wrong."""
    pair = engine_pairs("float64")
    real = tree.node_phase_c

    def without_ancestors(dormant, kv, values, rerun, values_of):
        def rebuild():
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(tree, "join_path", lambda path: None)
                return rerun()

        return real(dormant, kv, values, rebuild, values_of)

    monkeypatch.setattr(tree, "node_phase_c", without_ancestors)
    with pytest.raises(agreement.RecomputeMismatch, match="recomputed prefix K/V differ"):
        run_tree(pair, "recompute")
    monkeypatch.setattr(agreement.AgreedDormant, "settle_recompute", lambda self, mismatch: None)
    worst, _ = run_tree(pair, "recompute")
    assert worst > 1e-3, worst
