"""The structural capability check (``verl_prefix.schedule.models.capability``) on synthetic decoders whose layers vary
(hypothesis), and on real transformers families: every layer attending causally through HF's attention interface
is served; the first layer that does not names the reason and the module."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from verl_prefix.harness import model_zoo as Z
from verl_prefix.schedule.models.capability import FAMILY_REFUSALS, UNSERVED_RECURRENT_FAMILIES, structure_refusal


class InterfaceAttention(nn.Module):
    def __init__(self, layer_idx: int, is_causal: bool = True) -> None:
        super().__init__()
        self.layer_idx, self.is_causal, self.scaling = layer_idx, is_causal, 1.0

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](self, x, x, x, None, **kwargs)[0]


class CrossAttention(InterfaceAttention):
    is_cross_attention = True


class HandWrittenAttention(nn.Module):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.softmax(x @ x.transpose(-1, -2), -1) @ x


class ShortConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, groups=4)


class MambaMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(4))


class Layer(nn.Module):
    def __init__(self, i: int, kind: str) -> None:
        super().__init__()
        if kind in ("attention", "bidirectional"):
            self.self_attn = InterfaceAttention(i, is_causal=kind == "attention")
        elif kind == "cross":
            self.self_attn, self.cross_attn = InterfaceAttention(i), CrossAttention(i)
        elif kind == "hand_written":
            self.self_attn = HandWrittenAttention(i)
        elif kind == "conv":
            self.conv = ShortConv()
        elif kind == "mamba":
            self.mamba = MambaMixer()

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.self_attn(x, **kwargs)


class DropsKeywords(Layer):
    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.self_attn(x)


class Decoder(nn.Module):
    def __init__(self, kinds: list[str]) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=len(kinds), model_type="synthetic")
        self.layers = nn.ModuleList(
            DropsKeywords(i, "attention") if kind == "drops_keywords" else Layer(i, kind)
            for i, kind in enumerate(kinds)
        )


EXPECTED = {
    "bidirectional": "bidirectional_attention",
    "cross": "cross_attention",
    "hand_written": "attention_outside_interface",
    "conv": "convolution_layers",
    "mamba": "recurrent_layers",
    "drops_keywords": "keywords_not_forwarded",
}
KINDS = ["attention", *EXPECTED]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(KINDS), min_size=1, max_size=6))
def test_the_first_unserved_layer_names_the_reason_and_module(kinds):
    refusal = structure_refusal(Decoder(kinds))
    odd = [i for i, kind in enumerate(kinds) if kind != "attention"]
    if not odd:
        assert refusal is None
        return
    first = odd[0]
    assert refusal is not None and refusal.reason == EXPECTED[kinds[first]], (kinds, refusal)
    assert refusal.module.startswith(f"layers.{first}"), refusal.module
    assert refusal.module in refusal.message() and refusal.reason in refusal.message()


def test_a_missing_layer_index_is_refused():
    model = Decoder(["attention", "attention"])
    model.layers[1].self_attn.layer_idx = 0  # two layers claim index 0: phase A would never see layer 1's K/V
    refusal = structure_refusal(model)
    assert refusal is not None and refusal.reason == "attention_outside_interface" and "layers.1" in refusal.module


def test_no_decoder_layers_and_encoder_decoder():
    model = Decoder(["attention"])
    model.config.num_hidden_layers = 3
    assert structure_refusal(model).reason == "no_decoder_layers"
    model.config.is_encoder_decoder = True
    assert structure_refusal(model).reason == "encoder_decoder"


def test_real_families():
    """Served: plain attention, MoE, per-layer inputs, Qwen3-Next's and OLMo-Hybrid's gated delta-nets (OLMo's
    decoder layer passes no keywords on, which a layer whose only mixer is a served recurrent one does not need),
    Mamba-2 hybrids (Nemotron-H: attention under a path named ``mixer``), LFM2's short conv; refused: Falcon-H1's
    Mamba, plain Mamba-2, a router that samples, a layer that drops its keywords (each family as the matrix
    builds it)."""
    served = ("llama", "qwen3_moe", "gemma3n_text", "qwen3_next", "olmo_hybrid", "bamba", "nemotron_h", "lfm2")
    for family in served:
        assert structure_refusal(Z.build(family)) is None, family
    cases = {
        "mamba2": ("recurrent_layers", "backbone.layers.0 (Mamba2Block)"),
        "falcon_h1": ("recurrent_layers", "model.layers.0.mamba (FalconH1Mixer)"),
        "phimoe": (FAMILY_REFUSALS["phimoe"][0], "PhimoeForCausalLM (phimoe)"),
        "stablelm": ("keywords_not_forwarded", "model.layers.0 (StableLmDecoderLayer)"),
    }
    for family, (reason, module) in cases.items():
        refusal = structure_refusal(Z.build(family))
        assert refusal is not None and (refusal.reason, refusal.module) == (reason, module), (family, refusal)
        assert (family in UNSERVED_RECURRENT_FAMILIES) == (
            UNSERVED_RECURRENT_FAMILIES.get(family, "?") in refusal.detail
        )


def test_unserved_hybrid_families_name_what_is_missing():
    """Falcon-H1, Zamba2, Jamba, plain Mamba-2 and MiniMax run dense, decided at initialisation, the refusal
    saying what their recurrent layers lack (the coverage matrix shows it)."""
    for family in ("zamba2", "jamba", "minimax"):
        refusal = structure_refusal(Z.build(family))
        assert refusal is not None and refusal.reason == "recurrent_layers", (family, refusal)
        assert refusal.detail.endswith(f"{family}: {UNSERVED_RECURRENT_FAMILIES[family]}"), refusal.detail
