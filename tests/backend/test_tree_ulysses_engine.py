"""``prefix_reuse.tree`` under Ulysses sequence parallelism (issue 25, "composes with Ulysses"), two gloo ranks.

As in ``test_ulysses_engine``: verl's stock Ulysses path wraps flash attention only, so on CPU the reference is
verl's stock ``fsdp2`` engine without sequence parallelism on the same global batch, each of its two
data-parallel ranks holding half the rows, while the SP=2 group holds the whole mini-batch on both ranks. Two
batches, fp64 (1e-10) and fp32 (1e-5): groups sharing a system block (a trie of depth 2 whose nodes have odd
lengths, so the SP slices are padded) and tree rollouts plus per-turn samples with loss on the shared stems
(forward-only too, nodes as chains of chunks, and ``dormant_prefix=recompute`` per node, in fp64). Every comparison
asserts the tree ran with its telemetry as without SP (nodes, depth, shared and saved tokens, fewer physical than
logical tokens) and no ``tree_fallback`` reason. The negative control (rank 1's slice of every node positioned as
rank 0's: a shard that forgot its offset) fails. On four ranks (DP = 2 x SP = 2) the two SP groups' tries differ
in shape and run padded with lockstep fillers, against the stock engine at DP = 4 in fp64."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.ranks import run_ranks
from test_tree_engine import SYSTEM, VOCAB, assert_tree_ran, system_batch, tree_reuse
from test_tree_loss_engine import assert_shared_loss_ran, shared_loss_batch

from verl_prefix import PrefixReuseConfig

TOL = {"float64": 1e-10, "float32": 1e-5}
SHARED_LOSS_REUSE = PrefixReuseConfig(min_prefix_len=2, min_group_size=1, tree=True, min_shared_tokens=2)


def _worst(got: dict, want: dict) -> float:
    return max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())


def _infer_gap(got: dict, want: dict, offset: int) -> float:
    """The largest gap of this reference rank's rows (at ``offset`` in the SP group's batch), relative to the
    largest |value| (at least 1)."""
    gap = 0.0
    for key in ("response_log_probs", "response_entropy"):
        mine = list(got[key].unbind())[offset : offset + len(want[key])]
        for a, b in zip(mine, want[key].unbind(), strict=True):
            gap = max(gap, ((a - b).abs().max() / b.abs().max().clamp(min=1)).item())
    return gap


def _misplaced_shards(prefix_forward, shifted: list[int]):
    """``tree.prefix_forward`` whose node positions are rolled by half a node on SP rank 1: its slice (the second
    half) then runs at the first half's positions, as a shard that forgot its offset would."""
    import torch.distributed as dist

    def forward(model, ids, positions, options, earlier=None):
        if dist.get_rank() == 1 and positions.shape[-1] > 1:
            shifted.append(positions.shape[-1])
            positions = positions.roll(options.ulysses.padded(positions.shape[-1]) // 2, dims=-1)
        return prefix_forward(model, ids, positions, options, earlier)

    return forward


def _body(rank: int, model_dir: str) -> dict:
    from helpers.precision import promote_fp32_upcasts
    from verl.utils import tensordict_utils as tu

    from verl_prefix.harness import verl_engine
    from verl_prefix.schedule.tree import schedule as tree

    out: dict = {}
    for dtype in ("float64", "float32"):
        kwargs = dict(dtype=dtype, micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01)
        kwargs.update(use_remove_padding=True, lr=0.0)  # lr 0: the control sees the same weights
        ref, ref_loss, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs)
        sp = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
        got_engine, got_loss, _ = verl_engine.build_verl_engine(
            model_dir, backend="prefix_fsdp2", overrides=sp, **kwargs
        )
        assert got_engine.use_ulysses_sp and got_engine.get_data_parallel_size() == 1
        for name, batch, reuse in (
            ("system", system_batch(), tree_reuse()),
            ("shared_loss", shared_loss_batch(), SHARED_LOSS_REUSE),
        ):
            half = len(batch) // 2
            part = tu.index_select_tensor_dict(batch, list(range(rank * half, (rank + 1) * half)))
            got_engine.reuse_config = reuse
            with promote_fp32_upcasts():
                want = verl_engine.run_train_step(ref, ref_loss, part, capture_grads=True)
                got = verl_engine.run_train_step(got_engine, got_loss, batch, capture_grads=True)
                key = f"{name}/{dtype}"
                out[key] = {"worst": _worst(got, want), "metrics": got["reduced_metrics"]}
                if dtype == "float64":  # forward-only once: it shares every line of phase A/B with training
                    got_infer, want_infer = verl_engine.run_infer(got_engine, batch), verl_engine.run_infer(ref, part)
                    out[key]["infer"] = _infer_gap(got_infer, want_infer, rank * half)
                    out[key]["infer_metrics"] = verl_engine.reduce_step_metrics(got_infer["metrics"])
                if dtype == "float64" and name == "shared_loss":  # nodes as chains of chunks of 3, sliced too
                    got_engine.reuse_config = dataclasses.replace(reuse, prefix_chunk_tokens=3)
                    chunked = verl_engine.run_train_step(got_engine, got_loss, batch, capture_grads=True)
                    out["chunked"] = {"worst": _worst(chunked, want), "metrics": chunked["reduced_metrics"]}
                    # dormant_prefix=recompute per node (test_tree_dormant_engine): each rebuilt slice checked
                    got_engine.reuse_config, got_engine.dormant_prefix = reuse, "recompute"
                    rebuilt = verl_engine.run_train_step(got_engine, got_loss, batch, capture_grads=True)
                    got_engine.dormant_prefix = "keep"
                    out["recompute"] = {"worst": _worst(rebuilt, want), "metrics": rebuilt["reduced_metrics"]}
                if dtype == "float64" and name == "system":  # the control once (CPU budget)
                    shifted: list[int] = []
                    original = tree.prefix_forward
                    tree.prefix_forward = _misplaced_shards(original, shifted)
                    try:
                        control = verl_engine.run_train_step(got_engine, got_loss, batch, capture_grads=True)
                    finally:
                        tree.prefix_forward = original
                    out["control"] = {"worst": _worst(control, want), "shifted": len(shifted)}
    return out


def assert_no_tree_fallback(metrics: dict) -> None:
    assert metrics["prefix/sp/size"] == 2 and metrics["prefix/sp/all_to_all_mib"] > 0
    reasons = [k for k in metrics if k.startswith(("prefix/tree_fallback_", "prefix/fallback_")) and metrics[k]]
    assert not reasons and "prefix/tree_fallback_ulysses" not in metrics, reasons


def test_tree_under_ulysses_matches_stock_engine(tiny_model):
    results = run_ranks(_body, str(tiny_model("qwen3")), world=2, timeout=540)
    for rank in range(2):
        r = results[rank]
        for dtype in ("float64", "float32"):
            system, shared = r[f"system/{dtype}"], r[f"shared_loss/{dtype}"]
            assert system["worst"] < TOL[dtype] and shared["worst"] < TOL[dtype], (rank, dtype, system, shared)
            assert_tree_ran(system["metrics"])
            assert_shared_loss_ran(shared["metrics"])
            for entry in (system, shared):
                assert_no_tree_fallback(entry["metrics"])
        assert_tree_ran(r["system/float64"]["infer_metrics"])
        assert_shared_loss_ran(r["shared_loss/float64"]["infer_metrics"])
        for name in ("system", "shared_loss"):
            entry = r[f"{name}/float64"]
            assert entry["infer"] < TOL["float64"], (rank, name, entry["infer"])
            assert_no_tree_fallback(entry["infer_metrics"])
        chunked = r["chunked"]
        assert chunked["worst"] < TOL["float64"], (rank, chunked["worst"])
        assert_shared_loss_ran(chunked["metrics"])
        assert_no_tree_fallback(chunked["metrics"])
        assert chunked["metrics"]["prefix/tree_node_chunks"] >= 8
        rebuilt = r["recompute"]
        assert rebuilt["worst"] < TOL["float64"], (rank, rebuilt["worst"])
        assert_shared_loss_ran(rebuilt["metrics"])
        assert_no_tree_fallback(rebuilt["metrics"])
        m = rebuilt["metrics"]
        assert m["prefix/policy/recompute"] == m["prefix/tree_nodes"] > 0 and m["prefix/max_recompute_kv_diff"] == 0
        # the control: rank 1 shifted every node's slice, and both ranks' gradients are off
        assert results[1]["control"]["shifted"] >= 5, results[1]["control"]
        assert r["control"]["worst"] > 1e-3, (rank, r["control"])


def mesh_batch(dp_rank: int):
    """One SP group's mini-batch on the data-parallel x Ulysses mesh: two groups of G = 3 behind a system block
    (a root with two children, two micro-batches each) on DP rank 0, three groups of G = 2 behind another (a root
    with three children, one micro-batch each) on DP rank 1. Six rows each, so the reference's four ranks hold
    three rows each; the tries differ in shape, so each SP group pads to their union with lockstep fillers."""
    from verl_prefix.harness import grpo_batches

    if dp_rank == 0:
        return system_batch(seed=3, prompt_lens=(5, 9))
    return grpo_batches.make_grpo_batch(
        num_groups=3,
        group_size=2,
        prompt_lens=[4, 7, 6],
        response_len_range=(1, 6),
        vocab_size=VOCAB,
        seed=4,
        use_kl=True,
        calculate_entropy=True,
        shared_system=SYSTEM,
    )


def _mesh_body(rank: int, model_dir: str) -> dict:
    """DP = 2 x SP = 2 against the stock engine without SP at DP = 4 (each of its ranks half an SP group's rows)."""
    from helpers.precision import promote_fp32_upcasts
    from verl.utils import tensordict_utils as tu

    from verl_prefix.harness import verl_engine

    kwargs = dict(dtype="float64", use_kl_loss=True, entropy_coeff=0.01, use_remove_padding=True)
    # the reference's three rows in micro-batches of one (token-mean: the split does not change its gradient)
    ref, ref_loss, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", micro_batch_size_per_gpu=1, **kwargs)
    sp = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
    got_engine, got_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="prefix_fsdp2", overrides=sp, micro_batch_size_per_gpu=2, **kwargs
    )
    assert got_engine.use_ulysses_sp and got_engine.get_data_parallel_size() == 2
    got_engine.reuse_config = tree_reuse()
    batch = mesh_batch(rank // 2)
    half = len(batch) // 2
    part = tu.index_select_tensor_dict(batch, list(range((rank % 2) * half, (rank % 2 + 1) * half)))
    with promote_fp32_upcasts():
        want = verl_engine.run_train_step(ref, ref_loss, part, capture_grads=True)
        got = verl_engine.run_train_step(got_engine, got_loss, batch, capture_grads=True)
    return {"worst": _worst(got, want), "metrics": got["reduced_metrics"]}


def test_tree_on_a_data_parallel_by_ulysses_mesh_matches_stock_engine(tiny_model):
    """Four gloo ranks, DP = 2 x SP = 2, the two SP groups holding tries of different shapes: every rank agrees
    on the union (the agreement spans the whole mesh), each SP group runs its padded trie sliced over its two
    ranks, fillers included; fp64 within 1e-10 of the stock engine without SP at DP = 4."""
    results = run_ranks(_mesh_body, str(tiny_model("qwen3")), world=4, timeout=300)
    for rank in range(4):
        r = results[rank]
        assert r["worst"] < TOL["float64"], (rank, r["worst"])
        m = r["metrics"]
        assert_tree_ran(m, groups=(2, 3)[rank // 2])
        assert_no_tree_fallback(m)
        # DP rank 0 a filler child (the peer's third question) with its micro-batch; DP rank 1 a filler
        # micro-batch under each of its first two questions (the peer's groups run two each)
        assert m["prefix/tree_lockstep_fillers"] == (2, 2)[rank // 2], (rank, m["prefix/tree_lockstep_fillers"])


pytestmark = pytest.mark.timeout(900)
