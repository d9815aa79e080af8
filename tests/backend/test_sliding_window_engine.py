"""Sliding windows through the engine: prefix_fsdp2 against verl's stock fsdp2 on ``gemma3_text`` (sliding and
full layers) and ``gpt_oss`` (sliding and full layers, attention sinks, MoE) with a 16-token window and prompts
of 60-120 tokens (issue 21, item 1).

The engine used to run every such mini-batch dense (``prefix/fallback_sliding_window``); now it must reuse
(no fallback, groups reused, fewer physical than logical tokens), match the stock update in fp64 (1e-10) and
fp32 (1e-5), and say which phase-B attention served each layer (``prefix/phase_b_layers/<path>``).
"""

from __future__ import annotations

import pytest
import torch
from helpers.precision import promote_fp32_upcasts
from helpers.reuse import assert_infer_matches, assert_reuse_ran, reduced
from test_engine_exactness import GRAD_TOL, compare_update, engines

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import grpo_batches, tiny_models, verl_engine
from verl_prefix.schedule.kv.contexts import LAYER_PATHS

LAYERS = ["sliding_attention", "full_attention"]  # one windowed layer, one full layer


def windowed_batch(**overrides):
    """Two groups of 4 with prompts of 70 and 110 tokens; responses of 1-30 tokens (past the 16-token window)."""
    args = dict(
        num_groups=2,
        group_size=4,
        prompt_lens=[70, 110],
        response_len_range=(1, 30),
        vocab_size=128,
        seed=5,
        use_kl=True,
        calculate_entropy=True,
    )
    args.update(overrides)
    return grpo_batches.make_grpo_batch(**args)


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    """``windowed_model(family)``: a tiny model directory whose first layer has a 16-token window."""
    cache = {}

    def make(family: str):
        if family not in cache:
            cache[family] = tiny_models.write_tiny_model(
                tmp_path_factory.mktemp(f"windowed_{family}"),
                family,
                hidden_size=32,
                experts_implementation="eager" if family == "gpt_oss" else None,
                extra_config={"layer_types": LAYERS},
            )
        return cache[family]

    return make


def layer_paths(metrics) -> dict[str, float]:
    """Layer-calls by the phase-B path that served them (every rank reports every path, zero where none ran)."""
    layers = {k.rsplit("/", 1)[-1]: v for k, v in reduced(metrics).items() if k.startswith("prefix/phase_b_layers/")}
    assert set(layers) == set(LAYER_PATHS)  # merged, concat, each also _window and _chunk, merged_varlen
    return {path: n for path, n in layers.items() if n}


# gpt_oss has no sdpa in transformers; under eager, auto serves concat (the family's own eager maths)
CASES = [
    ("gemma3_text", "sdpa", "auto", "merged", "float64"),
    ("gemma3_text", "sdpa", "auto", "merged", "float32"),
    ("gemma3_text", "eager", "concat", "concat", "float64"),
    ("gpt_oss", "eager", "auto", "concat", "float64"),
    ("gpt_oss", "eager", "merged", "merged", "float64"),
    ("gpt_oss", "eager", "merged", "merged", "float32"),
]


@pytest.mark.parametrize("family, attn, attention, served, dtype", CASES)
def test_windowed_update_matches_stock_engine(windowed_model, family, attn, attention, served, dtype):
    reuse = PrefixReuseConfig(min_prefix_len=2, phase_b_attention=attention, suffix_micro_batch_size=2)
    grads, update, dense, prefix = compare_update(
        windowed_model(family),
        windowed_batch(),
        dtype=dtype,
        reuse=reuse,
        attn_implementation=attn,
        micro_batch_size_per_gpu=2,
        use_kl_loss=True,
        entropy_coeff=0.01,
    )
    assert grads < GRAD_TOL[dtype]
    if dtype == "float64":
        assert update < 1e-9
    metrics = reduced(prefix["metrics"])
    assert_reuse_ran(prefix["metrics"], groups=2)
    assert metrics.get("prefix/fallback_sliding_window", 0.0) == 0.0
    # per micro-batch (verl averages the per-micro-batch counts): the sliding layer banded, the full layer plain
    paths = layer_paths(prefix["metrics"])
    assert set(paths) == {f"{served}_window", served} and paths[f"{served}_window"] == paths[served] > 0


@pytest.mark.parametrize("family, attn", [("gemma3_text", "sdpa"), ("gpt_oss", "eager")])
def test_windowed_infer_matches_stock(windowed_model, family, attn):
    (d_engine, _, _), (p_engine, _, _) = engines(
        windowed_model(family), dtype="float64", attn_implementation=attn, micro_batch_size_per_gpu=2
    )
    batch = windowed_batch()
    with promote_fp32_upcasts():
        dense = verl_engine.run_infer(d_engine, batch, calculate_entropy=True)
        prefix = verl_engine.run_infer(p_engine, batch, calculate_entropy=True)
    assert_infer_matches(dense, prefix, 1e-10, groups=2)


def test_negative_control_window_ignored_on_the_prefix(windowed_model, monkeypatch):
    """The same comparison with the prefix part seeing every prefix key (the window kept on the suffix part
    only) must fail."""
    from verl_prefix.schedule.attention import merged as MA

    monkeypatch.setattr(MA, "cut_prefix", lambda prefix, window: prefix)
    monkeypatch.setattr(
        MA, "banded_prefix_keep", lambda q, cut, window, device: torch.ones(q, cut, dtype=torch.bool, device=device)
    )
    grads, _, _, _ = compare_update(
        windowed_model("gemma3_text"),
        windowed_batch(),
        dtype="float64",
        reuse=PrefixReuseConfig(min_prefix_len=2, phase_b_attention="merged"),
        micro_batch_size_per_gpu=2,
    )
    assert grads > 1e-3


def test_merged_varlen_refuses_windowed_models_at_initialisation(windowed_model):
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    with pytest.raises(ValueError, match=r"merged_varlen does not serve sliding-window attention.*\[16\]"):
        verl_engine.build_verl_engine(
            windowed_model("gemma3_text"),
            backend="prefix_fsdp2",
            overrides=[
                f"{fsdp}._target_=verl_prefix.config.PrefixFSDPEngineConfig",
                f"+{fsdp}.prefix_reuse.phase_b_attention=merged_varlen",
            ],
        )
