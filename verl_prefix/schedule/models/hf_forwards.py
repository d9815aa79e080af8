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

With ``model.use_fused_kernels`` verl replaces the causal LM's own class forward (whatever the family) with its fused
forward (``verl.models.transformers.*.forward_with_{torch,triton}_backend``: log-probs and entropy from the hidden
states, no logits), which calls the decoder without the forward keywords the schedule's prefix context travels in.
``remember_fused_forwards`` wraps verl's ``patch_forward_with_backends`` so that the class's forward is remembered
before it is replaced (nothing else changes): HF's own, or for the vision-language families verl's unfused
``forward_with_normal_backend`` that its visual patch installed first. ``hf_causal_forward`` puts it back while the
schedule runs; the schedule then computes verl's fused log-probs itself (``schedule.fused_head``), inside the LM
head's own call.
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
# the forward a causal LM's class had just before verl's fused forward replaced it (``remember_fused_forwards``):
# HF's own, or, for the vision-language families, verl's unfused ``forward_with_normal_backend`` of its visual patch
_UNFUSED_FORWARDS: dict[type, Callable] = {}


def patched_by_verl(cls: type) -> bool:
    """Whether ``cls.forward`` is a verl monkey patch rather than the forward its family defines."""
    return getattr(cls.forward, "__module__", "").startswith("verl.")


def remember_hf_forwards() -> None:
    """Remember HF's forward of every class verl's patch replaces, where it is not patched yet. Runs at import and
    again before an engine builds its model (``backend.fsdp.engine``)."""
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


def remember_fused_forwards() -> None:
    """Wrap verl's ``patch_forward_with_backends`` (which ``apply_monkey_patch`` looks up by name) to remember the
    model class's HF forward before verl's fused forward replaces it. Idempotent; a no-op where verl lacks it."""
    from verl.models.transformers import monkey_patch

    original = getattr(monkey_patch, "patch_forward_with_backends", None)
    if original is None or getattr(original, "_verl_prefix", False):
        return

    def patch_forward_with_backends(model: nn.Module, *args: object, **kwargs: object) -> object:
        cls = model.__class__
        if not patched_by_verl(cls):
            _HF_FORWARDS.setdefault(cls, cls.forward)
        if not is_fused_forward(cls.forward):
            _UNFUSED_FORWARDS[cls] = cls.forward
        return original(model, *args, **kwargs)

    patch_forward_with_backends._verl_prefix = True
    patch_forward_with_backends.__wrapped__ = original
    monkey_patch.patch_forward_with_backends = patch_forward_with_backends


def is_fused_forward(forward: Callable) -> bool:
    """Whether ``forward`` is one of verl's fused-kernel forwards (``forward_with_{torch,triton}_backend``)."""
    return getattr(forward, "__module__", "").startswith("verl.") and getattr(forward, "__name__", "") in (
        "forward_with_torch_backend",
        "forward_with_triton_backend",
    )


@contextmanager
def hf_causal_forward(model: nn.Module) -> Iterator[None]:
    """The unfused forward of ``model``'s causal-LM class where verl's fused-kernel patch replaced it, for the block:
    HF's own, or a vision-language family's ``forward_with_normal_backend`` (verl's packed-row forward, which calls
    the LM head as a module, so that ``schedule.fused_head`` and FSDP2's hooks run around it; verl's fused forwards
    of every family read ``lm_head.weight`` directly). FSDP2 wraps the model in a subclass: the patched class is found
    along its MRO."""
    swaps = [
        (cls, _UNFUSED_FORWARDS[cls])
        for cls in type(model).__mro__
        if "forward" in vars(cls) and is_fused_forward(cls.forward) and cls in _UNFUSED_FORWARDS
    ]
    with class_forwards(swaps):
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
remember_fused_forwards()
