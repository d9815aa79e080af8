"""A token trie over a rank's reuse rows (``prefix_reuse.tree``): compute every shared token once.

One-level reuse computes each uid group's prefix (``prompt[:-1]``) once. Rows on a rank often share more: a
system block and tool schemas in front of every question; a response stem that several samples of a tree
rollout share; per-turn samples where each sample (prompt and response) is the next one's prefix. The trie is
built from the rows' token ids (and positions) alone, no annotation. A node is a run of positions every row
below it computes alike: the same input token at the same position and, where the position carries loss for a
row (it predicts a response token), the same next token. Children branch where rows differ; a row hangs on the
deepest node it shares, and what is left of it (its tail, ``[node.end, len - 1)``) runs in phase B as a suffix
row. A row whose every input lies in shared nodes (a per-turn sample under the next turn) has an empty tail:
its loss runs on the nodes' log-probs alone (``schedule.tree.loss``).

Where rows branch at a loss position (the first differing response token), the position before the branch
runs in each child or tail, as ``prompt[-1]`` runs in every suffix row under one-level reuse: a node's every
log-prob then has one label for all rows below. With ``share_loss`` off every row's key stops at
``prompt[:-1]``, the prompt-only trie, and each row's tail is its whole suffix. With ``own_last`` (the MoE router
aux loss) every row's key stops one position earlier than it otherwise would: its last loss position runs in its
own tail, so every row has a suffix forward, in which its last token runs through the routers too (dense routes
every input token; no node ends on a row's last token, no row is without a tail).

A node shorter than ``min_shared_tokens`` is merged into its children and the tails of the rows that hang on
it (its tokens run once per child and tail instead), unless a row's prompt ends inside or after it (a tail holds
loss positions only): a node is one more forward (and backward), a fixed cost the FLOP model does not price,
exactly as ``min_prefix_len`` decides for a whole prefix. With ``chunk_tokens`` (``prefix_chunk_tokens``) a
longer node runs as a chain of chunks of at most that many tokens, each a node of its own (``continues``) that
attends to the earlier chunks' K/V as leaves, the way a chunked prefix runs under one-level reuse: the chain is
the same causal attention split at more boundaries. With images (``visual_keys``) a visual placeholder
token's key holds its item too (``schedule.tree.visuals``): every image's placeholder ids are the same, so the
content decides where groups branch. What the tree schedule runs over this trie is ``schedule.tree.schedule``.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from verl_prefix.schedule.grouping import GroupPlan, RowLayout
from verl_prefix.schedule.tree.visuals import Segment, TokenKey, node_segments

# the default ``min_shared_tokens``: a shared node pays one more forward's fixed cost, as a group's prefix
# does (``prefix_reuse.min_prefix_len``'s default); by FLOPs alone any shared token pays
DEFAULT_MIN_SHARED_TOKENS = 32


@dataclass(frozen=True)
class RowSpan:
    """What the trie keeps of a row: its uid, prompt length and token count (prompt + response)."""

    uid: str
    prompt_len: int
    length: int


@dataclass
class TrieNode:
    """Positions ``[start, end)`` shared by every row below; ``ids``/``positions`` are that run (positions
    ``[..., end - start]``, mrope's leading axis kept). ``hanging``: the rows that hang here (their tails start
    at ``end``). ``groups``: those with a non-empty tail, per uid group as suffix micro-batches whose prefix is
    the path (``prefix_len == end``); ``ended``: micro-batches of those whose tail is empty. ``logits_from``:
    the first position whose log-prob some row below needs (positions ``[logits_from, end)`` then run the LM
    head, their next tokens ``labels``), or None for a node that carries no loss."""

    start: int
    end: int
    ids: torch.Tensor
    positions: torch.Tensor
    children: list[TrieNode] = field(default_factory=list)
    hanging: dict[int, RowSpan] = field(default_factory=dict)
    groups: list[GroupPlan] = field(default_factory=list)
    ended: list[list[int]] = field(default_factory=list)
    logits_from: int | None = None
    labels: torch.Tensor | None = None
    continues: bool = False  # a later chunk of a node split by ``chunk_tokens`` (its parent is the chunk before)
    # lockstep (``schedule.tree.lockstep``): zero-loss work that keeps this rank's passes in step with the others'
    filler: bool = False  # a node of no row (one token), run only for its passes
    filler_micro_batches: int = 0  # suffix micro-batches run after this node's real ones
    filler_children: list[TrieNode] = field(default_factory=list)  # filler subtrees run after the real children
    lockstep_logits: bool = False  # no loss, but runs the LM head (seeded with zeros) where a peer's node does
    images: list[Segment] = field(default_factory=list)  # the visual tokens it holds (``schedule.tree.visuals``)

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

    def rows_below(self) -> dict[int, RowSpan]:
        """Every row that hangs on this node or below it (each computes this node's positions)."""
        return {row: span for node, _ in self.walk() for row, span in node.hanging.items()}

    def loss_rows(self) -> list[int]:
        """The rows below that take log-probs from this node (their loss starts before its end)."""
        return [row for row, span in self.rows_below().items() if span.prompt_len - 1 < self.end]

    def subtree_groups(self) -> list[GroupPlan]:
        """The suffix groups that hang anywhere below (and on) this node."""
        return [g for node, _ in self.walk() for g in node.groups]


@dataclass(frozen=True)
class TrieStats:
    """What the trie saved: ``nodes``, ``depth`` (longest root-to-node path), ``shared_tokens[d]`` (tokens of
    depth-``d+1`` nodes that more than one uid group shares), ``prefix_tokens`` (the groups' prefix tokens, one
    copy per group: what one-level reuse computes), ``node_tokens`` (what the tree's nodes compute),
    ``suffix_tokens`` and ``tail_tokens`` (the rows' suffixes under one-level reuse, their tails under the tree),
    ``loss_nodes`` (nodes that run the LM head) and ``shared_loss_tokens`` (their log-prob positions in nodes
    with more than one row below: loss-carrying tokens computed once for several rows). A node split into
    chunks counts as one node at one depth (``loss_nodes``: each chunk that runs the LM head);
    ``node_chunks`` counts the chunks such nodes ran as. ``visual_items``: the images and videos the tree
    encodes (each once per subtree that holds it, ``schedule.tree.visuals``); ``group_visual_items``: what
    one-level reuse encodes (each group's own)."""

    nodes: int
    depth: int
    shared_tokens: tuple[int, ...]
    prefix_tokens: int
    node_tokens: int
    suffix_tokens: int = 0
    tail_tokens: int = 0
    loss_nodes: int = 0
    shared_loss_tokens: int = 0
    node_chunks: int = 0
    visual_items: int = 0
    group_visual_items: int = 0

    @property
    def saved_tokens(self) -> int:
        """Tokens one-level reuse computes that the tree does not."""
        return self.prefix_tokens + self.suffix_tokens - self.node_tokens - self.tail_tokens


@dataclass
class _Row:
    """A row's keys: per position its input (token id, position column) and, where the position carries
    loss for the row, the token it predicts (None elsewhere)."""

    row: int
    span: RowSpan
    inputs: list[tuple]
    labels: list[int | None]
    ids: list[int]


def _row(layout: RowLayout, row: int, share_loss: bool, own_last: bool, visual: list[TokenKey] | None) -> _Row:
    prompt_len = layout.prompt_lens[row]
    ids = layout.input_ids[row].tolist()
    n = max(len(ids) - 1 - own_last, prompt_len - 1) if share_loss else prompt_len - 1
    pos = layout.position_ids[row][..., :n].reshape(-1, n).tolist()
    labels = [ids[t + 1] if t >= prompt_len - 1 else None for t in range(n)]
    span = RowSpan(str(layout.uids[row]), prompt_len, len(ids))
    extra = [] if visual is None else [visual[:n]]  # a visual token's item and index (``tree.visuals``)
    return _Row(row, span, list(zip(ids[:n], *pos, *extra)), labels, ids)


def _conflict(members: list[_Row], t: int) -> bool:
    """Rows for which position ``t`` carries loss predict different tokens there."""
    return len({m.labels[t] for m in members if m.labels[t] is not None}) > 1


def _buckets(members: list[_Row], start: int) -> list[list[_Row]]:
    """Rows by their input at ``start``; where their labels there conflict, by the next token too (the branch
    position then runs in each child)."""
    buckets: OrderedDict[tuple, list[_Row]] = OrderedDict()
    for m in members:
        buckets.setdefault(m.inputs[start], []).append(m)
    out = []
    for bucket in buckets.values():
        if not _conflict(bucket, start):
            out.append(bucket)
            continue
        refined: OrderedDict[int, list[_Row]] = OrderedDict()
        for m in bucket:
            refined.setdefault(m.ids[start + 1], []).append(m)
        out.extend(refined.values())
    return out


def _node(layout: RowLayout, row: int, start: int, end: int) -> TrieNode:
    return TrieNode(start, end, layout.input_ids[row][start:end], layout.position_ids[row][..., start:end].clone())


def _build(layout: RowLayout, items: list[_Row], start: int) -> tuple[list[TrieNode], list[_Row]]:
    """The nodes that start at ``start`` and the rows alone from there (their tails start at ``start``)."""
    nodes, alone = [], []
    for members in _buckets(items, start):
        first = members[0]
        if len(members) == 1 and start >= first.span.prompt_len - 1:
            alone.append(first)  # nothing to share: its tail, on the parent node
            continue
        limit = min(len(m.inputs) for m in members)
        if len(members) == 1:
            limit = min(limit, first.span.prompt_len - 1)  # a row alone shares its prefix with no one
        end = start + 1
        while end < limit and all(m.inputs[end] == first.inputs[end] for m in members) and not _conflict(members, end):
            end += 1
        node = _node(layout, first.row, start, end)
        # a row alone hangs where its prefix ends; others where their keys end (an empty tail unless prompt-only)
        goes_on = [len(members) > 1 and len(m.inputs) > end for m in members]
        rest = [m for m, on in zip(members, goes_on) if on]
        here = [m for m, on in zip(members, goes_on) if not on]
        node.children, tails = _build(layout, rest, end) if rest else ([], [])
        node.hanging = {m.row: m.span for m in [*here, *tails]}
        nodes.append(node)
    return nodes, alone


def _merge_short(
    layout: RowLayout, nodes: list[TrieNode], min_shared_tokens: int
) -> tuple[list[TrieNode], dict[int, RowSpan]]:
    """Dissolve every node shorter than ``min_shared_tokens`` whose rows can do without it: its children take
    its tokens, and the rows hanging on it move up to its parent (their tails start where it started), which
    only rows whose loss starts at or before it can (a row's tail holds loss positions only). Returns the
    nodes that stay and the rows that move up to the caller's node."""
    out: list[TrieNode] = []
    up: dict[int, RowSpan] = {}
    for node in nodes:
        node.children, moved = _merge_short(layout, node.children, min_shared_tokens)
        node.hanging.update(moved)
        tails_can_start = all(node.start >= span.prompt_len - 1 for span in node.hanging.values())
        if node.length >= min_shared_tokens or not tails_can_start:
            out.append(node)
            continue
        up.update(node.hanging)
        for child in node.children:
            row = next(iter(child.rows_below()))
            child.start = node.start
            child.ids = layout.input_ids[row][child.start : child.end]
            child.positions = layout.position_ids[row][..., child.start : child.end].clone()
        out.extend(node.children)
    return out, up


def _split_long(layout: RowLayout, nodes: list[TrieNode], chunk_tokens: int) -> None:
    """Split every node longer than ``chunk_tokens`` into a chain of chunks (the last one keeps its children and
    rows), in place."""
    for node in nodes:
        _split_long(layout, node.children, chunk_tokens)
        if node.length <= chunk_tokens:
            continue
        row, end = next(iter(node.rows_below())), node.end
        tail = node
        for lo in range(node.start + chunk_tokens, end, chunk_tokens):
            hi = min(lo + chunk_tokens, end)
            piece = _node(layout, row, lo, hi)
            piece.continues = True
            piece.children, piece.hanging = tail.children, tail.hanging
            tail.children, tail.hanging = [piece], {}
            tail.end = lo
            tail = piece
        node.ids = layout.input_ids[row][node.start : node.end]
        node.positions = layout.position_ids[row][..., node.start : node.end].clone()


def _logits(layout: RowLayout, node: TrieNode) -> None:
    """Where ``node``'s log-probs start (the first loss position of a row below) and their labels."""
    below = node.rows_below()
    firsts = {row: max(node.start, span.prompt_len - 1) for row, span in below.items()}
    needing = {row: first for row, first in firsts.items() if first < node.end}
    if not needing:
        return
    row = min(needing, key=needing.get)  # carries loss on every position from the node's first
    node.logits_from = needing[row]
    node.labels = layout.input_ids[row][node.logits_from + 1 : node.end + 1]


def _attach_micro_batches(roots: list[TrieNode], groups: list[GroupPlan]) -> None:
    """Each group's micro-batches split by the node each row hangs on: rows with a tail as that node's suffix
    group (prefix = the path), rows without one as the node's ended micro-batches (budgets hold: parts of a
    planned micro-batch)."""
    where = {row: node for root in roots for node, _ in root.walk() for row in node.hanging}
    for group in groups:
        views: dict[int, GroupPlan] = {}
        for rows in group.micro_batches:
            parts: OrderedDict[tuple[int, bool], list[int]] = OrderedDict()
            for row in rows:
                node = where[row]
                parts.setdefault((id(node), node.end < node.hanging[row].length - 1), []).append(row)
            for (_, has_tail), part in parts.items():
                node = where[part[0]]
                if not has_tail:
                    node.ended.append(part)
                    continue
                if id(node) not in views:
                    views[id(node)] = dataclasses.replace(
                        group, rows=[], prompt_len=node.end + 1, micro_batches=[], filler_micro_batches=0
                    )  # the tree's lockstep fillers are per node (``TrieNode.filler_micro_batches``)
                    node.groups.append(views[id(node)])
                views[id(node)].rows.extend(part)
                views[id(node)].micro_batches.append(part)


def build_trie(
    layout: RowLayout,
    groups: list[GroupPlan],
    min_shared_tokens: int,
    share_loss: bool = True,
    own_last: bool = False,
    chunk_tokens: int | None = None,
    visual_keys: dict[int, list[TokenKey]] | None = None,
) -> list[TrieNode]:
    """The roots of the trie over ``groups``' rows, in the rows' first-appearance order. ``share_loss`` off:
    over their prompts only (``prompt[:-1]``; every row's tail is its suffix). ``own_last``: each row's last
    loss position stays in its tail (the MoE router aux loss: every row's last token runs in a suffix forward).
    ``chunk_tokens``: nodes longer than that run as chains of chunks (``prefix_chunk_tokens``). ``visual_keys``
    (``tree.visuals.visual_token_keys``, a batch with images): each row's visual tokens keyed by their item too,
    and each node's ``images`` its items' token ranges."""
    if min_shared_tokens < 1:
        raise ValueError(f"min_shared_tokens must be >= 1, got {min_shared_tokens}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
    empty = [g.uid for g in groups if g.prefix_len < 1]
    if empty:
        raise ValueError(f"groups {empty[:8]} have no prefix to share (prompt of one token)")
    items = [
        _row(layout, row, share_loss, own_last, None if visual_keys is None else visual_keys[row])
        for group in groups
        for row in group.rows
    ]
    roots, alone = _build(layout, items, 0)
    assert not alone, "a row alone from position 0 is a node of its own prefix"
    roots, up = _merge_short(layout, roots, min_shared_tokens)
    assert not up, "a root's rows start their loss after it"
    if chunk_tokens:
        _split_long(layout, roots, chunk_tokens)
    for root in roots:
        for node, _ in root.walk():
            _logits(layout, node)
            if visual_keys is not None:
                node.images = node_segments(visual_keys[next(iter(node.rows_below()))], node.start, node.end)
    _attach_micro_batches(roots, groups)
    return roots


def trie_stats(roots: list[TrieNode]) -> TrieStats:
    """Nodes, depth and tokens of a trie (``prefix/tree_*`` metrics)."""
    nodes = depth = node_tokens = tail_tokens = loss_nodes = shared_loss = chunks = 0
    shared: dict[int, int] = {}
    prefixes: dict[str, int] = {}
    suffix_tokens = 0
    for root in roots:
        if root.filler:
            continue
        for node, d in _logical_walk(root):
            nodes += not node.continues
            chunks += node.continues + (not node.continues and any(c.continues for c in node.children))
            depth = max(depth, d)
            node_tokens += node.length
            below = node.rows_below()
            if len({span.uid for span in below.values()}) > 1:
                shared[d] = shared.get(d, 0) + node.length
            if node.logits_from is not None and not node.lockstep_logits:
                loss_nodes += 1
                shared_loss += (node.end - node.logits_from) if len(below) > 1 else 0
            for span in node.hanging.values():
                prefixes[span.uid] = span.prompt_len - 1
                suffix_tokens += span.length - span.prompt_len
                tail_tokens += span.length - 1 - node.end
    levels = tuple(shared.get(d, 0) for d in range(1, depth + 1))
    visual_items, group_visual_items = _visual_item_counts(roots)
    return TrieStats(
        nodes,
        depth,
        levels,
        sum(prefixes.values()),
        node_tokens,
        suffix_tokens,
        tail_tokens,
        loss_nodes,
        shared_loss,
        chunks,
        visual_items,
        group_visual_items,
    )


def _visual_item_counts(roots: list[TrieNode]) -> tuple[int, int]:
    """(items the tree encodes: each where the path above holds it not yet; items one-level reuse encodes: the
    distinct items on each group's path)."""
    encoded = 0
    per_group: dict[str, set[int]] = {}
    stack = [(root, frozenset()) for root in roots if not root.filler]
    while stack:
        node, held = stack.pop()
        here = {id(item) for item, _, _ in node.images}
        encoded += len(here - held)
        held = held | here
        for span in node.hanging.values():
            per_group.setdefault(span.uid, set()).update(held)
        stack.extend((child, held) for child in node.children)
    return encoded, sum(len(items) for items in per_group.values())


def _logical_walk(root: TrieNode) -> list[tuple[TrieNode, int]]:
    """``root.walk()`` with a chunk at its node's depth (a chain of chunks is one node)."""
    out, stack = [], [(root, 1)]
    while stack:
        node, depth = stack.pop()
        out.append((node, depth))
        stack.extend((c, depth if c.continues else depth + 1) for c in reversed(node.children))
    return out


def run_order(roots: list[TrieNode]) -> list[TrieNode]:
    """Every node (lockstep fillers included) in the order the tree schedule runs their phase A: after lockstep
    padding (``schedule.tree.lockstep``) every data-parallel rank's i-th node stands at the same position of the
    agreed shape, so per-node decisions can be agreed position by position."""
    out: list[TrieNode] = []

    def visit(node: TrieNode) -> None:
        out.append(node)
        for child in [*node.children, *node.filler_children]:
            visit(child)

    for root in roots:
        visit(root)
    return out


def execution_signature(roots: list[TrieNode]) -> str:
    """The tree schedule's sequence of model passes (``F`` node forward, ``L`` one that runs the LM head too,
    ``B`` suffix micro-batch, ``E`` a micro-batch of rows without a tail (no model call), ``C`` node backward),
    in the order the schedule runs them, lockstep fillers included (``schedule.tree.lockstep``)."""
    parts: list[str] = []

    def visit(node: TrieNode) -> None:
        parts.append("F" if node.logits_from is None else "L")
        for child in [*node.children, *node.filler_children]:
            visit(child)
        micro = sum(len(g.micro_batches) for g in node.groups) + node.filler_micro_batches
        parts.append("B" * micro)
        parts.append("E" * len(node.ended))
        parts.append("C")

    for root in roots:
        visit(root)
    return "".join(parts)


# ``prefix/tree_shared_tokens/<level>``: levels past the third are summed into the last key, so every rank and
# mini-batch reports the same keys
TREE_LEVELS = ("level1", "level2", "level3plus")


def tree_metrics(stats: TrieStats | None) -> dict[str, float]:
    """What a mini-batch's token trie (``prefix_reuse.tree``, ``schedule.tree.trie``) did: its nodes, its depth,
    the tokens shared by more than one group per level, the tokens it computed fewer than one-level reuse
    would have (already subtracted from ``prefix/physical_tokens``), its nodes that run the LM head and their
    log-prob positions shared by several rows (loss on shared tokens), and the chunks its nodes longer than
    ``prefix_chunk_tokens`` ran as; with images, the images and videos it encoded and how many fewer than
    one-level reuse would have (an image that several groups' prompts share: ``schedule.tree.visuals``).
    ``None``: the mini-batch ran one-level (every metric 0)."""
    stats = stats or TrieStats(0, 0, (), 0, 0)
    levels = [*stats.shared_tokens[:2], sum(stats.shared_tokens[2:])]
    levels += [0] * (len(TREE_LEVELS) - len(levels))
    metrics = {"prefix/tree_nodes": float(stats.nodes), "prefix/tree_depth": float(stats.depth)}
    metrics.update({f"prefix/tree_shared_tokens/{name}": float(n) for name, n in zip(TREE_LEVELS, levels)})
    metrics["prefix/tree_saved_tokens"] = float(stats.saved_tokens)
    metrics["prefix/tree_loss_nodes"] = float(stats.loss_nodes)
    metrics["prefix/tree_shared_loss_tokens"] = float(stats.shared_loss_tokens)
    metrics["prefix/tree_node_chunks"] = float(stats.node_chunks)
    metrics["prefix/tree_visual_items"] = float(stats.visual_items)
    metrics["prefix/tree_saved_visual_items"] = float(stats.group_visual_items - stats.visual_items)
    return metrics
