"""Per-phase metrics from the engine are present and plausible (no timing thresholds)."""

from __future__ import annotations

import time

import pytest
import torch

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import grpo_batches, verl_engine
from verl_prefix.schedule.telemetry import PhaseMeter

MIB = 1024.0**2


def prefix_kv_mib(engine, prefix_len: int) -> float:
    """What one prefix's K/V takes, from the model config: 2 (K, V) x layers x KV heads x head_dim."""
    config = engine.module.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.finfo(next(engine.module.parameters()).dtype).bits // 8
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element
    return per_token * prefix_len / MIB


def test_update_reports_every_phase(tiny_qwen3_dir):
    engine, loss_fn, _ = verl_engine.build_verl_engine(
        tiny_qwen3_dir, backend="prefix_fsdp2", micro_batch_size_per_gpu=2
    )
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=6)  # one group reuses, one runs dense
    batch = grpo_batches.make_grpo_batch(
        num_groups=2, group_size=4, prompt_lens=[12, 5], response_len_range=(2, 6), vocab_size=128
    )
    start = time.perf_counter()
    metrics = verl_engine.run_train_step(engine, loss_fn, batch)["reduced_metrics"]
    wall = time.perf_counter() - start
    phases = [metrics[f"prefix/time_s/{p}"] for p in ("A", "B", "C", "dense")]
    assert all(t > 0 for t in phases)
    assert sum(phases) == metrics["prefix/time_s/schedule"] <= wall
    assert 0 < metrics["prefix/time_s/optimizer"] <= wall
    assert metrics["prefix/logical_tokens"] > metrics["prefix/physical_tokens"] > 0
    assert metrics["prefix/logical_tokens_per_s"] == pytest.approx(
        metrics["prefix/logical_tokens"] / metrics["prefix/time_s/schedule"]
    )
    saved_a = metrics["prefix/max_saved_for_backward_mib/A"]
    saved_b = metrics["prefix/max_saved_for_backward_mib/B"]
    assert saved_a > 0 and saved_b > 0
    assert metrics["prefix/max_saved_for_backward_held_mib"] >= saved_a + saved_b - 1e-9
    assert metrics["prefix/max_rss_mib/A"] > 0
    # a lone rank never waits for peers; the phase is reported anyway, as on every rank
    assert metrics["prefix/time_s/lockstep"] == 0.0
    # one mini-batch on one rank: the slowest rank's phase time is the phase time
    for p in ("A", "B", "C", "dense"):
        assert metrics[f"prefix/max_time_s/{p}"] == metrics[f"prefix/time_s/{p}"]
    # only the 12-token prompt reuses: its prefix is prompt[:-1]
    assert metrics["prefix/max_prefix_kv_mib"] == prefix_kv_mib(engine, 11)


def test_forward_only_reports_phases_without_saved_tensors(tiny_qwen3_dir):
    engine, _, _ = verl_engine.build_verl_engine(tiny_qwen3_dir, backend="prefix_fsdp2")
    engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    batch = grpo_batches.make_grpo_batch(
        num_groups=2, group_size=4, prompt_lens=[12, 5], response_len_range=(2, 6), vocab_size=128
    )
    metrics = verl_engine.reduce_step_metrics(verl_engine.run_infer(engine, batch)["metrics"])
    assert metrics["prefix/time_s/A"] > 0 and metrics["prefix/time_s/B"] > 0
    assert "prefix/time_s/C" not in metrics
    assert metrics["prefix/max_saved_for_backward_held_mib"] == 0.0
    # the cache a forward-only pass holds: the longest prefix (prompt 12 -> 11 tokens) is the peak
    assert metrics["prefix/max_prefix_kv_mib"] == prefix_kv_mib(engine, 11)


def test_dense_fallback_reports_no_prefix_cache(tiny_qwen3_dir):
    engine, loss_fn, _ = verl_engine.build_verl_engine(tiny_qwen3_dir, backend="prefix_fsdp2")
    engine.reuse_config = PrefixReuseConfig(enable=False)
    batch = grpo_batches.make_grpo_batch(
        num_groups=1, group_size=4, prompt_lens=[12], response_len_range=(2, 4), vocab_size=128
    )
    metrics = verl_engine.run_train_step(engine, loss_fn, batch)["reduced_metrics"]
    assert metrics["prefix/fallback_disabled"] == 4
    assert metrics["prefix/time_s/dense"] > 0 and "prefix/time_s/A" not in metrics
    assert "prefix/max_prefix_kv_mib" not in metrics


def test_saved_bytes_counts_each_storage_once():
    meter = PhaseMeter(torch.device("cpu"))
    x = torch.randn(256, requires_grad=True)  # 1 KiB
    with meter.phase("A"):
        y = (x * x).sum()  # saves x twice: one storage
    assert meter.saved_mib["A"] * 1024**2 == 1024
    y.backward()


def test_cpu_meter_reports_no_device_peak():
    meter = PhaseMeter(torch.device("cpu"))
    with meter.phase("A"):
        pass
    assert not [k for k in meter.metrics(1, 1) if "peak_device" in k]


def test_engine_counts_checkpointed_layers(tiny_qwen3_dir):
    """verl's non-reentrant gradient checkpointing through the engine: phases A and B hold the layers'
    inputs plus the largest layer's recompute, at least 1/layers of the plain figure and below it (the
    schedule-level reference is in ``test_telemetry_honesty``)."""
    batch = grpo_batches.make_grpo_batch(
        num_groups=1, group_size=4, prompt_lens=[24], response_len_range=(16, 20), vocab_size=128
    )
    saved = {}
    for checkpointing in (False, True):
        engine, loss_fn, _ = verl_engine.build_verl_engine(
            tiny_qwen3_dir, backend="prefix_fsdp2", micro_batch_size_per_gpu=2, gradient_checkpointing=checkpointing
        )
        engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
        metrics = verl_engine.run_train_step(engine, loss_fn, batch)["reduced_metrics"]
        assert metrics["prefix/groups"] == 1
        saved[checkpointing] = {p: metrics[f"prefix/max_saved_for_backward_mib/{p}"] for p in "AB"}
    layers = engine.module.config.num_hidden_layers
    for phase in "AB":
        assert saved[False][phase] / layers <= saved[True][phase] < saved[False][phase], (phase, saved)
