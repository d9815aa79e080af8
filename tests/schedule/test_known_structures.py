"""The capability check's allowlist (``verl_prefix.schedule.models.known_structures``, DESIGN trap 19).

Walks the installed transformers and fails on any layer type or mask-shaping attribute the tables do not list:
every allowed layer type (``configuration_utils.ALLOWED_LAYER_TYPES``), every entry of each decoder family's
default per-layer type lists and of the modeling files' mask mappings, every attribute of those default configs
and every ``self.<name>`` of an attention class whose name looks mask-shaping. Generated unknown names (hypothesis)
refuse as ``unknown_structure:<name>``. DeepSeek-V4 with compression rates shorter than the sequences refuses as
``compressed_attention`` (reuse there stops mid-step: the negative control), while a DeepSeek-V4 of sliding layers
only is served and exact.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
import torch
import transformers
from helpers import deepseek_v4 as V4
from helpers import model_matrix as M
from helpers.layouts import make_layout, token_weights
from helpers.precision import fp64_throughout
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import CONFIG_MAPPING
from transformers.configuration_utils import ALLOWED_LAYER_TYPES

from verl_prefix.harness import model_zoo as Z
from verl_prefix.schedule.models import known_structures as K
from verl_prefix.schedule.models.capability import structure_refusal
from verl_prefix.tools.report.dashboard_spec import all_panels

MODELS = Path(transformers.__file__).parent / "models"
LAYER_TYPES = {**K.SERVED_LAYER_TYPES, **K.REFUSED_LAYER_TYPES}
ATTRIBUTES = {**K.SERVED_ATTRIBUTES, **K.REFUSED_ATTRIBUTES, **K.UNRELATED_ATTRIBUTES}


@functools.cache
def default_text_configs() -> dict[str, object]:
    """The text config of every decoder family's default config, and of the vision-language families verl trains."""
    configs = {}
    for family in [*Z.decoder_families(), *(f for f in Z.VISION_LANGUAGE_NOTES if f in CONFIG_MAPPING)]:
        try:
            configs[family] = CONFIG_MAPPING[family]().get_text_config()
        except Exception:  # noqa: BLE001 - checked below: only the families the matrix lists as not buildable
            assert (Z.skip_reason(family) or "").startswith("its config class does not build"), family
    return configs


@functools.cache
def _modeling_trees() -> list[tuple[str, ast.Module]]:
    return [(path.parent.name, ast.parse(path.read_text())) for path in sorted(MODELS.glob("*/modeling_*.py"))]


def _names(node: ast.AST) -> set[str]:
    """Every name, attribute and argument a class's body mentions."""
    found = set()
    for sub in ast.walk(node):
        found.add(getattr(sub, "id", None) or getattr(sub, "attr", None) or getattr(sub, "arg", None))
    return found


@functools.cache
def mask_mapping_layer_types() -> dict[str, set[str]]:
    """Keys of the ``*mask_mapping`` dict literals in transformers' modeling files: the layer types models build
    masks for, by family."""
    found: dict[str, set[str]] = {}
    for family, tree in _modeling_trees():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)):
                continue
            names = [getattr(t, "id", getattr(t, "attr", "")) for t in node.targets]
            if any("mask_mapping" in name for name in names):
                for key in node.value.keys:
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        found.setdefault(key.value, set()).add(family)
    return found


@functools.cache
def attention_class_attributes() -> dict[str, set[str]]:
    """``self.<name>`` assigned in every class of transformers' modeling files that calls an attention function
    through ``ALL_ATTENTION_FUNCTIONS`` and carries a ``layer_idx``, by attribute name: families."""
    found: dict[str, set[str]] = {}
    for family, tree in _modeling_trees():
        for node in tree.body:
            if not (isinstance(node, ast.ClassDef) and {"ALL_ATTENTION_FUNCTIONS", "layer_idx"} <= _names(node)):
                continue
            for sub in ast.walk(node):
                targets = (
                    sub.targets
                    if isinstance(sub, ast.Assign)
                    else [sub.target]
                    if isinstance(sub, ast.AnnAssign)
                    else []
                )
                for target in targets:
                    if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                        found.setdefault(target.attr, set()).add(family)
    return found


def test_the_tables_are_consistent():
    """No name in two tables; every attribute named is one the check looks at (``MASK_NAME_PATTERN``); every
    refusal has a reason a metric key can carry."""
    assert not K.SERVED_LAYER_TYPES.keys() & K.REFUSED_LAYER_TYPES.keys()
    tables = (K.SERVED_ATTRIBUTES, K.REFUSED_ATTRIBUTES, K.UNRELATED_ATTRIBUTES)
    assert sum(map(len, tables)) == len(ATTRIBUTES), "an attribute in two tables"
    unmatched = [name for name in ATTRIBUTES if not K.MASK_NAME_PATTERN.search(name)]
    assert not unmatched, f"never consulted (MASK_NAME_PATTERN does not match them): {unmatched}"
    for reason, detail in [*K.REFUSED_LAYER_TYPES.values(), *K.REFUSED_ATTRIBUTES.values()]:
        assert re.fullmatch(r"[a-z_]+", reason) and detail, reason
    assert set(K.CONFIGURES_LAYER_TYPES) <= set(K.REFUSED_ATTRIBUTES)


def test_every_layer_type_of_the_installed_transformers_is_served_or_refused():
    """``ALLOWED_LAYER_TYPES``, every entry of the default configs' per-layer lists (DeepSeek-V4's ``hash_moe``
    is not in ``ALLOWED_LAYER_TYPES``) and every mask mapping's key."""
    found = {t: {"ALLOWED_LAYER_TYPES"} for t in ALLOWED_LAYER_TYPES}
    for family, config in default_text_configs().items():
        for _, _, value in K.layer_type_entries(config):
            found.setdefault(value, set()).add(family)
    for value, families in mask_mapping_layer_types().items():
        found.setdefault(value, set()).update(families)
    assert {"chunked_attention", "heavily_compressed_attention", "hash_moe", "mamba"} <= found.keys()  # it walked
    missing = {value: sorted(families)[:4] for value, families in found.items() if value not in LAYER_TYPES}
    assert not missing, f"layer types neither served nor refused (schedule.models.known_structures): {missing}"


def test_every_mask_shaping_attribute_of_the_installed_transformers_is_listed():
    """Config attributes of every default text config and attention-class attributes whose names match
    ``MASK_NAME_PATTERN`` must be served, refused or unrelated: a new one fails here before a model trains on it."""
    found: dict[str, set[str]] = {}
    for family, config in default_text_configs().items():
        for name, _ in K.shaping_attributes(config):
            found.setdefault(name, set()).add(f"{family} config")
    for name, families in attention_class_attributes().items():
        if K.MASK_NAME_PATTERN.search(name) and not name.startswith("_"):
            found.setdefault(name, set()).update(f"{family} attention" for family in families)
    assert {"sliding_window", "attention_chunk_size", "compress_rates", "index_topk", "sinks", "compressor"} <= set(
        found
    )
    missing = {name: sorted(where)[:4] for name, where in found.items() if name not in ATTRIBUTES}
    assert not missing, f"mask-shaping attributes neither served, refused nor unrelated: {missing}"


def test_every_default_text_config_passes_or_refuses_with_a_listed_reason():
    """The families' default configs alone: the only refusals are listed ones (never ``unknown_structure``)."""
    refused = {}
    for family, config in default_text_configs().items():
        found = K.layer_type_refusal(config)
        reasons = [found[3]] if found else []
        reasons += [r[0] for n, v in K.shaping_attributes(config) if (r := K.attribute_refusal(n, v, config))]
        assert not [r for r in reasons if r.startswith("unknown_structure")], (family, reasons)
        if reasons:
            refused[family] = reasons[0]
    assert refused.get("deepseek_v4") == "compressed_attention" and refused.get("glm_moe_dsa") == "sparse_attention"
    assert "llama4_text" not in refused and "gemma4_unified_text" not in refused  # chunked; bidirectional on images


@functools.cache
def llama() -> torch.nn.Module:
    return Z.build("llama")


NOT_LISTED = st.text(min_size=1, max_size=80).filter(lambda s: s not in LAYER_TYPES)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.sampled_from(sorted(LAYER_TYPES)), min_size=1, max_size=3),
    st.one_of(st.none(), NOT_LISTED),
    st.integers(0, 3),
)
def test_the_first_unlisted_or_refused_layer_type_decides(types, unknown, at):
    """A Llama whose config lists layer types (it builds plain causal attention whatever they say: the check
    reads the config): served types pass, a refused one names its reason, anything else ``unknown_structure``,
    a metric key the dashboard plots."""
    types = list(types)
    if unknown is not None:
        types.insert(min(at, len(types)), unknown)
    model = llama()
    model.config.layer_types = types
    try:
        refusal = structure_refusal(model)
    finally:
        del model.config.layer_types
    first = next((i for i, t in enumerate(types) if t not in K.SERVED_LAYER_TYPES), None)
    if first is None:
        assert refusal is None
        return
    value = types[first]
    want = K.REFUSED_LAYER_TYPES[value][0] if value in K.REFUSED_LAYER_TYPES else K.unknown_reason(value)
    assert refusal is not None and refusal.reason == want, (types, refusal)
    assert f"layer_types[{first}]={value!r}" in refusal.detail
    if value not in K.REFUSED_LAYER_TYPES:
        assert re.fullmatch(r"unknown_structure:[\w.-]{1,64}", refusal.reason), refusal.reason
        assert any(p.matches(f"actor/prefix/fallback_{refusal.reason}") for p in all_panels())


FRAGMENTS = ("window", "chunk", "compress", "sparse", "index", "sink", "bidirectional", "topk", "block_size", "span")


@settings(max_examples=60, deadline=None)
@given(
    st.from_regex(r"[a-z]{1,8}", fullmatch=True),
    st.sampled_from(FRAGMENTS),
    st.sampled_from(["config", "module"]),
    st.one_of(st.integers(1, 4096), st.just(True), st.just("all")),
)
def test_an_unlisted_mask_shaping_attribute_refuses_when_active(word, fragment, owner, value):
    """A new attribute named like a window, a chunk, a compression, an index or a sink, on the config or on an
    attention module: refused as ``unknown_structure:<name>`` while set, served when None, False or 0."""
    name = f"{word}_{fragment}"
    model = llama()
    target = model.config if owner == "config" else model.model.layers[1].self_attn
    if name in ATTRIBUTES or hasattr(target, name):
        return
    try:
        setattr(target, name, value)
        refusal = structure_refusal(model)
        for off in (None, False, 0):
            setattr(target, name, off)
            assert structure_refusal(model) is None, (name, off)
    finally:
        delattr(target, name)
    assert refusal is not None and refusal.reason == f"unknown_structure:{name}", refusal
    assert ("model.layers.1.self_attn" if owner == "module" else "LlamaForCausalLM (config.") in refusal.module


@pytest.mark.parametrize(
    "layer_types",
    [
        ["heavily_compressed_attention", "heavily_compressed_attention"],
        ["sliding_attention", "compressed_sparse_attention"],  # an indexer too: compressed_attention comes first
    ],
)
def test_deepseek_v4_compressed_attention_refuses_at_initialisation(layer_types):
    refusal = structure_refusal(V4.build(layer_types))
    first = next(i for i, t in enumerate(layer_types) if t != "sliding_attention")
    assert refusal is not None and refusal.reason == "compressed_attention", refusal
    assert refusal.module == f"model.layers.{first} (DeepseekV4DecoderLayer)"
    assert "pool prefix and suffix tokens across the boundary" in refusal.detail
    # whatever the rate: the released one (128) too
    config = Z.tiny_config("deepseek_v4", "eager", layer_types=layer_types)
    assert config.compress_rates["heavily_compressed_attention"] == 128
    assert K.layer_type_refusal(config)[3] == "compressed_attention"


def _reuse_error(net: torch.nn.Module) -> float:
    layout = make_layout(M.GROUPS, vocab=100)  # a 40-token prompt: five 8-token blocks, past the 16-token window
    weights = token_weights(layout, torch.float64)
    with fp64_throughout():
        return M.relative_errors(M.reuse_grads(net, layout, weights), M.dense_grads(net, layout, weights))


def test_deepseek_v4_negative_control_reuse_would_stop_mid_step():
    """Why it is refused: forced past the check, reuse over compressed layers stops in phase B (the suffix's
    compressor sees only suffix tokens, so its compressed keys do not line up with the dense ones)."""
    with pytest.raises(RuntimeError, match="must match the size"):
        _reuse_error(V4.build(["heavily_compressed_attention", "heavily_compressed_attention"], torch.float64))


def test_deepseek_v4_of_sliding_layers_only_is_served_and_exact():
    """Without compressed layers its compression rates and indexer sizes configure nothing
    (``CONFIGURES_LAYER_TYPES``): served, and exact against dense (sinks, hash-routed experts, a 16-token window)."""
    net = V4.build(["sliding_attention", "sliding_attention"], torch.float64)
    assert structure_refusal(net) is None
    assert _reuse_error(net) < M.TOLERANCE[torch.float64]
