"""A token trie over a rank's reuse groups (``prefix_reuse.tree``): compute every shared prefix token once.

One-level reuse computes each uid group's prefix (``prompt[:-1]``) once. Groups on a rank often share more:
a system block and tool schemas in front of every question. The trie is built from the groups' prefix
tokens (and positions) alone, no annotation: a node is a run of tokens that every group below it shares,
children branch where the groups' prefixes differ, and a group hangs on the node where its prefix ends.
One-level reuse is the special case of a root per group (nothing shared across groups).

A node shorter than ``min_shared_tokens`` that no group ends on is merged into its children (its tokens run
once per child instead): a node is one more prefix forward (and backward), a fixed cost the FLOP model does
not price, exactly as ``min_prefix_len`` decides for a whole prefix. What the tree schedule runs over this
trie is ``schedule.tree``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from verl_prefix.schedule.grouping import GroupPlan, RowLayout

# the default ``min_shared_tokens``: a shared node pays one more forward's fixed cost, as a group's prefix
# does (``prefix_reuse.min_prefix_len``'s default); by FLOPs alone any shared token pays
DEFAULT_MIN_SHARED_TOKENS = 32


@dataclass
class TrieNode:
    """Prefix tokens ``[start, end)`` shared by every group below; ``ids``/``positions`` are that run
    (positions ``[..., end - start]``, mrope's leading axis kept). ``groups``: the groups whose prefix ends
    here (their suffix rows attend to this node and its ancestors)."""

    start: int
    end: int
    ids: torch.Tensor
    positions: torch.Tensor
    children: list[TrieNode] = field(default_factory=list)
    groups: list[GroupPlan] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.end - self.start

    def walk(self) -> Iterator[tuple[TrieNode, int]]:
        """Every node of the subtree depth-first (the node before its children), with its depth (1 = root)."""
        stack = [(self, 1)]
        while stack:
            node, depth = stack.pop()
            yield node, depth
            stack.extend((child, depth + 1) for child in reversed(node.children))

    def subtree_groups(self) -> list[GroupPlan]:
        """The groups that hang anywhere below (and on) this node."""
        return [g for node, _ in self.walk() for g in node.groups]

    def rows_below(self) -> int:
        """Rows whose prefix contains this node: its router statistics count once per such row."""
        return sum(len(g.rows) for g in self.subtree_groups())


@dataclass(frozen=True)
class TrieStats:
    """What the trie saved: ``nodes``, ``depth`` (longest root-to-node path), ``shared_tokens[d]`` (tokens of
    depth-``d+1`` nodes that more than one group shares), ``prefix_tokens`` (the groups' prefix tokens, one
    copy per group: what one-level reuse computes) and ``node_tokens`` (what the tree computes)."""

    nodes: int
    depth: int
    shared_tokens: tuple[int, ...]
    prefix_tokens: int
    node_tokens: int


def _keys(layout: RowLayout, group: GroupPlan) -> list[tuple]:
    """Per prefix token (token id, position column): tokens that sit at different positions differ."""
    row = group.rows[0]
    ids = layout.input_ids[row][: group.prefix_len].tolist()
    pos = layout.position_ids[row][..., : group.prefix_len].reshape(-1, group.prefix_len).tolist()
    return list(zip(ids, *pos))


def _build(layout: RowLayout, items: list[tuple[GroupPlan, list[tuple]]], start: int) -> list[TrieNode]:
    buckets: OrderedDict[tuple, list[tuple[GroupPlan, list[tuple]]]] = OrderedDict()
    for item in items:
        buckets.setdefault(item[1][start], []).append(item)
    nodes = []
    for members in buckets.values():
        shortest = min(len(keys) for _, keys in members)
        first = members[0][1]
        end = start + 1
        while end < shortest and all(keys[end] == first[end] for _, keys in members):
            end += 1
        row = members[0][0].rows[0]
        node = TrieNode(start, end, layout.input_ids[row][start:end], layout.position_ids[row][..., start:end].clone())
        node.groups = [group for group, keys in members if len(keys) == end]
        node.children = _build(layout, [m for m in members if len(m[1]) > end], end)
        nodes.append(node)
    return nodes


def _merge_short(layout: RowLayout, nodes: list[TrieNode], min_shared_tokens: int) -> list[TrieNode]:
    """Merge every node shorter than ``min_shared_tokens`` on which no group ends into its children."""
    out = []
    for node in nodes:
        node.children = _merge_short(layout, node.children, min_shared_tokens)
        if node.length >= min_shared_tokens or node.groups or not node.children:
            out.append(node)
            continue
        for child in node.children:
            row = child.subtree_groups()[0].rows[0]
            child.start = node.start
            child.ids = layout.input_ids[row][child.start : child.end]
            child.positions = layout.position_ids[row][..., child.start : child.end].clone()
        out.extend(node.children)
    return out


def build_trie(layout: RowLayout, groups: list[GroupPlan], min_shared_tokens: int) -> list[TrieNode]:
    """The roots of the trie over ``groups``' prefixes, in the groups' first-appearance order."""
    if min_shared_tokens < 1:
        raise ValueError(f"min_shared_tokens must be >= 1, got {min_shared_tokens}")
    empty = [g.uid for g in groups if g.prefix_len < 1]
    if empty:
        raise ValueError(f"groups {empty[:8]} have no prefix to share (prompt of one token)")
    items = [(group, _keys(layout, group)) for group in groups]
    return _merge_short(layout, _build(layout, items, 0), min_shared_tokens)


def trie_stats(roots: list[TrieNode]) -> TrieStats:
    """Nodes, depth and tokens of a trie (``prefix/tree_*`` metrics)."""
    nodes = depth = node_tokens = prefix_tokens = 0
    shared: dict[int, int] = {}
    for root in roots:
        for node, d in root.walk():
            nodes += 1
            depth = max(depth, d)
            node_tokens += node.length
            prefix_tokens += sum(g.prefix_len for g in node.groups)
            if len(node.subtree_groups()) > 1:
                shared[d] = shared.get(d, 0) + node.length
    levels = tuple(shared.get(d, 0) for d in range(1, depth + 1))
    return TrieStats(nodes, depth, levels, prefix_tokens, node_tokens)


def execution_signature(roots: list[TrieNode]) -> str:
    """The tree schedule's sequence of model passes (``F`` node forward, ``B`` suffix micro-batch, ``C`` node
    backward), what data-parallel ranks must agree on for their FSDP collectives to match."""
    parts: list[str] = []

    def visit(node: TrieNode) -> None:
        parts.append("F")
        for child in node.children:
            visit(child)
        parts.append("B" * sum(len(g.micro_batches) + g.filler_micro_batches for g in node.groups))
        parts.append("C")

    for root in roots:
        visit(root)
    return "".join(parts)
