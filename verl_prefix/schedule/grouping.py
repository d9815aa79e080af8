"""Regroup a per-rank mini-batch by ``uid``, validate it, and plan suffix micro-batches.

Pure bookkeeping on token ids and lengths: no model, no verl engine. Every check raises with the
sample indices a user needs to find the bad rows; nothing is dropped or repaired silently.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from verl_prefix.schedule.models.multimodal import VisualInputs, same_visual_inputs, visual_tokens_outside


@dataclass(frozen=True)
class RowLayout:
    """The rows of one mini-batch, unpadded: ``input_ids[i]`` is prompt followed by response.
    ``temperature[i]`` divides row ``i``'s logits (the sampling temperature; ``None``: 1 for every row).
    ``visual[i]`` are row ``i``'s multimodal model inputs (pixel values, grids), ``None`` for a text row
    (``None``: a text batch)."""

    input_ids: list[torch.Tensor]
    position_ids: list[torch.Tensor]
    prompt_lens: list[int]
    response_lens: list[int]
    uids: list[str]
    temperature: torch.Tensor | None = None
    visual: list[VisualInputs | None] | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        sizes = {len(self.position_ids), len(self.prompt_lens), len(self.response_lens), len(self.uids)}
        if self.temperature is not None:
            sizes.add(len(self.temperature))
        if self.visual is not None:
            sizes.add(len(self.visual))
        if sizes != {n}:
            raise ValueError(f"row layout fields disagree on the number of samples: {sizes | {n}}")
        for i, (ids, p, s) in enumerate(zip(self.input_ids, self.prompt_lens, self.response_lens)):
            if ids.numel() != p + s:
                raise ValueError(f"sample {i}: {ids.numel()} tokens but prompt {p} + response {s}")

    def __len__(self) -> int:
        return len(self.input_ids)

    def visual_of(self, row: int) -> VisualInputs | None:
        """Row ``row``'s visual inputs (``None`` for a text row)."""
        return self.visual[row] if self.visual is not None else None


@dataclass
class GroupPlan:
    """One uid group that runs the A/B/C schedule: its prefix is ``prompt[:-1]`` of any member."""

    uid: str
    rows: list[int]
    prompt_len: int
    micro_batches: list[list[int]] = field(default_factory=list)
    # zero-loss micro-batches over rows[0] that only keep data-parallel ranks in lockstep
    filler_micro_batches: int = 0
    # the least number of prefix forwards phase A runs (lockstep with a peer's chunked prefix in the same
    # slot: one-token filler chunks make up the difference; ``schedule.chunked``)
    min_prefix_chunks: int = 0

    @property
    def prefix_len(self) -> int:
        return self.prompt_len - 1


@dataclass
class BatchPlan:
    """Reuse groups in execution order, and the rows that run dense keyed by the reason why."""

    groups: list[GroupPlan]
    dense_rows: dict[str, list[int]]

    @property
    def all_dense_rows(self) -> list[int]:
        return sorted(i for rows in self.dense_rows.values() for i in rows)


def group_rows_by_uid(uids: list[str]) -> OrderedDict[str, list[int]]:
    """Rows of each uid in first-appearance order; works whether or not groups arrive contiguous."""
    groups: OrderedDict[str, list[int]] = OrderedDict()
    for i, uid in enumerate(uids):
        groups.setdefault(str(uid), []).append(i)
    return groups


def _fmt(rows: list[int], limit: int = 16) -> str:
    shown = ", ".join(map(str, rows[:limit]))
    return f"[{shown}{', ...' if len(rows) > limit else ''}]"


# marks the sub-groups of a uid whose rows do not all share one prompt (``split_uid_groups``)
PROMPT_SPLIT = "#prompt"


def validate_batch(
    layout: RowLayout, advantages: torch.Tensor | None = None, response_mask: torch.Tensor | None = None
) -> RowLayout:
    """Refuse input that would train on garbage (empty responses or prompts, non-finite advantages) and return
    the layout regrouped so that every group shares one prompt (``split_uid_groups``)."""
    validate_rows(layout.prompt_lens, layout.response_lens, advantages, response_mask)
    return split_uid_groups(layout)


def validate_rows(
    prompt_lens: list[int],
    response_lens: list[int],
    advantages: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
) -> None:
    """The checks that do not depend on uids, so they also apply to a mini-batch that runs dense:
    every sample has a prompt and a response, and finite advantages (``[batch, response]``, padded)."""
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(response_lens)} response lengths")
    empty = [i for i, s in enumerate(response_lens) if s <= 0]
    if empty:
        raise ValueError(f"samples {_fmt(empty)} have empty responses; every sample needs at least one response token")
    empty_prompt = [i for i, p in enumerate(prompt_lens) if p <= 0]
    if empty_prompt:
        raise ValueError(f"samples {_fmt(empty_prompt)} have empty prompts")
    if advantages is not None:
        if advantages.shape[0] != len(response_lens):
            raise ValueError(f"{advantages.shape[0]} rows of advantages for {len(response_lens)} samples")
        values = advantages if response_mask is None else advantages.masked_fill(~response_mask.bool(), 0.0)
        bad = (~torch.isfinite(values)).reshape(values.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"samples {_fmt(bad)} have non-finite advantages (NaN or inf)")


def _same_prompt(layout: RowLayout, i: int, j: int) -> bool:
    p = layout.prompt_lens[i]
    return (
        layout.prompt_lens[j] == p
        and torch.equal(layout.input_ids[i][:p], layout.input_ids[j][:p])
        and torch.equal(layout.position_ids[i][..., :p], layout.position_ids[j][..., :p])
    )


def split_uid_groups(layout: RowLayout) -> RowLayout:
    """Rows of one uid whose prompts differ (tokens or positions: per-sample prompt augmentation, per-sample
    system prompts, a re-tokenised turn) become sub-groups of identical prompts, each reusing its own prompt:
    GRPO itself is fine with such a group, and reuse computes a prompt once only for the rows that really share
    it. Their uids become ``<uid>#prompt<k>`` (k in first-appearance order); a sub-group too small to reuse runs
    dense as ``prompt_mismatch`` (``plan_batch``), and under ``prefix_reuse.tree`` the trie still shares what the
    sub-groups' prompts have in common. A layout whose uids each name one prompt is returned as it is."""
    uids = list(layout.uids)
    for uid, rows in group_rows_by_uid(layout.uids).items():
        classes: list[list[int]] = []
        for i in rows:
            home = next((c for c in classes if _same_prompt(layout, c[0], i)), None)
            if home is None:
                classes.append([i])
            else:
                home.append(i)
        if len(classes) > 1:
            for k, members in enumerate(classes):
                for i in members:
                    uids[i] = f"{uid}{PROMPT_SPLIT}{k}"
    return layout if uids == list(layout.uids) else dataclasses.replace(layout, uids=uids)


def is_prompt_split(uid: str) -> bool:
    """Whether ``uid`` names a sub-group ``split_uid_groups`` made (its rows shared a uid, not a prompt)."""
    return PROMPT_SPLIT in uid


def plan_suffix_micro_batches(
    rows: list[int],
    response_lens: list[int],
    max_rows: int | None,
    max_tokens: int | None,
    extra_tokens_per_row: int = 0,
    prefix_tokens_per_row: int = 0,
) -> list[list[int]]:
    """Split a group's suffix rows into micro-batches, longest first so padding stays small.

    A micro-batch holds at most ``max_rows`` rows and at most ``max_tokens`` tokens, counted as
    rows x (longest suffix + ``extra_tokens_per_row`` + ``prefix_tokens_per_row``): a suffix row is one
    token longer when it also feeds its last response token, and every one of its queries attends to the
    prefix, which ``plan_batch`` counts per row as the prefix length (the keys a row's attention covers,
    what the same row costs in a dense micro-batch). A single row over the budget still forms its own
    micro-batch.
    """
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"suffix micro-batch size must be >= 1, got {max_rows}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"suffix token budget must be >= 1, got {max_tokens}")
    ordered = sorted(rows, key=lambda i: (-response_lens[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in ordered:
        longest = max([response_lens[j] for j in current] + [response_lens[i]]) + extra_tokens_per_row
        longest += prefix_tokens_per_row
        too_many = max_rows is not None and len(current) + 1 > max_rows
        too_long = max_tokens is not None and (len(current) + 1) * longest > max_tokens
        if current and (too_many or too_long):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def plan_batch(
    layout: RowLayout,
    *,
    max_rows: int | None,
    max_tokens: int | None,
    min_prefix_len: int,
    min_group_size: int,
    extra_tokens_per_row: int = 0,
    count_prefix_tokens: bool = True,
    visual_token_ids: tuple[int, ...] = (),
) -> BatchPlan:
    """Decide per uid group whether it reuses its prefix, and plan its suffix micro-batches.

    ``count_prefix_tokens``: the token budget charges each suffix row the prefix it attends to, so a
    budget means what it means for dense micro-batches (short suffixes do not pack a whole group into one
    micro-batch whose attention covers G x P prefix keys); off counts padded suffix tokens only.

    A group whose rows do not share identical visual inputs (by content: a uid with different images) runs
    dense as ``multimodal_mismatch``; one with a visual token (``visual_token_ids``) past the prefix, as
    ``multimodal_layout``: phase A encodes the group's images once, over the prefix."""
    groups: list[GroupPlan] = []
    dense: dict[str, list[int]] = {}
    for uid, rows in group_rows_by_uid(layout.uids).items():
        prompt_len = layout.prompt_lens[rows[0]]
        if prompt_len - 1 < max(min_prefix_len, 1):
            dense.setdefault("short_prefix", []).extend(rows)
            continue
        if len(rows) < min_group_size:  # a uid's rows that share too little of their prompt: prompt_mismatch
            dense.setdefault("prompt_mismatch" if is_prompt_split(uid) else "small_group", []).extend(rows)
            continue
        visual_reason = _visual_reason(layout, rows, visual_token_ids)
        if visual_reason is not None:
            dense.setdefault(visual_reason, []).extend(rows)
            continue
        plan = GroupPlan(uid=uid, rows=rows, prompt_len=prompt_len)
        plan.micro_batches = plan_suffix_micro_batches(
            rows,
            layout.response_lens,
            max_rows,
            max_tokens,
            extra_tokens_per_row,
            prefix_tokens_per_row=plan.prefix_len if count_prefix_tokens else 0,
        )
        groups.append(plan)
    return BatchPlan(groups=groups, dense_rows=dense)


def _visual_reason(layout: RowLayout, rows: list[int], visual_token_ids: tuple[int, ...]) -> str | None:
    """Why a group's visual inputs cannot run once in phase A, or None (always None for text groups)."""
    first = layout.visual_of(rows[0])
    if any(not same_visual_inputs(first, layout.visual_of(i)) for i in rows[1:]):
        return "multimodal_mismatch"
    prefix_len = layout.prompt_lens[rows[0]] - 1
    if any(visual_tokens_outside(layout.input_ids[i], prefix_len, visual_token_ids) for i in rows):
        return "multimodal_layout"
    return None
