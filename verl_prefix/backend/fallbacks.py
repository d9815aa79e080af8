"""Can this mini-batch reuse, and if not, why: the reasons a batch runs through the stock dense path.

Every reason is a metric (``prefix/fallback_<reason>``); none is silent. Data-parallel ranks agree on one
path, since FSDP2 collectives must match.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id

from verl_prefix.backend.config import PrefixReuseConfig
from verl_prefix.schedule import moe
from verl_prefix.schedule.prefix_kv import PREFIX_ATTENTION_NAMES, base_attention_implementation

# non-tensor batch flags verl sets for features reuse does not serve -> reason
_BATCH_FLAGS = {
    "fused_kernels": "use_fused_kernels",
    "sum_pi_squared": "calculate_sum_pi_squared",
    "distillation": "distillation_use_topk",
}


def model_fallback_reason(
    module: nn.Module, reuse: PrefixReuseConfig, *, forward_only: bool, ulysses: bool
) -> str | None:
    """A reason the whole mini-batch must run dense because of the model or the knobs, or None."""
    if not reuse.enable:
        return "disabled"
    if forward_only and not reuse.forward_only_reuse:
        return "forward_only_disabled"
    if ulysses:
        return "ulysses"
    if base_attention_implementation(module) not in PREFIX_ATTENTION_NAMES:
        return "attn_implementation"
    config = module.config.get_text_config()
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or []
    ):
        return "sliding_window"
    if not forward_only and has_active_dropout(module):
        return "dropout"
    if not forward_only and uses_reentrant_checkpointing(module):
        return "reentrant_checkpointing"
    if not forward_only:
        # a per-forward random router sample or an in-gate aux loss would see the prefix once per group
        return moe.stochastic_routing_reason(module) or moe.in_model_aux_reason(module)
    return None


def has_active_dropout(model: nn.Module) -> bool:
    """Reuse shares one prefix dropout sample across the group: a different distribution (trap 7)."""
    if not model.training:
        return False
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            return True
        p = getattr(module, "attention_dropout", 0.0)
        if isinstance(p, float) and p > 0:
            return True
    return False


def uses_reentrant_checkpointing(model: nn.Module) -> bool:
    """Reentrant checkpointing re-runs a layer without the forward kwargs that carry the prefix
    context, which breaks phase A (trap 8); verl itself enables the non-reentrant kind."""
    if not model.training:
        return False
    for module in model.modules():
        checkpoint_fn = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and checkpoint_fn is not None:
            if (getattr(checkpoint_fn, "keywords", None) or {}).get("use_reentrant", True):
                return True
    return False


def _has_mm_inputs(data: TensorDict) -> bool:
    from verl.utils.model import extract_multi_modal_inputs

    return bool(extract_multi_modal_inputs(list(data["multi_modal_inputs"])))


def batch_fallback_reason(data: TensorDict) -> str | None:
    """A reason from the batch itself: a verl feature the schedule does not serve, or multimodal inputs."""
    for reason, key in _BATCH_FLAGS.items():
        if tu.get_non_tensor_data(data=data, key=key, default=False):
            return reason
    # verl's agent loop writes multi_modal_inputs={} for every text sample: only real inputs count
    if data["position_ids"].dim() == 3 or ("multi_modal_inputs" in data.keys() and _has_mm_inputs(data)):
        return "multimodal"
    return None


def agree_on_fallback(reason: str | None, group: Any) -> str | None:
    """Every data-parallel rank takes the same path, or their FSDP collectives would not match:
    when any rank must run dense, all do, and the others count it as ``peer_fallback``."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return reason
    flag = torch.tensor([0 if reason is None else 1], device=get_device_id())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return reason if reason is not None or int(flag.item()) == 0 else "peer_fallback"
