"""What a model's modules say about reuse, read off the HF model itself (no batch): dropout, reentrant
checkpointing and activation offload (each a reason a training mini-batch runs dense, ``backend.fallbacks``),
the sliding windows attention is handed and the ones the config declares, RoPE whose frequencies follow
the call's length, and a decoder that builds its attention masks without the position ids (packed rows)."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Iterator

import torch
import torch.utils.checkpoint
from torch import nn
from verl.utils.activation_offload import ActivationHandler


def has_active_dropout(model: nn.Module) -> bool:
    """Reuse shares one prefix dropout sample across the group: a different distribution (trap 7)."""
    if not model.training:
        return False
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name, value in (vars(text) if text is not None else {}).items():
        # a rate the model applies through ``F.dropout`` (Seed-OSS's ``residual_dropout``): no module to find;
        # heads that causal LMs do not run (classifier, sequence summary) do not count
        if ("dropout" in name or "pdrop" in name) and not any(w in name for w in ("classifier", "summary")):
            if isinstance(value, float | int) and not isinstance(value, bool) and value > 0:
                return True
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            return True
        p = getattr(module, "attention_dropout", 0.0)
        if isinstance(p, float) and p > 0:
            return True
    return False


def uses_reentrant_checkpointing(model: nn.Module) -> bool:
    """Reentrant checkpointing runs a layer's forward under no_grad, so phase A's K/V carry no graph and
    the prefix would get no gradient (trap 8); verl itself enables the non-reentrant kind. Found through
    HF's flags, torch's ``CheckpointWrapper`` and forwards patched onto a module that close over
    ``checkpoint(use_reentrant=True)``; any other wrapper is caught by phase C (``prefix_backward``)."""
    if not model.training:
        return False
    for module in model.modules():
        checkpoint_fn = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and checkpoint_fn is not None:
            if (getattr(checkpoint_fn, "keywords", None) or {}).get("use_reentrant", True):
                return True
        if _is_reentrant_checkpoint(getattr(module, "checkpoint_fn", None)):  # torch's CheckpointWrapper
            return True
        patched = vars(module).get("forward")
        if patched is not None and any(_is_reentrant_checkpoint(obj) for obj in _reachable(patched)):
            return True
    return False


def uses_activation_offload(model: nn.Module) -> bool:
    """verl's ``enable_activation_offload`` wraps each decoder layer's forward in an ``ActivationHandler``:
    a reentrant checkpoint when checkpointing is on (phase A's K/V lose their graph), and in any case an
    offload state machine that counts one forward per layer then one backward per layer, which phases
    A/B/C do not follow. It is idle in eval mode, so forward-only passes still reuse."""
    if not model.training:
        return False
    for module in model.modules():
        patched = vars(module).get("forward")
        if patched is not None and any(isinstance(obj, ActivationHandler) for obj in _reachable(patched)):
            return True
    return False


def _is_reentrant_checkpoint(obj: object) -> bool:
    if isinstance(obj, functools.partial) and obj.func is torch.utils.checkpoint.checkpoint:
        return bool(obj.keywords.get("use_reentrant", True))
    return obj is torch.utils.checkpoint.CheckpointFunction


def _reachable(fn: object, depth: int = 4) -> Iterator[object]:
    """What a patched forward closes over: bound methods' functions, ``functools.partial`` parts,
    ``__wrapped__`` and closure cells, ``depth`` steps deep."""
    seen: set[int] = set()
    stack = [(fn, 0)]
    while stack:
        obj, level = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        if level >= depth:
            continue
        children: list[object] = []
        if isinstance(obj, functools.partial):
            children += [obj.func, *obj.args, *obj.keywords.values()]
        for attr in ("__func__", "__wrapped__"):
            child = getattr(obj, attr, None) if callable(obj) else None
            if child is not None:
                children.append(child)
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                children.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        stack += [(child, level + 1) for child in children]


def attention_windows(model: nn.Module) -> list[int]:
    """The sliding window of each windowed attention layer, as HF 5.10.4 hands it to the kernel.

    Families with ``layer_types`` (Qwen2/Qwen3 via ``use_sliding_window``/``max_window_layers``, Gemma...)
    store ``sliding_window`` on each attention module, None on full-attention layers; the others (Mistral,
    Mixtral, Phi-3, Starcoder2) pass ``config.sliding_window`` from every layer.
    """
    windows = []
    attention = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    for module in attention:
        if "sliding_window" in vars(module):
            window = module.sliding_window
        else:
            window = getattr(getattr(module, "config", None), "sliding_window", None)
        if window is not None and hands_window_to_attention(type(module)):
            windows.append(int(window))
    if not attention:  # no module to read: trust the config
        window = getattr(model.config.get_text_config(), "sliding_window", None)
        windows += [int(window)] if window is not None else []
    return windows


@functools.cache
def hands_window_to_attention(cls: type) -> bool:
    """Whether ``cls.forward`` hands a ``sliding_window=`` keyword to the attention function (the window reuse
    serves, ``schedule.attention.windows``). Qwen2-MoE's attention stores its window but passes none: its dense masks
    are windowed, the keyword the schedule reads is absent, so its window counts as undeclared (dense with the reason
    where it is shorter than the sequences). True where the source cannot be read."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True
    return "sliding_window=" in source.replace(" ", "")


def declared_windows(model: nn.Module) -> list[int]:
    """A window the config declares (``use_sliding_window``, ``sliding_attention`` layers) even where the
    modules ended up without it: verl's ``override_config`` sets attributes after the config derived its
    ``layer_types``. Reuse serves the windows the modules hand attention (``schedule.attention.windows``); where the
    config and the modules disagree, dense is the safe side."""
    config = model.config.get_text_config()
    declared = getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or []
    )
    window = getattr(config, "sliding_window", None)
    return [int(window)] if declared and window is not None else []


def rope_length_limit(model: nn.Module) -> int | None:
    """For RoPE that recomputes its frequencies from each call's largest position (HF's
    ``dynamic_rope_update``: ``rope_type`` containing "dynamic", or "longrope"), the sequence length
    from which phase A (prefix only) and phase B (prefix + suffix) could rotate with other frequencies
    than the dense call; None for RoPE with fixed frequencies.

    Below it every call rotates with the original frequencies: longrope switches above
    ``original_max_position_embeddings``; dynamic grows above its cached length and resets only below
    ``max_position_embeddings``, so a call at exactly that length keeps an earlier call's frequencies.
    """
    config = model.config.get_text_config()
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    entries = [v for v in params.values() if isinstance(v, dict)] or [params]  # one dict per layer type
    types = [str(e.get("rope_type", e.get("type", "default"))) for e in entries]
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if isinstance(rope_type, dict):
            types += [str(t) for t in rope_type.values()]
        elif isinstance(rope_type, str):
            types.append(rope_type)
    if not any("dynamic" in t or t == "longrope" for t in types):
        return None
    limits = [getattr(config, name, None) for name in ("max_position_embeddings", "original_max_position_embeddings")]
    limits += [e.get("original_max_position_embeddings") for e in entries]
    limits += [getattr(m, "original_max_seq_len", None) for m in model.modules()]
    known = [int(v) for v in limits if isinstance(v, int | float)]
    return min(known) if known else 0  # no length known: every batch runs dense


def undeclared_windows(model: nn.Module) -> list[int]:
    """Windows the config declares that no attention module carries (``declared_windows``): the modules and
    the config disagree, and reuse cannot tell which one the dense model's masks follow."""
    carried = set(attention_windows(model))
    return [window for window in declared_windows(model) if window not in carried]


# transformers' mask builders: given the position ids they find packed sequences (positions restarting at 0)
MASK_BUILDERS = frozenset({"create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask"})


def packed_masks_without_positions(model: nn.Module) -> str | None:
    """The class of a module whose forward builds attention masks without the position ids, or None.

    Under verl's remove-padding layout a micro-batch's sequences are one row, told apart only by position ids that
    restart at 0; transformers' mask builders find those sequences only when given the position ids. A decoder
    that builds its masks without them (transformers 5.10.4: ``GptOssModel``, ``AfmoeModel``) lets each packed
    sequence attend to the ones before it under a mask-based attention (eager, sdpa, flex): verl's stock engine
    computes that (measured on a tiny GPT-OSS: logits 3.1 apart). Flash attention's varlen path reads the
    position ids itself, so it is no reason."""
    attention = str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "")
    if "flash" in attention:
        return None
    for cls in dict.fromkeys(type(module) for module in model.modules()):  # in module order, each class once
        owner = next((k for k in cls.__mro__ if "forward" in k.__dict__), None)  # the class whose forward runs
        if owner is not None and _masks_without_positions(owner.__dict__["forward"]):
            return owner.__name__
    return None


@functools.cache
def _masks_without_positions(forward: object) -> bool:
    """Whether ``forward`` calls a mask builder without ``position_ids`` (as a keyword, or a key of the dict
    literal it unpacks)."""
    try:
        source = textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError):
        return False
    if not any(name in source for name in MASK_BUILDERS):
        return False
    tree = ast.parse(source)
    literal_keys: dict[str, set[str]] = {}  # a keyword dict's keys: its literal, its copies, its item assignments
    for node in ast.walk(tree):  # in source order: a copy follows the dict it copies
        if not isinstance(node, ast.Assign):
            continue
        keys = _dict_keys(node.value, literal_keys)
        for target in node.targets:
            if isinstance(target, ast.Name) and keys is not None:
                literal_keys.setdefault(target.id, set()).update(keys)
            elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                key = target.slice
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    literal_keys.setdefault(target.value.id, set()).add(key.value)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if callee not in MASK_BUILDERS:
            continue
        passed = {k.arg for k in node.keywords if k.arg is not None}
        for k in node.keywords:
            if k.arg is None and isinstance(k.value, ast.Name):
                passed |= literal_keys.get(k.value.id, set())
        if "position_ids" not in passed:
            return True
    return False


def _dict_keys(value: ast.expr, known: dict[str, set[str]]) -> set[str] | None:
    """The string keys of a dict literal, or of ``other.copy()`` / ``dict(other)`` of a dict seen before."""
    if isinstance(value, ast.Dict):
        return {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    if isinstance(value, ast.Call):
        func = value.func
        if isinstance(func, ast.Attribute) and func.attr == "copy" and isinstance(func.value, ast.Name):
            return set(known.get(func.value.id, set()))
        if isinstance(func, ast.Name) and func.id == "dict" and value.args and isinstance(value.args[0], ast.Name):
            return set(known.get(value.args[0].id, set()))
    return None
