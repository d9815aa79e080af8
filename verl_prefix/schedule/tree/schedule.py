"""The depth-first tree schedule (``prefix_reuse.tree``): phases A/B/C over a token trie (``schedule.tree.trie``).

Each node's tokens run forward once (phase A), attending to its ancestors' K/V held as leaves, the way a later
chunk of a chunked prefix attends to the earlier chunks' (``ChunkCaptureContext``); the node's own K/V become
leaves of their own. Then its children run, then the suffix micro-batches of the groups that end on it
(phase B, attending to the path's leaves); the path's leaves are joined by ``torch.cat`` per call
(``executor.join_path``; a one-node path's leaves as they are), so every descendant's dK/dV flows back through
the cat into each ancestor's own leaves. After the last of them the
node's backward runs once (phase C), seeded with its leaves' gradients, and deposits its share on its
ancestors' leaves before their own backward runs. Exact by construction: the same K/V, the same causal
attention, the chain rule split at node boundaries. Only one root-to-node path's graphs are alive at a time.
The phase steps are the executor's (``node_forward``, ``train_suffixes``/``infer_suffixes``, ``filler_step``,
``node_backward``): one-level reuse runs the same steps over a one-node path, its group's prefix.

With an MoE router aux loss each node keeps its router statistics as one more leaf; a micro-batch's aux sees
every node on its path once per row (``moe.logical_stats`` over the path's summed statistics), so each node
counts once per row below it, as dense does, loss-carrying nodes included. Every row then has a tail (the trie
is built ``own_last``), whose suffix forward routes the row's last token as dense does.

Loss on shared tokens (``schedule.tree.loss``): a node whose positions carry loss for a row below (a shared
response stem, a turn that is one sample's response and the next one's prompt) runs the LM head there once; its
log-probs and entropies are leaves each row's loss slices (``tree.loss.with_path``), seeded into its phase C
with its K/V. Rows without a tail run their loss on those leaves alone, with no model call.

Sliding windows need nothing of their own: a node's path K/V is a longer prefix, cut to the window as a chunked
prefix's is (``schedule.attention.windows``). Recurrent layers (gated delta-net, Mamba-2, short convolutions) carry
state, not K/V: each node continues from its parent's end state (a leaf, ``join_path``), so every child's and every
suffix's state gradient lands on its parent's leaves and reaches the parent's phase C, as a chunk's does.

Under Ulysses (``options.ulysses``) each node's phase A and each tail micro-batch run as this rank's slice, the
way one-level reuse runs a (chunked) prefix and its suffixes: a node's K/V leaves are this rank's head shard of
the node, the path joins the shards, and a loss-carrying node's log-probs are gathered over the group
(``tree.loss.sharded_node_values``). Lockstep fillers (``schedule.tree.lockstep``) keep data-parallel ranks whose
tries differ in shape in step.

Dormant-prefix policies apply per node (``schedule.tree.dormant``): under ``recompute`` a node's phase A keeps
no graph and its phase C runs the node forward again, checked, before the seeded backward; under ``offload`` its
graph waits in host memory. A filler node runs the policy agreed for its position, so recomputing ranks and
filling ranks run the same passes. ``merged_varlen`` needs nothing of its own: a node's forward is one row over
its ancestors' K/V, packed as a chunk of a chunked prefix is. Chunked long nodes (``prefix_chunk_tokens``) are
chains of nodes in the trie (``trie.build_trie``), nothing of their own here.

Images and videos (``schedule.tree.visuals``): the topmost node on a path that holds an item's tokens encodes
it in its own model call and keeps the embeddings as leaves; its descendants that hold more of the item take
slices; the owner's phase C, after theirs, runs the encoder's backward once with everything they left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from verl_prefix.schedule.executor import (
    Above,
    LossFn,
    build_suffix_batch,
    filler_step,
    handed_off,
    handoffs_backward,
    infer_suffixes,
    join_path,
    node_backward,
    node_forward,
    prefix_forward,
    train_suffixes,
)
from verl_prefix.schedule.grouping import RowLayout
from verl_prefix.schedule.kv.container import PrefixKV
from verl_prefix.schedule.kv.seam import prefix_attention_mode
from verl_prefix.schedule.kv.shim import scores
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.telemetry import NullMeter
from verl_prefix.schedule.tree import loss as tree_loss
from verl_prefix.schedule.tree.dormant import NodePolicy, keep_every_node, node_phase_c
from verl_prefix.schedule.tree.loss import NodeValues
from verl_prefix.schedule.tree.trie import TrieNode
from verl_prefix.schedule.tree.visuals import PathImages, VisualItem

FILLER_UID = "__tree_lockstep_filler__"


def filler_suffix(path_len: int, options: ScheduleOptions) -> object:
    """One zero-token suffix row at position ``path_len``: a lockstep filler micro-batch under a path of that
    length (``schedule.tree.lockstep``)."""
    length = path_len + 2
    ids, positions = torch.zeros(length, dtype=torch.long), torch.arange(length)
    layout = RowLayout([ids], [positions], [path_len + 1], [1], [FILLER_UID])
    return build_suffix_batch(layout, [0], path_len + 1, options)


def run_filler(
    model: nn.Module,
    node: TrieNode,
    path: list[PrefixKV],
    options: ScheduleOptions,
    train: bool,
    policies: NodePolicy = keep_every_node,
) -> None:
    """A filler subtree (``TrieNode.filler``): the passes its shape stands for, on one-token nodes and
    one-token suffixes whose losses are zero, attending to filler ancestors only; ``options`` are the filler
    options. Training: each node's backward is seeded with zeros where nothing below reached it, and a node
    that runs the LM head seeds its logits with zeros, so every rank gives grads to the same parameters. Each
    node runs under ``policies(node)``, the policy agreed for its position: where a peer rank's real node
    recomputes, the filler too runs its forward again in phase C and joins the agreed check."""
    dormant = policies(node) if train else None

    def forward() -> PrefixKV:
        return _node_forward(model, node, path, options)

    kv, leaves, _ = node_forward(model, forward, dormant, options, copies=0)
    logits, kv.logits = kv.logits, None
    below = [*path, leaves]
    for child in node.children:
        run_filler(model, child, below, options, train, policies)
    run_filler_micro_batches(model, node, below, options, train)
    if dormant is None:
        return

    def rebuild() -> tuple[PrefixKV, list[tuple[torch.Tensor, torch.Tensor]]]:
        rebuilt: list[torch.Tensor | None] = []

        def take_logits(again: PrefixKV) -> list:
            rebuilt.append(again.logits)
            again.logits = None
            return []

        roots = dormant.phase_c_prefix(kv, forward, take_logits)
        kept = rebuilt[0] if rebuilt else logits
        return roots, [(kept, torch.zeros_like(kept))] if kept is not None else []

    node_backward(model, leaves, dormant, rebuild, options, "lockstep")


def run_filler_micro_batches(
    model: nn.Module, node: TrieNode, path: list[PrefixKV], options: ScheduleOptions, train: bool
) -> None:
    """``node.filler_micro_batches`` zero-loss suffix micro-batches under ``path`` (``node.end`` tokens)."""
    handoffs = []
    for _ in range(node.filler_micro_batches):
        handoff = filler_step(model, join_path(path), filler_suffix(node.end, options), options, train, "lockstep")
        handoffs.append(handed_off(handoff, options, "lockstep") if train else handoff)
    if train and not scores(model):  # a pipeline stage before the last: their backward once all went forward
        handoffs_backward(handoffs, options, "lockstep")


def _node_forward(
    model: nn.Module,
    node: TrieNode,
    path: list[PrefixKV],
    options: ScheduleOptions,
    images: tuple[PathImages, list[VisualItem]] | None = None,
) -> PrefixKV:
    """Phase A of one node: its tokens, attending to its path's K/V (a root: plain capture); a node that
    carries loss runs the whole model and keeps its logits (``tree.loss.node_options``). ``images``: the
    path's encoded items and the ones this node owns (``tree.visuals``), for a node that holds visual tokens."""
    ids, positions = node.ids.to(options.device), node.positions.to(options.device)
    node_options = tree_loss.node_options(options, node)
    if images is None or not node.images:
        return prefix_forward(model, ids, positions, node_options, join_path(path))
    path_images, owned = images
    with path_images.node_call(node.images, owned, options.device) as visual:
        # the encoder's runs are counted once per tree (``PathImages.calls``), not per call
        return prefix_forward(
            model, ids, positions, dataclasses.replace(node_options, meter=None), join_path(path), visual
        )


def _valued_forward(
    model: nn.Module,
    node: TrieNode,
    path: list[PrefixKV],
    layout: RowLayout,
    options: ScheduleOptions,
    images: tuple[PathImages, list[VisualItem]] | None,
) -> tuple[Callable[[], PrefixKV], list[NodeValues | None]]:
    """A node's phase-A call for ``executor.node_forward``, and where it leaves the node's values (a loss-carrying
    node's log-probs and entropies, ``tree.loss``; None for a node that carries no loss) once it ran."""
    found: list[NodeValues | None] = []

    def forward() -> PrefixKV:
        kv = _node_forward(model, node, path, options, images)
        found.append(tree_loss.node_values(kv, node, layout, options))
        return kv

    return forward, found


def _path_images(model: nn.Module, roots: list[TrieNode], train: bool) -> PathImages | None:
    """The tree's image bookkeeping where a node holds visual tokens (None for a text batch)."""
    if any(node.images for root in roots for node, _ in root.walk()):
        return PathImages(model, train)
    return None


def train_tree(
    model: nn.Module,
    layout: RowLayout,
    roots: list[TrieNode],
    loss_fn: LossFn,
    options: ScheduleOptions,
    policies: NodePolicy = keep_every_node,
) -> list[torch.Tensor]:
    """Run the tree schedule over ``roots``; parameter grads accumulate. Returns every micro-batch's loss
    (detached) in the order they ran (children before the rows that hang on a node; rows with a tail before
    rows without one). ``policies(node)``: the ``Dormant`` a node's graph waits under from its phase A to its
    phase C (``schedule.tree.dormant``; a per-node decision, so not an option)."""
    meter = options.meter or NullMeter()
    autocast = options.autocast
    fillers = options.for_fillers()
    losses: list[torch.Tensor] = []
    path_images = _path_images(model, roots, train=True)

    def visit(node: TrieNode, path: list[PrefixKV], values_path: list[NodeValues | None], held: int) -> None:
        dormant = policies(node)
        images = (path_images, path_images.enter(node.images)) if path_images is not None else None
        forward, found = _valued_forward(model, node, path, layout, options, images)
        kv, leaves, saved = node_forward(model, forward, dormant, options, copies=len(node.rows_below()))
        values = found[0]
        held += saved  # the path's graphs, as the policies left them
        value_leaves = values.as_leaves() if values is not None else None
        below, values_below = [*path, leaves], [*values_path, value_leaves]
        for child in node.children:
            visit(child, below, values_below, held)
        for child in node.filler_children:
            run_filler(model, child, [], fillers, train=True, policies=policies)

        def with_path_loss(rows: list[int], log_probs: list, entropy: list | None) -> torch.Tensor:
            return loss_fn(rows, *tree_loss.with_path(values_below, layout, rows, log_probs, entropy))

        for group in node.groups:
            losses.extend(train_suffixes(model, layout, group, Above(below, dormant, held), with_path_loss, options))
        run_filler_micro_batches(model, node, below, fillers, train=True)
        # rows without a tail: their loss on the path's values alone, no model call (the last stage's, under PP)
        for rows in node.ended if scores(model) else ():
            if options.routes_last:  # their last token would go unrouted: the engine builds the trie own_last
                raise RuntimeError(f"rows {rows} have no tail to route their last token (trie.build_trie own_last)")
            with meter.phase("B"):
                with autocast():
                    loss = with_path_loss(rows, None, None)
                options.backward(loss)
            losses.append(loss.detach())

        def rebuild() -> tuple[PrefixKV, list[tuple[torch.Tensor, torch.Tensor]]]:
            # recompute: the node forward again over the same ancestors' leaves, checked
            roots, again = node_phase_c(
                dormant,
                kv,
                values,
                lambda: _node_forward(model, node, path, options, images),
                lambda rebuilt: tree_loss.node_values(rebuilt, node, layout, options),
            )
            extra = again.seeds(value_leaves) if again is not None else []
            if node.lockstep_logits and again is not None:  # the LM head joins the backward as on the peer
                extra.append((again.log_probs, torch.zeros_like(again.log_probs)))
            return roots, extra

        node_backward(model, leaves, dormant, rebuild, options)
        if images is not None:
            images[0].leave(images[1])

    with prefix_attention_mode(model):
        for root in roots:
            if root.filler:
                run_filler(model, root, [], fillers, train=True, policies=policies)
            else:
                visit(root, [], [], 0)
    if path_images is not None:
        meter.count("prefix/vision_encoder_calls", path_images.calls)
    return losses


@torch.no_grad()
def infer_tree(
    model: nn.Module, layout: RowLayout, roots: list[TrieNode], options: ScheduleOptions
) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """Forward-only tree schedule (old/ref log-probs): ``{row: (response log-probs, entropy or None)}``."""
    options = options.forward_only()
    meter = options.meter or NullMeter()
    fillers = options.for_fillers()
    results: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    path_images = _path_images(model, roots, train=False)

    def visit(node: TrieNode, path: list[PrefixKV], values_path: list[NodeValues | None]) -> None:
        images = (path_images, path_images.enter(node.images)) if path_images is not None else None
        forward, found = _valued_forward(model, node, path, layout, options, images)
        kv, _, _ = node_forward(model, forward, None, options, copies=len(node.rows_below()))
        below, values_below = [*path, kv], [*values_path, found[0]]
        for child in node.children:
            visit(child, below, values_below)
        for child in node.filler_children:
            run_filler(model, child, [], fillers, train=False)
        for group in node.groups:
            tails: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
            infer_suffixes(model, layout, group, join_path(below), tails, options)
            for row, tail in tails.items():
                first, temperature = layout.prompt_lens[row] - 1, tree_loss.row_temperature(layout, row)
                results[row] = tree_loss.row_values(values_below, first, tail, temperature)
        run_filler_micro_batches(model, node, below, fillers, train=False)
        for rows in node.ended if scores(model) else ():
            for row in rows:
                first, temperature = layout.prompt_lens[row] - 1, tree_loss.row_temperature(layout, row)
                results[row] = tree_loss.row_values(values_below, first, (None, None), temperature)
        if images is not None:
            images[0].leave(images[1])

    with prefix_attention_mode(model), options.autocast():
        for root in roots:
            if root.filler:
                run_filler(model, root, [], fillers, train=False)
            else:
                visit(root, [], [])
    if path_images is not None:
        meter.count("prefix/vision_encoder_calls", path_images.calls)
    return results
