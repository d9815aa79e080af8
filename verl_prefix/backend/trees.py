"""The engine's side of ``prefix_reuse.tree``: the rank's trie for a mini-batch, padded so every data-parallel
rank runs the same passes.

FSDP2 issues collectives in every forward and backward, so every rank must run the same sequence of model
passes. The tree schedule's sequence (``trie.execution_signature``) depends on each rank's trie; the ranks
exchange their tries' shapes (in the mini-batch's exchange, ``backend.distributed.mini_batch``) and
pad them to their union with zero-loss fillers (``schedule.tree.lockstep``).
Every mini-batch one-level reuse serves, the tree serves: images are keyed by content (``schedule.tree.visuals``),
rows of different temperatures under one loss-carrying node take the node's values at their own
(``schedule.tree.loss``)."""

from __future__ import annotations

import torch.distributed as dist

from verl_prefix.backend.distributed.collectives import gather_objects
from verl_prefix.schedule.grouping import BatchPlan, RowLayout
from verl_prefix.schedule.tree.lockstep import pad_to, trie_shape, union_shapes
from verl_prefix.schedule.tree.trie import TrieNode, build_trie
from verl_prefix.schedule.tree.visuals import VisualTokens, visual_token_keys


def local_trie(
    layout: RowLayout,
    plan: BatchPlan,
    min_shared_tokens: int,
    own_last: bool = False,
    chunk_tokens: int | None = None,
    visual: VisualTokens | None = None,
) -> list[TrieNode]:
    """This rank's trie roots for the mini-batch, before any peer is heard (no collective). ``own_last`` (the MoE
    router aux loss on): each row's last loss position stays in its tail, so its last token runs through the
    routers in its suffix forward; ``chunk_tokens`` (``prefix_chunk_tokens``): longer nodes run as chains of
    chunks (``trie.build_trie``); ``visual`` (a vision-language model, ``VisualTokens.of``): the trie keys visual
    tokens by their image's content (``schedule.tree.visuals``). No model is refused here: Ulysses, sliding
    windows, recurrent layers and images are served."""
    return build_trie(
        layout,
        plan.groups,
        min_shared_tokens,
        own_last=own_last,
        chunk_tokens=chunk_tokens,
        visual_keys=_visual_keys(layout, plan, visual),
    )


def padded_trie(roots: list[TrieNode], shapes: list[object]) -> list[TrieNode]:
    """``roots`` padded to the union of every rank's trie shape (``shapes``, from the mini-batch's exchange) with
    lockstep fillers (``schedule.tree.lockstep``; the filler roots come last)."""
    return pad_to(roots, union_shapes(shapes))


def plan_tree(
    layout: RowLayout,
    plan: BatchPlan,
    min_shared_tokens: int,
    group: dist.ProcessGroup | None,
    own_last: bool = False,
    chunk_tokens: int | None = None,
    visual: VisualTokens | None = None,
) -> list[TrieNode]:
    """``local_trie`` padded to every rank's shape, the shapes exchanged here (a collective on every rank of
    ``group``): the tree on its own, outside a mini-batch's exchange."""
    roots = local_trie(layout, plan, min_shared_tokens, own_last, chunk_tokens, visual)
    return padded_trie(roots, [shape for _, shape in gather_objects(trie_shape(roots), group)])


def _visual_keys(layout: RowLayout, plan: BatchPlan, visual: VisualTokens | None) -> dict | None:
    """Each reuse row's visual token keys where a group holds images (None for a text mini-batch)."""
    if not any(layout.visual_of(group.rows[0]) for group in plan.groups):
        return None
    if visual is None:
        raise ValueError("the mini-batch holds visual inputs but the model has no vision encoder (vision_config)")
    return visual_token_keys(layout, plan.groups, visual)
