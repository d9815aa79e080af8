"""Per-group (and, under ``prefix_reuse.tree``, per-node) dormant-prefix policies for one mini-batch, agreed
across data-parallel ranks.

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

from verl_prefix.schedule.dormant import GraphEstimate, choose_policy, compute_dtype, estimate_prefix_graph
from verl_prefix.schedule.grouping import BatchPlan
from verl_prefix.schedule.tree_dormant import node_estimate
from verl_prefix.schedule.trie import TrieNode

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
    autocast_dtype: torch.dtype | None = None,
) -> list[tuple[str, str]]:
    """``(policy, reason)`` per group slot (lockstep fillers included). A fixed knob applies to every
    slot ("configured"); ``auto`` estimates each group's prefix graph from the model shape in the compute
    dtype (``autocast_dtype`` where the engine autocasts, e.g. bf16 over fp32 master weights; else the
    parameters') and keeps it where it fits the budget, else picks the policy that lowers the peak
    (``choose_policy``); a slot a peer rank recomputes is recomputed here too ("peer_recompute"). One
    log line per reason per process."""
    if knob != "auto":
        return [(knob, "configured")] * num_slots
    assert budget_bytes is not None
    chosen: list[tuple[str, str]] = []
    dtype = compute_dtype(model, autocast_dtype)
    for slot in range(num_slots):
        if slot < len(plan.groups):
            estimate = estimate_prefix_graph(model, plan.groups[slot].prefix_len, dtype)
            chosen.append(_choose(estimate, budget_bytes, device, dtype))
        else:
            chosen.append(("keep", "filler"))
    return _agree_on_recompute(chosen, device, group)


def agree_on_node_policies(
    knob: str,
    budget_bytes: int | None,
    model: nn.Module,
    nodes: list[TrieNode],
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> list[tuple[str, str]]:
    """``agree_on_policies`` for the tree schedule: ``(policy, reason)`` per trie node, ``nodes`` in the
    depth-first order every rank runs them (ranks run the tree only where their tries' passes agree, so the
    i-th node is the same pass on every rank). ``auto`` estimates each node's graph (``tree_dormant.node_estimate``:
    a loss-carrying node runs every layer and the LM head), and a node a peer rank recomputes is recomputed here
    too ("peer_recompute")."""
    if knob != "auto":
        return [(knob, "configured")] * len(nodes)
    assert budget_bytes is not None
    dtype = compute_dtype(model, autocast_dtype)
    chosen = [_choose(node_estimate(model, node, dtype), budget_bytes, device, dtype) for node in nodes]
    return _agree_on_recompute(chosen, device, group)


def _choose(estimate: GraphEstimate, budget_bytes: int, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """``choose_policy`` with its one log line per reason."""
    policy, reason = choose_policy(estimate, budget_bytes, device)
    message = (
        f"{reason}: prefix graph of ~{estimate.total / 2**20:.1f} MiB ({dtype}), budget {budget_bytes / 2**20:.1f} MiB"
    )
    if policy == "recompute":  # the budget bounds phase B; phase C rebuilds the graph
        message += (
            " (recompute keeps it out of phase B; phase C still holds it whole unless prefix_chunk_tokens "
            "chunks the prefix)"
        )
    elif policy == "offload":
        message += (
            f" (offload keeps it out of phase B and restores it layer by layer in phase C: "
            f"~{estimate.offload_resident / 2**20:.1f} MiB at once)"
        )
    _log_once(reason, message)
    return policy, reason


def _agree_on_recompute(
    chosen: list[tuple[str, str]], device: torch.device, group: dist.ProcessGroup | None
) -> list[tuple[str, str]]:
    """Where any rank recomputes a slot (group or node), every rank does (one all-reduce)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1 and chosen:
        flags = torch.tensor([p == "recompute" for p, _ in chosen], dtype=torch.long, device=_collective(device, group))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        for slot, flag in enumerate(flags.tolist()):
            if flag and chosen[slot][0] != "recompute":
                chosen[slot] = ("recompute", "peer_recompute")
                _log_once("peer_recompute", "peer_recompute: another data-parallel rank recomputes this slot or node")
    return chosen


def _collective(device: torch.device, group: dist.ProcessGroup | None) -> torch.device:
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else device


def _log_once(reason: str, message: str) -> None:
    if reason not in LOGGED_REASONS:
        LOGGED_REASONS.add(reason)
        logger.warning("dormant_prefix=auto: %s", message)
