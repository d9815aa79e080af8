"""Every keyword HF hands an attention function is honoured by the prefix attention or refused, never dropped.

The prefix attention (``kv.seam``) stands in for the model's own attention function during phases A and
B, so each keyword a model passes (``attention_interface(..., softcap=..., s_aux=..., **kwargs)``) must
either change reuse's maths exactly as it changes the dense function's, change nothing in either, or stop
the call with the keyword's name (``AttentionKeywordRefused``). Keywords nobody declared here are refused
when they carry a value (anything but None or False): a new transformers keyword cannot be swallowed by a
``**kwargs``. ``tests/schedule/test_attention_keywords.py`` walks what transformers' attention functions
accept and what its model families pass, and fails on any keyword missing from these tables.

What "the dense function" is depends on the model's ``attn_implementation`` (``dense_keywords``):
flash attention and eager apply ``softcap`` and sinks (``s_aux``), so reuse applies them in every path
(``scored_keywords``: the scores are built in plain torch ops; ``kv.contexts.scored_attention``,
``attention.merged.scored_merged_attention``). transformers' sdpa function takes neither and computes
without them, so under sdpa reuse computes without them too (exact to dense) and says so once in the log.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

# keyword -> how reuse honours it (values it cannot honour are refused by ``check_attention_keywords``)
HONOURED: dict[str, str] = {
    "query": "the queries (positional in HF's signature)",
    "key": "the keys: phase A captures them, phase B attends to the prefix's and its own",
    "value": "the values, as the keys",
    "attention_mask": (
        "replaced by the schedule's own mask: a prefix row attends causally over itself, a suffix row to the "
        "whole prefix and causally over itself; the rows are right-padded, which needs no key mask"
    ),
    "scaling": "the softmax scale of every path (phase A, concat, merged, merged_varlen)",
    "softcap": (
        "scores capped as softcap * tanh(s / softcap) before the mask and softmax in phase A and concat, and "
        "before each part's own log-sum-exp in merged (the merge stays exact), wherever the dense function "
        "applies it (flash attention, eager); transformers' sdpa ignores it, and so does reuse under sdpa"
    ),
    "s_aux": (
        "attention sinks: one more logit per query head in every softmax denominator, with no value (merged: "
        "a third part of the log-sum-exp merge); wherever the dense function applies them (flash attention, "
        "eager); transformers' sdpa ignores them, and so does reuse under sdpa; refused under Ulysses"
    ),
    "sliding_window": (
        "HF's rule (query q sees key k iff q - W < k <= q) in phase A, chunked phase A, concat and merged: the "
        "prefix cut to its last W - 1 positions with a banded mask (schedule.attention.windows); a window covering "
        "every key of the call changes nothing and runs the plain paths; a positive integer only"
    ),
    "dropout": (
        "a rate of 0 only; a positive rate is refused: reuse would share one prefix dropout sample across "
        "the group (DESIGN.md trap 7; the engine runs such mini-batches dense first: prefix/fallback_dropout)"
    ),
    "is_causal": "causal (True, or None with a causal module) only; bidirectional attention is refused",
    "position_ids": (
        "RoPE consumed them before attention; flash attention reads them only to find packed sequences, and "
        "the schedule's rows are never packed (each row is one sequence)"
    ),
}

# keyword -> why it changes nothing the loss sees
NO_EFFECT: dict[str, str] = {
    "use_cache": "a cache flag the model reads; the schedule passes use_cache=False and keeps no cache",
    "output_attentions": "attention weights are returned, not used by the loss (sdpa and merged return None)",
    "output_hidden_states": "read by the model, not by attention",
    "output_router_logits": "read by the model, not by attention (the MoE aux loss has its own hooks)",
    "num_items_in_batch": "a loss normaliser the model reads, not attention",
    "deterministic": "flash-attn's reduction order, not its result",
    "second_per_grid_ts": (
        "Qwen2.5-VL's video frame timing, which verl's data set already turned into the rows' rotary positions; "
        "verl's forward hands it on to every layer, and attention reads it nowhere"
    ),
    "images_seqlens": (
        "each image's patch count, which verl's agent loop adds to every row's multi_modal_inputs for its FLOP "
        "counter; verl's forward hands it on to every layer, and attention reads it nowhere"
    ),
}

# keyword -> why reuse cannot serve a value (None or False is accepted: the feature is off)
REFUSED: dict[str, str] = {
    "cu_seq_lens_q": "packed sequences: the schedule's masks would let a row see another row's tokens",
    "cu_seq_lens_k": "packed sequences: the schedule's masks would let a row see another row's tokens",
    "max_length_q": "packed sequences (goes with cu_seq_lens_q)",
    "max_length_k": "packed sequences (goes with cu_seq_lens_k)",
    "max_seqlen_q": "packed sequences (paged attention)",
    "max_seqlen_k": "packed sequences (paged attention)",
    "seq_idx": "packed sequences (sequence index of each token)",
    "cache": "paged attention's KV cache (generation, not training)",
    "block_table": "paged attention's block table (generation, not training)",
    "indices": "sparse attention over selected keys (DeepSeek sparse attention): the prefix would be attended whole",
}

# keywords the dense function ignores under each implementation kind (``dense_keywords``)
DENSE_IGNORES = {"sdpa": ("softcap", "s_aux"), "eager": (), "flash": ()}

LOGGED: set[str] = set()


class AttentionKeywordRefused(ValueError):
    """An attention call carries a keyword value the prefix attention cannot honour exactly."""

    def __init__(self, name: str, value: Any, reason: str) -> None:
        self.name, self.reason = name, reason
        shown = f"tensor of shape {tuple(value.shape)}" if hasattr(value, "shape") else repr(value)
        super().__init__(
            f"prefix reuse cannot honour the attention keyword {name}={shown}: {reason}. Dense training honours "
            "it; run this model without prefix reuse: +actor_rollout_ref.actor.prefix_reuse.enable=false (with "
            "actor_rollout_ref.actor._target_=verl_prefix.PrefixFSDPActorConfig; no '+' where the YAML has the key)"
        )


def dense_keywords(kind: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords as the model's dense attention function of ``kind`` ("sdpa", "eager", "flash") uses
    them: those it ignores (``DENSE_IGNORES``) are dropped, once logged, so reuse computes what dense does."""
    ignored = [name for name in DENSE_IGNORES[kind] if kwargs.get(name) is not None]
    if not ignored:
        return kwargs
    for name in ignored:
        if f"{kind}:{name}" not in LOGGED:
            LOGGED.add(f"{kind}:{name}")
            logger.warning(
                "the model passes %s to attention, which transformers' %s attention ignores: dense computes "
                "without it and so does prefix reuse; attn_implementation=eager or flash_attention_2 applies it",
                name,
                kind,
            )
    return {name: value for name, value in kwargs.items() if name not in ignored}


def scored_keywords(kwargs: dict[str, Any]) -> bool:
    """Whether the call needs scores built in plain torch ops: softcapping or sinks (no fused kernel here
    takes them)."""
    return bool(kwargs.get("softcap")) or kwargs.get("s_aux") is not None


def _value_refusal(name: str, value: Any, module: nn.Module) -> str | None:
    if name == "dropout" and float(value or 0.0) > 0.0:
        return "a positive attention dropout rate would share one prefix dropout sample across the group"
    if name == "is_causal" and not (getattr(module, "is_causal", True) if value is None else value):
        return "bidirectional attention: the schedule's prefix and suffix masks are causal"
    if name == "sliding_window" and value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
        return "a sliding window is a positive number of keys (query q sees key k iff q - W < k <= q)"
    return None


def check_attention_keywords(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise ``AttentionKeywordRefused`` for the first keyword reuse cannot honour."""
    for name, value in kwargs.items():
        if name in NO_EFFECT:
            continue
        if name in HONOURED:
            reason = _value_refusal(name, value, module)
        elif value is None or value is False:
            continue  # a refused or unknown feature that is off
        else:
            reason = REFUSED.get(name, "a keyword verl-prefix does not know: it cannot tell what it changes")
        if reason is not None:
            raise AttentionKeywordRefused(name, value, reason)
    if "is_causal" not in kwargs:  # the dense functions then read the module's own flag
        reason = _value_refusal("is_causal", None, module)
        if reason is not None:
            raise AttentionKeywordRefused("is_causal", None, reason)
