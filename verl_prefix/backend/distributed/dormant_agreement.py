"""Per-group (and, under ``prefix_reuse.tree``, per-node) dormant-prefix policies for one mini-batch, agreed
across data-parallel ranks (per group: in the mini-batch's exchange, ``backend.distributed.mini_batch``; per node:
one all-reduce once the padded trie is known).

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

from verl_prefix.backend.distributed.collectives import collective_device, is_distributed
from verl_prefix.schedule.dormant import GraphEstimate, choose_policy, compute_dtype, estimate_prefix_graph
from verl_prefix.schedule.grouping import BatchPlan
from verl_prefix.schedule.tree.dormant import node_estimate
from verl_prefix.schedule.tree.trie import TrieNode

logger = logging.getLogger(__name__)
# reasons this process has already logged (once each; tests clear it)
LOGGED_REASONS: set[str] = set()


def group_policies(
    knob: str,
    budget_bytes: int | None,
    model: nn.Module,
    plan: BatchPlan,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> list[tuple[str, str]]:
    """``(policy, reason)`` per group of this rank's plan, chosen locally (no collective: the recompute flags travel
    in the mini-batch's exchange, ``slot_policies`` applies them). A fixed knob applies to every group
    ("configured"); ``auto`` estimates each group's prefix graph from the model shape in the compute dtype
    (``autocast_dtype`` where the engine autocasts, e.g. bf16 over fp32 master weights; else the parameters') and
    keeps it where it fits the budget, else picks the policy that lowers the peak (``choose_policy``). One log line
    per reason per process."""
    if knob != "auto":
        return [(knob, "configured")] * len(plan.groups)
    assert budget_bytes is not None
    dtype = compute_dtype(model, autocast_dtype)
    return [
        _choose(estimate_prefix_graph(model, group.prefix_len, dtype), budget_bytes, device, dtype)
        for group in plan.groups
    ]


def slot_policies(
    knob: str, own: list[tuple[str, str]], recompute: list[bool], num_slots: int
) -> list[tuple[str, str]]:
    """``(policy, reason)`` per group slot (lockstep fillers included) once every rank's choices are known:
    ``recompute[k]`` says some rank recomputes slot ``k``, and then this rank does too ("peer_recompute"); a filler
    slot keeps under ``auto`` ("filler") and runs the fixed knob otherwise."""
    filler = (knob, "configured") if knob != "auto" else ("keep", "filler")
    chosen = [own[k] if k < len(own) else filler for k in range(num_slots)]
    for slot in range(num_slots):
        if slot < len(recompute) and recompute[slot] and chosen[slot][0] != "recompute":
            chosen[slot] = ("recompute", "peer_recompute")
            _log_once("peer_recompute", "peer_recompute: another data-parallel rank recomputes this slot or node")
    return chosen


def agree_on_node_policies(
    knob: str,
    budget_bytes: int | None,
    model: nn.Module,
    nodes: list[TrieNode],
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> list[tuple[str, str]]:
    """``group_policies`` for the tree schedule, agreed: ``(policy, reason)`` per trie node, ``nodes`` in the
    depth-first order every rank runs them (ranks run the tree only where their tries' passes agree, so the
    i-th node is the same pass on every rank). ``auto`` estimates each node's graph (``tree.dormant.node_estimate``:
    a loss-carrying node runs every layer and the LM head), and a node a peer rank recomputes is recomputed here
    too ("peer_recompute")."""
    if knob != "auto":
        return [(knob, "configured")] * len(nodes)
    assert budget_bytes is not None
    dtype = compute_dtype(model, autocast_dtype)
    chosen = [_choose(node_estimate(model, node, dtype), budget_bytes, device, dtype) for node in nodes]
    return _agree_on_recompute(chosen, group)


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


def _agree_on_recompute(chosen: list[tuple[str, str]], group: dist.ProcessGroup | None) -> list[tuple[str, str]]:
    """Where any rank recomputes a node, every rank does (one all-reduce)."""
    if is_distributed(group) and chosen:
        flags = torch.tensor([p == "recompute" for p, _ in chosen], dtype=torch.long, device=collective_device(group))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return slot_policies("auto", chosen, [bool(f) for f in flags.tolist()], len(chosen))
    return chosen


def _log_once(reason: str, message: str) -> None:
    if reason not in LOGGED_REASONS:
        LOGGED_REASONS.add(reason)
        logger.warning("dormant_prefix=auto: %s", message)
