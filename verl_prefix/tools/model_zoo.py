"""Tiny random configs of every decoder-only causal-LM family of the installed transformers.

The coverage matrix (``docs/models.md``, ``tests/tools/test_model_matrix.py``) runs each family through the
capability check and, where reuse serves it, against plain HF dense gradients. A family's own config class
is built with generic small sizes (only the attributes its defaults have) and then the family's overrides
(``FAMILY_OVERRIDES``); families the matrix does not build carry the reason (``SKIPPED``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB = 128  # ids drawn below it; every family's special ids are moved below it too
WINDOW = 16  # a sliding window shorter than the matrix's prompts
PROMPT_LEN = 40

# generic small sizes, set where a family's default config has the attribute
GENERIC: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "n_inner": 96,
    "ffn_dim": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "sliding_window": WINDOW,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": False,
    # dropout: reuse shares one prefix dropout sample across a group (DESIGN trap 7)
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "dropout": 0.0,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "summary_first_dropout": 0.0,
    "classifier_dropout": 0.0,
    "activation_dropout": 0.0,
    "router_jitter_noise": 0.0,
    "input_jitter_noise": 0.0,
    "residual_dropout": 0.0,
    "layerdrop": 0.0,
    "rotary_dim": 8,
}

_MLA = {
    "num_key_value_heads": 4,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "qk_head_dim": 24,
    "v_head_dim": 8,
    "head_dim": 8,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
}
_HYBRID = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
# gated delta-nets shrunk (their defaults: 32 value heads of 128, a 8192-channel convolution, 2 MiB of state a row)
_DELTA_NET = {
    **_HYBRID,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
_MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 8, "mamba_chunk_size": 16, "mamba_n_groups": 1}

# per family, applied after the generic sizes (any key, present in the defaults or not)
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # MLA: rope/nope/value head dims and the low-rank projections (DESIGN.md section 7)
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "glm4_moe_lite": _MLA,
    "glm_moe_dsa": {**_MLA, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8},
    "longcat_flash": {**_MLA, "num_layers": 2, "ffn_hidden_size": 96, "expert_ffn_hidden_size": 32},
    "youtu": _MLA,
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "dbrx": {
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 2,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 96, "hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "gpt_neo": {"num_layers": 2, "attention_types": [[["global", "local"], 1]], "window_size": WINDOW},
    # per-layer inputs and their table shrunk (their defaults build a 200M-parameter model)
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
        "laurel_rank": 8,
        "intermediate_size": [96] * 4,
        "activation_sparsity_pattern": [0.0] * 4,
    },
    "gemma4_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
        "global_head_dim": 16,
    },
    # hybrids: both layer kinds present in two layers
    "qwen3_next": _DELTA_NET,
    "qwen3_5_text": _DELTA_NET,
    "qwen3_5_moe_text": _DELTA_NET,
    "olmo_hybrid": _DELTA_NET,
    "minimax": _HYBRID,
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # served Mamba-2 hybrids: one scan chunk longer than the matrix's sequences (transformers' torch scan is the
    # Mamba-2 recurrence within one chunk only, ``verl_prefix.schedule.mamba``)
    "bamba": {**_MAMBA, "attn_layer_indices": [1], "mamba_chunk_size": 64},
    "granitemoehybrid": {**_MAMBA, "layer_types": ["mamba", "attention"], "mamba_chunk_size": 64},
    "falcon_h1": {**_MAMBA, "mamba_d_ssm": 128, "mamba_expand": 2},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "mamba_d_state": 8},
    "nemotron_h": {
        **_MAMBA,
        "hybrid_override_pattern": "M*",
        "layers_block_type": ["mamba", "attention"],
        "mamba_chunk_size": 64,
        "mamba_num_heads": 4,
        "mamba_head_dim": 32,
        "ssm_state_size": 8,
    },
    "zamba": {**_MAMBA, "layers_block_type": ["mamba", "hybrid"], "attn_layer_period": 2, "attn_layer_offset": 1},
    "zamba2": {**_MAMBA, "layers_block_type": ["mamba", "hybrid"], "hybrid_layer_ids": [1]},
    "mamba2": {"num_heads": 8, "head_dim": 16, "expand": 2, "n_groups": 1, "state_size": 8, "chunk_size": 16},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 64, "attention_window_size": WINDOW},
}

# families the matrix does not build, and why (the rest of the skips are decided by ``skip_reason``)
SKIPPED: dict[str, str] = {
    "phi4_multimodal": "multimodal: builds its vision and audio encoders for any config; its text decoder is Phi-3's",
    "blt": "byte latent transformer: a byte patcher and local encoder/decoder cross-attending to a global model "
    "(its 500k-row hash embeddings make even a tiny build large)",
    "dbrx": "the tiny-config builder does not size its nested attn_config/ffn_config consistently yet (its router "
    "reads another hidden size than the model's)",
    "reformer": "LSH / local-chunk attention with axial positions: not a standard causal decoder",
    "xlnet": "permutation language model (two-stream attention), not a causal decoder",
    "gemma4_assistant": "a draft (assistant) head for speculative decoding, not a standalone model",
    "gemma4_unified_assistant": "a draft (assistant) head for speculative decoding, not a standalone model",
}

# the matrix's columns, as ``docs/models.md`` names them
EXACT, DENSE, REFUSED, SKIP = "exact under reuse", "dense with a reason", "refused at initialisation", "not built"
COLUMNS = (EXACT, DENSE, REFUSED, SKIP)

# the vision-language families verl's FSDP engine trains (image-text-to-text, not in the causal-LM mapping): what
# reuse does with a batch of their visual inputs, and why (``schedule.multimodal``, ``docs/multimodal.md``)
VISION_LANGUAGE_NOTES: dict[str, str] = {
    "qwen2_5_vl": "the vision encoder runs once per group in phase A; against verl's stock fsdp2 engine in fp64 and "
    "fp32 (`tests/backend/test_multimodal_engine.py`)",
    "qwen2_vl": "verl's Qwen2.5-VL forward, a tower without windows; against the stock engine in fp64 "
    "(`tests/backend/test_multimodal_engine.py`)",
    "qwen3_vl": "deepstack features reach only prefix positions, added in phase A (sliced per chunk in a chunked "
    "prefix); against the stock engine in fp64 and fp32 (`tests/backend/test_multimodal_engine.py`)",
    "qwen3_vl_moe": "verl's Qwen3-VL forward, experts in every layer; against the stock engine in fp64 "
    "(`tests/backend/test_multimodal_engine.py`), router aux loss included",
    "qwen3_5": "verl's Qwen3.5 forward, no deepstack; its gated delta-net layers carry their state across the "
    "prefix boundary (`schedule/recurrent.py`); against the stock engine in fp64 "
    "(`tests/backend/test_multimodal_engine.py`)",
    "qwen3_5_moe": "as `qwen3_5`, experts and a shared expert in every layer; against the stock engine in fp64 "
    "(`tests/backend/test_multimodal_engine.py`)",
    "glm4v": "`multimodal`: verl patches its forward (its own rotary index and encoder call), which "
    "`schedule.multimodal` does not feed yet",
    "kimi_vl": "`multimodal`: a remote-code model verl patches (DeepSeek-V3 decoder, MoonViT tower), not fed by "
    "`schedule.multimodal` yet",
}


@dataclass(frozen=True)
class MatrixRow:
    """One family's place in the coverage matrix: its column and why (empty for exact), on one table line."""

    family: str
    status: str
    reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", " ".join(self.reason.replace("|", "/").split()))


def decoder_families() -> list[str]:
    """Every ``model_type`` of transformers' causal-LM auto mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def skip_reason(family: str) -> str | None:
    """Why the matrix does not build ``family`` (its config alone decides), or None."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if family in SKIPPED:
        return SKIPPED[family]
    try:
        defaults = CONFIG_MAPPING[family]()
    except Exception as exc:  # noqa: BLE001 - a config class that cannot build from defaults
        return f"its config class does not build from defaults ({type(exc).__name__})"
    if getattr(defaults, "is_encoder_decoder", False):
        return "encoder-decoder: the schedule serves decoder-only models"
    if defaults.get_text_config() is not defaults:
        text = getattr(defaults.get_text_config(), "model_type", "?")
        return f"composite (multimodal) config: its text decoder is the {text!r} family"
    if family in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "a masked-LM encoder family (its causal-LM head is the encoder with a decoder flag)"
    return None


def tiny_config(family: str, attn_implementation: str = "sdpa", **overrides: Any) -> Any:
    """The family's config class with the generic small sizes, its overrides, then ``overrides`` (a test's own
    shapes: one builder for every tiny config, so the families' quirks are handled in one place)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[family]
    defaults = config_class()
    known = set(defaults.to_dict())
    settable = lambda k: not isinstance(getattr(config_class, k, None), property)  # noqa: E731 - derived sizes
    kwargs = {k: v for k, v in GENERIC.items() if (k in known or hasattr(defaults, k)) and settable(k)}
    kwargs.update(FAMILY_OVERRIDES.get(family, {}))
    kwargs.update(overrides)
    config = config_class(**kwargs)
    config._attn_implementation = attn_implementation
    return config


def build(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, window: int | None = WINDOW) -> nn.Module:
    """A random-init tiny model of ``family`` in ``dtype``, in train mode, its sliding window (where it has
    one) ``window`` tokens. Experts run HF's eager loop (its default grouped_mm has no fp64 kernel)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    if window != WINDOW:
        for name in ("sliding_window", "window_size", "attention_window_size"):
            if getattr(config, name, None) is not None:
                setattr(config, name, window)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", experts_implementation="eager")
    except (ValueError, ImportError):  # a family without an sdpa path (or experts choice): its defaults
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(dtype).train()


def write_model(dir: str | os.PathLike, family: str, dtype: torch.dtype = torch.float32) -> Path:
    """``build(family)`` saved with a local tokenizer of ``VOCAB`` ids: a model directory verl's engines load
    (``verl_prefix.tools.testing.build_verl_engine``)."""
    from verl_prefix.tools.testing import write_tokenizer

    out = write_tokenizer(dir, VOCAB)
    build(family, dtype).save_pretrained(out)
    return out


def has_window(model: nn.Module) -> bool:
    """Whether some attention layer of ``model`` has a sliding window (the matrix's is ``WINDOW`` tokens)."""
    config = model.config.get_text_config()
    if getattr(config, "sliding_window", None) is None:
        return False
    types = getattr(config, "layer_types", None)
    return types is None or "sliding_attention" in types or bool(getattr(config, "use_sliding_window", True))


def classify(family: str, model: nn.Module | None = None) -> MatrixRow:
    """The family's column as the engine decides it at initialisation (``prefix_reuse.unsupported_model``'s
    default, ``dense``): not built (why), dense with the capability check's reason, or exact under reuse (which
    ``tests/tools/test_model_matrix*.py`` proves against dense). ``model``: ``build(family)`` already built."""
    from verl_prefix.schedule.capability import structure_refusal

    why = skip_reason(family)
    if why is not None:
        return MatrixRow(family, SKIP, why)
    try:
        model = build(family) if model is None else model
    except Exception as exc:  # noqa: BLE001 - the builder's limits are listed, not hidden
        error = " ".join(str(exc).split())[:300]
        return MatrixRow(family, SKIP, f"the tiny-config builder cannot build it: {type(exc).__name__}: {error}")
    refusal = structure_refusal(model)
    if refusal is not None:
        return MatrixRow(family, DENSE, refusal.message())
    return MatrixRow(family, EXACT)


def matrix_rows(families: list[str] | None = None) -> list[MatrixRow]:
    """``classify`` over every decoder family (or ``families``), sorted by family."""
    return [classify(family) for family in (families or decoder_families())]


def parse(page: str) -> list[MatrixRow]:
    """``render``'s rows back from the page (the family tables under each column's heading)."""
    rows, status = [], None
    by_heading = {f"## {s[0].upper()}{s[1:]}": s for s in COLUMNS}
    for line in page.splitlines():
        if line.startswith("## "):
            status = by_heading.get(line)
        elif status is not None and line.startswith("| `"):
            family, _, note = line[3:].partition("` | ")
            rows.append(MatrixRow(family, status, note[:-2] if note.endswith(" |") else note.rstrip("|").rstrip()))
    return rows


def vision_language_rows() -> list[MatrixRow]:
    """The vision-language families' rows: exact under reuse where ``schedule.multimodal`` serves their visual
    inputs, dense with the reason otherwise."""
    from verl_prefix.schedule.multimodal import SERVED_VISUAL_MODELS

    return [
        MatrixRow(family, EXACT if family in SERVED_VISUAL_MODELS else DENSE, note)
        for family, note in sorted(VISION_LANGUAGE_NOTES.items())
    ]


def render(rows: list[MatrixRow]) -> str:
    """``docs/models.md``: the counts per column, then one table per column."""
    import transformers

    lines = [
        "# Model coverage",
        "",
        "<!-- generated by `verl-prefix models --write docs/models.md`; "
        "tests/tools/test_model_matrix_*.py check it -->",
        "",
        f"Every `model_type` of transformers {transformers.__version__}'s causal-LM auto mapping, built from a tiny "
        "random config of its own config class (`verl_prefix.tools.model_zoo`: hidden 64, 2 layers, 4 heads / 2 "
        f"KV heads, small experts, dropout 0, a sliding window of {WINDOW} tokens where the family has one). "
        "The capability check (`verl_prefix.schedule.capability`) decides at engine initialisation whether reuse "
        "serves it; *exact under reuse* families are trained under reuse against plain HF dense gradients in fp32 "
        f"(1e-5) and fp64 (1e-10) with a {PROMPT_LEN}-token prompt (longer than the window) and a group that "
        "reuses, and under the tree schedule (`prefix_reuse.tree`) in fp64 (1e-10) with two groups behind a "
        f"{PROMPT_LEN}-token system block computed once (`tests/tools/test_model_matrix_a.py`, `_b.py`); a family "
        "that crashes or differs fails the tests.",
        "",
        "*Dense with a reason* is what the engine does under `prefix_reuse.unsupported_model: dense` (the default): "
        "every mini-batch runs through the stock path, counted as `prefix/fallback_<reason>`, one log line at "
        "initialisation naming the module. Under `unsupported_model: raise` the same families are *refused at "
        "initialisation* with that message (every data-parallel rank raises `UnsupportedModel`); the tests check "
        "both. *Not built*: families the matrix does not build, and why.",
        "",
        "| column | families |",
        "|---|---|",
    ]
    for status in COLUMNS:
        lines.append(f"| {status} | {sum(r.status == status for r in rows)} |")
    for status in COLUMNS:
        chosen = [r for r in rows if r.status == status]
        if not chosen:
            continue
        lines += ["", f"## {status[0].upper()}{status[1:]}", "", "| family | note |", "|---|---|"]
        lines += [f"| `{r.family}` | {r.reason} |" for r in chosen]
    lines += [
        "",
        "## Vision-language families",
        "",
        "The image-text-to-text families verl's FSDP engine trains, with their visual inputs in the shared prefix "
        "([multimodal.md](multimodal.md)); a batch of theirs that reuse does not serve runs dense, counted as "
        "`prefix/fallback_<reason>`.",
        "",
        "| family | status | note |",
        "|---|---|---|",
    ]
    lines += [f"| {r.family} | {r.status} | {r.reason} |" for r in vision_language_rows()]
    return "\n".join(lines) + "\n"
