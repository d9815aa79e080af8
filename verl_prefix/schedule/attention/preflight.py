"""Before a mini-batch runs: can this rank's kernels serve ``prefix_reuse.phase_b_attention`` at all?

A refusal found inside an attention call is found on one rank in the middle of FSDP's collectives (a node
without flash-attn, another GPU, another torch build). ``phase_b_kernel_refusal`` asks the same questions the
attention call will ask (``attention.merged.merged_refusal``, ``attention.varlen.varlen_refusal``) of a small
query with the model's head_dim and compute dtype, before anything runs, so that the engine can agree on the
answer across ranks (``verl_prefix.backend.distributed.mini_batch``). What depends on the attention call's kwargs
(sliding windows, softcapping, sinks, dropout) is the model's, the same on every rank, and not asked here.
"""

from __future__ import annotations

import torch

from verl_prefix.schedule.attention import kernels
from verl_prefix.schedule.attention import merged as MA
from verl_prefix.schedule.attention import varlen as V


def probe_query(device: torch.device, dtype: torch.dtype, head_dim: int, requires_grad: bool) -> torch.Tensor:
    """A small query ``[1, 1, 8, head_dim]`` with the model's head_dim and compute dtype on ``device``."""
    return torch.zeros(1, 1, 8, head_dim, dtype=dtype, device=device, requires_grad=requires_grad)


def phase_b_kernel_refusal(
    attention: str, device: torch.device, dtype: torch.dtype, head_dim: int, requires_grad: bool
) -> tuple[str, str] | None:
    """``(reason, explanation)`` when this rank's kernels cannot serve ``prefix_reuse.phase_b_attention`` for a
    model of ``head_dim`` computing in ``dtype`` on ``device`` (``requires_grad``: training), else None."""
    if attention == "concat":
        return None
    query = probe_query(device, dtype, head_dim, requires_grad)
    reason = MA.merged_refusal(query, {})
    if reason is None and attention == "merged_varlen":
        reason = V.varlen_refusal(query, {})
    if reason is None:
        return None
    return reason, explain(reason, device, dtype, head_dim)


def explain(reason: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """One line for a user: what refused, on which machine."""
    machine = f"torch {torch.__version__}"
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        machine += f", {torch.cuda.get_device_name(device)} (sm{major}{minor})"
    if kernels.is_rocm():
        machine += f", ROCm {torch.version.hip}"
    what = {
        "kernel_dtype": f"the flash kernels take fp16/bf16, the model computes in {dtype}",
        "kernel_head_dim": f"the flash kernels take head_dim a multiple of 8 up to 256, the model has {head_dim}",
        "kernel_rocm": "ROCm's flash op returns its LSE in other conventions than the merge expects",
        "kernel_impl": f"flash implementation {kernels.active_flash_impl()!r} is activated in place of torch's own",
        "kernel_arch": (
            f"torch.backends.cuda.can_use_flash_attention refuses {dtype} head_dim {head_dim} here "
            "(pre-Ampere GPU, a build without flash attention, or flash sdp disabled)"
        ),
        "kernel_device": f"no two-part attention kernels on {device.type}",
    }.get(reason)
    if what is None and reason.startswith("varlen"):
        what = V.varlen_kernel_problem() or reason
    return f"{reason}: {what or reason} ({machine})"
