"""The mini-batch ending both engines share (``backend.outputs``): a dense chunk's forward-only pass keeps no
graph, its training pass backpropagates; a whole-batch fallback is counted, logged (not when reuse is off) and
reports every token as computed."""

from __future__ import annotations

import logging

import pytest
import torch
from tensordict import TensorDict

from verl_prefix.backend import fallbacks
from verl_prefix.backend.outputs import dense_batch_output, dense_chunk
from verl_prefix.schedule.telemetry import PhaseMeter


def _step(seen: list[bool]):
    weight = torch.ones(3, requires_grad=True)

    def step(micro, loss_function, forward_only):
        seen.append(torch.is_grad_enabled())
        loss = (weight * 2.0).sum()
        return loss, {"loss": float(loss.detach()), "metrics": {}, "model_output": {}}

    return step


def test_dense_chunk_forward_only_keeps_no_graph():
    seen, backward = [], []
    loss, _ = dense_chunk(_step(seen), None, None, True, backward.append)
    assert seen == [False] and loss.grad_fn is None and backward == []
    loss, _ = dense_chunk(_step(seen), None, None, False, backward.append)
    assert seen == [False, True] and loss.grad_fn is not None and backward == [loss]


def test_dense_batch_output_counts_and_logs(monkeypatch, caplog):
    monkeypatch.setattr(fallbacks, "LOGGED_REASONS", set())
    ids = torch.nested.nested_tensor([torch.arange(5), torch.arange(3)], layout=torch.jagged)
    data = TensorDict({"input_ids": ids}, batch_size=[2])
    for reason in ("disabled", "small_group"):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            out = dense_batch_output(lambda: {"metrics": {}}, data, reason, PhaseMeter(torch.device("cpu")))
        m = out["metrics"]
        assert m[f"prefix/fallback_{reason}"] == 2.0 and m["prefix/groups"] == 0.0
        assert m["prefix/logical_tokens"] == m["prefix/physical_tokens"] == pytest.approx(8.0)
        assert f"prefix/fallback_{reason}" in caplog.text, caplog.text  # each reason logged, disabled too
