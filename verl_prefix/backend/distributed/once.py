"""Decisions outside the mini-batch's one exchange (``mini_batch``): once per model, and inside phase C.

The model's structure (``agree_on_structure``). Whether the schedule can serve the model at all
(``verl_prefix.schedule.models.capability``) is decided once, at engine initialisation: every rank inspects its own
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

from torch import nn

from verl_prefix.backend.distributed.collectives import gather_flagged
from verl_prefix.schedule.dormant import Dormant
from verl_prefix.schedule.models.capability import structure_refusal

logger = logging.getLogger(__name__)


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
    chunks (``dormant_agreement.slot_policies``, lockstep chunk counts), so each recompute's verdict is one flag
    all-reduce (the messages are gathered only on a mismatch), and every rank raises the same ``RecomputeMismatch``
    naming the ranks, before phase C's backward and its reduce-scatters; none is left waiting in them."""

    group: Any = None

    def settle_recompute(self, mismatch: str | None) -> None:
        flagged = gather_flagged(mismatch, self.group)
        if not flagged:
            return
        ranks = ", ".join(str(rank) for rank, _ in flagged)
        raise RecomputeMismatch(f"rank(s) {ranks} (every data-parallel rank stops): {flagged[0][1]}")
