"""Model structures beyond plain decoders through prefix_fsdp2 against verl's stock fsdp2 engine (issue 21,
items 3 and 4): Gemma-4 text (per-layer inputs computed at the root, KV-shared layers), DeepSeek-V3 (MLA:
value heads narrower than query/key heads) and phase A without early exit.

Gemma-4 used to die with a segmentation fault in phase C's backward: phase A's graph saved unsharded FSDP2
parameters that phase B's backward had resharded (storage freed), and nothing unsharded them again, because
FSDP2 unshards a unit for backward from a hook on its forward OUTPUTS and phase C starts from the captured
K/V. The root's per-layer-input projection, and the last layer that computes its own K/V (the last one
before Gemma-4's KV-shared layers, or the last layer when early exit is off), read freed storage.
``executor.unshard_cut_short`` unshards them; the negative control restores the old choice of units and
must fail (a plain Qwen3 without early exit raises there rather than crashing the worker).
"""

from __future__ import annotations

import pytest
import torch
from helpers.reuse import assert_reuse_ran, reduced
from test_engine_exactness import GRAD_TOL, compare_update, grpo_batch

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness.tiny_models import write_tiny_model
from verl_prefix.schedule import executor

ENGINE = dict(micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01)


def batch():
    return grpo_batch(num_groups=2, group_size=4, prompt_lens=[9, 12], response_len_range=(1, 7))


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory):
    """Four layers (sliding, global, sliding, global), per-layer inputs, the last two KV-shared."""
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny_gemma4_text"),
        "gemma4_text",
        hidden_size=32,
        num_layers=4,
        num_heads=2,
        num_kv_heads=1,
        initializer_range=0.02,
        extra_config={
            "num_kv_shared_layers": 2,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        },
    )


def test_tiny_gemma4_has_what_crashed(gemma4_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma4_dir, dtype=torch.float32)
    assert model.model.hidden_size_per_layer_input and model.model.layers[3].self_attn.is_kv_shared_layer


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gemma4_text_with_kv_shared_layers_matches_stock(gemma4_dir, dtype):
    grads, _, dense, prefix = compare_update(gemma4_dir, batch(), dtype=dtype, **ENGINE)
    assert grads < GRAD_TOL[dtype]
    assert_reuse_ran(prefix["metrics"], groups=2)
    assert reduced(prefix["metrics"])["prefix/phase_b_attention/merged"] > 0


def test_deepseek_v3_mla_matches_stock_through_merged(tiny_model):
    model_dir = tiny_model("deepseek_v3", hidden_size=32, num_layers=2, num_heads=2, experts_implementation="eager")
    reuse = PrefixReuseConfig(min_prefix_len=2, phase_b_attention="auto")
    grads, update, _, prefix = compare_update(model_dir, batch(), reuse=reuse, **ENGINE)
    assert grads < 1e-10 and update < 1e-9
    metrics = reduced(prefix["metrics"])
    assert_reuse_ran(prefix["metrics"], groups=2)
    assert metrics["prefix/phase_b_attention/merged"] > 0
    assert not [k for k, v in metrics.items() if k.startswith("prefix/phase_b_attention/concat") and v]


def test_no_early_exit_matches_stock(tiny_model):
    reuse = PrefixReuseConfig(min_prefix_len=2, early_exit=False)
    grads, update, _, prefix = compare_update(tiny_model("qwen3"), batch(), reuse=reuse, **ENGINE)
    assert grads < 1e-10 and update < 1e-9
    assert_reuse_ran(prefix["metrics"], groups=2)


def test_negative_control_units_left_sharded(tiny_model, monkeypatch):
    """The old choice (only the early-exit unit) leaves the last layer's unsharded weights freed when early exit
    is off: phase C's backward must fail on them."""
    original = executor.unshard_cut_short
    monkeypatch.setattr(executor, "unshard_cut_short", lambda model, modules: original(model, modules[:1]))
    reuse = PrefixReuseConfig(min_prefix_len=2, early_exit=False)
    with pytest.raises(RuntimeError, match="storage"):
        compare_update(tiny_model("qwen3"), batch(), reuse=reuse, **ENGINE)
