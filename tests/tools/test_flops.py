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


def test_sliding_window_layers_count_the_pairs_their_window_keeps():
    """Gemma-3 style: 2 of 3 layers windowed (W = 3). A sequence of 7 keeps 1+2+3+3+3+3+3 = 18 pairs on a
    windowed layer, 28 on the full one; reuse's prefix of 4 keeps 9 and 10, each suffix query sees at most W keys
    (itself included) on the windowed layers: suffix queries at 4 and 5 keep 3 + 3 there, 5 + 6 on the full one."""
    from transformers import Gemma3TextConfig

    layers = ["sliding_attention", "full_attention", "sliding_attention"]
    config = Gemma3TextConfig(
        intermediate_size=128, sliding_window=3, layer_types=layers, **{**SHAPE, "num_hidden_layers": 3}
    )
    shape = ModelShape.from_config(config)
    assert shape.windows == (3, 3)
    pair = shape.attention_per_layer_pair
    assert shape.attention_flops(0, 7) == (2 * 18 + 28) * pair
    assert shape.attention_flops(0, 4) == (2 * 9 + 10) * pair
    assert shape.attention_flops(4, 6) == (2 * 6 + 11) * pair
    linear, head = shape.linear_per_token, shape.head_per_token
    assert dense_flops(shape, 5, [2]) == 7 * (linear + head) + (2 * 18 + 28) * pair
    assert reuse_flops(shape, 5, [2]) == 4 * linear + 2 * (linear + head) + (2 * 9 + 10 + 2 * 6 + 11) * pair
    full = ModelShape.from_config(
        Gemma3TextConfig(
            intermediate_size=128, sliding_window=4096, layer_types=layers, **{**SHAPE, "num_hidden_layers": 3}
        )
    )
    assert full.attention_flops(0, 7) == 3 * 28 * pair  # a window longer than the sequence keeps every pair


def test_windows_per_family_convention():
    from transformers import MistralConfig, Qwen2Config

    assert ModelShape.from_config(MistralConfig(sliding_window=512, **SHAPE)).windows == (512, 512)
    assert ModelShape.from_config(MistralConfig(sliding_window=None, **SHAPE)).windows == ()
    assert ModelShape.from_config(Qwen2Config(**SHAPE)).windows == ()  # use_sliding_window defaults to off
    assert ModelShape.from_config(Qwen3Config(**SHAPE)).windows == ()


def test_window_preset_model_is_a_windowed_gemma3(tmp_path):
    """The ``window`` bench preset's model: written as a Gemma-3 config whose layers the FLOP model reads as
    three 512-token windows and one full layer (what the table's FLOP column rests on)."""
    from transformers import AutoConfig

    from verl_prefix.tools.bench.presets import PRESETS

    (cell,) = PRESETS["window"].cells
    config = AutoConfig.from_pretrained(cell.model.write(tmp_path / "model"))
    assert config.model_type == "gemma3_text" and config.sliding_window == 512
    assert ModelShape.from_config(config).windows == (512, 512, 512)
    assert (cell.prompt_len, cell.response_len_range, cell.group_size) == (2048, (128, 128), 8)


def test_hybrid_preset_counts_delta_net_layers_as_linear_in_length(tmp_path):
    """The ``hybrid`` presets' model (Qwen3.5-style): three gated delta-net layers cost per token (projections,
    conv, ``8 d_k d_v`` per value head) and add no attention pairs; only the full layer's pairs grow as P^2."""
    from transformers import AutoConfig

    from verl_prefix.tools.bench.presets import PRESETS
    from verl_prefix.tools.flops import delta_net_per_token

    (cell,) = PRESETS["hybrid"].cells
    config = AutoConfig.from_pretrained(cell.model.write(tmp_path / "model"))
    shape = ModelShape.from_config(config)
    assert config.model_type == "qwen3_5_text" and shape.recurrent_layers == 3
    key, value = config.linear_num_key_heads * 16, config.linear_num_value_heads * 16
    proj = 2 * 64 * (2 * key + 2 * value + 2 * config.linear_num_value_heads) + 2 * value * 64
    recurrence = 8 * config.linear_num_value_heads * 16 * 16 + 2 * 4 * (2 * key + value)
    assert config.linear_key_head_dim == config.linear_value_head_dim == 16
    assert delta_net_per_token(config) == proj + recurrence == shape.recurrent_per_token
    assert shape.attention_flops(0, 100) == 5050 * 4 * 4 * 16  # one full-attention layer's pairs
    assert 1 < predicted_speedup(shape, [(2048, [128] * 8)]) < 8  # (P + S) G / (P + G S) = 6.2 caps it
    assert (PRESETS["hybrid_8192"].cells[0].prompt_len, cell.prompt_len, cell.group_size) == (8192, 2048, 8)


def test_vision_encoder_count_against_torch_flop_counter(tmp_path):
    """``vision_encoder_flops`` against torch's own FLOP counter on a tiny tower's forward over one image:
    Qwen3-VL (every block full attention, deepstack mergers) to within 1%, Qwen2.5-VL at most the count (its
    windowed blocks attend to fewer pairs than the model's full-attention bound)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForImageTextToText

    from verl_prefix.harness import vl as V
    from verl_prefix.tools.flops import vision_encoder_flops

    for family, exact in (("qwen3_vl", True), ("qwen2_5_vl", False)):
        path = V.write_tiny_vl_model(tmp_path / family, family)
        model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager")  # attention as matmuls
        inputs = V.image_inputs([(8, 8)], seed=0, family=family)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        counted = counter.get_total_flops()
        modelled = vision_encoder_flops(model.config.vision_config, [(1, 8, 8)])
        if exact:
            assert abs(counted - modelled) <= 0.01 * counted, (family, counted, modelled)
        else:
            assert 0.5 * modelled < counted <= modelled, (family, counted, modelled)


def test_vl_preset_counts_the_encoder_once_per_row_dense_once_per_group_reused(tmp_path):
    """The ``vl`` preset's cell (issue 23): one 64 x 64-patch image (1,024 visual tokens) among 200 text tokens,
    responses of 128, G=8, on a Qwen2.5-VL; the FLOP model adds the encoder G times dense and once reused."""
    from transformers import AutoConfig

    from verl_prefix.tools.bench.presets import PRESETS, cell_batch
    from verl_prefix.tools.flops import vision_encoder_flops

    (cell,) = PRESETS["vl"].cells
    config = AutoConfig.from_pretrained(cell.model.write(tmp_path / "model"))
    assert config.model_type == "qwen2_5_vl" and cell.image == (64, 64)
    batch = cell_batch(cell)
    prompt = batch["prompts"][0]
    assert int((prompt == config.image_token_id).sum()) == 1024 and len(prompt) == 200 + 1024 + 2
    assert (cell.group_size, cell.response_len_range) == (8, (128, 128))
    shape, groups = ModelShape.from_config(config), [(len(prompt), [128] * 8)]
    encoder = vision_encoder_flops(config.vision_config, [(1, 64, 64)])
    text_only = predicted_speedup(shape, groups)
    with_encoder = predicted_speedup(shape, groups, [encoder])
    dense = dense_flops(shape, *groups[0]) + 8 * encoder
    assert with_encoder == dense / (reuse_flops(shape, *groups[0]) + encoder) and with_encoder > text_only
