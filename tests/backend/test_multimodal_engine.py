"""Visual tokens in the shared prefix: prefix_fsdp2 against verl's stock fsdp2 engine on a tiny Qwen2.5-VL with
real pixel inputs (two image sizes, a group with two images, a text group with verl's empty entries), fp64 and
fp32, suffix micro-batches of 1, 2 and G rows, vision tower trainable and frozen, updates and forward-only
passes, a chunked prefix cutting the images; Qwen3-VL (fp64 micro-batches of 1, 2 and G rows, chunked with its
deepstack features sliced, a video, trainable and frozen tower, fp32), Qwen3.5 and Qwen3.5-MoE (hybrid decoders,
chunked too), Qwen2-VL and Qwen3-VL-MoE (router aux loss too) on the same batch layout; Ulysses refused from the
configs; each comparison asserts reuse ran and the vision encoder ran once per group. Negative
controls: suffix rotary positions computed as if the image were text, and a row whose image was swapped
(detected by content: the group runs dense, and without the check reuse would be wrong)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
from helpers.delta_rule import fp64_delta_net
from helpers.precision import fp64_throughout
from helpers.reuse import assert_infer_matches, assert_reuse_ran, reduced
from helpers.vl_steps import step, worst

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend import fallbacks
from verl_prefix.backend.fsdp import refusals
from verl_prefix.harness import verl_engine
from verl_prefix.harness import vl as V
from verl_prefix.schedule import executor, grouping
from verl_prefix.schedule.models import multimodal, visual_chunks
from verl_prefix.schedule.models.multimodal import text_only_call

G = 4
GRAD_TOL = {"float64": 1e-10, "float32": 1e-5}
# group 0: a 4 x 4 patch image (4 tokens); group 1: 4 x 8 (8 tokens); group 2: two images; group 3: text only
IMAGES = [[(4, 4)], [(4, 8)], [(4, 4), (8, 4)], []]
VISUAL_GROUPS = 3


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return V.write_tiny_vl_model(tmp_path_factory.mktemp("tiny_qwen2_5_vl"))


def vl_batch(**kwargs):
    return V.make_vl_grpo_batch(images=IMAGES, group_size=G, seed=5, use_kl=True, calculate_entropy=True, **kwargs)


def build(model_dir, dtype):
    """The stock engine and prefix_fsdp2 on the same model; lr 0 keeps the weights for every later comparison."""
    args = dict(dtype=dtype, micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01, lr=0.0)
    dense = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **args)
    prefix = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **args)
    prefix[0].reuse_config = PrefixReuseConfig(min_prefix_len=2)
    return dense, prefix


@pytest.fixture(scope="module")
def fp64(vl_model):
    return build(vl_model, "float64")


@pytest.fixture(scope="module")
def fp32(vl_model):
    return build(vl_model, "float32")


def compare(engines, batch, dtype, reuse=None):
    (dense, prefix) = engines
    if reuse is not None:
        prefix[0].reuse_config = reuse
    precision = fp64_throughout if dtype == "float64" else nullcontext
    want = step(dense, batch, precision)
    got = step(prefix, batch, precision)
    return worst(got["grads"], want["grads"]), want, got


def assert_encoder_calls(metrics, calls=VISUAL_GROUPS):
    """The vision encoder ran `calls` times: once per group with images, unless a test says otherwise."""
    assert reduced(metrics)["prefix/vision_encoder_calls"] == calls


@pytest.mark.parametrize("rows", [1, 2, G])
def test_update_matches_stock_engine_fp64(fp64, rows):
    grads, dense, prefix = compare(
        fp64, vl_batch(), "float64", PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=rows)
    )
    assert grads < GRAD_TOL["float64"]
    assert prefix["loss"] == pytest.approx(dense["loss"], rel=1e-10)
    assert any("visual" in n for n in prefix["grads"]), "the vision tower trains: phase C must reach it"
    assert_reuse_ran(prefix["metrics"], groups=len(IMAGES))
    assert_encoder_calls(prefix["metrics"])


def test_update_matches_stock_engine_fp32_dynamic_batch_size(fp32):
    batch = vl_batch(worker_settings={"use_dynamic_bsz": True, "max_token_len_per_gpu": 64})
    grads, _, prefix = compare(fp32, batch, "float32", PrefixReuseConfig(min_prefix_len=2))
    assert grads < GRAD_TOL["float32"]
    assert_reuse_ran(prefix["metrics"], groups=len(IMAGES))
    assert_encoder_calls(prefix["metrics"])


def test_frozen_vision_tower(fp64):
    """verl 0.9.1 declares ``freeze_vision_tower`` but its engine never reads it: a frozen tower is one whose
    parameters do not require grad, in both engines alike; reuse then leaves the tower without gradients."""
    towers = [engine.module.model.visual for (engine, _, _) in fp64]
    for tower in towers:
        tower.requires_grad_(False)
    try:
        grads, _, prefix = compare(fp64, vl_batch(), "float64", PrefixReuseConfig(min_prefix_len=2))
    finally:
        for tower in towers:
            tower.requires_grad_(True)
    assert grads < GRAD_TOL["float64"]
    assert not any("visual" in n for n in prefix["grads"])
    assert_reuse_ran(prefix["metrics"], groups=len(IMAGES))
    assert_encoder_calls(prefix["metrics"])


def test_freeze_vision_tower_flag_is_honoured(vl_model, fp64):
    """``actor.freeze_vision_tower=true`` through ``PrefixFSDPActorConfig`` freezes the prefix engine's tower
    (verl 0.9.1's engine ignores the flag): the same update as the stock engine with its tower frozen by hand."""
    a = "actor_rollout_ref.actor"
    overrides = [f"{a}._target_=verl_prefix.PrefixFSDPActorConfig", f"{a}.freeze_vision_tower=true"]
    args = dict(dtype="float64", micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01, lr=0.0)
    prefix = verl_engine.build_verl_engine(vl_model, backend="prefix_fsdp2", overrides=overrides, **args)
    assert not any(p.requires_grad for p in prefix[0].module.model.visual.parameters())
    prefix[0].reuse_config = PrefixReuseConfig(min_prefix_len=2)
    dense_tower = fp64[0][0].module.model.visual
    dense_tower.requires_grad_(False)
    try:
        grads, _, got = compare((fp64[0], prefix), vl_batch(), "float64")
    finally:
        dense_tower.requires_grad_(True)
    assert grads < GRAD_TOL["float64"]
    assert not any("visual" in n for n in got["grads"])
    assert_reuse_ran(got["metrics"], groups=len(IMAGES))


def forward_only_matches(engines) -> dict:
    """fp64 log-probs and entropies of ``vl_batch()``: the prefix engine's (as configured) match the stock engine's
    to 1e-10, every group reused and the encoder run once per group with images. Returns the stock engine's."""
    (dense, _, _), (prefix, _, _) = engines
    with fp64_throughout():
        with text_only_call(dense.module):
            want = verl_engine.run_infer(dense, vl_batch())
        got = verl_engine.run_infer(prefix, vl_batch())
    assert_infer_matches(want, got, 1e-10, groups=len(IMAGES))
    assert_encoder_calls(got["metrics"])
    return want


def test_forward_only_matches_stock_engine(fp64):
    fp64[1][0].reuse_config = PrefixReuseConfig(min_prefix_len=2)
    forward_only_matches(fp64)


def test_suffix_positions_as_if_the_image_were_text_fail(fp64, monkeypatch):
    """Negative control: suffix rows rotated at text positions (the dense row's first position row on every
    rotary axis) instead of the multimodal positions that continue after the image."""
    monkeypatch.setattr(executor, "suffix_positions", text_positions)
    grads, _, prefix = compare(fp64, vl_batch(), "float64", PrefixReuseConfig(min_prefix_len=2))
    assert_reuse_ran(prefix["metrics"], groups=len(IMAGES))
    assert grads > 1e-4


def text_positions(positions, prompt_len, response_len):
    """A suffix's positions as if the image were text: the dense row's text positions on every rotary axis."""
    cut = positions[..., prompt_len - 1 : prompt_len - 1 + response_len]
    return cut[..., :1, :].expand_as(cut) if cut.dim() == 2 else cut


def swapped(batch, row):
    """The batch with one row's image replaced by another image of the same size (same tokens, positions)."""
    entries = list(batch["multi_modal_inputs"])
    other = V.image_inputs([tuple(entries[row]["image_grid_thw"][0, 1:].tolist())], seed=999)
    entries[row] = other
    batch = batch.copy()
    from tensordict import NonTensorStack

    batch["multi_modal_inputs"] = NonTensorStack(*entries)
    return batch


def test_swapped_image_is_detected_by_content(fp64, monkeypatch):
    batch = swapped(vl_batch(), row=1)
    grads, _, prefix = compare(fp64, batch, "float64", PrefixReuseConfig(min_prefix_len=2))
    assert grads < GRAD_TOL["float64"]
    metrics = reduced(prefix["metrics"])
    assert metrics["prefix/fallback_multimodal_mismatch"] == G
    assert_reuse_ran(prefix["metrics"], groups=len(IMAGES) - 1)
    # negative control: without the content check, the group reuses row 0's image for row 1
    monkeypatch.setattr(grouping, "same_visual_inputs", lambda a, b: True)
    grads, _, prefix = compare(fp64, batch, "float64")
    assert_reuse_ran(prefix["metrics"], groups=len(IMAGES))
    assert grads > 1e-4


def test_chunk_boundary_inside_an_image_matches_stock_engine(fp64, monkeypatch):
    """``prefix_chunk_tokens=5`` over 12-token prefixes cuts every image group's image tokens (group 0's at 5,
    group 1's at 5 and 10, group 2's second image at 10): the images are encoded once per group and each chunk
    takes its slice of the embeddings; update (tower gradients compared; ``dormant_prefix=recompute`` too; a
    video group and an image-and-video group) and forward-only within 1e-10. Qwen3-VL's (deepstack features
    sliced alike) and Qwen3.5's chunks: their own tests."""
    reuse = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=2, prefix_chunk_tokens=5)
    grads, dense, prefix = compare(fp64, vl_batch(), "float64", reuse)
    assert grads < GRAD_TOL["float64"]
    assert prefix["loss"] == pytest.approx(dense["loss"], rel=1e-10)
    assert any("visual" in n for n in prefix["grads"]), "phase C reaches the tower through the encoded leaf"
    metrics = reduced(prefix["metrics"])
    assert metrics["prefix/chunked_groups"] == len(IMAGES) and "prefix/fallback_multimodal_chunked" not in metrics
    assert_reuse_ran(prefix["metrics"], groups=len(IMAGES))
    assert_encoder_calls(prefix["metrics"])
    (dense_engine, _, _), (prefix_engine, _, _) = fp64
    want = forward_only_matches(fp64)
    # recompute: phase A keeps no graph; the later chunks rebuilt in phase C leave their gradient on the leaf
    # before the first chunk's rebuild (which encodes again, and is counted) backpropagates it into the tower
    prefix_engine.dormant_prefix = "recompute"
    try:
        grads, _, prefix = compare(fp64, vl_batch(), "float64", reuse)
    finally:
        prefix_engine.dormant_prefix = "keep"
    assert grads < GRAD_TOL["float64"]
    assert_reuse_ran(prefix["metrics"], groups=len(IMAGES))
    assert_encoder_calls(prefix["metrics"], calls=2 * VISUAL_GROUPS)
    # a video group and an image-and-video group: verl encodes each kind in its own call, each sliced apart
    batch = V.make_vl_grpo_batch(images=[[(2, 4, 4)], [(4, 4), (2, 4, 8)]], group_size=G, seed=7, use_kl=True)
    grads, _, prefix = compare(fp64, batch, "float64", reuse)
    assert grads < GRAD_TOL["float64"]
    assert_reuse_ran(prefix["metrics"], groups=2)
    assert reduced(prefix["metrics"])["prefix/chunked_groups"] == 2
    assert_encoder_calls(prefix["metrics"], calls=3)
    # negative control: each chunk given the image's first embeddings (its slice not offset past earlier chunks')
    bounds = visual_chunks.EncodedVisuals.token_range

    def unshifted(self, kind, start, end):
        first, last = bounds(self, kind, start, end)
        return 0, last - first

    monkeypatch.setattr(visual_chunks.EncodedVisuals, "token_range", unshifted)
    with fp64_throughout():
        wrong = verl_engine.run_infer(prefix_engine, vl_batch())
    off = wrong["response_log_probs"].values() - want["response_log_probs"].values()
    assert off.abs().max().item() > 1e-4
    assert_reuse_ran(wrong["metrics"], groups=len(IMAGES))


def test_what_reuse_does_not_serve_yet_is_refused_with_a_reason(vl_model, fp64, monkeypatch):
    """Ulysses is refused from the configs, before verl builds a device mesh or the model (verl's own Ulysses
    path slices the embeddings after the images are scattered in; the schedule's slices token ids first);
    verl's remove-padding attention (flash attention called
    directly, no HF interface to capture K/V through) runs dense as ``multimodal_remove_padding`` where HF's own
    forward was not remembered before verl patched it (an engine built before this one patched the class)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from verl.models.transformers.qwen2_vl import qwen2_vl_attn_forward

    module = fp64[1][0].module
    reuse = PrefixReuseConfig()
    ulysses = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
    with pytest.raises(ValueError, match="vision-language models .'qwen2_5_vl'. under Ulysses"):
        verl_engine.build_verl_engine(vl_model, backend="prefix_fsdp2", use_remove_padding=True, overrides=ulysses)
    assert refusals.multimodal_ulysses_error(module.config, reuse, ulysses_size=1) is None
    assert refusals.multimodal_ulysses_error(module.config, PrefixReuseConfig(enable=False), 2) is None
    assert fallbacks.model_fallback_reason(module, reuse, forward_only=True) is None
    monkeypatch.setattr(modeling_qwen2_5_vl.Qwen2_5_VLAttention, "forward", qwen2_vl_attn_forward)
    assert fallbacks.model_fallback_reason(module, reuse, forward_only=True) is None  # remembered: served
    monkeypatch.setattr(multimodal, "hf_forward", lambda cls: None)
    assert fallbacks.model_fallback_reason(module, reuse, forward_only=True) == "multimodal_remove_padding"


def test_remove_padding_path_reuses_with_hf_attention(vl_model, fp64, monkeypatch):
    """verl's remove-padding path patches Qwen2-VL attention to call flash attention on packed rows (no CPU
    kernel here, so the stock reference runs padded: the same maths). The prefix engine remembers HF's own
    attention forward before verl's patch and serves the schedule's padded rows with it."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    for cls in (modeling_qwen2_5_vl.Qwen2_5_VLAttention, modeling_qwen2_vl.Qwen2VLAttention):
        monkeypatch.setattr(cls, "forward", cls.forward)  # verl's patch is undone after the test
    batch = vl_batch()
    want = step(fp64[0], batch, fp64_throughout)
    args = dict(dtype="float64", micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01, lr=0.0)
    prefix = verl_engine.build_verl_engine(vl_model, backend="prefix_fsdp2", use_remove_padding=True, **args)
    assert multimodal.attention_bypassed(prefix[0].module) is False
    assert modeling_qwen2_5_vl.Qwen2_5_VLAttention.forward.__module__.startswith("verl."), "verl patched it"
    prefix[0].reuse_config = PrefixReuseConfig(min_prefix_len=2)
    got = step(prefix, batch, fp64_throughout)
    assert worst(got["grads"], want["grads"]) < GRAD_TOL["float64"]
    assert_reuse_ran(got["metrics"], groups=len(IMAGES))
    assert_encoder_calls(got["metrics"])


def test_coverage_page_lists_the_vision_language_families():
    """``docs/models.md`` ends with the vision-language families and their status, as ``model_zoo`` renders them:
    exact under reuse exactly where ``schedule.models.multimodal`` serves the family (this file's tests)."""
    from pathlib import Path

    from verl_prefix.harness import model_zoo as Z
    from verl_prefix.schedule.models.multimodal import SERVED_VISUAL_MODELS

    page = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    rows = Z.vision_language_rows()
    assert {r.family for r in rows} >= {"qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe"}
    for row in rows:
        assert f"| {row.family} | {row.status} | {row.reason} |" in page, "run verl-prefix models --write"
        assert (row.status == Z.EXACT) == (row.family in SERVED_VISUAL_MODELS)
    assert {r.family for r in Z.parse(page)} == set(Z.decoder_families()), "the section is not a matrix column"


def test_qwen3_vl_deepstack_matches_stock_engine(tmp_path):
    """Qwen3-VL adds the vision encoder's deepstack features to the first decoder layers' hidden states at the
    visual positions: all of them prefix positions, so phase A applies them and phase B's text rows have none,
    as in the dense rows. fp64 with the tower trainable (suffix micro-batches of 1, 2 and G rows; a chunk
    boundary inside every image, the deepstack features sliced per chunk like the embeddings; a video, each
    frame marked on its own, next to an image-and-video group, chunked too) and frozen, and fp32."""
    model_dir = V.write_tiny_vl_model(tmp_path / "tiny_qwen3_vl", "qwen3_vl")
    batch = V.make_vl_grpo_batch(
        images=IMAGES, group_size=G, seed=5, use_kl=True, calculate_entropy=True, family="qwen3_vl"
    )
    reuse = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=2)
    chunked = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=2, prefix_chunk_tokens=5)
    engines = build(model_dir, "float64")
    want = step(engines[0], batch, fp64_throughout)
    for case in (reuse, *(PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=r) for r in (1, G)), chunked):
        engines[1][0].reuse_config = case
        prefix = step(engines[1], batch, fp64_throughout)
        assert worst(prefix["grads"], want["grads"]) < GRAD_TOL["float64"], case
        assert any("deepstack" in n for n in prefix["grads"]), "the deepstack mergers train through phase C"
        assert_reuse_ran(prefix["metrics"], groups=len(IMAGES))
        assert_encoder_calls(prefix["metrics"])
    assert reduced(prefix["metrics"])["prefix/chunked_groups"] == len(IMAGES)
    video = V.make_vl_grpo_batch(
        images=[[(2, 4, 4)], [(4, 4), (2, 4, 8)]], group_size=G, seed=7, use_kl=True, family="qwen3_vl"
    )
    for case in (reuse, chunked):
        grads, _, prefix = compare(engines, video, "float64", case)
        assert grads < GRAD_TOL["float64"], case
        assert_reuse_ran(prefix["metrics"], groups=2)
        assert_encoder_calls(prefix["metrics"], calls=3)  # the image and the video in separate calls
    # the tower (deepstack mergers included) frozen by hand in both engines: no gradient reaches it
    for engine, _, _ in engines:
        engine.module.model.visual.requires_grad_(False)
    grads, _, prefix = compare(engines, batch, "float64", reuse)
    assert grads < GRAD_TOL["float64"]
    assert not any("visual" in n for n in prefix["grads"])
    assert_reuse_ran(prefix["metrics"], groups=len(IMAGES))
    # fp32, the tower trainable
    grads, _, prefix = compare(build(model_dir, "float32"), batch, "float32", reuse)
    assert grads < GRAD_TOL["float32"]
    assert any("deepstack" in n for n in prefix["grads"])
    assert_reuse_ran(prefix["metrics"], groups=len(IMAGES))
    assert_encoder_calls(prefix["metrics"])


def test_video_group_matches_stock_engine(fp64):
    """A group whose prompt holds a video (2 temporal patches of 4 x 4, with Qwen2.5-VL's ``second_per_grid_ts``,
    which verl hands on to attention) next to an image group: the encoder runs once per group."""
    batch = V.make_vl_grpo_batch(images=[[(2, 4, 4)], [(4, 4), (2, 4, 8)]], group_size=G, seed=7, use_kl=True)
    assert "pixel_values_videos" in batch["multi_modal_inputs"][0]
    grads, _, prefix = compare(fp64, batch, "float64", PrefixReuseConfig(min_prefix_len=2))
    assert grads < GRAD_TOL["float64"]
    assert_reuse_ran(prefix["metrics"], groups=2)
    # the video and the image of group 1 run through the encoder in separate calls, as verl's forward makes them
    assert reduced(prefix["metrics"])["prefix/vision_encoder_calls"] == 3


def test_recompute_dormant_policy_encodes_the_images_again(fp64):
    """``dormant_prefix=recompute`` runs phase A again before phase C, vision encoder included: still exact, and
    the metric counts the second encoding."""
    prefix_engine = fp64[1][0]
    prefix_engine.dormant_prefix = "recompute"
    try:
        grads, _, prefix = compare(fp64, vl_batch(), "float64", PrefixReuseConfig(min_prefix_len=2))
    finally:
        prefix_engine.dormant_prefix = "keep"
    assert grads < GRAD_TOL["float64"]
    assert_reuse_ran(prefix["metrics"], groups=len(IMAGES))
    assert_encoder_calls(prefix["metrics"], calls=2 * VISUAL_GROUPS)


def _two_rank_body(rank: int, model_dir: str, qwen3_dir: str) -> dict:
    """Rank 0: two groups of 4 (an image; two images); rank 1: one group of 8 (another image). Lockstep gives
    rank 0 filler micro-batches in the first slot and rank 1 a filler group (a text prefix: verl's placeholder
    image) in the second; FSDP2 shards every parameter, the vision tower's too, over both ranks. Then the same
    batch with ``prefix_chunk_tokens=5`` (every image cut; the ranks' chunk counts differ, lockstep filler
    chunks run the placeholder image), and on a Qwen3-VL, chunked too (deepstack features sliced per chunk)."""
    images, group_size = ([[(4, 4)], [(4, 4), (4, 8)]], 4) if rank == 0 else ([[(4, 8)]], 8)
    chunked = PrefixReuseConfig(min_prefix_len=2, prefix_chunk_tokens=5)
    out = {}
    for family, path in (("qwen2_5_vl", model_dir), ("qwen3_vl", qwen3_dir)):
        batch = V.make_vl_grpo_batch(
            images=images, group_size=group_size, seed=11 + rank, use_kl=True, global_batch_size=16, family=family
        )
        (dense, prefix) = build(path, "float64")
        want = step(dense, batch, fp64_throughout)
        for name, reuse in (("plain", PrefixReuseConfig(min_prefix_len=2)), ("chunked", chunked)):
            if family == "qwen3_vl" and name == "plain":
                continue  # the single-rank test covers it; here the chunks' lockstep across ranks
            prefix[0].reuse_config = reuse
            got = step(prefix, batch, fp64_throughout)
            out[f"{family} {name}"] = {"worst": worst(got["grads"], want["grads"]), "metrics": got["reduced_metrics"]}
    return out


def test_two_data_parallel_ranks_with_different_groups(vl_model, tmp_path):
    from helpers.ranks import run_two_ranks

    qwen3 = V.write_tiny_vl_model(tmp_path / "qwen3_vl", "qwen3_vl")
    results = run_two_ranks(_two_rank_body, str(vl_model), str(qwen3))
    for rank, groups in ((0, 2), (1, 1)):
        for case, result in results[rank].items():
            assert result["worst"] < GRAD_TOL["float64"], (rank, case, result["worst"])
            assert_reuse_ran(result["metrics"], groups=groups)
            assert_encoder_calls(result["metrics"], calls=groups)
            if "chunked" in case:
                assert result["metrics"]["prefix/chunked_groups"] == groups, (rank, case)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl_moe"])
def test_shared_forward_families_match_stock_engine(tmp_path, family):
    """Qwen2-VL (verl feeds it through its Qwen2.5-VL forward; a tower without windows) and Qwen3-VL-MoE (its
    Qwen3-VL forward; experts in every decoder layer, deepstack at the first): fp64 against the stock engine, and
    Qwen3-VL-MoE's router aux loss against prefix_fsdp2's dense mode."""
    model_dir = V.write_tiny_vl_model(tmp_path / family, family)
    batch = V.make_vl_grpo_batch(images=IMAGES, group_size=G, seed=5, use_kl=True, family=family)
    reuse = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=2)
    engines = build(model_dir, "float64")
    grads, dense, prefix = compare(engines, batch, "float64", reuse)
    assert grads < GRAD_TOL["float64"]
    assert any("visual" in n for n in prefix["grads"])
    if family == "qwen3_vl_moe":
        assert any("experts" in n for n in prefix["grads"])
        # the router aux loss (the stock engine has none): reuse against prefix_fsdp2's dense mode on the same
        # partition (the aux is a per-micro-batch mean: one row each), visual tokens counted alike
        one_row = V.make_vl_grpo_batch(
            images=IMAGES[1:3],
            group_size=G,
            seed=5,
            use_kl=True,
            family=family,
            worker_settings={"micro_batch_size_per_gpu": 1},
        )
        engines[1][0].moe_aux_loss_coef = 0.5
        engines[1][0].reuse_config = PrefixReuseConfig(enable=False)
        want = step(engines[1], one_row, fp64_throughout)
        engines[1][0].reuse_config = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=1)
        got = step(engines[1], one_row, fp64_throughout)
        assert worst(got["grads"], want["grads"]) < GRAD_TOL["float64"]
        assert reduced(got["metrics"])["moe_aux_loss"] > 0
        assert_reuse_ran(got["metrics"], groups=2)
    assert_reuse_ran(prefix["metrics"], groups=len(IMAGES))
    assert_encoder_calls(prefix["metrics"])


def test_qwen3_5_vision_language_matches_stock_engine(tmp_path, monkeypatch):
    """Qwen3.5's multimodal model (verl's Qwen3.5 forward: the encoder's ``pooler_output``, no deepstack; a
    hybrid decoder whose gated delta-net layers carry their recurrent state, not K/V, across the prefix boundary):
    fp64 update (tower gradients compared) and forward-only within 1e-10 against the stock engine, a video
    group, a chunk boundary inside every image (encoded once per group, each chunk its slice); Qwen3.5-MoE
    within 1e-10 too. fp32 is not compared at 1e-5 here: transformers' chunked delta rule rounds an fp32 row
    split at the prefix differently (about 1e-4 on the decay gate's parameters), which
    ``test_recurrent_engine`` judges against an fp64 reference. Negative control: suffix rotary positions as
    if the image were text."""
    family = "qwen3_5"
    batch = V.make_vl_grpo_batch(
        images=IMAGES, group_size=G, seed=5, use_kl=True, calculate_entropy=True, family=family
    )
    (dense, prefix) = build(V.write_tiny_vl_model(tmp_path / family, family), "float64")
    want = step(dense, batch, fp64_throughout)
    for reuse in (
        PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=2),
        PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=2, prefix_chunk_tokens=5),
    ):
        prefix[0].reuse_config = reuse
        got = step(prefix, batch, fp64_throughout)
        assert worst(got["grads"], want["grads"]) < GRAD_TOL["float64"], reuse
        assert any("visual" in n for n in got["grads"]) and any("linear_attn" in n for n in got["grads"])
        assert_reuse_ran(got["metrics"], groups=len(IMAGES))
        assert_encoder_calls(got["metrics"])
    assert reduced(got["metrics"])["prefix/chunked_groups"] == len(IMAGES)
    with fp64_throughout(), fp64_delta_net(dense[0].module), fp64_delta_net(prefix[0].module):
        infer_want = verl_engine.run_infer(dense[0], batch)
        infer_got = verl_engine.run_infer(prefix[0], batch)
    assert_infer_matches(infer_want, infer_got, 1e-10, groups=len(IMAGES))
    assert_encoder_calls(infer_got["metrics"])
    # a video (each frame marked on its own) next to an image-and-video group
    video = V.make_vl_grpo_batch(
        images=[[(2, 4, 4)], [(4, 4), (2, 4, 8)]], group_size=G, seed=7, use_kl=True, family=family
    )
    grads, _, got = compare((dense, prefix), video, "float64", PrefixReuseConfig(min_prefix_len=2))
    assert grads < GRAD_TOL["float64"]
    assert_reuse_ran(got["metrics"], groups=2)
    assert_encoder_calls(got["metrics"], calls=3)
    # negative control: the suffix rows rotated at text positions
    prefix[0].reuse_config = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=2)
    monkeypatch.setattr(executor, "suffix_positions", text_positions)
    wrong = step(prefix, batch, fp64_throughout)
    assert_reuse_ran(wrong["metrics"], groups=len(IMAGES))
    assert worst(wrong["grads"], want["grads"]) > 1e-4
    monkeypatch.undo()
    # Qwen3.5-MoE (experts and a shared expert in every layer)
    family = "qwen3_5_moe"
    batch = V.make_vl_grpo_batch(images=IMAGES, group_size=G, seed=5, use_kl=True, family=family)
    grads, _, got = compare(
        build(V.write_tiny_vl_model(tmp_path / family, family), "float64"),
        batch,
        "float64",
        PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=2),
    )
    assert grads < GRAD_TOL["float64"]
    assert any("experts" in n for n in got["grads"]) and any("visual" in n for n in got["grads"])
    assert_reuse_ran(got["metrics"], groups=len(IMAGES))
    assert_encoder_calls(got["metrics"])
