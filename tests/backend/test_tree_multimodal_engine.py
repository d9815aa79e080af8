"""Images and videos under ``prefix_reuse.tree`` (issue 25) against verl's stock fsdp2 engine, fp64 1e-10 and
fp32 1e-5, each comparison asserting the tree ran (depth >= 2, fewer physical than logical tokens, no one-level
fallback) and counting what the encoder ran over.

The batch (Qwen2.5-VL, G = 3): a 12-token system block, then each group's images, then its own text. Groups 0 and
1 share their first image A (same pixels) and differ in the second (4 x 8 vs 8 x 4 patches); groups 2 and 3 hold
image C, the size of A but other pixels; group 4 is text. The trie keys a visual token by its image's content
(``schedule.tree.visuals``): A and C branch although their tokens and positions are the same, A is encoded once
for groups 0 and 1, C once for groups 2 and 3. Cases: nodes whole; a chunk boundary inside every image
(``prefix_chunk_tokens=5``: later chunks take their slices of an image their first chunk encoded); nodes holding
an image merged into their children (``min_shared_tokens=8``: sibling nodes each own an encoding); recompute per
node; forward-only; videos; Qwen3-VL (deepstack features sliced per node); Qwen3.5 (gated delta-nets carry their
state along the path); two data-parallel ranks with images on one of them. Negative controls that fail: images
identified by their grid alone (C given A's embeddings), and an owner's encoder backward that does not add what
the later chunks left on its leaves."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
from helpers.precision import fp64_throughout
from helpers.reuse import assert_infer_matches, assert_reuse_ran, reduced
from helpers.vl_steps import step, worst

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import verl_engine
from verl_prefix.harness import vl as V
from verl_prefix.schedule.models import visual_chunks
from verl_prefix.schedule.models.multimodal import text_only_call
from verl_prefix.schedule.tree import visuals as tree_visuals

G = 3
SYSTEM = 12
IMAGES = [[(4, 4), (4, 8)], [(4, 4), (8, 4)], [(4, 4)], [(4, 4)], []]
PIXEL_SEEDS = [1, 1, 2, 2, 3]
GROUPS = len(IMAGES)
GRAD_TOL = {"float64": 1e-10, "float32": 1e-5}
# the images the tree encodes (A, B, B', C) and what one-level reuse would (each group its own: 2 + 2 + 1 + 1)
ITEMS, GROUP_ITEMS = 4, 6


def vl_batch(family: str = "qwen2_5_vl", images=IMAGES, seeds=PIXEL_SEEDS, **kwargs):
    return V.make_vl_grpo_batch(
        images=images,
        group_size=G,
        seed=5,
        use_kl=True,
        calculate_entropy=True,
        shared_system=SYSTEM,
        text_before=SYSTEM,
        family=family,
        pixel_seeds=seeds,
        **kwargs,
    )


def tree(**overrides) -> PrefixReuseConfig:
    settings = dict(min_prefix_len=2, tree=True, min_shared_tokens=4, suffix_micro_batch_size=2)
    return PrefixReuseConfig(**{**settings, **overrides})


def build(model_dir, dtype):
    args = dict(dtype=dtype, micro_batch_size_per_gpu=3, use_kl_loss=True, entropy_coeff=0.01, lr=0.0)
    dense = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **args)
    prefix = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **args)
    return dense, prefix


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return V.write_tiny_vl_model(tmp_path_factory.mktemp("tree_qwen2_5_vl"))


@pytest.fixture(scope="module")
def fp64(vl_model):
    return build(vl_model, "float64")


def assert_tree_ran(metrics, groups: int = GROUPS, items: int = ITEMS, group_items: int = GROUP_ITEMS) -> dict:
    m = reduced(metrics)
    assert_reuse_ran(m, groups=groups)
    assert m["prefix/tree_depth"] >= 2 and m["prefix/tree_shared_tokens/level1"] >= SYSTEM, m
    assert m["prefix/tree_visual_items"] == items, m
    assert m["prefix/tree_saved_visual_items"] == group_items - items, m
    return m


def test_images_in_the_tree_match_the_stock_engine_fp64(fp64):
    """Whole nodes, chunked nodes and merged image nodes: update (tower gradients compared) within 1e-10."""
    dense, prefix = fp64
    want = step(dense, vl_batch())
    cases = (
        (tree(), ITEMS, ITEMS),  # one encoder run per owning node: A, B, B', C
        (tree(prefix_chunk_tokens=5), ITEMS, None),  # an image's owner is its first chunk; later chunks slice
        # A's and C's nodes merged into their children: each child owns (and encodes) its copy, with its own image
        (tree(min_shared_tokens=8), GROUP_ITEMS, 4),
    )
    for reuse, items, calls in cases:
        prefix[0].reuse_config = reuse
        got = step(prefix, vl_batch())
        assert worst(got["grads"], want["grads"]) < GRAD_TOL["float64"], reuse
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-10)
        assert any("visual" in n for n in got["grads"]), "phase C reaches the tower"
        m = assert_tree_ran(got["metrics"], items=items)
        if calls is not None:
            assert m["prefix/vision_encoder_calls"] == calls, reuse
        else:  # a chunk owns the items whose first token it holds: at least one run per image, fewer than chunks
            assert ITEMS <= m["prefix/vision_encoder_calls"] < m["prefix/tree_node_chunks"], m
            assert m["prefix/tree_node_chunks"] > 0


def test_forward_only_and_recompute_match_the_stock_engine(fp64):
    dense, prefix = fp64
    prefix[0].reuse_config = tree(prefix_chunk_tokens=5)
    with fp64_throughout():
        with text_only_call(dense[0].module):
            want_infer = verl_engine.run_infer(dense[0], vl_batch())
        got_infer = verl_engine.run_infer(prefix[0], vl_batch())
    assert_infer_matches(want_infer, got_infer, 1e-10, groups=GROUPS)
    assert_tree_ran(got_infer["metrics"])
    # recompute: each node's phase C runs it again, an owner encoding its images again; the later chunks' slices
    # have left their gradients on the leaves by then
    want = step(dense, vl_batch())
    prefix[0].dormant_prefix = "recompute"
    try:
        got = step(prefix, vl_batch())
    finally:
        prefix[0].dormant_prefix = "keep"
    assert worst(got["grads"], want["grads"]) < GRAD_TOL["float64"]
    m = assert_tree_ran(got["metrics"])
    assert m["prefix/policy/recompute"] > 0 and m["prefix/max_recompute_kv_diff"] == 0.0, m


def test_negative_controls_fail(fp64, monkeypatch):
    """Images identified by grid alone: C's groups share A's node and embeddings. An owner whose encoder
    backward ignores its leaves: the gradient later chunks left on them never reaches the tower."""
    dense, prefix = fp64
    want = step(dense, vl_batch())
    prefix[0].reuse_config = tree()
    with monkeypatch.context() as patch:
        by_grid = lambda item: (item.kind, tuple(item.grid.tolist()))  # noqa: E731
        patch.setattr(tree_visuals.VisualItem, "fingerprint", by_grid)
        patch.setattr(tree_visuals.VisualItem, "same_content", lambda self, other: by_grid(self) == by_grid(other))
        got = step(prefix, vl_batch())
    assert_reuse_ran(got["metrics"], groups=GROUPS)
    assert reduced(got["metrics"])["prefix/tree_visual_items"] == ITEMS - 1  # C taken for A
    assert worst(got["grads"], want["grads"]) > 1e-4

    prefix[0].reuse_config = tree(prefix_chunk_tokens=5)
    with monkeypatch.context() as patch:
        patch.setattr(visual_chunks, "JoinLeafGrad", ForgetLeaf)
        got = step(prefix, vl_batch())
    assert_tree_ran(got["metrics"])
    visual = {n: g for n, g in want["grads"].items() if "visual" in n}
    assert worst({n: got["grads"][n] for n in visual}, visual) > 1e-4


class ForgetLeaf:
    """``JoinLeafGrad`` without the join: the owner's encoder backward sees only its own chunk's gradient."""

    @staticmethod
    def apply(root, leaf):
        return root.clone()


def test_fp32_matches_the_stock_engine(vl_model):
    engines = build(vl_model, "float32")
    engines[1][0].reuse_config = tree()
    want = step(engines[0], vl_batch(), nullcontext)
    got = step(engines[1], vl_batch(), nullcontext)
    assert worst(got["grads"], want["grads"]) < GRAD_TOL["float32"]
    assert_tree_ran(got["metrics"])


def test_videos_match_the_stock_engine(fp64):
    """A video under the system block in groups 0 and 2 (the same pixels: one node, encoded once) next to a group
    holding an image and a video (one encoder run over both, the owning node's)."""
    dense, prefix = fp64
    batch = vl_batch(images=[[(2, 4, 4)], [(4, 4), (2, 4, 8)], [(2, 4, 4)]], seeds=[1, 2, 1])
    prefix[0].reuse_config = tree()
    want = step(dense, batch)
    got = step(prefix, batch)
    assert worst(got["grads"], want["grads"]) < GRAD_TOL["float64"]
    # groups 0 and 2 hold the same video: encoded once; group 1's image and video in one run
    m = assert_tree_ran(got["metrics"], groups=3, items=3, group_items=4)
    assert m["prefix/vision_encoder_calls"] == 2


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "qwen2_vl", "qwen3_vl_moe"])
def test_other_families_match_the_stock_engine(tmp_path, family):
    """Qwen3-VL (deepstack features per visual token, sliced with the embeddings; also its videos, each frame
    between markers of its own, so a video's tokens are not one run), Qwen3.5 (a hybrid whose gated delta-nets
    continue from their parent node's state), Qwen2-VL and Qwen3-VL-MoE (the forwards they share with verl's
    Qwen2.5-VL and Qwen3-VL ones), chunked so images straddle nodes."""
    dense, prefix = build(V.write_tiny_vl_model(tmp_path / family, family), "float64")
    prefix[0].reuse_config = tree(prefix_chunk_tokens=5)
    batch = vl_batch(family)
    want = step(dense, batch)
    got = step(prefix, batch)
    assert worst(got["grads"], want["grads"]) < GRAD_TOL["float64"]
    assert any("visual" in n for n in got["grads"])
    assert_tree_ran(got["metrics"])
    if family == "qwen3_vl":
        videos = vl_batch(family, images=[[(2, 4, 4)], [(4, 4), (2, 4, 8)], [(2, 4, 4)]], seeds=[1, 2, 1])
        want = step(dense, videos)
        got = step(prefix, videos)
        assert worst(got["grads"], want["grads"]) < GRAD_TOL["float64"]
        assert_tree_ran(got["metrics"], groups=3, items=3, group_items=4)


def _two_rank_body(rank: int, model_dir: str) -> dict:
    """Rank 0: the module's batch; rank 1: text groups under the same system block. Each rank's trie differs,
    so lockstep fillers run; FSDP2 shards the vision tower over both ranks, so a node call that ran the encoder
    a different number of times on the two ranks would hang."""
    if rank == 0:
        batch = vl_batch(global_batch_size=2 * GROUPS * G)
    else:
        batch = vl_batch(images=[[], [], [], [], []], global_batch_size=2 * GROUPS * G)
    dense, prefix = build(model_dir, "float64")
    prefix[0].reuse_config = tree()
    want = step(dense, batch)
    got = step(prefix, batch)
    return {"worst": worst(got["grads"], want["grads"]), "metrics": got["reduced_metrics"]}


def test_two_data_parallel_ranks_with_images_on_one(vl_model):
    from helpers.ranks import run_two_ranks

    results = run_two_ranks(_two_rank_body, str(vl_model))
    for rank in range(2):
        assert results[rank]["worst"] < GRAD_TOL["float64"], rank
        m = results[rank]["metrics"]
        assert_reuse_ran(m, groups=GROUPS)
        assert m["prefix/tree_depth"] >= 2, m
    assert results[0]["metrics"]["prefix/tree_visual_items"] == ITEMS
    assert results[1]["metrics"]["prefix/tree_visual_items"] == 0
    assert sum(results[rank]["metrics"]["prefix/tree_lockstep_fillers"] for rank in range(2)) > 0
