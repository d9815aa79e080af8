"""One reuse run of a whole layout through ``train_group`` or ``infer_group``: the loops every schedule-level
test shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from verl_prefix.schedule.dormant import Dormant
from verl_prefix.schedule.executor import infer_group, train_group
from verl_prefix.schedule.grouping import BatchPlan, RowLayout, plan_batch
from verl_prefix.schedule.options import ScheduleOptions

CPU = torch.device("cpu")


def train_reuse(
    model: torch.nn.Module,
    layout: RowLayout,
    loss_fn: Callable,
    *,
    rows: int | None = None,
    min_group_size: int = 1,
    dormant: Callable[[], Dormant] | None = None,
    prefix_chunks: int = 0,
    **options: object,
) -> tuple[dict[str, torch.Tensor], BatchPlan]:
    """Zero the grads, plan ``layout`` (every group reuses: ``min_prefix_len=1``), run each group's A/B/C
    with ``ScheduleOptions(**options)`` (CPU unless ``device`` is given), a fresh ``dormant()`` per group and
    at least ``prefix_chunks`` prefix forwards per group (lockstep fillers); returns the parameter grads and
    the plan (tests assert reuse ran)."""
    model.zero_grad()
    plan = plan_batch(layout, max_rows=rows, max_tokens=None, min_prefix_len=1, min_group_size=min_group_size)
    options.setdefault("device", CPU)
    schedule_options = ScheduleOptions(**options)
    for group in plan.groups:
        policy = dormant() if dormant is not None else None
        group = dataclasses.replace(group, min_prefix_chunks=prefix_chunks)
        train_group(model, layout, group, loss_fn, schedule_options, policy)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, plan


def infer_reuse(
    model: torch.nn.Module,
    layout: RowLayout,
    *,
    rows: int | None = None,
    temperature: torch.Tensor | None = None,
    prefix_chunks: int = 0,
    **options: object,
) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """Forward-only A and B over every group of ``layout`` (``ScheduleOptions(**options)``; CPU and entropy
    on by default; per-row ``temperature`` if given): ``{row: (response log-probs, entropy or None)}``."""
    plan = plan_batch(layout, max_rows=rows, max_tokens=None, min_prefix_len=1, min_group_size=1)
    options.setdefault("device", CPU)
    options.setdefault("calculate_entropy", True)
    schedule_options = ScheduleOptions(**options)
    if temperature is not None:
        layout = dataclasses.replace(layout, temperature=temperature)
    results: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for group in plan.groups:
        group = dataclasses.replace(group, min_prefix_chunks=prefix_chunks)
        results.update(infer_group(model, layout, group, schedule_options))
    return results


def assert_every_row_reused(layout: RowLayout, plan: BatchPlan) -> None:
    """Every row went through a group's A/B/C (no dense rows) and fewer tokens ran than dense would run: an
    exactness test that passed on dense rows would prove nothing."""
    assert plan.groups and not plan.dense_rows, "every row must reuse"
    assert sum(len(g.rows) for g in plan.groups) == len(layout)
    logical = sum(p + s for p, s in zip(layout.prompt_lens, layout.response_lens))
    physical = sum(g.prompt_len - 1 for g in plan.groups) + sum(layout.response_lens)
    assert physical < logical, f"physical {physical} vs logical {logical} tokens: nothing reused"


def reused_grads(
    model: torch.nn.Module, layout: RowLayout, loss_fn: Callable, **kwargs: object
) -> dict[str, torch.Tensor]:
    """``train_reuse``'s gradients, after asserting every row reused (``assert_every_row_reused``)."""
    grads, plan = train_reuse(model, layout, loss_fn, **kwargs)
    assert_every_row_reused(layout, plan)
    return grads
