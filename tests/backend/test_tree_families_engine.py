"""``prefix_reuse.tree`` on the families one-level reuse serves beyond plain attention (issue 25, "composes with
the coverage matrix's families"): a Qwen3.5-style hybrid whose gated delta-net layers carry a state across every
node boundary, and a Gemma-3-style model whose sliding windows are shorter than the shared system block. Against
verl's stock fsdp2 engine on two groups sharing a 24-token system block (a trie of depth 2); each comparison asserts
the tree ran; a Nemotron-H Mamba-2 hybrid takes the same path. The negative control continues a node from its
root's state instead of its parent's."""

from __future__ import annotations

import pytest
import torch
from helpers import offload as O
from helpers.precision import fp64_throughout, promote_fp32_upcasts
from helpers.reuse import assert_infer_matches, reduced
from test_engine_exactness import GRAD_TOL, engines
from test_mamba_engine import NEMOTRON
from test_recurrent_engine import fp64_engines
from test_tree_engine import assert_tree_ran, system_batch, tree_reuse
from transformers import AutoModelForCausalLM

from verl_prefix.harness import model_zoo, tiny_models, verl_engine
from verl_prefix.schedule import executor
from verl_prefix.schedule.attention import merged as merged_attention
from verl_prefix.schedule.dormant import default_store
from verl_prefix.schedule.tree import schedule as tree

HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention"]
QUESTIONS = (5, 9)  # two groups of G = 3 under the system block: depth 2, the CPU budget
WINDOWED_LAYERS = ["sliding_attention", "full_attention"]  # a 16-token window: shorter than the system block


@pytest.fixture(scope="module")
def hybrid_engines(tmp_path_factory):
    model_dir = tiny_models.write_tiny_model(
        tmp_path_factory.mktemp("tree_qwen3_5_text"),
        "qwen3_5_text",
        num_layers=3,
        hidden_size=32,
        extra_config={"layer_types": HYBRID_LAYERS},
    )
    (dense, d_loss, _), (prefix, p_loss, _) = engines(
        model_dir, dtype="float64", lr=0.0, micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01
    )  # lr 0: each test starts from the same weights
    prefix.reuse_config = tree_reuse()
    return dense, d_loss, prefix, p_loss


def tree_step(dense, d_loss, prefix, p_loss, precision) -> tuple[float, dict]:
    """One update of the two-group system batch through both engines under ``precision`` (a context): the worst
    relative gradient difference and the prefix engine's result."""
    batch = system_batch(prompt_lens=QUESTIONS)
    with precision:
        want = verl_engine.run_train_step(dense, d_loss, batch, capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
    return worst, got


def hybrid_grads(hybrid_engines) -> tuple[float, dict]:
    dense, _, prefix, _ = hybrid_engines
    return tree_step(*hybrid_engines, fp64_engines(dense, prefix))


def test_hybrid_tree_carries_the_recurrent_state_across_nodes(hybrid_engines):
    """Update and forward-only log-probs within 1e-10 of the stock engine in fp64; the tree ran (the system block
    once, its delta-net state handed to each group's question node, whose end state starts the suffixes); then
    the update with ``dormant_prefix=recompute`` per node (states rebuilt in phase C and checked)."""
    worst, got = hybrid_grads(hybrid_engines)
    assert worst < 1e-10
    assert_tree_ran(got["metrics"], groups=2)
    dense, _, prefix, _ = hybrid_engines
    with fp64_engines(dense, prefix):
        want_infer = verl_engine.run_infer(dense, system_batch(prompt_lens=QUESTIONS), calculate_entropy=True)
        got_infer = verl_engine.run_infer(prefix, system_batch(prompt_lens=QUESTIONS), calculate_entropy=True)
    assert_infer_matches(want_infer, got_infer, 1e-10, groups=2)
    assert_tree_ran(got_infer["metrics"], groups=2)
    prefix.dormant_prefix = "recompute"  # each node rebuilt in phase C from its parent's state leaf, and checked
    try:
        worst, got = hybrid_grads(hybrid_engines)
        recomputed = reduced(got["metrics"])
        assert worst < 1e-10
        # offload per node (the CPU stand-in store): each node's phase A, its delta-net layers' saved tensors
        # included, waits in a store of its own and is restored layer by layer in its phase C
        prefix.dormant_prefix, prefix.offload_store_factory = "offload", O.RecordingStore
        O.RecordingStore.instances.clear()
        worst, got = hybrid_grads(hybrid_engines)
    finally:
        prefix.dormant_prefix, prefix.offload_store_factory = "keep", default_store
    assert_tree_ran(recomputed, groups=2)
    assert recomputed["prefix/policy/recompute"] == 3.0  # the system block and both questions
    assert recomputed["prefix/max_recompute_kv_diff"] == 0.0, recomputed
    assert worst < 1e-10, worst
    assert_tree_ran(got["metrics"], groups=2)
    m = reduced(got["metrics"])
    assert m["prefix/policy/offload"] == 3.0 == len(O.RecordingStore.instances), m
    assert m["prefix/offloaded_mib"] >= m["prefix/offload_restored_mib"] > 0, m
    for store in O.RecordingStore.instances:  # no parameter moved, nothing resident while phase B ran
        found = O.claims(store, prefix.module)
        assert found["parameter_bytes_moved"] == found["storages_moved_twice"] == found["resident_in_b"] == 0


def test_negative_control_a_node_continuing_from_its_roots_state_fails(hybrid_engines, monkeypatch):
    joined = tree.join_path

    def from_root(path):
        out = joined(path)
        if out is not None:
            out.recurrent = list(path[0].recurrent)  # skips every node between the root and the last one
        return out

    for module in (tree, executor):  # the nodes' forwards and the suffix micro-batches (executor.suffix_step)
        monkeypatch.setattr(module, "join_path", from_root)
    worst, got = hybrid_grads(hybrid_engines)
    assert_tree_ran(got["metrics"], groups=2)
    assert worst > 1e-3


def cut_one_more(cut_prefix):
    """``windows.cut_prefix`` that drops one more position: every query's earliest visible prefix key (the
    first row position's ``W - 1``-th) is lost, a window one token short on the path's K/V."""

    def cut(prefix: torch.Tensor, window: int) -> torch.Tensor:
        return cut_prefix(prefix, window)[..., 1:, :]

    return cut


def windowed_layers(metrics: dict) -> float:
    """Phase-B layer calls a window cut into (``prefix/phase_b_layers/<path>_window``)."""
    return sum(v for k, v in metrics.items() if k.startswith("prefix/phase_b_layers/") and k.endswith("_window"))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_windowed_tree_matches_stock_engine(tmp_path_factory, dtype, monkeypatch):
    """fp64 also runs the negative control on the same engines: the path's K/V cut one position short of the
    window (in phase A's node forwards and phase B's suffixes alike) gives wrong gradients, the tree running."""
    model_dir = tiny_models.write_tiny_model(
        tmp_path_factory.mktemp("tree_gemma3_text"),
        "gemma3_text",
        hidden_size=32,
        extra_config={"layer_types": WINDOWED_LAYERS},
    )
    (dense, d_loss, _), (prefix, p_loss, _) = engines(
        model_dir, dtype=dtype, lr=0.0, micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01
    )  # lr 0: the control starts from the same weights
    prefix.reuse_config = tree_reuse()
    worst, got = tree_step(dense, d_loss, prefix, p_loss, promote_fp32_upcasts())
    assert worst < GRAD_TOL[dtype]
    assert_tree_ran(got["metrics"], groups=2)
    metrics = reduced(got["metrics"])
    assert windowed_layers(metrics) > 0, metrics  # the window cut into the path's K/V in phase B
    if dtype == "float64":
        monkeypatch.setattr(merged_attention, "cut_prefix", cut_one_more(merged_attention.cut_prefix))
        worst, got = tree_step(dense, d_loss, prefix, p_loss, promote_fp32_upcasts())
        assert_tree_ran(got["metrics"], groups=2)
        assert windowed_layers(reduced(got["metrics"])) == windowed_layers(metrics)
        assert worst > 1e-4, worst


def test_mamba2_hybrid_tree_matches_stock_engine(tmp_path_factory):
    """Nemotron-H (Mamba-2, MLP, attention, Mamba-2 blocks): the SSM and conv states cross the node boundaries as
    the delta-net's do; fp64 within 1e-10. One scan chunk covers the longest row (past it both engines' torch
    scans differ from the recurrence, ``mamba_multichunk``)."""
    model_dir = tiny_models.write_tokenizer(tmp_path_factory.mktemp("tree_nemotron_h"), NEMOTRON["vocab_size"])
    torch.manual_seed(0)
    config = model_zoo.tiny_config("nemotron_h", **{**NEMOTRON, "mamba_chunk_size": 48})
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    (dense, d_loss, _), (prefix, p_loss, _) = engines(
        model_dir, dtype="float64", micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01
    )
    prefix.reuse_config = tree_reuse()
    worst, got = tree_step(dense, d_loss, prefix, p_loss, fp64_throughout())
    assert worst < 1e-10
    assert_tree_ran(got["metrics"], groups=2)
