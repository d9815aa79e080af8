"""Per-group dormant-prefix policies for one mini-batch, agreed across data-parallel ranks.

``recompute`` runs one more prefix forward in phase C, i.e. one more round of FSDP2 all-gathers; ranks
must run the same collectives, so wherever a rank recomputes a group slot, every rank recomputes
that slot (``auto`` decides per rank from its own group's estimate, then takes the max). ``keep`` and
``offload`` issue the same collectives and need no agreement.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from verl_prefix.schedule.dormant import choose_policy, estimate_prefix_graph_bytes
from verl_prefix.schedule.grouping import BatchPlan

logger = logging.getLogger(__name__)
# reasons this process has already logged (once each; tests clear it)
LOGGED_REASONS: set[str] = set()


def agree_on_policies(
    knob: str,
    budget_bytes: int | None,
    model: nn.Module,
    plan: BatchPlan,
    num_slots: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> list[tuple[str, str]]:
    """``(policy, reason)`` per group slot (lockstep fillers included). A fixed knob applies to every
    slot ("configured"); ``auto`` estimates each group's prefix graph from the model shape
    (``estimate_prefix_graph_bytes``) and picks the cheapest policy that fits the budget; a slot a peer
    rank recomputes is recomputed here too ("peer_recompute"). One log line per reason per process."""
    if knob != "auto":
        return [(knob, "configured")] * num_slots
    assert budget_bytes is not None
    chosen: list[tuple[str, str]] = []
    for slot in range(num_slots):
        if slot < len(plan.groups):
            estimate = estimate_prefix_graph_bytes(model, plan.groups[slot].prefix_len)
            policy, reason = choose_policy(estimate, budget_bytes, device)
            message = f"{reason}: prefix graph of ~{estimate / 2**20:.1f} MiB, budget {budget_bytes / 2**20:.1f} MiB"
            if policy != "keep":  # the budget bounds phase B; phase C restores or rebuilds the graph
                message += (
                    f" ({policy} keeps it out of phase B; phase C still holds it whole unless prefix_chunk_tokens "
                    "chunks the prefix)"
                )
            _log_once(reason, message)
        else:
            policy, reason = "keep", "filler"
        chosen.append((policy, reason))
    if dist.is_initialized() and dist.get_world_size(group) > 1 and num_slots:
        flags = torch.tensor([p == "recompute" for p, _ in chosen], dtype=torch.long, device=_collective(device, group))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        for slot, flag in enumerate(flags.tolist()):
            if flag and chosen[slot][0] != "recompute":
                chosen[slot] = ("recompute", "peer_recompute")
                _log_once("peer_recompute", "peer_recompute: another data-parallel rank recomputes this group slot")
    return chosen


def _collective(device: torch.device, group: dist.ProcessGroup | None) -> torch.device:
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else device


def _log_once(reason: str, message: str) -> None:
    if reason not in LOGGED_REASONS:
        LOGGED_REASONS.add(reason)
        logger.warning("dormant_prefix=auto: %s", message)
