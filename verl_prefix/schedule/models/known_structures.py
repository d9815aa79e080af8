"""The structures reuse knows: an allowlist of layer types and mask-shaping attributes (DESIGN trap 19).

Reuse is exact only where phase B can rebuild, from the prefix K/V, every key a suffix query sees in dense. Which
keys those are is decided by a layer's type (``config.layer_types``: full, sliding, chunked, compressed...) and
by attributes of the config and of the attention modules (a window, a chunk, a compression rate, an indexer's
top-k, sinks, a bidirectional span). A new transformers adds new ones, and a check that only refuses what it
knows to refuse would serve them silently wrong. So each value must be listed here:

* served (``SERVED_LAYER_TYPES``, ``SERVED_ATTRIBUTES``): reuse computes what dense computes; for the recurrent,
  convolution and hybrid kinds the module checks of ``schedule.models.capability`` still decide per module;
* refused with a reason (``REFUSED_LAYER_TYPES``, ``REFUSED_ATTRIBUTES``): the model runs dense,
  ``prefix/fallback_<reason>``;
* for attribute names that only look mask-shaping (``MASK_NAME_PATTERN``), unrelated (``UNRELATED_ATTRIBUTES``,
  with why: an MoE top-k, a scan chunk, a token id).

Anything else refuses as ``unknown_structure:<name>`` (``unknown_reason``): the model trains dense until someone
decides. ``tests/schedule/test_known_structures.py`` walks the installed transformers (every allowed layer type,
every decoder family's default config and attention module) and fails on a name none of these tables lists.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from torch import nn

# config attributes that list one kind per decoder layer
LAYER_TYPE_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types")

_MODULE_CHECKS = "the module checks decide per module (schedule.models.capability)"
_POSITION_WISE = "a position-wise feed-forward block: a token's output reads no other token"

# layer type -> how reuse serves it
SERVED_LAYER_TYPES: dict[str, str] = {
    "full_attention": "causal attention over every earlier key: the prefix K/V and the suffix's own",
    "attention": "a hybrid's attention layer (Nemotron-H, Granite-4, Zamba, RecurrentGemma): causal attention",
    "sliding_attention": "the window each module hands HF's attention interface (schedule.attention.windows)",
    "chunked_attention": "attention within chunks of attention_chunk_size keys (Llama-4): the prefix part a suffix "
    "query sees is the prefix's tail inside the query's chunk (schedule.attention.windows)",
    "linear_attention": f"a recurrent mixer (gated delta-net, lightning attention): its state is carried across "
    f"the prefix boundary where schedule.models.recurrent serves it; {_MODULE_CHECKS}",
    "mamba": f"a Mamba mixer: served where schedule.models.mamba continues it; {_MODULE_CHECKS}",
    "recurrent": f"RecurrentGemma's RG-LRU block; {_MODULE_CHECKS}",
    "hybrid": f"Zamba's attention beside a Mamba mixer; {_MODULE_CHECKS}",
    "conv": f"a short convolution: LFM2's tail is carried across the boundary; {_MODULE_CHECKS}",
    "dense": _POSITION_WISE,
    "sparse": f"{_POSITION_WISE} (sparse: routed experts)",
    "moe": f"{_POSITION_WISE} (routed experts)",
    "hash_moe": f"{_POSITION_WISE} (DeepSeek-V4: experts looked up from the token id)",
    "mlp": _POSITION_WISE,
}

_COMPRESSED = (
    "compressed_attention",
    "compressed attention (DeepSeek-V4): every compress_rate tokens are pooled into one compressed key, and the "
    "compressed blocks a suffix query sees pool prefix and suffix tokens across the boundary, which phase B cannot "
    "rebuild from the prefix K/V (whatever the rate: only a sequence shorter than one block has no compressed key)",
)
# layer type -> (reason, what phase B cannot rebuild)
REFUSED_LAYER_TYPES: dict[str, tuple[str, str]] = {
    "heavily_compressed_attention": _COMPRESSED,
    "compressed_sparse_attention": (
        _COMPRESSED[0],
        f"{_COMPRESSED[1]}; an indexer also selects the top-k compressed keys from the whole sequence",
    ),
}

# what a config attribute or an attention module's attribute may be named when it decides which keys a query sees
MASK_NAME_PATTERN = re.compile(
    r"window|chunk|compress|spars|index|sink|bidirectional|causal|block_size|top_?k|local|global|mask|span|stride|"
    r"dynamic|dilat",
    re.IGNORECASE,
)

# attribute -> how reuse serves it
SERVED_ATTRIBUTES: dict[str, str] = {
    "sliding_window": "the window the modules hand attention, served in phase A and B (schedule.attention.windows); "
    "one the config declares but no module carries runs dense per batch (prefix/fallback_sliding_window)",
    "use_sliding_window": "turns sliding_window on (Qwen2 family): served as sliding_window",
    "max_window_layers": "which layers get sliding_window (Qwen2 family): the modules carry it",
    "sliding_window_pattern": "which layers slide (EXAONE-4, Cohere-2): the modules carry sliding_window",
    "prefix_dense_sliding_window_pattern": "which layers slide (Cohere-2-MoE): the modules carry sliding_window",
    "global_attn_every_n_layers": "which layers attend fully, the rest slide (AFMoE, ModernBERT-decoder): derives "
    "layer_types",
    "local_attention": "ModernBERT-decoder's local span: its config derives sliding_window from it",
    "attention_window_size": "RecurrentGemma's name for sliding_window (its attribute_map)",
    "is_local_attention": "marks a sliding layer (AFMoE, Laguna); its window is sliding_window",
    "attention_chunk_size": "Llama-4's chunked attention: served with the chunked_attention layers",
    "sinks": "attention sinks, one logit per head in every softmax denominator (s_aux, schedule.attention.keywords)",
    "kv_shared_layer_index": "the earlier layer whose K/V a KV-shared layer reads "
    "(schedule.models.structure.kv_sources)",
}

_BIDIRECTIONAL = ("bidirectional_attention", "bidirectional attention; the schedule's masks are causal")
_SPARSE = (
    "sparse_attention",
    "sparse attention over keys a learned indexer selects from the whole sequence: phase B would attend to the "
    "whole prefix",
)
# attribute -> (reason, why) for a value that is active (``active``)
REFUSED_ATTRIBUTES: dict[str, tuple[str, str]] = {
    "is_causal": _BIDIRECTIONAL,
    "causal": _BIDIRECTIONAL,
    "use_bidirectional_attention": _BIDIRECTIONAL,
    "compress_rates": _COMPRESSED,
    "compressor": _COMPRESSED,
    "index_topk": _SPARSE,
    "index_n_heads": _SPARSE,
    "index_head_dim": _SPARSE,
    "indexer": _SPARSE,
    "indexer_types": _SPARSE,
    "skip_topk": _SPARSE,
    "next_skip_topk": _SPARSE,
    "keep_window_size": (
        "content_dependent_mask",
        "a dynamic mask that keeps the keys whose value-derived score is in the top keep_window_size (Doge), which "
        "a suffix row cannot rebuild for prefix keys it never computed",
    ),
    "window_size": (
        "unserved_window",
        "a local attention window the model applies through its own mask (GPT-Neo), not as the sliding_window "
        "HF's attention interface receives",
    ),
    "block_size": (
        "block_sparse_attention",
        "block-sparse attention (BigBird: random and global blocks); MiniMax's lightning-attention block size goes "
        "with its recurrent layers, refused first",
    ),
    **{
        name: ("attention_outside_interface", "Reformer's local-chunk and LSH attention, its own attention modules")
        for name in (
            "local_attn_chunk_length",
            "local_num_chunks_after",
            "local_num_chunks_before",
            "lsh_attn_chunk_length",
            "lsh_num_chunks_after",
            "lsh_num_chunks_before",
            "local_attention_probs_dropout_prob",
        )
    },
}

_TOP_K = "an MoE router's top-k or its normalisation: per token, not which keys a query sees"
_SCAN = "a recurrent scan's or kernel's chunking (the recurrent layers are checked per module)"
# attribute -> why it does not decide which keys a query sees (its name only looks like it)
UNRELATED_ATTRIBUTES: dict[str, str] = {
    "chunk_size_feed_forward": "transformers' feed-forward chunking: position-wise",
    "chunk_size_lm_head": "Reformer's LM-head chunking: position-wise",
    "chunk_size": _SCAN,
    "mamba_chunk_size": f"{_SCAN}; past one chunk the batch runs dense (prefix/fallback_mamba_multichunk)",
    "chunkwise_kernel": _SCAN,
    "max_inference_chunksize": _SCAN,
    "compress_rope_theta": "the RoPE base of DeepSeek-V4's compressed keys (compress_rates is refused)",
    "hc_sinkhorn_iters": "DeepSeek-V4's hyper-connection mixing of residual streams: per token",
    "activation_sparsity_pattern": "Gemma-3n's activation sparsity in the feed-forward block: per token",
    "decoder_sparse_step": "which layers hold experts",
    "moe_layer_start_index": "which layers hold experts",
    "moe_layer_end_index": "which layers hold experts",
    "norm_topk_prob": _TOP_K,
    "topk_group": _TOP_K,
    "topk_method": _TOP_K,
    "moe_topk": _TOP_K,
    "top_k": f"{_TOP_K} (JetMoE's mixture of attention heads picks query experts per token)",
    "top_k_experts": _TOP_K,
    "centroid_intermediate_top_k": "a speculative-decoding draft head's vocabulary shortlist: per token",
    "num_local_experts": "an expert count",
    "global_head_dim": "the head size of Gemma-4's full-attention layers",
    "num_global_key_value_heads": "the K/V head count of Gemma-4's full-attention layers",
    "global_config": "BLT's global transformer's sizes (BLT is not built)",
    "mask_value": "the fill value of a masked score (GPT-BigCode); which keys are masked is the causal mask's",
    "mask_token_id": "a token id",
    "mask_index": "a token id",
    "unk_index": "a token id",
    **{
        name: "SpecAugment masking of audio features (Whisper's encoder, not the decoder's attention)"
        for name in (
            "mask_feature_length",
            "mask_feature_min_masks",
            "mask_feature_prob",
            "mask_time_length",
            "mask_time_min_masks",
            "mask_time_prob",
        )
    },
}


def _causal_off(value: object) -> bool:
    return value is False


def _bidirectional_text(value: object) -> bool:
    """Gemma's ``use_bidirectional_attention``: True or "all" make every layer bidirectional; "vision" only the
    image tokens' blocks (text rows stay causal, and a batch with visual inputs of a family reuse does not feed
    runs dense per batch: ``prefix/fallback_multimodal``)."""
    return bool(value) and value != "vision"


# attribute -> when its value is active; the rest are active when set (not None, False, 0 or empty)
ACTIVE: dict[str, Callable[[object], bool]] = {
    "is_causal": _causal_off,
    "causal": _causal_off,
    "use_bidirectional_attention": _bidirectional_text,
}

# attribute -> the layer types it configures: inactive where the config's ``layer_types`` lists none of them (a
# DeepSeek-V4 of sliding layers only carries compress_rates and indexer sizes it never builds; GLM-MoE-DSA lists no
# layer types and builds an indexer in every layer)
CONFIGURES_LAYER_TYPES: dict[str, tuple[str, ...]] = {
    "compress_rates": tuple(REFUSED_LAYER_TYPES),
    "index_topk": ("compressed_sparse_attention",),
    "index_n_heads": ("compressed_sparse_attention",),
    "index_head_dim": ("compressed_sparse_attention",),
}


def active(name: str, value: object, owner: object = None) -> bool:
    """Whether ``value`` of attribute ``name`` (of ``owner``, a config or module) changes which keys a query sees
    from plain causal attention."""
    if name in ACTIVE:
        return ACTIVE[name](value)
    types = getattr(owner, "layer_types", None)
    if name in CONFIGURES_LAYER_TYPES and isinstance(types, list | tuple):
        if not any(t in CONFIGURES_LAYER_TYPES[name] for t in types):
            return False
    if value is None or value is False:
        return False
    if isinstance(value, int | float | str | list | tuple | dict | set):
        return bool(value)
    return True  # a parameter, a submodule, another object: present


def unknown_reason(name: object) -> str:
    """``unknown_structure:<name>``: the name kept to word characters, dots, dashes (at most 64), so the metric
    key ``prefix/fallback_unknown_structure:<name>`` is one path segment every tracker and the dashboard take."""
    return "unknown_structure:" + (re.sub(r"[^\w.-]", "_", str(name))[:64] or "_")


def layer_type_entries(config: object) -> Iterator[tuple[str, int, object]]:
    """``(list name, layer, type)`` for each entry of the config's per-layer type lists."""
    for attribute in LAYER_TYPE_LISTS:
        values = getattr(config, attribute, None)
        if isinstance(values, list | tuple):
            for layer, value in enumerate(values):
                yield attribute, layer, value


def layer_type_refusal(config: object) -> tuple[str, int, object, str, str] | None:
    """``(list name, layer, type, reason, detail)`` for the first layer type reuse does not serve, or None."""
    for attribute, layer, value in layer_type_entries(config):
        if isinstance(value, str) and value in SERVED_LAYER_TYPES:
            continue
        if isinstance(value, str) and value in REFUSED_LAYER_TYPES:
            reason, detail = REFUSED_LAYER_TYPES[value]
        else:
            reason = unknown_reason(value)
            detail = (
                f"a layer type verl-prefix does not know ({attribute} entry {value!r}): it cannot tell which keys "
                "a query of that layer sees, so the model trains dense until the type is served or refused "
                "(schedule.models.known_structures)"
            )
        return attribute, layer, value, reason, detail
    return None


def shaping_attributes(owner: object) -> Iterator[tuple[str, object]]:
    """``(name, value)`` of the public attributes of a config or module whose name matches ``MASK_NAME_PATTERN``
    (a module's parameters, buffers and submodules included)."""
    names = dict(vars(owner))
    if isinstance(owner, nn.Module):
        for table in (owner._parameters, owner._buffers, owner._modules):
            names.update(table)
    for name, value in names.items():
        if not name.startswith("_") and MASK_NAME_PATTERN.search(name):
            yield name, value


def attribute_refusal(name: str, value: object, owner: object = None) -> tuple[str, str] | None:
    """``(reason, detail)`` for an attribute of ``owner`` that shapes masks in a way reuse does not serve, or None."""
    if name in SERVED_ATTRIBUTES or name in UNRELATED_ATTRIBUTES or not active(name, value, owner):
        return None
    if name in REFUSED_ATTRIBUTES:
        return REFUSED_ATTRIBUTES[name]
    return unknown_reason(name), (
        f"an attribute verl-prefix does not know ({name}) that may decide which keys a query sees: the model trains "
        "dense until it is listed as served, refused or unrelated (schedule.models.known_structures)"
    )
