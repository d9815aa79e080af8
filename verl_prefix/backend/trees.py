"""The engine's side of ``prefix_reuse.tree``: whether a mini-batch runs the tree schedule, agreed by every
data-parallel rank, and why not where it does not (``prefix/tree_fallback_<reason>``, one log line per reason).

FSDP2 issues collectives in every forward and backward, so every rank must run the same sequence of model
passes. The tree schedule's sequence (``trie.execution_signature``) depends on each rank's trie; the ranks
exchange their tries' shapes and pad them to their union with zero-loss fillers (``schedule.tree_lockstep``).
Rows that take log-probs from one node but differ in temperature run one-level reuse (``temperature``; every
other rank: ``lockstep``). Images are served: the trie keys a visual token by its image's content
(``schedule.tree_visuals``)."""

from __future__ import annotations

import logging

import torch.distributed as dist

from verl_prefix.schedule.grouping import BatchPlan, RowLayout
from verl_prefix.schedule.tree_lockstep import pad_to, trie_shape, union_shapes
from verl_prefix.schedule.tree_visuals import VisualTokens, visual_token_keys
from verl_prefix.schedule.trie import TrieNode, build_trie

logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()

# why a mini-batch ran one-level reuse with ``prefix_reuse.tree`` on
TREE_FALLBACKS = ("lockstep", "temperature")


def gather_shapes(shape: object, group: dist.ProcessGroup | None) -> list[object]:
    """Every data-parallel rank's trie shape (``[shape]`` without several ranks)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [shape]
    shapes: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shapes, shape, group=group)
    return shapes


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
    layout: RowLayout,
    plan: BatchPlan,
    min_shared_tokens: int,
    group: dist.ProcessGroup | None,
    own_last: bool = False,
    chunk_tokens: int | None = None,
    visual: VisualTokens | None = None,
) -> tuple[list[TrieNode] | None, str | None]:
    """``(roots, None)`` where the mini-batch runs the tree schedule, else ``(None, reason)``. Collective (the
    shape exchange) on every rank that reaches it, whatever its own trie: the ranks' tries are padded to the
    union of their shapes with lockstep fillers (``schedule.tree_lockstep``; the filler roots come last in
    ``roots``). A rank whose rows of different temperatures take log-probs from one node sends no shape, so
    every rank runs one-level reuse (``temperature`` there, ``lockstep`` on the others). ``own_last`` (the MoE
    router aux loss on): each row's last loss position stays in its tail, so its last token runs through the
    routers in its suffix forward; ``chunk_tokens`` (``prefix_chunk_tokens``): longer nodes run as chains of
    chunks (``trie.build_trie``); ``visual`` (a vision-language model, ``VisualTokens.of``): the trie keys
    visual tokens by their image's content (``schedule.tree_visuals``). No model is refused here: Ulysses,
    sliding windows, recurrent layers and images are served."""
    roots = build_trie(
        layout,
        plan.groups,
        min_shared_tokens,
        own_last=own_last,
        chunk_tokens=chunk_tokens,
        visual_keys=_visual_keys(layout, plan, visual),
    )
    local = "temperature" if temperature_conflict(roots, layout) else None
    roots = None if local else roots
    shapes = gather_shapes(trie_shape(roots) if roots is not None else None, group)
    union = union_shapes(shapes) if all(shape is not None for shape in shapes) else None
    if union is not None and roots is not None:
        return pad_to(roots, union), None
    reason = local or "lockstep"
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.warning(
            "prefix_reuse.tree: this mini-batch runs one-level reuse (%s); counted as prefix/tree_fallback_%s",
            reason,
            reason,
        )
    return None, reason


def _visual_keys(layout: RowLayout, plan: BatchPlan, visual: VisualTokens | None) -> dict | None:
    """Each reuse row's visual token keys where a group holds images (None for a text mini-batch)."""
    if not any(layout.visual_of(group.rows[0]) for group in plan.groups):
        return None
    if visual is None:
        raise ValueError("the mini-batch holds visual inputs but the model has no vision encoder (vision_config)")
    return visual_token_keys(layout, plan.groups, visual)
