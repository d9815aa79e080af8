"""The FLOP model of a batch under ``prefix_reuse.tree``: the trie the engine builds, priced like ``flops``.

``flops.predicted_speedup`` prices one-level reuse (each group's prefix once). With the tree each trie node
runs once, attending to its ancestors (its queries at positions ``[start, end)``), and each group's suffixes
run against their path as before; so the model is the nodes' prefix work plus the groups' suffix work. With loss
on shared tokens a node also runs the LM head over its loss positions, and each row runs only its tail. The
trie is built the engine's way (``backend.inputs.row_layout``, ``schedule.grouping.plan_batch``,
``schedule.tree.trie.build_trie``) from the batch and the reuse knobs, so the model prices what actually runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_prefix.backend.inputs import row_layout
from verl_prefix.schedule.flop_model import ModelShape, dense_flops, reuse_flops, tree_flops, trie_spans
from verl_prefix.schedule.grouping import plan_batch
from verl_prefix.schedule.tree.trie import build_trie, trie_stats


@dataclass(frozen=True)
class TreeModel:
    """A batch's groups (``(prompt_len, response_lens)``, reuse groups only) and trie nodes (``(start, end)``
    prefix spans), with what each schedule costs under the FLOP model."""

    groups: list[tuple[int, list[int]]]
    nodes: list[tuple[int, int]]
    depth: int
    # each row's tail (``(start, end)`` positions it runs in phase B) and the node positions that run the LM
    # head (loss on shared tokens); ``None``: every row's tail is its whole suffix (a prompt-only trie)
    tails: list[tuple[int, int]] | None = None
    node_head_tokens: int = 0

    def dense(self, shape: ModelShape) -> float:
        return sum(dense_flops(shape, p, s) for p, s in self.groups)

    def one_level(self, shape: ModelShape) -> float:
        return sum(reuse_flops(shape, p, s) for p, s in self.groups)

    def tree(self, shape: ModelShape) -> float:
        """Each node's tokens once (linear layers, attention to the path before them), each suffix once."""
        tails = self.tails
        if tails is None:
            tails = [(p - 1, p - 1 + s) for p, responses in self.groups for s in responses]
        return tree_flops(shape, self.nodes, tails, self.node_head_tokens)

    def speedups(self, shape: ModelShape) -> dict[str, float]:
        """Dense over each schedule, and one-level reuse over the tree (what the tree adds)."""
        dense, one, tree = self.dense(shape), self.one_level(shape), self.tree(shape)
        return {"one_level": dense / one, "tree": dense / tree, "tree_over_one_level": one / tree}


def tree_model(batch: Any, reuse: Any) -> TreeModel:
    """The trie ``prefix_fsdp2`` builds for ``batch`` with the reuse knobs ``reuse`` (a ``PrefixReuseConfig``),
    as a ``TreeModel``. Rows that would run dense are left out of both sides."""
    layout = row_layout(batch)
    plan = plan_batch(
        layout,
        max_rows=None,
        max_tokens=None,
        min_prefix_len=reuse.min_prefix_len,
        min_group_size=reuse.min_group_size,
    )
    roots = []
    if plan.groups:
        roots = build_trie(layout, plan.groups, reuse.min_shared_tokens, chunk_tokens=reuse.prefix_chunk_tokens)
    spans = trie_spans(roots)
    groups = [(g.prompt_len, [layout.response_lens[r] for r in g.rows]) for g in plan.groups]
    depth = trie_stats(roots).depth if roots else 0
    return TreeModel(groups, spans.nodes, depth, spans.tails, spans.node_head_tokens)
