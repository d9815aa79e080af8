"""Lockstep for the tree schedule: data-parallel ranks whose tries differ in shape still run the tree.

FSDP2 issues collectives in every forward and backward, so every rank must run the same sequence of model
passes. A trie's passes follow its shape: per node a forward (``F``, or ``L`` where it runs the LM head), its
children, its suffix micro-batches (each a forward and a backward), its backward. The ranks exchange their
shapes, take their union (children paired by position, micro-batch counts maxed) and each pads its own trie to
it with zero-loss work: filler micro-batches after a node's real ones, and filler nodes (one token, no row,
attending only to filler ancestors) after its real children. Where the ranks' nodes at one position differ
in kind (one runs the LM head, the other does not), the union's node runs it: the other rank's node runs the
LM head too, over its last position, its logits seeded with zeros (``TrieNode.lockstep_logits``), so the LM
head and final norm take part in every rank's passes. Every rank then runs the union's passes; the fillers
add zero to every gradient.

Rows without a tail (``E``) run no model call, so they are not part of the shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import zip_longest

import torch

from verl_prefix.schedule.tree.trie import TrieNode, run_order

# (kind "F"/"L", suffix micro-batches, children's shapes): what a node's passes are
Shape = tuple[str, int, tuple["Shape", ...]]


def node_shape(node: TrieNode) -> Shape:
    """The passes ``node``'s subtree runs (fillers included)."""
    kind = "F" if node.logits_from is None else "L"
    micro = sum(len(g.micro_batches) for g in node.groups) + node.filler_micro_batches
    return kind, micro, tuple(node_shape(child) for child in [*node.children, *node.filler_children])


def trie_shape(roots: Sequence[TrieNode]) -> tuple[Shape, ...]:
    return tuple(node_shape(root) for root in roots)


def _union(a: Shape | None, b: Shape | None) -> Shape | None:
    if a is None or b is None:
        return a or b
    kind = "L" if "L" in (a[0], b[0]) else "F"  # a node without loss runs the LM head where a peer's does
    return kind, max(a[1], b[1]), _union_list(a[2], b[2])


def _union_list(a: Sequence[Shape], b: Sequence[Shape]) -> tuple[Shape, ...]:
    return tuple(_union(x, y) for x, y in zip_longest(a, b))


def union_shapes(shapes: Sequence[tuple[Shape, ...]]) -> tuple[Shape, ...]:
    """The smallest shape every rank's trie pads to."""
    out: tuple[Shape, ...] = ()
    for shape in shapes:
        out = _union_list(out, shape)
    return out


def filler_node(shape: Shape, start: int) -> TrieNode:
    """A node of one token at position ``start`` that no row hangs on, with ``shape``'s passes below it."""
    kind, micro, children = shape
    node = TrieNode(
        start=start,
        end=start + 1,
        ids=torch.zeros(1, dtype=torch.long),
        positions=torch.tensor([start]),
        filler=True,
        filler_micro_batches=micro,
    )
    if kind == "L":
        node.logits_from, node.labels = start, torch.zeros(1, dtype=torch.long)
    node.children = [filler_node(child, start + 1) for child in children]
    return node


def _pad_node(node: TrieNode, shape: Shape) -> None:
    kind, micro, children = shape
    if kind == "L" and node.logits_from is None:  # a peer's node here runs the LM head: this one does too
        node.logits_from, node.labels, node.lockstep_logits = node.end - 1, torch.zeros(1, dtype=torch.long), True
    node.filler_micro_batches += micro - node_shape(node)[1]
    for index, child_shape in enumerate(children):
        if index < len(node.children):
            _pad_node(node.children[index], child_shape)
        else:  # a subtree of its own: its path starts over (it attends to no real node's K/V)
            node.filler_children.append(filler_node(child_shape, 0))


def pad_to(roots: list[TrieNode], union: tuple[Shape, ...]) -> list[TrieNode]:
    """``roots`` padded to ``union`` in place, with filler roots appended. Raises if the padded trie's shape is
    not the union (a bug: the ranks' collectives would not match)."""
    out = list(roots)
    for index, shape in enumerate(union):
        if index < len(roots):
            _pad_node(roots[index], shape)
        else:
            out.append(filler_node(shape, 0))
    if trie_shape(out) != union:
        raise RuntimeError("prefix_reuse.tree: the padded trie does not have the agreed shape")
    return out


def filler_passes(roots: Sequence[TrieNode]) -> int:
    """Filler nodes, filler micro-batches and real nodes running the LM head for lockstep only, in a padded
    trie (``prefix/tree_lockstep_fillers``)."""
    return sum(node.filler + node.filler_micro_batches + node.lockstep_logits for node in run_order(roots))
