"""Per-phase wall time and memory of the schedule, as verl metrics under ``prefix/``.

Phases: ``A`` prefix forward, ``B`` suffix micro-batches (forward + backward), ``C`` prefix backward,
``dense`` rows that ran the stock path, ``lockstep`` zero-loss filler work a rank runs while its peers
still have groups or dense chunks (FSDP collectives must match; much of it is waiting for them). Memory inside a phase:

- CUDA/NPU: the allocator's peak, reset at phase start (verl never resets it);
- every device: bytes saved for backward held at once. Phase A's saved tensors live until C, each
  B micro-batch's until its own backward, so the peak is ``A + max(B micro-batch)``; counted by a
  ``saved_tensors_hooks`` pack hook, deduplicated by storage;
- CPU: process RSS at the phase's end (max over the mini-batch);
- every device, training and forward-only: the bytes of one group's prefix K/V (plus MoE router sums),
  held from phase A to the group's last suffix micro-batch (training also holds a gradient of that size).

Values are per mini-batch. verl's ``reduce_metrics`` takes the max over data-parallel ranks and
mini-batches of keys containing ``max`` and the mean of the rest, so peaks and the slowest rank's phase
times (``max_time_s``) carry ``max``; nothing else may.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import psutil
import torch

PHASES = ("A", "B", "C", "dense", "lockstep")
_MIB = 1024.0**2


class SavedBytes:
    """Counts bytes autograd saves for backward inside a block (each storage once)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses (nested, DTensor) own no storage
            key, nbytes = id(tensor), tensor.numel() * tensor.element_size()
        if key not in self._seen and nbytes > 0:
            self._seen.add(key)
            self.bytes += nbytes
        return tensor

    @contextmanager
    def counting(self) -> Iterator[SavedBytes]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self


class PhaseMeter:
    """Accumulates time, peaks and tokens per phase over one ``forward_backward_batch`` call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.peak_device_mib: dict[str, float] = defaultdict(float)
        self.peak_rss_mib: dict[str, float] = defaultdict(float)
        self.saved_mib: dict[str, float] = defaultdict(float)
        self.held_saved_mib = 0.0  # prefix saved bytes of the current group, live until phase C
        self.peak_held_saved_mib = 0.0
        self.peak_prefix_kv_mib = 0.0
        self.counts: dict[str, float] = defaultdict(float)  # e.g. prefix/phase_b_attention/merged
        self._accelerator = device.type in ("cuda", "npu")

    def _sync(self) -> None:
        if self._accelerator:
            getattr(torch, self.device.type).synchronize(self.device)

    @contextmanager
    def phase(self, name: str) -> Iterator[SavedBytes]:
        module = getattr(torch, self.device.type) if self._accelerator else None
        self._sync()
        if module is not None:
            module.reset_peak_memory_stats(self.device)
        saved = SavedBytes()
        start = time.perf_counter()
        try:
            with saved.counting():
                yield saved
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start
            if module is not None:
                self.peak_device_mib[name] = max(
                    self.peak_device_mib[name], module.max_memory_allocated(self.device) / _MIB
                )
            self.peak_rss_mib[name] = max(self.peak_rss_mib[name], psutil.Process().memory_info().rss / _MIB)
            self._account_saved(name, saved.bytes / _MIB)

    def count(self, key: str, n: float = 1.0) -> None:
        """Add ``n`` to a counter reported as metric ``key`` (e.g. micro-batches per phase-B attention)."""
        self.counts[key] += n

    def note_prefix_kv(self, tensors: list[torch.Tensor]) -> None:
        """Record the size of a group's prefix cache (called once per group after phase A)."""
        mib = sum(t.numel() * t.element_size() for t in tensors) / _MIB
        self.peak_prefix_kv_mib = max(self.peak_prefix_kv_mib, mib)

    def _account_saved(self, name: str, mib: float) -> None:
        if name == "A":
            self.held_saved_mib = mib
            self.saved_mib["A"] = max(self.saved_mib["A"], mib)
        elif name == "C":
            self.held_saved_mib = 0.0
        else:
            self.saved_mib[name] = max(self.saved_mib[name], mib)
        held = mib + (self.held_saved_mib if name == "B" else 0.0)
        self.peak_held_saved_mib = max(self.peak_held_saved_mib, held)

    def metrics(
        self, logical_tokens: int, physical_tokens: int, phases: Sequence[str] | None = None
    ) -> dict[str, float]:
        """``phases``: report these even where they did not run (zeros). verl averages a key over the ranks
        that report it, so every rank must report the same phases for the means to add up."""
        out: dict[str, float] = {}
        total = 0.0
        for name in phases if phases is not None else [p for p in PHASES if p in self.seconds]:
            seconds = self.seconds.get(name, 0.0)
            total += seconds
            out[f"prefix/time_s/{name}"] = seconds
            out[f"prefix/max_time_s/{name}"] = seconds
            out[f"prefix/max_saved_for_backward_mib/{name}"] = self.saved_mib.get(name, 0.0)
            out[f"prefix/max_rss_mib/{name}"] = self.peak_rss_mib.get(name, 0.0)
            if self._accelerator:
                out[f"prefix/max_peak_device_mib/{name}"] = self.peak_device_mib.get(name, 0.0)
        out["prefix/max_saved_for_backward_held_mib"] = self.peak_held_saved_mib
        if "prefix/time_s/A" in out:
            out["prefix/max_prefix_kv_mib"] = self.peak_prefix_kv_mib
        out["prefix/time_s/schedule"] = total
        out["prefix/logical_tokens_per_s"] = logical_tokens / total if total > 0 else 0.0
        out["prefix/logical_tokens"] = float(logical_tokens)
        out["prefix/physical_tokens"] = float(physical_tokens)
        out["prefix/reuse_factor"] = logical_tokens / max(physical_tokens, 1)
        out.update(self.counts)
        return out


class NullMeter(PhaseMeter):
    """No measurement (the default for direct schedule calls)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield None

    def note_prefix_kv(self, tensors: list[torch.Tensor]) -> None:
        pass
