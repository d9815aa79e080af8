"""Assemble what the schedule computed into what verl's worker expects back: full-sequence nested
log-probs, the micro-batch order, metrics as per-micro-batch lists, token counts and fallback counts."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from verl_prefix.schedule.grouping import BatchPlan, RowLayout


def full_length(values: list[torch.Tensor], layout: RowLayout, rows: list[int]) -> torch.Tensor:
    """Place response values into verl's full-sequence nested layout (prompt+response per row).

    Position ``p`` holds what predicts token ``p+1``, so row i's response values sit at
    ``[P-1, P-1+S)``; positions the schedule never computes hold zeros.
    """
    pieces, lengths = [], []
    for i, v in zip(rows, values):
        p, s = layout.prompt_lens[i], layout.response_lens[i]
        pieces += [v.new_zeros(p - 1), v, v.new_zeros(1)]
        lengths.append(p + s)
    flat = torch.cat(pieces)
    offsets = torch.tensor([0] + lengths, device=flat.device).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(flat, offsets)


def static_bsz(data: TensorDict) -> TensorDict:
    """postprocess_batch_func reorders only under dynamic bsz; we always reorder ourselves."""
    view = data.select()  # empty view keeps batch size; carry only the flags postprocess reads
    tu.assign_non_tensor(view, use_dynamic_bsz=False)
    return view


def as_micro_batch_lists(metrics: dict[str, Any]) -> dict[str, Any]:
    """verl's worker chains per-micro-batch lists across mini-batches: plain numbers become one-item lists."""
    return {k: [v] if isinstance(v, int | float) else v for k, v in metrics.items()}


def fallback_metrics(dense_rows: dict[str, list[int]] | dict[str, int], groups: int) -> dict[str, float]:
    metrics = {"prefix/groups": float(groups)}
    for reason, rows in dense_rows.items():
        metrics[f"prefix/fallback_{reason}"] = float(rows if isinstance(rows, int) else len(rows))
    return metrics


def token_counts(layout: RowLayout, plan: BatchPlan, routed_last_token: bool = False) -> tuple[int, int]:
    """(logical, physical): what dense would compute, and what the schedule computed. With the MoE aux
    loss on, suffix rows also feed their last response token (``routed_last_token``)."""
    logical = physical = 0
    for group in plan.groups:
        suffix = sum(layout.response_lens[i] for i in group.rows)
        logical += len(group.rows) * group.prompt_len + suffix
        physical += group.prefix_len + suffix + (len(group.rows) if routed_last_token else 0)
    for i in plan.all_dense_rows:
        logical += layout.prompt_lens[i] + layout.response_lens[i]
        physical += layout.prompt_lens[i] + layout.response_lens[i]
    return logical, physical
