"""Does the torchtitan flavor verl built match the checkpoint? verl derives the flavor from
``(hidden_size, num_hidden_layers, vocab_size)`` only, so flavors sharing those (a dense and an MoE debug
flavor) are confused silently and the checkpoint loads into the wrong architecture, or fails late. The
engine compares what it built with the HF config and refuses a mismatch, naming every field that differs.
"""

from __future__ import annotations

from typing import Any

_MOE_TYPES = {"qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4"}


def _hf_num_experts(hf: Any) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(hf, name, None)
        if value:
            return int(value)
    return 0


def _built(spec: Any) -> dict[str, Any]:
    """What the flavor builds, in HF terms (None where the flavor does not say)."""
    model = spec.model
    layers = list(getattr(model, "layers", []) or [])
    first = layers[0] if layers else None
    attention = getattr(first, "attention", None)
    moe = getattr(first, "moe", None)
    feed_forward = getattr(first, "feed_forward", None)
    w1 = getattr(feed_forward, "w1", None)
    rope = getattr(attention, "rope", None)
    return {
        "hidden_size": getattr(model, "dim", None),
        "num_hidden_layers": len(layers),
        "vocab_size": getattr(model, "vocab_size", None),
        "num_attention_heads": getattr(attention, "n_heads", None),
        "num_key_value_heads": getattr(attention, "n_kv_heads", None),
        "head_dim": getattr(attention, "head_dim", None),
        "intermediate_size": getattr(w1, "out_features", None) if moe is None else None,
        "num_experts": getattr(moe, "num_experts", 0) if moe is not None else 0,
        "rope_theta": getattr(rope, "theta", None),
        "tie_word_embeddings": getattr(model, "enable_weight_tying", None),
    }


def _expected(hf: Any) -> dict[str, Any]:
    heads = int(hf.num_attention_heads)
    rope = getattr(hf, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    experts = _hf_num_experts(hf)
    return {
        "hidden_size": int(hf.hidden_size),
        "num_hidden_layers": int(hf.num_hidden_layers),
        "vocab_size": int(hf.vocab_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(hf, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(hf, "head_dim", None) or hf.hidden_size // heads),
        "intermediate_size": None if experts else int(hf.intermediate_size),
        "num_experts": experts,
        "rope_theta": float(theta if theta is not None else getattr(hf, "rope_theta", 10000.0)),
        "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
    }


def flavor_mismatches(spec: Any, hf_config: Any) -> list[str]:
    """``field: flavor X, checkpoint Y`` for every architecture field where the two disagree."""
    built, expected = _built(spec), _expected(hf_config)
    out = []
    for key, want in expected.items():
        got = built[key]
        if got is None:
            continue  # the flavor does not state it
        if isinstance(want, float):
            same = abs(float(got) - want) <= 1e-9 * max(1.0, abs(want))
        else:
            same = got == want
        if not same:
            out.append(f"{key}: flavor {got!r}, checkpoint {want!r}")
    model_type = getattr(hf_config, "model_type", "")
    if (model_type in _MOE_TYPES) != bool(built["num_experts"]):
        out.append(f"model_type {model_type!r} with a {'MoE' if built['num_experts'] else 'dense'} flavor")
    return out


def check_flavor(spec: Any, hf_config: Any) -> None:
    """Refuse a flavor that does not match the checkpoint (the model would be another architecture)."""
    mismatches = flavor_mismatches(spec, hf_config)
    if mismatches:
        raise ValueError(
            f"prefix_torchtitan: torchtitan flavor {spec.name}/{spec.flavor} does not match the checkpoint "
            f"({'; '.join(mismatches)}); verl picks the flavor by hidden size, layers and vocabulary only"
        )
