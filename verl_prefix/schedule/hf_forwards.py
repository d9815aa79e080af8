"""HF's own forwards of the classes verl's monkey patch replaces class-wide, remembered before the patch.

When a ``qwen3_5``/``qwen3_5_moe`` checkpoint loads, verl's ``apply_monkey_patch`` replaces, class-wide, the
forward of ``Qwen3_5GatedDeltaNet`` (and the MoE twin) with ``qwen3_5_gated_delta_net_forward`` (packed rows split
by ``cu_seqlens``; it always starts from ``initial_state=None``) and of the decoder layers with one that calls the
mixer without the forward keywords. The schedule's rows are padded, one sequence each, so HF's own forwards
compute what verl's padded path computes and continue from a boundary state: they are put back while the
schedule runs (``hf_recurrent``) and verl's are back after it.

The vision-language families' model, conditional-generation and attention classes are patched the same way
(verl's forwards take packed rows and ``[4, B, L]`` positions, and ignore a generation cache). Generating with HF's
``generate`` in a process where an engine loaded such a model (the hf rollout beside the actor, the tests) needs
HF's own forwards back for the call (``hf_own_forwards``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn
from transformers.models.glm4v import modeling_glm4v
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_vl import modeling_qwen3_vl
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe

# the classes whose forward verl's patch for ``qwen3_5``/``qwen3_5_moe`` checkpoints replaces
PATCHED_CLASSES: tuple[type[nn.Module], ...] = (
    modeling_qwen3_5.Qwen3_5GatedDeltaNet,
    modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet,
    modeling_qwen3_5.Qwen3_5DecoderLayer,
    modeling_qwen3_5_moe.Qwen3_5MoeDecoderLayer,
)

# the other classes verl's ``apply_monkey_patch`` replaces the forward of (vision-language families)
VISUAL_PATCHED_CLASSES: tuple[type[nn.Module], ...] = (
    modeling_qwen2_vl.Qwen2VLModel,
    modeling_qwen2_vl.Qwen2VLForConditionalGeneration,
    modeling_qwen2_vl.Qwen2VLAttention,
    modeling_qwen2_5_vl.Qwen2_5_VLModel,
    modeling_qwen2_5_vl.Qwen2_5_VLForConditionalGeneration,
    modeling_qwen2_5_vl.Qwen2_5_VLAttention,
    modeling_qwen3_vl.Qwen3VLModel,
    modeling_qwen3_vl.Qwen3VLForConditionalGeneration,
    modeling_qwen3_vl_moe.Qwen3VLMoeModel,
    modeling_qwen3_vl_moe.Qwen3VLMoeForConditionalGeneration,
    modeling_qwen3_5.Qwen3_5Model,
    modeling_qwen3_5.Qwen3_5ForConditionalGeneration,
    modeling_qwen3_5_moe.Qwen3_5MoeModel,
    modeling_qwen3_5_moe.Qwen3_5MoeForConditionalGeneration,
    modeling_glm4v.Glm4vModel,
    modeling_glm4v.Glm4vForConditionalGeneration,
    modeling_glm4v.Glm4vTextAttention,
)

# HF's own forward of each class above, by class (``remember_hf_forwards``)
_HF_FORWARDS: dict[type, Callable] = {}


def patched_by_verl(cls: type) -> bool:
    """Whether ``cls.forward`` is a verl monkey patch rather than the forward its family defines."""
    return getattr(cls.forward, "__module__", "").startswith("verl.")


def remember_hf_forwards() -> None:
    """Remember HF's forward of every class verl's patch replaces, where it is not patched yet. Runs at import and
    again before an engine builds its model (``backend.engine``)."""
    for cls in PATCHED_CLASSES + VISUAL_PATCHED_CLASSES:
        if not patched_by_verl(cls):
            _HF_FORWARDS.setdefault(cls, cls.forward)


def hf_forward(cls: type) -> Callable | None:
    """HF's own forward of ``cls``: the current one when verl has not patched it, the remembered one when it has
    (None when it was patched before it could be remembered)."""
    if not patched_by_verl(cls):
        return cls.forward
    return _HF_FORWARDS.get(cls)


@contextmanager
def hf_recurrent(model: nn.Module) -> Iterator[None]:
    """HF's own forward for every class of ``model`` verl's Qwen3.5 patch replaced, for the block. Matched by
    ``isinstance``: FSDP2 wraps decoder layers in a subclass that inherits the patched class's forward."""
    modules = list(model.modules())
    classes = [c for c in PATCHED_CLASSES if patched_by_verl(c) and any(isinstance(m, c) for m in modules)]
    with class_forwards([(cls, _HF_FORWARDS[cls]) for cls in classes if cls in _HF_FORWARDS]):
        yield


@contextmanager
def hf_own_forwards(model: nn.Module) -> Iterator[None]:
    """HF's own forward for every class of ``model`` (itself included) that verl patched, for the block: what HF's
    ``generate`` needs. A patched class whose HF forward was not remembered is an error, not verl's training
    forward run under a generation cache."""
    classes = {type(m) for m in model.modules() if patched_by_verl(type(m))}
    lost = sorted(cls.__name__ for cls in classes if cls not in _HF_FORWARDS)
    if lost:
        raise RuntimeError(
            f"verl patched the forward of {', '.join(lost)} before HF's own could be remembered; "
            "import verl_prefix before building the model"
        )
    with class_forwards([(cls, _HF_FORWARDS[cls]) for cls in classes]):
        yield


@contextmanager
def class_forwards(swaps: list[tuple[type, Callable]]) -> Iterator[None]:
    """Each ``(class, forward)`` installed class-wide for the block, the class's own forward put back after
    (even on an exception): how a patch verl applied class-wide is lifted for the schedule alone."""
    swapped = [(cls, cls.forward, forward) for cls, forward in swaps]
    try:
        for cls, _, forward in swapped:
            cls.forward = forward
        yield
    finally:
        for cls, patched, _ in swapped:
            cls.forward = patched


remember_hf_forwards()
