"""Every reason reuse may not apply is counted (and still exact), and bad input is an error naming the
samples. Nothing is skipped silently."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.precision import promote_fp32_upcasts
from verl.utils import tensordict_utils as tu

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend import fallbacks, model_checks
from verl_prefix.backend.config import PrefixFSDPEngineConfig
from verl_prefix.harness import grpo_batches, tiny_models, verl_engine
from verl_prefix.schedule.grouping import RowLayout, plan_suffix_micro_batches, validate_batch
from verl_prefix.schedule.kv import seam

VOCAB = 128


def grpo_batch(**overrides):
    args = dict(num_groups=2, group_size=4, prompt_lens=[9, 5], response_len_range=(1, 6), vocab_size=VOCAB, seed=5)
    args.update(overrides)
    return grpo_batches.make_grpo_batch(**args)


def run_both(model_dir, batch, reuse: PrefixReuseConfig, **kwargs):
    dense, d_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="fsdp2", dtype="float64", micro_batch_size_per_gpu=2, **kwargs
    )
    prefix, p_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="prefix_fsdp2", dtype="float64", micro_batch_size_per_gpu=2, **kwargs
    )
    prefix.reuse_config = reuse
    with promote_fp32_upcasts():
        want = verl_engine.run_train_step(dense, d_loss, batch, capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
    assert worst < 1e-10, "a fallback must still give the stock gradients"
    return got["reduced_metrics"]


def test_short_prefix_runs_dense_and_is_counted(tiny_model):
    metrics = run_both(tiny_model("qwen3"), grpo_batch(), PrefixReuseConfig(min_prefix_len=6))
    assert metrics["prefix/fallback_short_prefix"] == 4.0  # the P=5 group (prefix 4 < 6)
    assert metrics["prefix/groups"] == 1.0


def test_small_group_runs_dense_and_is_counted(tiny_model):
    batch = grpo_batches.make_grpo_batch(
        num_groups=4, group_size=1, prompt_lens=8, response_len_range=(2, 5), vocab_size=VOCAB
    )
    metrics = run_both(tiny_model("qwen3"), batch, PrefixReuseConfig(min_prefix_len=2, min_group_size=2))
    assert metrics["prefix/fallback_small_group"] == 4.0
    assert metrics["prefix/groups"] == 0.0


def test_disabled_runs_the_stock_path_and_is_counted(tiny_model):
    metrics = run_both(tiny_model("qwen3"), grpo_batch(), PrefixReuseConfig(enable=False))
    assert metrics["prefix/fallback_disabled"] == 8.0


def test_dropout_runs_dense_and_is_counted(tiny_model):
    # Dropout is random, so compare nothing but the decision: one prefix dropout sample would be shared.
    engine, loss_fn, _ = verl_engine.build_verl_engine(
        tiny_model("qwen3"),
        backend="prefix_fsdp2",
        overrides=["+actor_rollout_ref.model.override_config.attention_dropout=0.1"],
    )
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    result = verl_engine.run_train_step(engine, loss_fn, grpo_batch())
    assert result["reduced_metrics"]["prefix/fallback_dropout"] == 8.0
    # Forward-only passes run in eval mode, where dropout is off: they still reuse.
    assert (
        verl_engine.reduce_step_metrics(verl_engine.run_infer(engine, grpo_batch())["metrics"])["prefix/groups"] == 2.0
    )


def test_reentrant_checkpointing_runs_dense_and_is_counted(tiny_model):
    engine, loss_fn, _ = verl_engine.build_verl_engine(tiny_model("qwen3"), backend="prefix_fsdp2")
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    result = verl_engine.run_train_step(engine, loss_fn, grpo_batch())
    assert result["reduced_metrics"]["prefix/fallback_reentrant_checkpointing"] == 8.0


def test_forward_only_reuse_switch(tiny_model):
    engine, _, _ = verl_engine.build_verl_engine(tiny_model("qwen3"), backend="prefix_fsdp2")
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2, forward_only_reuse=False)
    assert (
        verl_engine.reduce_step_metrics(verl_engine.run_infer(engine, grpo_batch())["metrics"])[
            "prefix/fallback_forward_only_disabled"
        ]
        == 8.0
    )


def test_sum_pi_squared_runs_dense_and_is_counted(tiny_model):
    batch = grpo_batch()
    tu.assign_non_tensor(batch, calculate_sum_pi_squared=True)
    metrics = run_both(tiny_model("qwen3"), batch, PrefixReuseConfig(min_prefix_len=2))
    assert metrics["prefix/fallback_sum_pi_squared"] == 8.0


def test_declared_window_no_module_carries_runs_dense_and_is_counted(tiny_model):
    """verl's override_config declares a window after the config derived its layer types: no attention module
    carries it, so reuse cannot tell which the dense masks follow (windows the modules carry are served)."""
    overrides = [
        "+actor_rollout_ref.model.override_config.use_sliding_window=true",
        "+actor_rollout_ref.model.override_config.sliding_window=4",
        "+actor_rollout_ref.model.override_config.max_window_layers=0",
    ]
    metrics = run_both(tiny_model("qwen2"), grpo_batch(), PrefixReuseConfig(min_prefix_len=2), overrides=overrides)
    assert metrics["prefix/fallback_sliding_window"] == 8.0


def test_a_window_the_module_keeps_but_never_hands_attention_runs_dense(tmp_path):
    """Qwen2-MoE's attention stores ``sliding_window`` but passes none to the attention function: dense applies the
    window through its masks, reuse would attend to the whole prefix (found by the coverage matrix shrinking
    ``max_window_layers``: gradients off by 1.4). Its window counts as undeclared: dense with the reason, exact."""
    from transformers import AutoModelForCausalLM
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeAttention

    from verl_prefix.harness import model_zoo

    assert not model_checks.hands_window_to_attention(Qwen2MoeAttention)
    assert model_checks.hands_window_to_attention(MistralAttention)
    config = model_zoo.tiny_config("qwen2_moe", use_sliding_window=True, max_window_layers=1, sliding_window=4)
    config.experts_implementation = "eager"  # fp64 experts (grouped_mm has no fp64 kernel)
    out = tiny_models.write_tokenizer(tmp_path, VOCAB)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    metrics = run_both(out, grpo_batch(), PrefixReuseConfig(min_prefix_len=2))
    assert metrics["prefix/fallback_sliding_window"] == 8.0


def test_unsupported_attention_runs_dense_and_is_counted(tiny_model, monkeypatch):
    monkeypatch.setattr(fallbacks, "PREFIX_ATTENTION_NAMES", {"eager": "verl_prefix_eager"})
    metrics = run_both(tiny_model("qwen3"), grpo_batch(), PrefixReuseConfig(min_prefix_len=2))
    assert metrics["prefix/fallback_attn_implementation"] == 8.0


@pytest.mark.parametrize(
    "flag, reason, knob",
    [
        ("distillation_use_topk", "distillation", "distillation.distillation_loss.loss_settings.use_topk=false"),
        ("calculate_sum_pi_squared", "sum_pi_squared", "actor_rollout_ref.actor.calculate_sum_pi_squared=false"),
    ],
)
def test_batch_features_the_schedule_does_not_cover_are_named(tiny_model, flag, reason, knob, caplog):
    """Each reason's one warning names the knob, by its full override path, that lets such batches reuse; fused
    kernels are no reason any more (``test_fused_kernels_engine.py``)."""
    engine, _, _ = verl_engine.build_verl_engine(tiny_model("qwen3"), backend="prefix_fsdp2")
    batch = grpo_batch()
    tu.assign_non_tensor(batch, **{flag: True})
    assert fallbacks.batch_fallback_reason(batch) == reason
    fused = grpo_batch()
    tu.assign_non_tensor(fused, use_fused_kernels=True)
    assert fallbacks.batch_fallback_reason(fused) is None
    fallbacks.LOGGED_REASONS.discard(reason)
    with caplog.at_level("WARNING", logger="verl_prefix.backend.fallbacks"):
        fallbacks.log_fallbacks([reason])
    assert knob in caplog.text
    engine.use_ulysses_sp = True  # Ulysses itself is no reason to run dense any more
    assert engine._model_fallback_reason(forward_only=False) is None


def test_remove_padding_dense_rows_match_the_padded_stock_engine(tiny_model):
    """Reuse pads inside a group; its dense rows go through verl's packed path. Both must agree with
    the stock engine without remove-padding (transformers finds packed sequences by position ids)."""
    model_dir = tiny_model("qwen3")
    dense, d_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="fsdp2", dtype="float64", micro_batch_size_per_gpu=2
    )
    prefix, p_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="prefix_fsdp2", dtype="float64", micro_batch_size_per_gpu=2, use_remove_padding=True
    )
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=6)  # the P=5 group runs dense, packed
    with promote_fp32_upcasts():
        want = verl_engine.run_train_step(dense, d_loss, grpo_batch(), capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, grpo_batch(), capture_grads=True)
    assert got["reduced_metrics"]["prefix/fallback_short_prefix"] == 4.0
    assert max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items()) < 1e-10


# -- bad input ----------------------------------------------------------------------------------------------


def prefix_engine(tiny_model):
    engine, loss_fn, _ = verl_engine.build_verl_engine(tiny_model("qwen3"), backend="prefix_fsdp2")
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    return engine, loss_fn


def test_same_uid_different_prompts_reuses_each_prompt(tiny_model):
    """One uid over two prompts of 4 rows each (per-sample prompts, a re-tokenised turn): no error; each prompt's
    rows reuse it as a sub-group, exactly as the stock engine trains them; nothing runs dense."""
    batch = grpo_batch(prompt_lens=[9, 9])
    tu.assign_non_tensor_stack(batch, "uid", ["same"] * len(batch))  # two prompts, one uid
    metrics = run_both(tiny_model("qwen3"), batch, PrefixReuseConfig(min_prefix_len=2))
    assert metrics["prefix/groups"] == 2
    assert metrics.get("prefix/fallback_prompt_mismatch", 0.0) == 0.0
    assert metrics["prefix/physical_tokens"] < metrics["prefix/logical_tokens"]


def test_rows_sharing_too_little_of_their_prompt_run_dense_counted(tiny_model):
    """Prompts A, A, B, B, C, C; uid "same" over A, A, B, C (a per-sample system prompt on two of its rows): A's
    pair reuses, B and C alone run dense as ``prompt_mismatch``; the uids holding the other B and C alone are
    ``small_group``; every row with the stock gradients."""
    batch = grpo_batches.make_grpo_batch(
        num_groups=3, group_size=2, prompt_lens=9, response_len_range=(1, 6), vocab_size=VOCAB
    )
    tu.assign_non_tensor_stack(batch, "uid", ["same", "same", "same", "x", "same", "y"])
    metrics = run_both(tiny_model("qwen3"), batch, PrefixReuseConfig(min_prefix_len=2, min_group_size=2))
    assert metrics["prefix/groups"] == 1
    assert metrics["prefix/fallback_prompt_mismatch"] == 2
    assert metrics["prefix/fallback_small_group"] == 2


def test_non_finite_advantages_are_an_error(tiny_model):
    engine, loss_fn = prefix_engine(tiny_model)
    batch = grpo_batch()
    rows = list(batch["advantages"].unbind())
    rows[3] = rows[3].clone()
    rows[3][0] = float("nan")
    rows[6] = rows[6].clone()
    rows[6][-1] = float("inf")
    batch["advantages"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    with pytest.raises(ValueError, match=r"samples \[3, 6\] have non-finite advantages"):
        verl_engine.run_train_step(engine, loss_fn, batch)


def test_missing_uid_is_an_error(tiny_model):
    engine, loss_fn = prefix_engine(tiny_model)
    batch = grpo_batch()
    del batch["uid"]
    with pytest.raises(ValueError, match="uid"):
        verl_engine.run_train_step(engine, loss_fn, batch)


def test_empty_response_is_an_error():
    ids = [torch.arange(5), torch.arange(7)]
    layout = RowLayout(ids, [torch.arange(5), torch.arange(7)], [5, 5], [0, 2], ["a", "a"])
    with pytest.raises(ValueError, match=r"samples \[0\] have empty responses"):
        validate_batch(layout)


def test_micro_batch_planning_respects_rows_and_token_budget():
    lens = [5, 1, 9, 3, 7]
    assert plan_suffix_micro_batches([0, 1, 2, 3, 4], lens, max_rows=2, max_tokens=None) == [[2, 4], [0, 3], [1]]
    # 2 rows x longest 9 = 18 > 16: the budget counts padded tokens
    assert plan_suffix_micro_batches([0, 1, 2, 3, 4], lens, max_rows=None, max_tokens=16) == [[2], [4, 0], [3, 1]]
    # rows that also feed their last token are one longer: 2 x (9 + 1) = 20 > 18 splits [2, 4]
    assert plan_suffix_micro_batches([0, 1, 2, 3, 4], lens, None, 18)[0] == [2, 4]
    assert plan_suffix_micro_batches([0, 1, 2, 3, 4], lens, None, 18, extra_tokens_per_row=1) == [[2], [4, 0], [3, 1]]
    with pytest.raises(ValueError, match=">= 1"):
        plan_suffix_micro_batches([0], [1], max_rows=0, max_tokens=None)


def test_knob_validation_messages():
    with pytest.raises(ValueError, match="min_prefix_len must be >= 1"):
        PrefixReuseConfig(min_prefix_len=0)
    with pytest.raises(ValueError, match="suffix_micro_batch_size"):
        PrefixReuseConfig(suffix_micro_batch_size=0)
    config = PrefixFSDPEngineConfig(strategy="prefix_fsdp2", prefix_reuse={"min_prefix_len": 7})
    assert config.strategy == "prefix_fsdp2" and config.prefix_reuse.min_prefix_len == 7


def test_prefix_kv_names_cover_the_kernels_verl_uses():
    assert {"sdpa", "eager", "flash_attention_2"} <= set(seam.PREFIX_ATTENTION_NAMES)
    assert np.all([name.startswith("verl_prefix_") for name in seam.PREFIX_ATTENTION_NAMES.values()])
