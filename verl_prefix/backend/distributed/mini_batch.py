"""The one exchange of a mini-batch: every rank's ``RankReport`` in one gather, one ``Agreement`` from them.

Before this, a mini-batch issued a collective per decision (validity, fallback, loss tokens, the lockstep shape
twice, the trie shape, the phase-B kernels, the router tokens): on a multi-node cluster each a network round trip
before the first phase-A forward, where verl's stock engine issues one. Now each rank does all of its local work
first, with no collective (checks its batch, plans its groups, builds its trie, asks its kernels, chooses its
dormant policies), puts the outcomes in a ``RankReport``, and the ranks exchange the reports once
(``gather_objects``: one object all-gather, two collectives on the wire). Every rank derives the same
``Agreement`` from the same list (``agree``), so every rank takes the same path or raises the same error:

- a batch that failed its checks on any rank: ``BatchRejected`` on every rank, naming each bad rank's samples;
- a rank that must run dense for its own reason: every rank runs dense, the others as ``peer_fallback``;
- the loss's global normalisation (``batch_num_tokens``) and the router aux loss's token count: sums over the
  data-parallel ranks (the sequence-parallel ranks of one data-parallel rank hold the same mini-batch);
- the lockstep shape (``LockstepPlan.busiest``) and, under ``prefix_reuse.tree``, every rank's trie shape;
- phase B's kernels: whether torch's flash kernels serve (the GPU's architecture, a ROCm build, a node with
  another flash-attn or none) is found per rank and must not be found inside an attention call mid-collective:
  with ``auto`` every rank runs concat for the first refusing rank's reason, with ``merged``/``merged_varlen``
  every rank raises the same ``KernelRefused``;
- ``dormant_prefix=auto``: a group slot any rank recomputes, every rank recomputes (one more forward is one more
  round of FSDP2 all-gathers);
- an engine's own refusal of a dense chunk (``dense_refusal``): the same error on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from verl_prefix.backend.distributed.collectives import gather_objects
from verl_prefix.backend.distributed.lockstep import LockstepPlan
from verl_prefix.backend.validation import BatchRejected
from verl_prefix.schedule.attention.preflight import phase_b_kernel_refusal
from verl_prefix.schedule.models.structure import kernel_head_dim

logger = logging.getLogger(__name__)
# kernel reasons this process has already logged (once each)
LOGGED_REASONS: set[str] = set()


class KernelRefused(ValueError):
    """Raised on every data-parallel rank when an explicit phase-B attention cannot run on some rank."""


@dataclass
class RankReport:
    """What one rank found about its mini-batch, locally, before any collective."""

    dp_rank: int = 0  # the rank's data-parallel rank: sequence-parallel peers hold the same mini-batch
    error: str | None = None  # the batch failed this rank's checks: the message naming its samples
    reason: str | None = None  # this rank must run the whole mini-batch dense: why
    loss_tokens: int = 0  # the rank's loss-mask tokens (the loss's global normalisation)
    moe_tokens: int = 0  # the rank's logical tokens (the router aux loss's normalisation)
    lockstep: LockstepPlan | None = None  # the rank's own shape, where it would reuse
    trie: Any = None  # the rank's trie shape (``tree.lockstep.trie_shape``) under ``prefix_reuse.tree``
    kernel: tuple[str, str] | None = None  # the phase-B kernels' ``(reason, explanation)`` refusal
    recompute: list[bool] = field(default_factory=list)  # per own group: ``dormant_prefix=auto`` recomputes it
    dense_refusal: str | None = None  # the engine cannot run one of this rank's dense chunks: why


@dataclass
class Agreement:
    """What every rank runs, the same on every rank."""

    reason: str | None  # the whole mini-batch runs dense for this reason (None: reuse)
    loss_tokens: int
    moe_tokens: int
    lockstep: LockstepPlan | None
    tries: list[Any]  # every rank's trie shape, in rank order (tree only)
    kernel_refusal: str | None  # phase B's merged kernels refused on some rank: concat for this reason
    recompute: list[bool]  # per group slot: some rank recomputes it
    dense_refused: bool  # some rank's dense chunk cannot run: every rank raises (``ReuseDriver.dense_refusal``)


def model_head_dim(model: nn.Module) -> int:
    """The head size phase B's kernels run at for this model (``structure.kernel_head_dim``: the widest of its
    query/key and value heads, MLA's included)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return kernel_head_dim(text)


def local_refusal(
    attention: str, device: torch.device, dtype: torch.dtype, head_dim: int, requires_grad: bool
) -> tuple[str, str] | None:
    """This rank's ``(reason, explanation)`` for phase B's kernels, or None (``concat`` needs none); an error
    while asking is a refusal too (the peers must hear of it before they enter a collective)."""
    if attention == "concat":
        return None
    try:
        return phase_b_kernel_refusal(attention, device, dtype, head_dim, requires_grad)
    except Exception as exc:  # noqa: BLE001
        return "kernel_error", f"kernel_error: asking whether the kernels serve raised {type(exc).__name__}: {exc}"


def exchange(report: RankReport, group: Any = None) -> list[tuple[int, RankReport]]:
    """Every rank's report, ``(global rank, report)`` in rank order: the mini-batch's one gather (none without
    peers). A collective: every rank of ``group`` calls it once per mini-batch, whatever its batch holds."""
    return gather_objects(report, group)


def agree(
    reports: Sequence[tuple[int, RankReport]],
    mine: RankReport,
    attention: str,
    own_error: BaseException | None = None,
) -> Agreement:
    """The decisions every rank derives alike from the same ``reports`` (``mine``: this rank's own). Raises
    ``BatchRejected`` (chained to ``own_error``, this rank's own exception) where any rank's batch failed its
    checks, and ``KernelRefused`` where the mini-batch reuses under an explicit ``attention`` that some rank's
    kernels cannot run."""
    rejected = [(rank, r.error) for rank, r in reports if r.error is not None]
    if rejected:
        raise BatchRejected(describe_rejections(rejected)) from own_error
    fallback = any(r.reason is not None for _, r in reports)
    reason = (mine.reason or "peer_fallback") if fallback else None
    shapes = [r.lockstep for _, r in reports if r.lockstep is not None]
    refused = [(rank, r.kernel) for rank, r in reports if r.kernel is not None]
    kernel_refusal = None if reason is not None else settle_kernels(attention, refused)
    # token counts are the data-parallel group's: a mini-batch that Ulysses ranks share counts once
    per_dp_rank = {r.dp_rank: r for _, r in reports}
    slots = max((len(r.recompute) for _, r in reports), default=0)
    recompute = [any(k < len(r.recompute) and r.recompute[k] for _, r in reports) for k in range(slots)]
    return Agreement(
        reason=reason,
        loss_tokens=sum(r.loss_tokens for r in per_dp_rank.values()),
        moe_tokens=sum(r.moe_tokens for r in per_dp_rank.values()),
        lockstep=LockstepPlan.busiest(shapes) if reason is None and shapes else None,
        tries=[r.trie for _, r in reports],
        kernel_refusal=kernel_refusal,
        recompute=recompute,
        dense_refused=reason is None and any(r.dense_refusal is not None for _, r in reports),
    )


def settle_kernels(attention: str, refused: Sequence[tuple[int, tuple[str, str]]]) -> str | None:
    """The phase-B refusal every rank applies (``auto``: concat for the first refusing rank's reason), or None
    when every rank's kernels serve; raises ``KernelRefused`` for an explicit ``merged``/``merged_varlen``."""
    if not refused or attention == "concat":
        return None
    where = "; ".join(f"rank {rank}: {text}" for rank, (_, text) in refused)
    if attention == "auto":
        reason = refused[0][1][0]
        if reason not in LOGGED_REASONS:
            LOGGED_REASONS.add(reason)
            logger.warning("phase B runs concat attention on every data-parallel rank: %s", where)
        return reason
    raise KernelRefused(
        "actor_rollout_ref.actor."
        f"prefix_reuse.phase_b_attention={attention} cannot run on every data-parallel rank (every rank stops): "
        f"{where}. Use auto (concat where the kernels do not serve) or concat."
    )


def describe_rejections(rejections: Sequence[tuple[int, str]]) -> str:
    """One message naming every rank whose batch failed its checks, and why."""
    if len(rejections) == 1:
        rank, message = rejections[0]
        return f"rank {rank} rejected the mini-batch (every data-parallel rank stops): {message}"
    details = "; ".join(f"rank {rank}: {message}" for rank, message in rejections)
    return f"{len(rejections)} ranks rejected the mini-batch (every data-parallel rank stops): {details}"


def error_message(error: BaseException) -> str:
    """A rank's failure as its peers read it: a ``ValueError``'s message as is, anything else with its type."""
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
