"""Decisions one rank's machine makes, agreed across data-parallel ranks before they can split them
(DESIGN trap 15: a rank that raises between two collectives leaves its peers waiting).

Phase-B kernels. Whether torch's flash kernels serve the model (the GPU's architecture, a ROCm build, an
activated flash implementation, a node with another flash-attn or none) is found per rank. Found inside an
attention call, a refusal would stop one rank in the middle of FSDP's collectives. So each rank asks first
(``verl_prefix.schedule.preflight``), once per engine, attention setting, compute dtype and pass kind, and the
ranks share their answers (``agree_on_kernels``): with ``auto`` every rank runs concat with the first refusing
rank's reason (``prefix/phase_b_attention/concat_<reason>`` on every rank); with ``merged`` or
``merged_varlen`` every rank raises the same ``KernelRefused`` naming the refusing ranks and why.

The model's structure (``agree_on_structure``). Whether the schedule can serve the model at all
(``verl_prefix.schedule.capability``) is decided once, at engine initialisation: every rank inspects its own
modules and the ranks share their answers before any step, so with ``prefix_reuse.unsupported_model=dense``
every rank runs every mini-batch dense with the same reason, and with ``raise`` every rank raises the same
``UnsupportedModel``.

The recompute check (``AgreedDormant``). Under ``dormant_prefix=recompute`` phase C re-runs the prefix and
checks it against what phase B attended to; a mismatch that one rank sees (an MoE top-k flip, a
nondeterministic kernel) stops every rank with the same ``RecomputeMismatch`` before phase C's backward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verl_prefix.backend.validation import gather_flagged
from verl_prefix.schedule.capability import structure_refusal
from verl_prefix.schedule.dormant import Dormant
from verl_prefix.schedule.preflight import phase_b_kernel_refusal
from verl_prefix.schedule.structure import kernel_head_dim

logger = logging.getLogger(__name__)
# reasons this process has already logged (once each)
LOGGED_REASONS: set[str] = set()


class KernelRefused(ValueError):
    """Raised on every data-parallel rank when an explicit phase-B attention cannot run on some rank."""


def model_head_dim(model: nn.Module) -> int:
    """The head size phase B's kernels run at for this model (``structure.kernel_head_dim``: the widest of its
    query/key and value heads, MLA's included)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return kernel_head_dim(text)


def local_refusal(
    attention: str, device: torch.device, dtype: torch.dtype, head_dim: int, requires_grad: bool
) -> tuple[str, str] | None:
    """This rank's ``(reason, explanation)``, or None; an error while asking is a refusal too (the peers must
    hear of it before they enter a collective)."""
    try:
        return phase_b_kernel_refusal(attention, device, dtype, head_dim, requires_grad)
    except Exception as exc:  # noqa: BLE001
        return "kernel_error", f"kernel_error: asking whether the kernels serve raised {type(exc).__name__}: {exc}"


def agree_on_kernels(
    attention: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    requires_grad: bool,
    group: Any = None,
) -> str | None:
    """The refusal every rank applies (``auto``: concat for that reason), or None when every rank's kernels
    serve; raises ``KernelRefused`` on every rank for an explicit ``merged``/``merged_varlen`` some rank cannot
    run. A collective over ``group`` (none for ``concat``, the same on every rank)."""
    if attention == "concat":
        return None
    flagged = gather_flagged(local_refusal(attention, device, dtype, head_dim, requires_grad), group)
    if not flagged:
        return None
    where = "; ".join(f"rank {rank}: {text}" for rank, (_, text) in flagged)
    if attention == "auto":
        reason = flagged[0][1][0]
        if reason not in LOGGED_REASONS:
            LOGGED_REASONS.add(reason)
            logger.warning("phase B runs concat attention on every data-parallel rank: %s", where)
        return reason
    raise KernelRefused(
        "actor_rollout_ref.actor."
        f"prefix_reuse.phase_b_attention={attention} cannot run on every data-parallel rank (every rank stops): "
        f"{where}. Use auto (concat where the kernels do not serve) or concat."
    )


class UnsupportedModel(ValueError):
    """Raised on every data-parallel rank at engine initialisation, under ``prefix_reuse.unsupported_model=raise``,
    when the schedule cannot serve the model's structure on some rank."""


def local_structure_refusal(model: nn.Module) -> tuple[str, str] | None:
    """This rank's ``(reason, message)`` for a model the schedule cannot serve, or None; an error while
    inspecting is a refusal too (``structure_check_error``), so no rank trains on a model nobody checked."""
    try:
        refusal = structure_refusal(model)
    except Exception as exc:  # noqa: BLE001
        return "structure_check_error", f"inspecting the model raised {type(exc).__name__}: {exc}"
    return None if refusal is None else (refusal.reason, refusal.message())


def agree_on_structure(model: nn.Module, unsupported_model: str, group: Any = None) -> str | None:
    """The reason every rank runs dense (the first refusing rank's), or None when every rank's model can be
    served; raises ``UnsupportedModel`` on every rank under ``unsupported_model="raise"``. A collective over
    ``group``: every rank calls it once, at initialisation, before any step."""
    flagged = gather_flagged(local_structure_refusal(model), group)
    if not flagged:
        return None
    where = "; ".join(f"rank {rank}: {text}" for rank, (_, text) in flagged)
    if unsupported_model == "raise":
        raise UnsupportedModel(
            f"prefix reuse cannot serve this model (every data-parallel rank stops): {where}. Set "
            "prefix_reuse.unsupported_model=dense to train it through the stock dense path, or use strategy fsdp2."
        )
    reason = flagged[0][1][0]
    logger.warning(
        "prefix reuse cannot serve this model; every mini-batch runs through the stock dense path, counted as "
        "prefix/fallback_%s: %s",
        reason,
        where,
    )
    return reason


class RecomputeMismatch(RuntimeError):
    """Raised on every data-parallel rank when phase C's recomputed prefix differed from phase A's on any rank."""


@dataclass
class AgreedDormant(Dormant):
    """``Dormant`` whose recompute check is agreed over ``group``: ranks recompute the same group slots and
    chunks (``backend.dormant.agree_on_policies``, lockstep chunk counts), so each recompute's verdict is one
    flag all-reduce (the messages are gathered only on a mismatch), and every rank raises the same
    ``RecomputeMismatch`` naming the ranks, before phase C's backward and its reduce-scatters; none is left
    waiting in them."""

    group: Any = None

    def settle_recompute(self, mismatch: str | None) -> None:
        flagged = gather_flagged(mismatch, self.group)
        if not flagged:
            return
        ranks = ", ".join(str(rank) for rank, _ in flagged)
        raise RecomputeMismatch(f"rank(s) {ranks} (every data-parallel rank stops): {flagged[0][1]}")
