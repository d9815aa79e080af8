"""``batch_flops`` prices a planned mini-batch with the benches' formulas: reusing groups one-level, rows that
fall back dense on both sides, the MoE aux loss's routed last token on the schedule's side only."""

from __future__ import annotations

import pytest
import torch

from verl_prefix.schedule.flop_model import (
    BatchFlops,
    ModelShape,
    batch_flops,
    dense_flops,
    flop_metrics,
    reuse_flops,
    sequence_flops,
)
from verl_prefix.schedule.grouping import RowLayout, plan_batch

SHAPE = ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100)


def layout(prompts: list[int], responses: list[int], uids: list[str]) -> RowLayout:
    ids, positions = [], []
    prompt_of: dict[str, torch.Tensor] = {}
    for p, s, uid in zip(prompts, responses, uids):
        prompt = prompt_of.setdefault(uid, torch.arange(p) % 50 + 1)
        ids.append(torch.cat([prompt, torch.full((s,), 7)]))
        positions.append(torch.arange(p + s))
    return RowLayout(ids, positions, prompts, responses, uids)


def test_groups_and_dense_rows():
    rows = layout([40, 40, 40, 30, 30, 30, 12], [3, 5, 4, 6, 2, 2, 9], list("aaabbbc"))
    plan = plan_batch(rows, max_rows=None, max_tokens=None, min_prefix_len=16, min_group_size=2)
    assert plan.all_dense_rows == [6]
    got = batch_flops(SHAPE, rows, plan)
    dense_row = sequence_flops(SHAPE, 12 + 9)
    assert got.dense == pytest.approx(dense_flops(SHAPE, 40, [3, 5, 4]) + dense_flops(SHAPE, 30, [6, 2, 2]) + dense_row)
    assert got.schedule == pytest.approx(
        reuse_flops(SHAPE, 40, [3, 5, 4]) + reuse_flops(SHAPE, 30, [6, 2, 2]) + dense_row
    )
    assert got.saved_ratio > 1
    routed = batch_flops(SHAPE, rows, plan, routed_last_token=True)
    assert routed.dense == got.dense and routed.schedule > got.schedule


def test_all_dense_is_exactly_one():
    rows = layout([40, 40], [3, 5], ["a", "b"])  # two groups of one
    plan = plan_batch(rows, max_rows=None, max_tokens=None, min_prefix_len=16, min_group_size=2)
    got = batch_flops(SHAPE, rows, plan)
    assert got.dense == got.schedule and got.saved_ratio == 1.0
    assert BatchFlops(0.0, 0.0).saved_ratio == 1.0  # an empty mini-batch saves nothing


def test_metrics_estimate_dense_time():
    m = flop_metrics(BatchFlops(6.0, 2.0), seconds=1.5)
    assert m == {
        "prefix/flops_dense": 6.0,
        "prefix/flops_schedule": 2.0,
        "prefix/flops_saved_ratio": 3.0,
        "prefix/est_dense_time_s": 4.5,
    }
    # verl reduces with the mean unless a key says max or min: none of these may
    assert not any("max" in k or "min" in k for k in m)
