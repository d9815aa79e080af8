"""The engine's side of ``prefix_reuse.tree``: whether a mini-batch runs the tree schedule, agreed by every
data-parallel rank, and why not where it does not (``prefix/tree_fallback_<reason>``, one log line per reason).

FSDP2 issues collectives in every forward and backward, so every rank must run the same sequence of model
passes. The tree schedule's sequence (``trie.execution_signature``) depends on each rank's trie; ranks run the
tree only where every rank's signature is the same, and one-level reuse (whose lockstep fillers make any
shapes agree) otherwise, counted as ``lockstep``. Rows that take log-probs from one node but differ in temperature
run one-level reuse too (``temperature``)."""

from __future__ import annotations

import logging
import zlib

import torch
import torch.distributed as dist
from torch import nn

from verl_prefix.backend.fallbacks import attention_windows
from verl_prefix.backend.lockstep import collective_device
from verl_prefix.schedule import recurrent
from verl_prefix.schedule.grouping import BatchPlan, RowLayout
from verl_prefix.schedule.trie import TrieNode, build_trie, execution_signature

logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()

# why a mini-batch ran one-level reuse with ``prefix_reuse.tree`` on
TREE_FALLBACKS = ("sliding_window", "recurrent", "multimodal", "lockstep", "temperature")


def tree_refusal(model: nn.Module) -> str | None:
    """What the tree schedule does not serve yet for this model (the same on every rank). Ulysses is served:
    every node and tail runs sliced over the SP group as one-level reuse's prefix and suffixes do."""
    if attention_windows(model):
        return "sliding_window"
    if recurrent.recurrent_layers(model):
        return "recurrent"
    return None


def batch_refusal(layout: RowLayout, plan: BatchPlan) -> str | None:
    """What the tree does not serve in this rank's mini-batch (may differ between ranks): reuse groups with
    visual inputs. A node's forward takes token ids only, and image placeholder tokens are the same for every
    image, so a trie over them would share the prompts of groups whose images differ."""
    if any(layout.visual_of(group.rows[0]) for group in plan.groups):
        return "multimodal"
    return None


def signature_code(signature: str) -> int:
    """A process-independent 63-bit code of an execution signature (``hash`` differs per process)."""
    return (zlib.crc32(signature.encode()) << 31) ^ len(signature)


def agree_on_signature(signature: str, group: dist.ProcessGroup | None) -> bool:
    """Whether every rank's tree schedule runs the same sequence of passes (True without several ranks)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return True
    code = signature_code(signature)
    both = torch.tensor([code, -code], dtype=torch.long, device=collective_device(group))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return int(both[0]) == -int(both[1])


def temperature_conflict(roots: list[TrieNode], layout: RowLayout) -> bool:
    """Rows that take log-probs from one node differ in temperature (their logits are divided before the
    log-softmax, so the node's cannot serve them all)."""
    if layout.temperature is None:
        return False
    for root in roots:
        for node, _ in root.walk():
            if node.logits_from is None:
                continue
            if len({float(layout.temperature[row]) for row in node.loss_rows()}) > 1:
                return True
    return False


def plan_tree(
    model: nn.Module,
    layout: RowLayout,
    plan: BatchPlan,
    min_shared_tokens: int,
    group: dist.ProcessGroup | None,
    own_last: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[list[TrieNode] | None, str | None]:
    """``(roots, None)`` where the mini-batch runs the tree schedule, else ``(None, reason)``. Collective
    (the lockstep agreement) on every rank that reaches it, whatever its own trie: a rank whose own batch the
    tree does not serve (``batch_refusal``, or rows of different temperatures under one loss-carrying node) still
    takes part, with a signature no trie has, so every rank runs one-level reuse (its own reason there,
    ``lockstep`` on the others). ``own_last`` (the MoE router aux loss on): each row's last loss position stays
    in its tail, so its last token runs through the routers in its suffix forward; ``chunk_tokens``
    (``prefix_chunk_tokens``): longer nodes run as chains of chunks (``trie.build_trie``)."""
    reason = tree_refusal(model)
    if reason is None:
        local = batch_refusal(layout, plan)
        roots = (
            build_trie(layout, plan.groups, min_shared_tokens, own_last=own_last, chunk_tokens=chunk_tokens)
            if local is None
            else None
        )
        if roots is not None and temperature_conflict(roots, layout):
            local, roots = "temperature", None
        signature = execution_signature(roots) if roots is not None else f"refused:{local}"
        if agree_on_signature(signature, group) and roots is not None:
            return roots, None
        reason = local or "lockstep"
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.warning(
            "prefix_reuse.tree: this mini-batch runs one-level reuse (%s); counted as prefix/tree_fallback_%s",
            reason,
            reason,
        )
    return None, reason
