"""What the schedule must know of a model's structure before phase A runs, and what it cannot serve.

KV-shared layers (Gemma-3n, Gemma-4 ``num_kv_shared_layers``): the last ``n`` decoder layers compute no K/V
of their own; each attends with the K/V of the last earlier layer of its type (transformers passes them
through ``shared_kv_states`` inside one forward). For the schedule such a layer's prefix K/V IS its source
layer's: phase A need not run the shared layers at all (early exit comes after the last layer that computes
its own K/V, ``last_source_layer``), and their prefix K/V are the source's tensors (``kv_sources``).
Phase B needs nothing special: the source layer's suffix K/V reach the shared layer through
``shared_kv_states`` as in dense, and the prefix part is the source's.

A shared layer whose source cannot be told is refused before the first step by the engine's capability check
(``schedule.models.capability.structure_refusal``, reason ``kv_sharing``), never found inside a step.

``layer_roles`` gathers both per-layer facts phase A needs (the KV-shared layers' sources and the recurrent
layers, ``schedule.models.recurrent``): the engine decides them once per model (``ScheduleOptions.layer_roles``) rather
than walking the modules again for every group.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from verl_prefix.schedule.models.recurrent import recurrent_layers


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """``{layer_idx: module}`` of the modules HF's attention interface is called from (they carry an integer
    ``layer_idx`` and ``is_causal``, which decoder layers do not); the first one per index."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and hasattr(module, "is_causal") and layer not in found:
            found[layer] = module
    return found


def _source_of(module: nn.Module, modules: dict[int, nn.Module]) -> int | None:
    """The layer whose K/V a KV-shared attention module reads: Gemma-3n names it (``kv_shared_layer_index``);
    Gemma-4 reads the one earlier layer of its ``layer_type`` that stores them (``store_full_length_kv``)."""
    named = getattr(module, "kv_shared_layer_index", None)
    if isinstance(named, int):
        return named
    layer_type = getattr(module, "layer_type", None)
    stores = [
        idx
        for idx, other in modules.items()
        if getattr(other, "store_full_length_kv", False) and getattr(other, "layer_type", None) == layer_type
    ]
    return stores[0] if len(stores) == 1 else None


def kv_sources(model: nn.Module) -> dict[int, int]:
    """``{shared layer: source layer}`` for every KV-shared attention layer (empty for most models); raises
    ``ValueError`` naming the module where a shared layer's source cannot be told (``capability`` refuses it)."""
    modules = attention_modules(model)
    sources = {}
    for layer, module in modules.items():
        if not getattr(module, "is_kv_shared_layer", False):
            continue
        source = _source_of(module, modules)
        if source is None or source >= layer or getattr(modules.get(source), "is_kv_shared_layer", True):
            raise ValueError(
                f"{type(module).__name__} of layer {layer} reads another layer's K/V (is_kv_shared_layer) "
                "and the schedule cannot tell which"
            )
        sources[layer] = source
    return sources


def last_source_layer(num_layers: int, sources: dict[int, int]) -> int:
    """The last layer that computes its own K/V: where phase A may stop."""
    own = [layer for layer in range(num_layers) if layer not in sources]
    return own[-1] if own else num_layers - 1


def kernel_head_dim(config: object) -> int:
    """The head size phase B's kernels run at for a model of this (text) config: the widest of its query/key
    and value heads (MLA: ``qk_head_dim`` against ``v_head_dim``, padded to the wider) and of its global
    layers' (Gemma-4's ``global_head_dim``), what the preflight asks the kernels about."""
    heads = int(config.num_attention_heads)
    sizes = [getattr(config, "head_dim", None) or config.hidden_size // heads]
    sizes += [getattr(config, name, None) for name in ("qk_head_dim", "v_head_dim", "global_head_dim")]
    return max(int(size) for size in sizes if size)


@dataclass(frozen=True)
class LayerRoles:
    """What phase A captures per decoder layer besides plain K/V: ``sources`` (``kv_sources``: a KV-shared layer's
    prefix K/V are its source's) and ``recurrent`` (layers whose state crosses the boundary instead of K/V)."""

    sources: dict[int, int]
    recurrent: frozenset[int]


def layer_roles(model: nn.Module) -> LayerRoles:
    """``model``'s ``LayerRoles`` (one walk over its modules; raises as ``kv_sources`` does)."""
    return LayerRoles(kv_sources(model), frozenset(recurrent_layers(model)))
