"""The engine's side of ``prefix_reuse.tree``: the rank's trie for a mini-batch, padded so every data-parallel
rank runs the same passes.

FSDP2 issues collectives in every forward and backward, so every rank must run the same sequence of model
passes. The tree schedule's sequence (``trie.execution_signature``) depends on each rank's trie; the ranks
exchange their tries' shapes and pad them to their union with zero-loss fillers (``schedule.tree_lockstep``).
Every mini-batch one-level reuse serves, the tree serves: images are keyed by content (``schedule.tree_visuals``),
rows of different temperatures under one loss-carrying node take the node's values at their own
(``schedule.tree_loss``)."""

from __future__ import annotations

import torch.distributed as dist

from verl_prefix.schedule.grouping import BatchPlan, RowLayout
from verl_prefix.schedule.tree_lockstep import pad_to, trie_shape, union_shapes
from verl_prefix.schedule.tree_visuals import VisualTokens, visual_token_keys
from verl_prefix.schedule.trie import TrieNode, build_trie


def gather_shapes(shape: object, group: dist.ProcessGroup | None) -> list[object]:
    """Every data-parallel rank's trie shape (``[shape]`` without several ranks)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [shape]
    shapes: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shapes, shape, group=group)
    return shapes


def plan_tree(
    layout: RowLayout,
    plan: BatchPlan,
    min_shared_tokens: int,
    group: dist.ProcessGroup | None,
    own_last: bool = False,
    chunk_tokens: int | None = None,
    visual: VisualTokens | None = None,
) -> list[TrieNode]:
    """The rank's trie roots for the mini-batch, padded to the union of every data-parallel rank's trie shape
    with lockstep fillers (``schedule.tree_lockstep``; the filler roots come last). Collective (the shape
    exchange) on every rank. ``own_last`` (the MoE router aux loss on): each row's last loss position stays in
    its tail, so its last token runs through the routers in its suffix forward; ``chunk_tokens``
    (``prefix_chunk_tokens``): longer nodes run as chains of chunks (``trie.build_trie``); ``visual`` (a
    vision-language model, ``VisualTokens.of``): the trie keys visual tokens by their image's content
    (``schedule.tree_visuals``). No model is refused here: Ulysses, sliding windows, recurrent layers and
    images are served."""
    roots = build_trie(
        layout,
        plan.groups,
        min_shared_tokens,
        own_last=own_last,
        chunk_tokens=chunk_tokens,
        visual_keys=_visual_keys(layout, plan, visual),
    )
    return pad_to(roots, union_shapes(gather_shapes(trie_shape(roots), group)))


def _visual_keys(layout: RowLayout, plan: BatchPlan, visual: VisualTokens | None) -> dict | None:
    """Each reuse row's visual token keys where a group holds images (None for a text mini-batch)."""
    if not any(layout.visual_of(group.rows[0]) for group in plan.groups):
        return None
    if visual is None:
        raise ValueError("the mini-batch holds visual inputs but the model has no vision encoder (vision_config)")
    return visual_token_keys(layout, plan.groups, visual)
