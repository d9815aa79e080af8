"""Loss on shared tokens (issue 25): a tree node whose positions carry loss computes their log-probs once.

A node of the token trie (``schedule.tree.trie``) may hold positions that predict a response token of a row below
it: a response stem several samples of a tree rollout share, or a turn that is one sample's response and the
next sample's prompt. Its phase A then runs the whole model and the LM head over those positions
(``options.keep_logits``); their labels are the same for every row below (the trie branches before a position
whose next token differs). The node's log-probs and entropies become leaves, like its K/V: each row's response
values are the slices of its path's leaves that cover its response, followed by its tail's (``with_path``),
and verl's loss runs on them unchanged, each row with its own advantage, old log-prob, clipping, KL, entropy
and ``loss_agg_mode`` normalisation. A shared position therefore counts once per row, as in dense training,
and its gradient (the sum of every row's) reaches the LM head once, in the node's phase C.

Rows below one node may have been sampled at different temperatures (verl's per-sample ``temperature``): the
node runs the LM head once and divides its logits by each temperature its rows have, one row of values per
temperature; a row takes the values of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from verl_prefix.schedule.executor import kept_labels, token_outputs
from verl_prefix.schedule.grouping import RowLayout
from verl_prefix.schedule.kv.container import PrefixKV
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.tree.trie import TrieNode


@dataclass
class NodeValues:
    """A loss-carrying node's log-probs (and entropies, or None) of positions ``[start, end)``, one row per
    temperature of ``temperatures`` (``[len(temperatures), end - start]``)."""

    start: int
    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    temperatures: tuple[float, ...] = (1.0,)

    @property
    def end(self) -> int:
        return self.start + self.log_probs.shape[-1]

    def as_leaves(self) -> NodeValues:
        """Detached copies that collect every row's gradient (phase C seeds the node's graph with them)."""
        entropy = self.entropy.detach().requires_grad_(True) if self.entropy is not None else None
        return NodeValues(self.start, self.log_probs.detach().requires_grad_(True), entropy, self.temperatures)

    def seeds(self, leaves: NodeValues) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(root, gradient) pairs for phase C: the values whose leaves some row's loss reached."""
        pairs = [(self.log_probs, leaves.log_probs.grad)]
        if self.entropy is not None and leaves.entropy is not None:
            pairs.append((self.entropy, leaves.entropy.grad))
        return [(root, grad) for root, grad in pairs if grad is not None]


def node_options(options: ScheduleOptions, node: TrieNode) -> ScheduleOptions:
    """The options a node's phase A runs with: the whole model and its last positions' logits where it
    carries loss, else ``options`` (early exit as configured)."""
    if node.logits_from is None:
        return options
    return dataclasses.replace(options, keep_logits=node.end - node.logits_from, keep_labels=node.labels)


def node_temperatures(node: TrieNode, layout: RowLayout) -> tuple[float, ...]:
    """The temperatures that divide a node's logits: those of the rows that take log-probs from it (a row's
    logits are divided before the log-softmax), sorted; ``(1.0,)`` without any (a node running the LM head
    for lockstep only)."""
    if layout.temperature is None:
        return (1.0,)
    return tuple(sorted({row_temperature(layout, row) for row in node.loss_rows()})) or (1.0,)


def row_temperature(layout: RowLayout, row: int) -> float:
    """The temperature row ``row`` was sampled at (1 without per-row temperatures)."""
    return 1.0 if layout.temperature is None else float(layout.temperature[row])


def _divided(logits: torch.Tensor, temperature: float, in_place: bool) -> torch.Tensor:
    """``logits`` divided as phase B divides them: by the fp32 temperature in the logits' dtype."""
    if temperature == 1.0:
        return logits
    divisor = torch.tensor(temperature, dtype=torch.float32, device=logits.device).to(logits.dtype)
    return logits.div_(divisor) if in_place else logits / divisor  # lm_head's backward needs no output


def _scored(
    kept: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    options: ScheduleOptions,
    in_place: bool,
    fused_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of ``labels`` from what phase A kept: logits, divided by ``temperature`` as phase B
    divides them, or, under verl's fused kernels, the final hidden states (``schedule.fused_head``)."""
    if options.fused_backend:  # phase A's head computed them already, at the batch's one temperature
        if temperature != options.fused_temperature:
            raise ValueError("use_fused_kernels does not serve per-sample temperatures (verl's fused kernels)")
        log_probs, entropy = (kept[..., k].to(dtype) for k, dtype in enumerate(fused_dtypes or (kept.dtype,) * 2))
        return log_probs, entropy if options.calculate_entropy else None
    return token_outputs(_divided(kept, temperature, in_place), labels, options)


def node_values(kv: PrefixKV, node: TrieNode, layout: RowLayout, options: ScheduleOptions) -> NodeValues | None:
    """The node's log-probs and entropies from the logits (or, under fused kernels, the hidden states) its phase A
    kept, per temperature of its rows (None for a node without loss, and on a pipeline stage before the last, where
    the next stage's phase C reaches them through the node's output); they are released from ``kv``."""
    if node.logits_from is None or kv.handoff is not None:  # no loss, or a pipeline stage before the last
        return None
    logits, kv.logits = kv.logits, None
    dtypes = kv.fused_dtypes
    if logits is None:
        raise RuntimeError("phase A of a loss-carrying tree node kept no logits (options.keep_logits)")
    temperatures = node_temperatures(node, layout)
    log_probs, entropies = [], []
    for temperature in temperatures:
        in_place = len(temperatures) == 1
        if options.ulysses is not None:
            values = sharded_node_values(logits, node, options, temperature, in_place, dtypes)
        else:
            labels = node.labels.to(logits.device)
            values = NodeValues(node.logits_from, *_scored(logits, labels, temperature, options, in_place, dtypes))
        log_probs.append(values.log_probs)
        entropies.append(values.entropy)
    entropy = torch.stack(entropies) if entropies[0] is not None else None
    return NodeValues(node.logits_from, torch.stack(log_probs), entropy, temperatures)


def sharded_node_values(
    logits: torch.Tensor,
    node: TrieNode,
    options: ScheduleOptions,
    temperature: float = 1.0,
    in_place: bool = False,
    fused_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
) -> NodeValues:
    """A node's values under Ulysses: ``logits`` cover the last positions of this rank's slice of the node (its
    share of ``[logits_from, end)``, ``Ulysses.kept_in_slice``); its log-probs and entropies are computed there,
    front-padded with zeros to the slice, gathered over the group as phase B's are (the gather's backward keeps
    the local slice times the group size, verl's SP scaling) and cut to ``[logits_from, end)``. A position
    before ``logits_from`` (the one a rank without any keeps) gets a placeholder label and is cut away."""
    ulysses = options.ulysses
    skip = node.logits_from - node.start
    kept = logits.shape[0]
    local = kept_labels(options, node.labels, node.length, kept).to(logits.device)
    log_probs, entropy = _scored(logits, local, temperature, options, in_place, fused_dtypes)

    def gathered(values: torch.Tensor) -> torch.Tensor:
        pad = values.new_zeros(ulysses.padded(node.length) // ulysses.size - kept)
        return ulysses.gather(torch.cat([pad, values])[None], node.length)[0, skip:]

    return NodeValues(node.logits_from, gathered(log_probs), gathered(entropy) if entropy is not None else None)


def node_slice(values: NodeValues, first: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A row's share of a node's values: positions ``[max(first, start), end)`` at the row's ``temperature``,
    ``first`` being the row's first loss position (``prompt_len - 1``)."""
    lo = max(first, values.start) - values.start
    k = values.temperatures.index(temperature)
    return values.log_probs[k, lo:], values.entropy[k, lo:] if values.entropy is not None else None


def row_values(
    path: list[NodeValues | None],
    first: int,
    tail: tuple[torch.Tensor | None, torch.Tensor | None],
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A row's response log-probs and entropies: its path's node slices from ``first`` at its ``temperature``,
    then its tail's (``(None, None)`` for a row without a tail)."""
    pieces, entropies = [], []
    for values in path:
        if values is not None and values.end > first:
            log_probs, entropy = node_slice(values, first, temperature)
            pieces.append(log_probs)
            entropies.append(entropy)
    tail_log_probs, tail_entropy = tail
    if tail_log_probs is not None:
        pieces.append(tail_log_probs)
        entropies.append(tail_entropy)
    if not pieces:
        raise RuntimeError(f"a row whose first loss position is {first} got no log-probs from its path or tail")
    log_probs = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    if any(e is None for e in entropies):
        return log_probs, None
    return log_probs, entropies[0] if len(entropies) == 1 else torch.cat(entropies)


def with_path(
    path: list[NodeValues | None],
    layout: RowLayout,
    rows: list[int],
    log_probs: list[torch.Tensor] | None,
    entropy: list[torch.Tensor] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """A micro-batch's response values: each row's path slices, then its tail values (``log_probs[k]``,
    ``entropy[k]``; ``log_probs`` None: rows without a tail). Unchanged where no node of the path carries loss."""
    if log_probs is not None and all(values is None for values in path):
        return log_probs, entropy
    out_lp, out_ent = [], []
    for k, row in enumerate(rows):
        tail = (log_probs[k], entropy[k] if entropy is not None else None) if log_probs is not None else (None, None)
        lp, ent = row_values(path, layout.prompt_lens[row] - 1, tail, row_temperature(layout, row))
        out_lp.append(lp)
        out_ent.append(ent)
    if any(e is None for e in out_ent):
        return out_lp, None
    return out_lp, out_ent
