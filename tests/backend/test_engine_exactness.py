"""prefix_fsdp2 against verl's stock fsdp2 engine on the same TensorDict: gradients, the parameters
after one optimizer step, loss, and forward-only log-probs/entropy, in fp64 and fp32."""

from __future__ import annotations

import pytest
from helpers.engine_pairs import compare_on_pair, loss_with, worst_relative
from helpers.layouts import use_suffix_only_mask
from helpers.precision import promote_fp32_upcasts
from helpers.reuse import assert_infer_matches, assert_reuse_ran

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import grpo_batches, verl_engine
from verl_prefix.schedule import executor as schedule

VOCAB = 128
GRAD_TOL = {"float64": 1e-10, "float32": 1e-5}


def grpo_batch(**overrides):
    args = dict(
        num_groups=3,
        group_size=4,
        prompt_lens=[9, 5, 12],
        response_len_range=(1, 7),
        vocab_size=VOCAB,
        seed=3,
        use_kl=True,
        calculate_entropy=True,
    )
    args.update(overrides)
    return grpo_batches.make_grpo_batch(**args)


def engines(model_dir, *, reuse: PrefixReuseConfig | None = None, **kwargs):
    dense = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs)
    prefix = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **kwargs)
    prefix[0].reuse_config = reuse or PrefixReuseConfig(min_prefix_len=2)
    return dense, prefix


def compare_update(model_dir, batch, dtype="float64", reuse=None, **kwargs):
    """One update through both engines; returns (worst grad rel, worst update rel, dense, prefix results).
    Fails unless the prefix engine reused: a silent fallback to dense would match trivially."""
    (d_engine, d_loss, _), (p_engine, p_loss, _) = engines(model_dir, reuse=reuse, dtype=dtype, **kwargs)
    before = verl_engine.params_of(d_engine)
    with promote_fp32_upcasts():
        dense = verl_engine.run_train_step(d_engine, d_loss, batch, capture_grads=True)
        prefix = verl_engine.run_train_step(p_engine, p_loss, batch, capture_grads=True)
    assert dense["grads"], "the stock engine produced no gradients"
    assert_reuse_ran(prefix["metrics"])
    d_after, p_after = verl_engine.params_of(d_engine), verl_engine.params_of(p_engine)
    d_update = {n: d_after[n] - before[n] for n in before}
    p_update = {n: p_after[n] - before[n] for n in before}
    return worst_relative(prefix["grads"], dense["grads"]), worst_relative(p_update, d_update), dense, prefix


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_update_matches_stock_engine(tiny_model, family, attn, dtype):
    model_dir = tiny_model(family, tie_word_embeddings=family == "llama")
    grads, update, dense, prefix = compare_update(
        model_dir,
        grpo_batch(),
        dtype=dtype,
        attn_implementation=attn,
        micro_batch_size_per_gpu=2,
        use_kl_loss=True,
        entropy_coeff=0.01,
    )
    assert grads < GRAD_TOL[dtype]
    if dtype == "float64":
        assert update < 1e-9  # Adam's first step is ~lr*sign(g): fp32 noise can flip near-zero elements
    assert prefix["loss"] == pytest.approx(dense["loss"], rel=1e-5)
    assert prefix["grad_norm"] == pytest.approx(dense["grad_norm"], rel=1e-5)
    assert_reuse_ran(prefix["metrics"], groups=3)


@pytest.mark.parametrize("rows", [1, 2, 4, 8])  # micro-batch counts 8, 4, 2, 1 for G = 8
def test_every_suffix_partition(qwen3_pair, rows):
    batch = grpo_batch(num_groups=2, group_size=8, prompt_lens=[10, 6], response_len_range=(1, 9))
    reuse = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=rows)
    grads, _, _ = compare_on_pair(qwen3_pair, batch, reuse=reuse, micro_batch_size=4)
    assert grads < 1e-10


@pytest.mark.parametrize(
    "mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_every_loss_agg_mode(qwen3_pair, mode):
    # seq-mean-token-sum-norm divides by each micro-batch's padded width unless loss_scale_factor is set,
    # so even the stock engine changes with the micro-batch split; verl documents the constant.
    fields = {"loss_agg_mode": mode, "loss_scale_factor": 16 if mode.endswith("-norm") else None}
    grads, _, _ = compare_on_pair(qwen3_pair, grpo_batch(), loss_fn=loss_with(qwen3_pair[2], **fields))
    assert grads < 1e-10


# clip_cov / kl_cov pick tokens by covariance inside each micro-batch, so they are exact only when both
# engines see the same micro-batch: one group, one micro-batch.
WHOLE_BATCH_LOSSES = {"clip_cov", "kl_cov"}


@pytest.mark.parametrize(
    "loss_mode",
    ["vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo"],
)
def test_every_policy_loss(qwen3_pair, loss_mode):
    batch = grpo_batch(num_groups=1, group_size=6, prompt_lens=9) if loss_mode in WHOLE_BATCH_LOSSES else grpo_batch()
    mbs = 6 if loss_mode in WHOLE_BATCH_LOSSES else 2
    reuse = PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=mbs)
    loss_fn = loss_with(qwen3_pair[2], loss_mode)
    if loss_mode == "dro":
        object.__setattr__(loss_fn.keywords["config"].policy_loss, "dro_beta", 0.1)
    grads, _, _ = compare_on_pair(qwen3_pair, batch, reuse=reuse, micro_batch_size=mbs, loss_fn=loss_fn)
    assert grads < 1e-10


def test_dynamic_batch_size_and_gradient_checkpointing(tiny_model):
    grads, update, _, prefix = compare_update(
        tiny_model("qwen3"),
        grpo_batch(),
        use_dynamic_bsz=True,
        max_token_len_per_gpu=40,
        gradient_checkpointing=True,
        use_kl_loss=True,
        entropy_coeff=0.01,
    )
    assert grads < 1e-10 and update < 1e-9
    assert_reuse_ran(prefix["metrics"], groups=3)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_long_prompts_on_a_deeper_model(tiny_model, dtype):
    """Prompts of 64-96 tokens on 4 layers: long enough that phase B's suffix-to-prefix attention carries
    most of each row's context and every layer's K/V leaf gets a real phase-C gradient."""
    batch = grpo_batch(prompt_lens=[64, 96, 72], response_len_range=(4, 12))
    grads, update, dense, prefix = compare_update(
        tiny_model("qwen3", num_layers=4),
        batch,
        dtype=dtype,
        micro_batch_size_per_gpu=2,
        use_kl_loss=True,
        entropy_coeff=0.01,
    )
    assert grads < GRAD_TOL[dtype]
    if dtype == "float64":
        assert update < 1e-9
    assert prefix["loss"] == pytest.approx(dense["loss"], rel=1e-5)
    assert_reuse_ran(prefix["metrics"], groups=3)


def test_sampling_temperature_on_the_training_path(qwen3_pair):
    """verl divides the logits by the rollout temperature before the loss; reuse must do the same per row."""
    grads, dense, prefix = compare_on_pair(qwen3_pair, grpo_batch(temperature=0.7))
    assert grads < 1e-10
    assert prefix["loss"] == pytest.approx(dense["loss"], rel=1e-10)
    assert_reuse_ran(prefix["metrics"], groups=3)


def test_legacy_padded_layout(tiny_model):
    grads, _, _, _ = compare_update(tiny_model("qwen2"), grpo_batch(layout="legacy"), micro_batch_size_per_gpu=2)
    assert grads < 1e-10


def test_token_metrics_count_what_reuse_saved(qwen3_pair):
    batch = grpo_batch(num_groups=2, group_size=4, prompt_lens=[10, 6], response_len_range=(2, 2))
    _, _, prefix = compare_on_pair(qwen3_pair, batch)
    metrics = prefix["reduced_metrics"]
    assert metrics["prefix/logical_tokens"] == 4 * (10 + 2) + 4 * (6 + 2)
    assert metrics["prefix/physical_tokens"] == (9 + 4 * 2) + (5 + 4 * 2)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_infer_batch_matches_stock(tiny_model, dtype, attn):
    (d_engine, _, _), (p_engine, _, _) = engines(
        tiny_model("qwen3"), dtype=dtype, attn_implementation=attn, micro_batch_size_per_gpu=2
    )
    batch = grpo_batch()
    with promote_fp32_upcasts():
        dense = verl_engine.run_infer(d_engine, batch, calculate_entropy=True)
        prefix = verl_engine.run_infer(p_engine, batch, calculate_entropy=True)
    tol = 1e-10 if dtype == "float64" else 1e-5
    assert_infer_matches(dense, prefix, tol, groups=3)


FAULTS = {
    "suffix_only_mask": use_suffix_only_mask,
    "positions_off_by_one": lambda mp: mp.setattr(
        schedule, "suffix_positions", lambda pos, p, s: pos[..., p - 1 : p - 1 + s] + 1
    ),
    "skipped_phase_c": lambda mp: mp.setattr(schedule, "prefix_backward", lambda *a, **k: None),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_negative_controls_through_the_engine(qwen3_pair, monkeypatch, fault):
    """The same comparison that passes above must fail for a wrong schedule."""
    FAULTS[fault](monkeypatch)
    grads, _, _ = compare_on_pair(qwen3_pair, grpo_batch())
    assert grads > 1e-3


# verl's chunked entropy upcasts each chunk to fp32, so in an fp64 run its term carries fp32 rounding
@pytest.mark.parametrize("knob, tol", [("entropy_from_logits_with_chunking", 1e-7), ("entropy_checkpointing", 1e-10)])
def test_entropy_variants_follow_the_engine_config(tiny_model, knob, tol):
    overrides = [f"actor_rollout_ref.actor.{knob}=true", "actor_rollout_ref.actor.entropy_from_logits_chunk_size=5"]
    (d_engine, d_loss, _), (p_engine, p_loss, _) = engines(
        tiny_model("qwen3"), dtype="float64", micro_batch_size_per_gpu=2, entropy_coeff=0.01, overrides=overrides
    )
    assert getattr(p_engine.engine_config, knob)
    with promote_fp32_upcasts():
        dense = verl_engine.run_train_step(d_engine, d_loss, grpo_batch(), capture_grads=True)
        prefix = verl_engine.run_train_step(p_engine, p_loss, grpo_batch(), capture_grads=True)
    assert_reuse_ran(prefix["metrics"], groups=3)
    assert worst_relative(prefix["grads"], dense["grads"]) < tol
