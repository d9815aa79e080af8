"""Can the schedule serve this model at all: a structural check, run once before training.

Phase A captures each decoder layer's K/V through the attention function the schedule registers with HF's
``AttentionInterface`` (``kv.seam``), keyed by the attention module's ``layer_idx``; phase B serves them back
the same way. A model whose layers carry state in anything else (a recurrent or convolution mixer: gated
delta-net, Mamba/Mamba-2, short convs, RG-LRU...), attend outside the interface (a family-local interface, a
hand-written attention), attend bidirectionally or across to an encoder, or that is an encoder-decoder, cannot
be served: found during a step, the model would stop mid-step ("phase A did not capture K/V for every layer")
or train on something else than dense. ``structure_refusal`` finds these from the modules alone (no forward),
names the module, and says why; the backend decides what to do with it (``prefix_reuse.unsupported_model``).

``FAMILY_REFUSALS`` lists the few families whose attention goes through the interface but whose outputs
still depend on something phase B cannot reproduce; each entry says what, as measured by the coverage matrix
(``docs/models.md``).

Above the module checks sits an allowlist (``schedule.models.known_structures``): every per-layer type the config lists
(``layer_types``, ``mlp_layer_types``...) and every active mask-shaping attribute of the config and of the attention
modules (a window, a chunk, a compression rate, an indexer, sinks, a bidirectional flag) must be one reuse serves,
refuses with a reason (DeepSeek-V4's compressed layers: ``compressed_attention``), or knows to be unrelated; any
other value refuses as ``unknown_structure:<name>``, so a structure a new transformers adds trains dense until
someone decides (DESIGN trap 19).
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from dataclasses import dataclass

from torch import nn
from transformers import modeling_utils

from verl_prefix.schedule.models import known_structures
from verl_prefix.schedule.models.multimodal import vision_encoder
from verl_prefix.schedule.models.recurrent import served_recurrent_layer
from verl_prefix.schedule.models.structure import attention_modules, kv_sources

# model_type -> why reuse cannot reproduce its dense computation, though every layer attends through the
# interface (each found by the coverage matrix: reuse against dense differed or stopped)
FAMILY_REFUSALS: dict[str, tuple[str, str]] = {
    "phimoe": (
        "stochastic_routing",
        "its sparsemixer router samples experts in training mode: reuse would share one prefix sample across "
        "the group, a different distribution from dense",
    ),
    "doge": (
        "content_dependent_mask",
        "its attention mask is computed from the value states of every key (a dynamic mask), which a "
        "suffix row cannot rebuild for prefix keys it never computed",
    ),
}

# hybrid families whose recurrent layers reuse does not serve yet, and what is missing (appended to their
# ``recurrent_layers`` refusal, so the coverage matrix and the log line say why, decided at initialisation)
UNSERVED_RECURRENT_FAMILIES: dict[str, str] = {
    "falcon_h1": "every layer runs its Mamba-2 mixer and attention side by side, so one layer's boundary is K/V "
    "and an SSM/conv state at once (the schedule holds one or the other per layer), and the mixer's muP "
    "multipliers (ssm_in_multiplier, mup_vector) are not in the Mamba-2 continuation forward",
    "zamba2": "its hybrid layers run a shared attention block beside a Mamba-2 mixer, so one layer index holds "
    "K/V and an SSM/conv state at once (the schedule holds one or the other per layer)",
    "jamba": "Mamba-1 mixers (a selective scan with a state per channel), which the Mamba-2 continuation does "
    "not compute",
    "mamba2": "Mamba2Model calls each block with cache_params and attention_mask only, so the prefix context (a "
    "forward keyword) cannot reach the mixers",
    "minimax": "lightning attention (linear attention with a per-head exponential decay) has no boundary-state "
    "continuation yet",
}

# class-name fragments of token mixers that carry state along the sequence outside attention
_RECURRENT_NAMES = (
    "mamba",
    "gateddeltanet",
    "deltanet",
    "linearattention",
    "lightning",
    "shortconv",
    "rglru",
    "recurrent",
    "mlstm",
    "slstm",
    "xlstm",
    "rwkv",
    "mixer",
    "linearattn",
)


@dataclass(frozen=True)
class StructureRefusal:
    """Why the schedule cannot serve a model: ``reason`` names the ``prefix/fallback_<reason>`` metric,
    ``module`` the first module (dotted path and class) that shows it, ``detail`` what it does."""

    reason: str
    module: str
    detail: str

    def message(self) -> str:
        return f"{self.module}: {self.detail} ({self.reason})"


def text_config(model: nn.Module) -> object:
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def structure_refusal(model: nn.Module) -> StructureRefusal | None:
    """The first structure that keeps the schedule from serving ``model`` (an HF causal LM, possibly wrapped
    by FSDP2), or None when every decoder layer attends causally through HF's attention interface and every layer
    type and active mask-shaping attribute is one reuse serves (``known_structures``)."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        return StructureRefusal("encoder_decoder", name, "an encoder-decoder model; the schedule serves decoders")
    model_type = getattr(config, "model_type", None)
    for family in {model_type, getattr(text_config(model), "model_type", None)}:
        if family in FAMILY_REFUSALS:
            reason, detail = FAMILY_REFUSALS[family]
            return StructureRefusal(reason, f"{name} ({family})", detail)
    num_layers = int(getattr(text_config(model), "num_hidden_layers", 0) or 0)
    layers = decoder_layers(model, num_layers)
    if layers is None:
        return StructureRefusal(
            "no_decoder_layers", name, f"no list of {num_layers} decoder layers found to capture K/V from"
        )
    path, modules = layers
    # before the module checks, so DeepSeek-V4's compressed-sparse layers refuse by their compression (an indexer's
    # top-k over compressed keys is the second problem), not as sparse_attention
    by_type = known_structures.layer_type_refusal(text_config(model))
    if by_type is not None:
        attribute, index, value, reason, detail = by_type
        where = f"{path}.{index} ({type(modules[index]).__name__})" if index < len(modules) else name
        return StructureRefusal(reason, where, f"{attribute}[{index}]={value!r}: {detail}")
    try:
        kv_sources(model)  # KV-shared layers read an earlier layer's K/V: the schedule must tell which
    except ValueError as exc:
        return StructureRefusal("kv_sharing", name, str(exc))
    for i, layer in enumerate(modules):
        refusal, indices = _layer_refusal(f"{path}.{i}", layer)
        if refusal is not None and refusal.reason == "recurrent_layers" and model_type in UNSERVED_RECURRENT_FAMILIES:
            return StructureRefusal(
                refusal.reason,
                refusal.module,
                f"{refusal.detail}; {model_type}: {UNSERVED_RECURRENT_FAMILIES[model_type]}",
            )
        if refusal is not None:
            return refusal
        if i not in indices:
            return StructureRefusal(
                "attention_outside_interface",
                f"{path}.{i} ({type(layer).__name__})",
                f"no attention module with layer_idx={i} goes through HF's attention interface, so phase A could "
                "not capture that layer's K/V",
            )
        if not _forwards_keywords(type(layer)) and not _served_mixer_only(layer):
            return StructureRefusal(
                "keywords_not_forwarded",
                f"{path}.{i} ({type(layer).__name__})",
                "the decoder layer does not pass its forward keywords on to attention, so the schedule's prefix "
                "context (a forward keyword) cannot reach it",
            )
    return _attribute_refusal(model, path, modules)


def _attribute_refusal(model: nn.Module, path: str, modules: nn.ModuleList) -> StructureRefusal | None:
    """The first active mask-shaping attribute of the text config, then of each attention module (an integer
    ``layer_idx`` and ``is_causal``), that ``known_structures`` does not list as served or unrelated."""
    config = text_config(model)
    for attribute, value in known_structures.shaping_attributes(config) if config is not None else ():
        refusal = known_structures.attribute_refusal(attribute, value, config)
        if refusal is not None:
            where = f"{type(model).__name__} (config.{attribute}={_shown(value)})"
            return StructureRefusal(refusal[0], where, refusal[1])
    for i, layer in enumerate(modules):
        for sub_path, module in layer.named_modules():
            if not (isinstance(getattr(module, "layer_idx", None), int) and hasattr(module, "is_causal")):
                continue
            for attribute, value in known_structures.shaping_attributes(module):
                refusal = known_structures.attribute_refusal(attribute, value, module)
                if refusal is not None:
                    where = ".".join(p for p in (path, str(i), sub_path) if p)
                    where = f"{where} ({type(module).__name__}.{attribute}={_shown(value)})"
                    return StructureRefusal(refusal[0], where, refusal[1])
    return None


def _shown(value: object) -> str:
    """A value for a message: a module or tensor by its type, anything else by ``repr`` (at most 80 chars)."""
    if isinstance(value, nn.Module) or hasattr(value, "shape"):
        return type(value).__name__
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def decoder_layers(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList] | None:
    """The model's decoder layers: the first ``ModuleList`` of ``num_layers`` modules (``model.layers``...)
    outside a vision encoder (whose blocks may be as many)."""
    tower = vision_encoder(model)
    inside = {id(m) for m in tower.modules()} if tower is not None else set()
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers > 0 and id(module) not in inside:
            return path, module
    return None


def _layer_refusal(path: str, layer: nn.Module) -> tuple[StructureRefusal | None, set[int]]:
    """A refusal for one decoder layer, else the ``layer_idx`` values its interface attention modules carry."""
    indices: set[int] = set()
    named = dict(layer.named_modules())
    # served recurrent mixers (or mixer-less blocks): their containers and what they hold are theirs
    served = [p for p, m in named.items() if served_recurrent_layer(m)]
    holders = {p.rsplit(".", k)[0] for p in served for k in range(1, p.count(".") + 1)} | (
        {""} if any(served) else set()
    )
    for sub_path, module in named.items():
        if sub_path in holders:  # a container of a served mixer (OLMo-Hybrid's ``...LinearAttentionDecoderLayer``)
            continue
        if any(sub_path.startswith(f"{s}.") if s else sub_path for s in served):  # inside a served mixer
            continue
        if isinstance(module, nn.Conv1d) and "." in sub_path:  # name the mixer that holds the convolution
            sub_path = sub_path.rsplit(".", 1)[0]
            module = named[sub_path]
        where = f"{path}.{sub_path}" if sub_path else path
        where = f"{where} ({type(module).__name__})"
        if served_recurrent_layer(module):  # its state crosses the prefix boundary (``schedule.models.recurrent``)
            indices.add(int(module.layer_idx))
            continue
        lowered = f"{type(module).__name__} {sub_path.rsplit('.', 1)[-1]}".lower().replace("_", "")
        is_conv = any(isinstance(m, nn.Conv1d) for m in module.children())
        # an attention class held under a path named "mixer" (Nemotron-H's blocks) is no recurrent mixer
        own = type(module).__name__.lower().replace("_", "")
        plain_attention = "attention" in own and not any(fragment in own for fragment in _RECURRENT_NAMES)
        if (any(fragment in lowered for fragment in _RECURRENT_NAMES) or is_conv) and not plain_attention:
            recurrent = any(fragment in lowered for fragment in _RECURRENT_NAMES if fragment != "shortconv")
            kind = "recurrent_layers" if recurrent else "convolution_layers"
            return StructureRefusal(
                kind,
                where,
                "a recurrent or convolution token mixer: it carries state along the sequence outside attention, "
                "which phase A does not capture",
            ), indices
        if "indexer" in lowered:  # DeepSeek sparse attention: a learned top-k over the keys (``indices=``)
            return StructureRefusal(
                "sparse_attention",
                where,
                "sparse attention over keys a learned indexer selects from the whole sequence: phase B would "
                "attend to the whole prefix",
            ), indices
        if getattr(module, "is_cross_attention", False) or "crossattention" in lowered:
            return StructureRefusal(
                "cross_attention", where, "cross-attention to another sequence; the schedule serves self-attention"
            ), indices
        if not hasattr(module, "layer_idx") or not callable(getattr(type(module), "forward", None)):
            continue
        interface = _attention_interface(type(module))
        if interface is None:
            continue
        if interface == "local":
            return StructureRefusal(
                "attention_outside_interface",
                where,
                "attends through a family-local attention interface the schedule's attention is not registered in",
            ), indices
        if getattr(module, "is_causal", True) is False:
            return StructureRefusal(
                "bidirectional_attention", where, "bidirectional attention; the schedule's masks are causal"
            ), indices
        layer_idx = module.layer_idx
        if isinstance(layer_idx, int):
            indices.add(layer_idx)
    return None, indices


def _served_mixer_only(layer: nn.Module) -> bool:
    """A decoder layer whose only token mixer is a served recurrent layer: it needs no keywords passed on (the
    prefix context reaches the mixer from the layer's own call, ``recurrent.recurrent_state_mode``)."""
    mixers = [m for m in layer.modules() if served_recurrent_layer(m)]
    return bool(mixers) and not attention_modules(layer)


@functools.cache
def _forwards_keywords(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``**kwargs`` and passes some ``**mapping`` on (HF's decoder layers hand
    their keywords to attention); True when the source cannot be read (phase A then checks)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True
    return len(re.findall(r"\*\*[A-Za-z_]", source)) >= 2


@functools.cache
def _attention_interface(cls: type) -> str | None:
    """``"global"`` when ``cls.forward`` dispatches through transformers' ``ALL_ATTENTION_FUNCTIONS``,
    ``"local"`` through another ``AttentionInterface`` (a family-local one), None when it does not attend
    through an interface at all."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    if "ALL_ATTENTION_FUNCTIONS" not in source:
        return None
    family = sys.modules.get(cls.forward.__module__)
    table = getattr(family, "ALL_ATTENTION_FUNCTIONS", None)
    return "global" if table is None or table is modeling_utils.ALL_ATTENTION_FUNCTIONS else "local"
