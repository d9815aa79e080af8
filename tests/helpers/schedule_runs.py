"""One reuse run of a whole layout through ``train_group`` or ``infer_group``: the loops every schedule-level
test shares."""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_prefix.schedule.dormant import Dormant
from verl_prefix.schedule.executor import infer_group, train_group
from verl_prefix.schedule.grouping import BatchPlan, RowLayout, plan_batch

CPU = torch.device("cpu")


def train_reuse(
    model: torch.nn.Module,
    layout: RowLayout,
    loss_fn: Callable,
    *,
    rows: int | None = None,
    min_group_size: int = 1,
    dormant: Callable[[], Dormant] | None = None,
    **options: object,
) -> tuple[dict[str, torch.Tensor], BatchPlan]:
    """Zero the grads, plan ``layout`` (every group reuses: ``min_prefix_len=1``), run each group's A/B/C
    with ``options`` for ``train_group`` (and a fresh ``dormant()`` per group); returns the parameter
    grads and the plan (tests assert reuse ran)."""
    model.zero_grad()
    plan = plan_batch(layout, max_rows=rows, max_tokens=None, min_prefix_len=1, min_group_size=min_group_size)
    options.setdefault("device", CPU)
    options.setdefault("calculate_entropy", False)
    for group in plan.groups:
        policy = dormant() if dormant is not None else None
        train_group(model, layout, group, torch.ones(len(layout)), loss_fn, dormant=policy, **options)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, plan


def infer_reuse(
    model: torch.nn.Module,
    layout: RowLayout,
    *,
    rows: int | None = None,
    temperature: torch.Tensor | None = None,
    **options: object,
) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """Forward-only A and B over every group of ``layout`` (``options`` for ``infer_group``; entropy on by
    default): ``{row: (response log-probs, entropy or None)}``."""
    plan = plan_batch(layout, max_rows=rows, max_tokens=None, min_prefix_len=1, min_group_size=1)
    options.setdefault("device", CPU)
    options.setdefault("calculate_entropy", True)
    temperature = torch.ones(len(layout)) if temperature is None else temperature
    results: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for group in plan.groups:
        results.update(infer_group(model, layout, group, temperature, **options))
    return results
