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
RESPONSE_LENS = (5, 9, 3)  # the matrix's group (G = 3) behind one prompt
LONGEST = PROMPT_LEN + max(RESPONSE_LENS)  # the longest sequence the matrix trains (its tree layout's too)

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
    # Mamba-2 recurrence within one chunk only, ``verl_prefix.schedule.models.mamba``)
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

# The matrix builds each family twice where it has lengths besides the window (DESIGN trap 19: a tiny config that
# keeps a family's default lengths never crosses their boundaries): at the family's own defaults (``DEFAULT_LENGTHS``,
# the window shrunk to ``WINDOW``) and with every length shrunk below the prompt (``SHORT_LENGTHS``).
DEFAULT_LENGTHS, SHORT_LENGTHS = "default", "short"
LENGTH_CASES = (DEFAULT_LENGTHS, SHORT_LENGTHS)
SHORT = 12  # a length the matrix's 40-token prompts cross three times (at 12, 24 and 36)
SHORT_KERNEL = 2  # the shortest causal convolution: one token of context crosses the prefix boundary

# length attributes -> their short value, set where the family's default config has the attribute
SHORT_VALUES: dict[str, Any] = {
    # attention that changes along the sequence
    "attention_chunk_size": SHORT,  # Llama-4's chunked attention
    "floor_scale": SHORT,  # Llama-4's NoPE temperature tuning: the query scale steps at its multiples
    "original_max_position_embeddings": SHORT,  # long RoPE's switch to the long factors (Phi-3)
    "keep_window_size": SHORT,  # Doge's dynamic mask
    "block_size": SHORT,  # MiniMax's lightning-attention blocks
    # scans and convolutions along the sequence
    "mamba_chunk_size": SHORT,
    "chunk_size": SHORT,
    "conv_kernel": SHORT_KERNEL,
    "mamba_d_conv": SHORT_KERNEL,
    "conv_L_cache": SHORT_KERNEL,
    "linear_conv_kernel_dim": SHORT_KERNEL,
    "conv1d_width": SHORT_KERNEL,
    # which layers are local or position-free: periods and switches short enough for both kinds in two layers
    "global_attn_every_n_layers": 2,
    "sliding_window_pattern": 2,
    "no_rope_layer_interval": 2,
    "max_window_layers": 1,
    "use_sliding_window": True,
}
# per family, applied after ``SHORT_VALUES`` (constructor arguments the defaults do not list, nested lengths)
SHORT_FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # Phi-3's long-context releases: long RoPE, whose frequencies switch past ``original_max_position_embeddings``
    "phi3": {
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,  # one per rotary frequency (head_dim 16)
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": SHORT,
        }
    },
    "deepseek_v4": {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}},
}
# attention layer kinds a two-layer short build must all hold when the family's full-size defaults interleave them
_ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")

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
# reuse does with a batch of their visual inputs, and why (``schedule.models.multimodal``, ``docs/multimodal.md``)
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
    "prefix boundary (`schedule/models/recurrent.py`); against the stock engine in fp64 "
    "(`tests/backend/test_multimodal_engine.py`)",
    "qwen3_5_moe": "as `qwen3_5`, experts and a shared expert in every layer; against the stock engine in fp64 "
    "(`tests/backend/test_multimodal_engine.py`)",
    "glm4v": "`multimodal`: verl patches its forward (its own rotary index and encoder call), which "
    "`schedule.models.multimodal` does not feed yet",
    "kimi_vl": "`multimodal`: a remote-code model verl patches (DeepSeek-V3 decoder, MoonViT tower), not fed by "
    "`schedule.models.multimodal` yet",
}


@dataclass(frozen=True)
class MatrixRow:
    """One family's place in the coverage matrix: its column and why (a note, or empty, for exact), the lengths it
    was tested at (``describe_lengths``), on one table line."""

    family: str
    status: str
    reason: str = ""
    lengths: str = ""

    def __post_init__(self) -> None:
        for name in ("reason", "lengths"):
            object.__setattr__(self, name, " ".join(getattr(self, name).replace("|", "/").split()))


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


def tiny_config(
    family: str, attn_implementation: str = "sdpa", lengths: str = DEFAULT_LENGTHS, **overrides: Any
) -> Any:
    """The family's config class with the generic small sizes, its overrides, its short lengths
    (``lengths=SHORT_LENGTHS``: ``short_length_overrides``), then ``overrides`` (a test's own shapes: one builder for
    every tiny config, so the families' quirks are handled in one place)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[family]
    defaults = config_class()
    known = set(defaults.to_dict())
    settable = lambda k: not isinstance(getattr(config_class, k, None), property)  # noqa: E731 - derived sizes
    kwargs = {k: v for k, v in GENERIC.items() if (k in known or hasattr(defaults, k)) and settable(k)}
    kwargs.update(FAMILY_OVERRIDES.get(family, {}))
    if lengths == SHORT_LENGTHS:
        kwargs.update(short_length_overrides(family))
    elif lengths != DEFAULT_LENGTHS:
        raise ValueError(f"lengths must be one of {LENGTH_CASES}, got {lengths!r}")
    kwargs.update(overrides)
    config = config_class(**kwargs)
    config._attn_implementation = attn_implementation
    return config


def short_length_overrides(family: str) -> dict[str, Any]:
    """What the short-lengths build sets on top of the default build: every length attribute of ``SHORT_VALUES``
    the family's config has, a nested RoPE ``original_max_position_embeddings``, the family's
    ``SHORT_FAMILY_OVERRIDES``, and ``layer_types`` holding every attention kind (full, sliding, chunked) its
    full-size defaults interleave (or its window allows) where two layers would otherwise miss one. Empty: the
    family has no length besides the window."""
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[family]()
    base = tiny_config(family)
    settable = lambda k: not isinstance(getattr(type(base), k, None), property)  # noqa: E731 - derived sizes
    changes = {k: v for k, v in SHORT_VALUES.items() if settable(k) and _built_value(family, base, k) not in (None, v)}
    rope = getattr(base, "rope_parameters", None)
    if isinstance(rope, dict):
        shortened = _short_rope(rope)
        if shortened != rope:
            changes["rope_parameters"] = shortened
    changes.update(SHORT_FAMILY_OVERRIDES.get(family, {}))
    types = getattr(defaults, "layer_types", None)
    if isinstance(types, list) and "layer_types" not in FAMILY_OVERRIDES.get(family, {}):
        kinds = list(dict.fromkeys(types))
        if getattr(base, "sliding_window", None) and "sliding_attention" not in kinds:
            kinds.append("sliding_attention")  # a window its default layer types never use
        if set(kinds) <= set(_ATTENTION_KINDS) and len(kinds) <= base.num_hidden_layers:
            short = tiny_config(family, **changes)
            if not set(kinds) <= set(short.layer_types):
                layers = base.num_hidden_layers
                changes["layer_types"] = kinds + kinds[-1:] * (layers - len(kinds))
    return changes


def _built_value(family: str, config: Any, name: str) -> Any:
    """``name`` as the default build sets it: the family's override (an alias such as Nemotron-H's
    ``mamba_chunk_size``, which the config folds into ``chunk_size``) or the config's attribute; None: absent."""
    overrides = FAMILY_OVERRIDES.get(family, {})
    if name in overrides:
        return overrides[name]
    return getattr(config, name, None) if name in config.to_dict() else None


def _short_rope(rope: dict[str, Any]) -> dict[str, Any]:
    """``rope`` with each ``original_max_position_embeddings`` (top level or per layer type) set to ``SHORT``."""
    out = {}
    for key, value in rope.items():
        if isinstance(value, dict):
            value = _short_rope(value)
        elif key == "original_max_position_embeddings" and value is not None:
            value = SHORT
        out[key] = value
    return out


def build(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, lengths: str = DEFAULT_LENGTHS) -> nn.Module:
    """A random-init tiny model of ``family`` in ``dtype``, in train mode, its sliding window (where it has one)
    ``WINDOW`` tokens and its other lengths the family's defaults or short (``lengths``). Experts run HF's eager
    loop (its default grouped_mm has no fp64 kernel)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, lengths=lengths)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", experts_implementation="eager")
    except (ValueError, ImportError):  # a family without an sdpa path (or experts choice): its defaults
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(dtype).train()


def write_model(dir: str | os.PathLike, family: str, dtype: torch.dtype = torch.float32) -> Path:
    """``build(family)`` saved with a local tokenizer of ``VOCAB`` ids: a model directory verl's engines load
    (``verl_prefix.harness.verl_engine.build_verl_engine``)."""
    from verl_prefix.harness.tiny_models import write_tokenizer

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


def length_changes(family: str) -> list[tuple[str, Any, Any]]:
    """``(attribute, short value, default value)`` for each length the short build changes (nested RoPE and
    compression-rate entries as ``parent.key``); empty where the family has no length besides the window."""
    base = tiny_config(family)
    changes: list[tuple[str, Any, Any]] = []
    for name, short in short_length_overrides(family).items():
        changes += _flat_changes(name, short, _built_value(family, base, name))
    return changes


def _flat_changes(name: str, short: Any, default: Any) -> list[tuple[str, Any, Any]]:
    if isinstance(short, dict) and isinstance(default, dict):
        keys = dict.fromkeys([*short, *default])
        return [c for k in keys for c in _flat_changes(f"{name}.{k}", short.get(k), default.get(k))]
    return [] if short == default else [(name, short, default)]


def _length_value(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "/".join(v.removesuffix("_attention") for v in value)
    if isinstance(value, list) and len(set(value)) == 1:
        return f"{value[0]} x{len(value)}"
    return "unset" if value is None else str(value)


def describe_lengths(family: str, windowed: bool) -> str:
    """The lengths column: the window (``windowed``: the family has one), then each length at its short value and
    at the default build's (``length_changes``), e.g. "window 16; `attention_chunk_size` 12 and 8192 (default)"."""
    parts = [f"window {WINDOW}"] if windowed else []
    changes = [c for c in length_changes(family) if not c[0].endswith("_factor")]  # RoPE factors: not lengths
    parts += [f"`{n}` {_length_value(s)} and {_length_value(d)} (default)" for n, s, d in changes]
    return "; ".join(parts) or "none"


def batch_fallback_reason(model: nn.Module, sequences: list[torch.Tensor]) -> str | None:
    """The engine's per-mini-batch reason from the model's lengths for a batch of these sequences
    (``fallbacks.length_fallback_reason``: undeclared windows, dynamic/long RoPE, Mamba-2 past one scan chunk), or
    None: the matrix calls the schedule directly, so what the engine would run dense is asked of the same
    function rather than assumed."""
    from tensordict import TensorDict

    from verl_prefix.backend import fallbacks

    ids = torch.nested.as_nested_tensor([s.long() for s in sequences], layout=torch.jagged)
    positions = torch.nested.as_nested_tensor([torch.arange(len(s)) for s in sequences], layout=torch.jagged)
    data = TensorDict({"input_ids": ids, "position_ids": positions}, batch_size=[len(sequences)])
    return fallbacks.length_fallback_reason(model, data)


def case_outcome(model: nn.Module) -> tuple[str, str]:
    """One build's outcome on the matrix's batches: ``(EXACT, "")``, ``(DENSE, message)`` refused at initialisation
    by the capability check, or ``(DENSE, "`reason` per batch")`` (``batch_fallback_reason`` on a sequence of
    ``LONGEST`` tokens)."""
    from verl_prefix.schedule.models.capability import structure_refusal

    refusal = structure_refusal(model)
    if refusal is not None:
        return DENSE, refusal.message()
    reason = batch_fallback_reason(model, [torch.zeros(LONGEST, dtype=torch.long)])
    return (DENSE, f"`{reason}` per batch") if reason is not None else (EXACT, "")


def mamba_chunk_note(model: nn.Module) -> str:
    """Beside a served Mamba-2 hybrid's row: reuse serves it only within one scan chunk (empty for other
    families)."""
    from verl_prefix.schedule.models.mamba import single_chunk_limit

    limit = single_chunk_limit(model)
    if limit is None:
        return ""
    return (
        f"served only within one scan chunk (`mamba_chunk_size`, {limit} tokens in the default build): longer "
        "sequences run dense as `mamba_multichunk` (transformers' torch multi-chunk scan is not the recurrence); "
        "on a GPU with mamba_ssm's kernels (the stock path then) every length reuses"
    )


def classify(family: str, model: nn.Module | None = None, short_model: nn.Module | None = None) -> MatrixRow:
    """The family's column as the engine decides it at initialisation (``prefix_reuse.unsupported_model``'s
    default, ``dense``): not built (why), dense with the capability check's reason, or exact under reuse (which
    ``tests/tools/test_model_matrix*.py`` proves against dense), from the default build; the lengths column adds
    the short build's outcome where it differs (``case_outcome``). ``model`` / ``short_model``: ``build(family)``
    / ``build(family, lengths=SHORT_LENGTHS)`` already built."""
    why = skip_reason(family)
    if why is not None:
        return MatrixRow(family, SKIP, why)
    try:
        model = build(family) if model is None else model
    except Exception as exc:  # noqa: BLE001 - the builder's limits are listed, not hidden
        return MatrixRow(family, SKIP, f"the tiny-config builder cannot build it: {_error(exc)}")
    status, reason = case_outcome(model)
    notes = []
    if status == DENSE and reason.endswith(" per batch"):  # served at init, dense on the matrix's batches
        notes.append(f"at the defaults: dense, {reason}")
        status, reason = EXACT, ""
    windowed = has_window(model)
    if length_changes(family):
        try:
            short_model = build(family, lengths=SHORT_LENGTHS) if short_model is None else short_model
        except Exception as exc:  # noqa: BLE001 - listed (and failed by the matrix tests), not hidden
            notes.append(f"the short lengths do not build: {_error(exc)}")
        else:
            windowed = windowed or has_window(short_model)
            short_status, short_reason = case_outcome(short_model)
            if (short_status, short_reason) != (status, reason):
                notes.append(f"at the short lengths: {'exact under reuse' if short_status == EXACT else 'dense'}")
                notes[-1] += f", {short_reason}" if short_reason else ""
    lengths = "; ".join([describe_lengths(family, windowed), *notes])
    if status == EXACT:
        reason = mamba_chunk_note(model)
    return MatrixRow(family, status, reason, lengths)


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def matrix_rows(families: list[str] | None = None) -> list[MatrixRow]:
    """``classify`` over every decoder family (or ``families``), sorted by family."""
    return [classify(family) for family in (families or decoder_families())]


def parse(page: str) -> list[MatrixRow]:
    """``render``'s rows back from the page (the family tables under each column's heading: family, lengths,
    note)."""
    rows, status = [], None
    by_heading = {f"## {s[0].upper()}{s[1:]}": s for s in COLUMNS}
    for line in page.splitlines():
        if line.startswith("## "):
            status = by_heading.get(line)
        elif status is not None and line.startswith("| `"):
            family, _, rest = line[3:].partition("` | ")
            lengths, _, note = rest.partition(" | ")
            rows.append(MatrixRow(family, status, note.rstrip().removesuffix("|"), lengths))
    return rows


def vision_language_rows() -> list[MatrixRow]:
    """The vision-language families' rows: exact under reuse where ``schedule.models.multimodal`` serves their visual
    inputs, dense with the reason otherwise."""
    from verl_prefix.schedule.models.multimodal import SERVED_VISUAL_MODELS

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
        "random config of its own config class (`verl_prefix.harness.model_zoo`: hidden 64, 2 layers, 4 heads / 2 "
        f"KV heads, small experts, dropout 0, a sliding window of {WINDOW} tokens where the family has one). "
        "The capability check (`verl_prefix.schedule.models.capability`) decides at engine initialisation whether "
        "reuse serves it; *exact under reuse* families are trained under reuse against plain HF dense gradients in "
        f"fp32 (1e-5) and fp64 (1e-10) with a {PROMPT_LEN}-token prompt (longer than the window) and a group that "
        "reuses, and under the tree schedule (`prefix_reuse.tree`) in fp64 (1e-10) with two groups behind a "
        f"{PROMPT_LEN}-token system block computed once (`tests/tools/test_model_matrix_a.py`, `_b.py`); a family "
        "that crashes or differs fails the tests.",
        "",
        "*Lengths*: a tiny config that keeps a family's default lengths never crosses their boundaries with a "
        f"{PROMPT_LEN}-token prompt. A family with lengths besides the window (attention chunks, temperature-tuning "
        "floors, compression rates, scan chunks, convolution kernels, local/global layer periods and switches, "
        "long-RoPE switches: `model_zoo.SHORT_VALUES`, found by attribute name on the family's config, and "
        "`SHORT_FAMILY_OVERRIDES`) is built and checked twice: at the default build's lengths and with each one "
        f"short ({SHORT} tokens, crossed several times by the prompt; convolution kernels {SHORT_KERNEL}; layer "
        "periods 2, so both layer kinds meet in two layers). The lengths column names both values; where the "
        "short build's outcome differs from the family's column it says so: dense at initialisation with the "
        "capability check's reason, or dense per batch with the engine's reason "
        "(`fallbacks.length_fallback_reason`, asked of the same batches the matrix trains). Each build is held "
        "to its own outcome: exact under reuse, or dense with that reason.",
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
        lines += ["", f"## {status[0].upper()}{status[1:]}", "", "| family | lengths | note |", "|---|---|---|"]
        lines += [f"| `{r.family}` | {r.lengths} | {r.reason} |" for r in chosen]
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
