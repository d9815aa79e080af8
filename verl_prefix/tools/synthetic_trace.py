"""Synthetic traces: GRPO mini-batches of chosen shapes in the trace format, for replay without a real run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from verl_prefix.backend.config import PrefixReuseConfig
from verl_prefix.backend.trace import MANIFEST, TraceError, TraceWriter
from verl_prefix.harness import grpo_batches, tiny_models


def _length_range(value: int | tuple[int, int] | list[int], name: str) -> tuple[int, int]:
    lo, hi = (value, value) if isinstance(value, int) else tuple(value)
    if not 1 <= lo <= hi:
        raise TraceError(f"{name} must be a length >= 1 or a range lo:hi with 1 <= lo <= hi, got {value}")
    return int(lo), int(hi)


def synthetic_trace(
    dir: str | os.PathLike,
    *,
    steps: int,
    groups: int,
    group_size: int,
    prefix_len: int | tuple[int, int],
    suffix_len: int | tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    micro_batch_size: int = 4,
    lr: float = 1e-5,
    model_ref: str | None = None,
    overwrite: bool = False,
    system_len: int = 0,
    prefix_reuse: dict[str, Any] | None = None,
) -> Path:
    """Write a trace of ``steps`` GRPO mini-batches with chosen shapes, for replay without a real run.

    Each step has ``groups`` uid groups of ``group_size`` samples; a group's prompt length (the shared
    prefix) is drawn uniformly from ``prefix_len`` and each response length from ``suffix_len`` (an int or
    an inclusive ``(lo, hi)``). Batches come from ``grpo_batches.make_grpo_batch`` (GRPO advantages through
    verl's estimator), with the settings ``TrainingWorker`` injects, so they look like what an engine
    receives. ``overwrite`` replaces an existing trace in ``dir``. ``system_len``: every prompt of a step starts
    with one block of that many tokens (a system prompt, what ``prefix_reuse.tree`` computes once) before its
    ``prefix_len`` tokens of its own. ``prefix_reuse``: reuse knobs recorded in the trace's config, which replay
    builds ``prefix_fsdp2`` with (``{"tree": True}`` replays the tree).
    """
    for name, value in (("steps", steps), ("groups", groups), ("group_size", group_size)):
        if value < 1:
            raise TraceError(f"{name} must be >= 1, got {value}")
    if system_len < 0:
        raise TraceError(f"system_len must be >= 0, got {system_len}")
    p_lo, p_hi = _length_range(prefix_len, "prefix_len")
    s_range = _length_range(suffix_len, "suffix_len")
    if vocab_size <= len(tiny_models.SPECIAL_TOKENS):
        raise TraceError(f"vocab_size must exceed {len(tiny_models.SPECIAL_TOKENS)}, got {vocab_size}")
    root = Path(dir)
    if root.exists() and not root.is_dir():
        raise TraceError(f"{root} exists and is not a directory")
    if overwrite and (root / MANIFEST).exists():
        for old in list(root.glob("batch_*.pt")) + [root / MANIFEST]:
            old.unlink()
    config = {
        "micro_batch_size_per_gpu": micro_batch_size,
        "use_dynamic_bsz": False,
        "lr": lr,
        "synthetic": {
            "groups": groups,
            "group_size": group_size,
            "prefix_len": [p_lo, p_hi],
            "suffix_len": list(s_range),
            "vocab_size": vocab_size,
            "seed": seed,
            "system_len": system_len,
        },
    }
    if prefix_reuse:
        try:
            PrefixReuseConfig(**prefix_reuse)
        except (TypeError, ValueError) as exc:
            raise TraceError(f"prefix_reuse: {exc}") from None
        config["prefix_reuse"] = dict(prefix_reuse)
    writer = TraceWriter(root, model_ref=model_ref, config=config, source="synthetic")
    rng = np.random.default_rng(seed)
    worker = dict(
        use_remove_padding=False,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=16384,
        micro_batch_size_per_gpu=micro_batch_size,
        use_fused_kernels=False,
    )
    for step in range(steps):
        batch = grpo_batches.make_grpo_batch(
            num_groups=groups,
            group_size=group_size,
            prompt_lens=[int(x) for x in rng.integers(p_lo, p_hi + 1, size=groups)],
            response_len_range=s_range,
            vocab_size=vocab_size,
            seed=seed * 100_003 + step,
            worker_settings=worker,
            shared_system=system_len,
        )
        writer.record(batch, step=step)
    return root
