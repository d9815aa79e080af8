"""Dormant-prefix policies per tree node (``prefix_reuse.tree`` with ``dormant_prefix``): ``schedule.dormant``'s
concern at the tree's layer, hence the same module name.

Under the tree schedule (``schedule.tree.schedule``) a node's phase-A graph waits from its forward until its phase C,
while its whole subtree runs: with ``keep`` every node on the path to the micro-batch running holds its graph.
The policies of ``schedule.dormant`` apply per node, each with a ``Dormant`` of its own:

- ``recompute``: the node's phase A runs without a graph (its K/V, router sums and, for a loss-carrying node,
  its log-probs and entropies are kept as values; the subtree attends to them and takes its losses from them
  as leaves); its phase C re-runs the node forward under grad, attending to its ancestors' K/V leaves as phase A
  did (their own phase C has not run yet), checks that it gives back the K/V, router counts, log-probs and
  entropies phase A gave, and seeds the rebuilt roots with the accumulated gradients. So the node's logits and
  loss backward are exact: the LM head runs again over the node's loss positions, in the same backward.
- ``offload``: the node's phase A (LM head and log-softmax included) saves to the node's own host store and
  its phase C restores layer by layer, as a group's does.
- ``auto``: the policy chosen per node from its graph estimate (``node_estimate``; the engine agrees the
  recomputed nodes across data-parallel ranks, ``backend.distributed.dormant_agreement.agree_on_node_policies``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from verl_prefix.schedule.dormant import Dormant, GraphEstimate, estimate_prefix_graph
from verl_prefix.schedule.kv.container import PrefixKV
from verl_prefix.schedule.tree.loss import NodeValues
from verl_prefix.schedule.tree.trie import TrieNode

# the Dormant one node's phase A to C runs under (a fresh one per node: offload's store is per node)
NodePolicy = Callable[[TrieNode], Dormant]


def keep_every_node(node: TrieNode) -> Dormant:
    """The default: every node keeps its graph on the device from A to C."""
    return Dormant()


def value_pairs(phase_a: NodeValues | None, again: NodeValues | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(phase A's, recomputed) log-probs and entropies of a loss-carrying node, for the recompute check."""
    if phase_a is None or again is None:
        return []
    pairs = [(phase_a.log_probs, again.log_probs)]
    if phase_a.entropy is not None and again.entropy is not None:
        pairs.append((phase_a.entropy, again.entropy))
    return pairs


def node_phase_c(
    dormant: Dormant,
    kv: PrefixKV,
    values: NodeValues | None,
    rerun: Callable[[], PrefixKV],
    values_of: Callable[[PrefixKV], NodeValues | None],
) -> tuple[PrefixKV, NodeValues | None]:
    """The graph-attached K/V and values phase C seeds: phase A's (``keep``, ``offload``), or ``rerun()``'s and
    ``values_of`` them (``recompute``), checked against phase A's before any backward."""
    rebuilt: list[NodeValues | None] = []

    def also(recomputed: PrefixKV) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rebuilt.append(values_of(recomputed))
        return value_pairs(values, rebuilt[0])

    kv = dormant.phase_c_prefix(kv, rerun, also)
    return kv, (rebuilt[0] if rebuilt else values)


def node_estimate(model: nn.Module, node: TrieNode, dtype: torch.dtype | None = None) -> GraphEstimate:
    """A node's phase-A graph (``estimate_prefix_graph`` over its tokens, attending to its ancestors' ``start``
    tokens); a loss-carrying node runs every layer whole and the LM head over its log-prob positions."""
    positions = node.end - node.logits_from if node.logits_from is not None else 0
    return estimate_prefix_graph(model, node.length, dtype, logit_positions=positions, context=node.start)
