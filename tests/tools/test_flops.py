"""The FLOP model printed beside every measured ratio."""

from __future__ import annotations

from transformers import Qwen3Config, Qwen3MoeConfig

from verl_prefix.tools.flops import ModelShape, dense_flops, predicted_speedup, reuse_flops

SHAPE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100
)


def test_dense_linear_count():
    shape = ModelShape.from_config(Qwen3Config(intermediate_size=128, **SHAPE))
    attention = 2 * 64 * 64 + 2 * 64 * 32  # q,o and k,v projections
    assert shape.linear_per_token == 2.0 * 2 * (attention + 3 * 64 * 128)


def test_moe_layers_count_router_and_routed_experts_only():
    config = Qwen3MoeConfig(
        intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, **SHAPE
    )
    shape = ModelShape.from_config(config)
    assert shape.moe_layers == 2
    attention = 2 * 64 * 64 + 2 * 64 * 32
    assert shape.linear_per_token == 2.0 * 2 * (attention + 64 * 8 + 3 * 64 * 32 * 2)
    sparse_every_other = ModelShape.from_config(
        Qwen3MoeConfig(decoder_sparse_step=2, moe_intermediate_size=32, intermediate_size=128, num_experts=8, **SHAPE)
    )
    assert sparse_every_other.moe_layers == 1


def test_reuse_saves_the_prefix_but_not_the_head_or_suffix_attention():
    shape = ModelShape.from_config(Qwen3Config(intermediate_size=128, **SHAPE))
    assert reuse_flops(shape, 1, [5]) <= dense_flops(shape, 1, [5])  # a one-token prompt: never more than dense
    g, p, s = 8, 2048, 128
    ratio = predicted_speedup(shape, [(p, [s] * g)])
    assert 1 < ratio < g * (p + s) / (p + g * s)  # below the naive token ratio
