"""Per-phase wall time and memory of the schedule, as verl metrics under ``prefix/``.

Phases: ``A`` prefix forward, ``B`` suffix micro-batches (forward + backward), ``C`` prefix backward,
``dense`` rows that ran the stock path, ``lockstep`` zero-loss filler work a rank runs while its peers
still have groups or dense chunks (FSDP collectives must match; much of it is waiting for them).

Time: on CPU ``perf_counter``; on CUDA/NPU device events recorded at each phase's start and end and read
in ``metrics()`` after one device synchronisation per mini-batch (two synchronisations per phase would
serialise compute and communication on every micro-batch). An event pair measures the stream's
timeline between the two records: device time, including the device idling while the host is slow.

Memory inside a phase:

- CUDA/NPU: the allocator's peak, reset at phase start. The allocator counts allocations when the host
  enqueues them, so reading it needs no synchronisation. The reset would make verl's own
  ``perf/max_memory_allocated_gb`` (``get_torch_device().max_memory_allocated()`` after the update)
  show the last phase's peak only, so the first meter on a device module wraps that module's
  ``max_memory_allocated``/``max_memory_reserved`` to answer ``max(peak before our resets, current)``
  and its public ``reset_peak_memory_stats`` to clear that floor: every other reader sees the lifetime
  peak as if the meter never reset it;
- every device: bytes saved for backward held at once, parameters excluded (the model holds those
  anyway). Counted by a ``saved_tensors_hooks`` pack hook, deduplicated by storage. Under non-reentrant
  activation checkpointing the checkpoint saves each layer's inputs through the ambient hook (counted)
  while its own innermost hook drops what the layer saves; backward rematerialises one layer at a
  time, so the largest such layer (counted by composing with the checkpoint's hook, given the model) is
  added. Phase A's saved tensors live until C, each B micro-batch's until its own backward, so the
  peak is ``A + max(B micro-batch)``;
- CPU: process RSS at the phase's end (max over the mini-batch);
- in GiB beside verl's ``perf/*`` memory metrics: ``prefix/max_memory_allocated_gb`` (CUDA/NPU: the largest
  phase's allocator peak, this mini-batch only, where verl's ``perf/max_memory_allocated_gb`` is the
  process's lifetime peak) and ``prefix/max_rss_gb`` (the largest phase's process RSS; verl's
  ``perf/cpu_memory_used_gb`` is the whole machine's used memory);
- every device, training and forward-only: the bytes of one group's prefix K/V (plus MoE router sums),
  held from phase A to the group's last suffix micro-batch (training also holds a gradient of that size).

Values are per mini-batch. verl's ``reduce_metrics`` takes the max over data-parallel ranks and
mini-batches of keys containing ``max`` and the mean of the rest, so peaks and the slowest rank's phase
times (``max_time_s``) carry ``max``; nothing else may.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any

import psutil
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

PHASES = ("A", "B", "C", "dense", "lockstep")
_MIB = 1024.0**2


def _storage_of(tensor: torch.Tensor) -> tuple[int, int, StorageWeakRef | None]:
    """(key, bytes, weak reference): the key is the storage's address, which a later storage may reuse
    once this one is freed (a checkpoint frees what its layers save at once), hence the weak reference."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes(), StorageWeakRef(storage)
    except (RuntimeError, NotImplementedError):  # wrapper subclasses (nested, DTensor) own no storage
        return id(tensor), tensor.numel() * tensor.element_size(), None


def _count_new(seen: dict[int, StorageWeakRef | None], tensor: torch.Tensor, *also: dict) -> int:
    """Bytes of ``tensor``'s storage if no live storage in ``seen`` (or ``also``) is it; records it."""
    key, nbytes, ref = _storage_of(tensor)
    for known in (seen, *also):
        if key in known and (known[key] is None or not known[key].expired()):
            return 0
    seen[key] = ref
    return nbytes


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (``linear`` saves ``weight.t()``)."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _checkpointed_layers(model: nn.Module | None) -> list[nn.Module]:
    """HF layers that run under activation checkpointing (``GradientCheckpointingLayer`` with it on)."""
    if model is None:
        return []
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True and m.training]


class SavedBytes:
    """Counts bytes autograd saves for backward inside a block (each storage once, parameters excluded).

    ``bytes``: saved through the block's own hook (under checkpointing: what lives outside checkpointed
    layers, including the inputs each keeps for its recompute). ``recompute_bytes``: with ``model``, the
    most one checkpointed layer saves inside its checkpoint, which backward rematerialises at once.
    ``segment()`` marks a graph whose backward has run (a chunk of phase C): ``bytes`` is then the most
    one segment saved, since no two segments' graphs are alive at once.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._current = 0
        self._largest_done = 0
        self.recompute_bytes = 0
        self._seen: dict[int, StorageWeakRef | None] = {}
        self._model = model
        self._layer: dict[int, StorageWeakRef | None] = {}
        self._layer_bytes = 0
        self._pushed: list[torch.autograd.graph.saved_tensors_hooks | None] = []

    @property
    def bytes(self) -> int:
        """The most bytes saved outside checkpointed layers that one segment held at once."""
        return max(self._largest_done, self._current)

    @property
    def total(self) -> int:
        """What autograd holds at most for this block's backward."""
        return self.bytes + self.recompute_bytes

    def segment(self) -> None:
        """The graph saved so far has been backpropagated and freed: count what follows afresh."""
        self._largest_done = max(self._largest_done, self._current)
        self._current = 0
        self._seen = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(tensor):
            self._current += _count_new(self._seen, tensor)
        return tensor

    def _count_in_layer(self, inner_pack: Callable[[torch.Tensor], Any], tensor: torch.Tensor) -> Any:
        if not _is_parameter(tensor):
            # the layer's input was saved outside (``bytes``): a recompute re-saves it without new memory
            self._layer_bytes += _count_new(self._layer, tensor, self._seen)
        return inner_pack(tensor)

    def _enter_layer(self, module: nn.Module, args: Any) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        # forward inside a checkpoint only: its innermost hook is not ours; backward's recompute re-saves
        # the same tensors, so counting the forward is enough
        if top is None or top[0] == self._pack or torch._C._current_graph_task_id() != -1:
            self._pushed.append(None)
            return
        hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(self._count_in_layer, top[0]), top[1])
        hooks.__enter__()
        self._pushed.append(hooks)
        self._layer, self._layer_bytes = {}, 0

    def _exit_layer(self, module: nn.Module, args: Any, output: Any) -> None:
        hooks = self._pushed.pop() if self._pushed else None
        if hooks is not None:
            hooks.__exit__(None, None, None)
            self.recompute_bytes = max(self.recompute_bytes, self._layer_bytes)

    @contextmanager
    def counting(self) -> Iterator[SavedBytes]:
        with ExitStack() as stack:
            for layer in _checkpointed_layers(self._model):
                stack.callback(layer.register_forward_pre_hook(self._enter_layer).remove)
                # always_call: phase A's early exit raises inside a layer; the pushed hook must still pop
                stack.callback(layer.register_forward_hook(self._exit_layer, always_call=True).remove)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
            yield self


# -- the device's lifetime peak, kept true across the meter's resets --------------------------------

_FLOOR_ATTR = "_verl_prefix_peak_floor"


def _device_index(module: ModuleType, device: Any) -> int:
    if device is None:
        return int(module.current_device())
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else int(module.current_device())


def _keep_lifetime_peaks(module: ModuleType) -> dict[str, Any]:
    """Wrap ``module``'s peak readers once per process (see the module docstring); returns the state:
    the unwrapped functions and the per-device floors."""
    state = getattr(module, _FLOOR_ATTR, None)
    if state is not None:
        return state
    state = {
        "max_memory_allocated": module.max_memory_allocated,
        "max_memory_reserved": module.max_memory_reserved,
        "reset_peak_memory_stats": module.reset_peak_memory_stats,
        "floor": defaultdict(lambda: {"max_memory_allocated": 0, "max_memory_reserved": 0}),
    }

    def reader(name: str) -> Callable[..., int]:
        def read(device: Any = None) -> int:
            return max(state["floor"][_device_index(module, device)][name], state[name](device))

        read.__doc__ = f"{name}, kept a lifetime peak across verl-prefix's per-phase resets."
        return read

    def reset(device: Any = None) -> None:
        state["floor"].pop(_device_index(module, device), None)
        state["reset_peak_memory_stats"](device)

    module.max_memory_allocated = reader("max_memory_allocated")
    module.max_memory_reserved = reader("max_memory_reserved")
    module.reset_peak_memory_stats = reset
    setattr(module, _FLOOR_ATTR, state)
    return state


class PhaseMeter:
    """Accumulates time, peaks and tokens per phase over one ``forward_backward_batch`` call.

    ``model``: counts what checkpointed layers rematerialise in backward (see ``SavedBytes``)."""

    def __init__(self, device: torch.device, model: nn.Module | None = None) -> None:
        self.device = device
        self.model = model
        self.seconds: dict[str, float] = defaultdict(float)
        self.peak_device_mib: dict[str, float] = defaultdict(float)
        self.peak_rss_mib: dict[str, float] = defaultdict(float)
        self.saved_mib: dict[str, float] = defaultdict(float)
        self.held_saved_mib = 0.0  # prefix saved bytes of the current group, live until phase C
        self.peak_held_saved_mib = 0.0
        self.peak_prefix_kv_mib = 0.0
        self.peak_prefix_leaves_mib = 0.0
        self.counts: dict[str, float] = defaultdict(float)  # e.g. prefix/phase_b_attention/merged
        self._accelerator = device.type in ("cuda", "npu")
        self._module = getattr(torch, device.type) if self._accelerator else None
        self._pending: list[tuple[str, Any, Any]] = []  # (phase, start event, end event), read in metrics()

    def _reset_peak(self) -> None:
        """Reset the allocator's peak for this phase, first lifting the floor other readers see."""
        state = _keep_lifetime_peaks(self._module)
        floor = state["floor"][_device_index(self._module, self.device)]
        for name in ("max_memory_allocated", "max_memory_reserved"):
            floor[name] = max(floor[name], state[name](self.device))
        state["reset_peak_memory_stats"](self.device)

    def _event(self) -> Any:
        event = self._module.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def phase(self, name: str) -> Iterator[SavedBytes]:
        module = self._module
        if module is not None:
            self._reset_peak()
            start_event = self._event()
        saved = SavedBytes(self.model)
        start = time.perf_counter()
        try:
            with saved.counting():
                yield saved
        finally:
            if module is not None:
                self._pending.append((name, start_event, self._event()))
                self.seconds[name] += 0.0  # the phase ran; its time arrives in metrics()
                self.peak_device_mib[name] = max(
                    self.peak_device_mib[name], self._unwrapped("max_memory_allocated")(self.device) / _MIB
                )
            else:
                self.seconds[name] += time.perf_counter() - start
            self.peak_rss_mib[name] = max(self.peak_rss_mib[name], psutil.Process().memory_info().rss / _MIB)
            self._account_saved(name, saved.bytes / _MIB, saved.recompute_bytes / _MIB)

    def _unwrapped(self, name: str) -> Callable[..., int]:
        return _keep_lifetime_peaks(self._module)[name]

    def _read_events(self) -> None:
        """Add the recorded phases' device times: one synchronisation for all of them."""
        if not self._pending:
            return
        self._module.synchronize(self.device)
        for name, start, end in self._pending:
            self.seconds[name] += start.elapsed_time(end) / 1000.0
        self._pending.clear()

    def count(self, key: str, n: float = 1.0) -> None:
        """Add ``n`` to a counter reported as metric ``key`` (e.g. micro-batches per phase-B attention)."""
        self.counts[key] += n

    def note_prefix_kv(self, tensors: list[torch.Tensor]) -> None:
        """Record the size of a group's prefix cache (called once per group after phase A); a tensor that
        several layers share (KV-shared layers) counts once."""
        distinct = {id(t): t for t in tensors}.values()
        mib = sum(t.numel() * t.element_size() for t in distinct) / _MIB
        self.peak_prefix_kv_mib = max(self.peak_prefix_kv_mib, mib)

    def note_prefix_leaves(self, kv: list[torch.Tensor], leaves: list[torch.Tensor]) -> None:
        """Record what a training group's dK/dV leaves hold beside its prefix K/V (once per group, before
        phase B): each leaf held as a copy (fp32 leaves over bf16 K/V; none when the dtypes agree and the
        leaf shares the K/V's storage) plus its gradient, the fp32 dK/dV accumulated through phase B."""
        pairs = {id(leaf): (t, leaf) for t, leaf in zip(kv, leaves)}.values()  # a shared leaf counts once
        copies = sum(
            leaf.numel() * leaf.element_size()
            for t, leaf in pairs
            if leaf.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        )
        grads = sum(leaf.numel() * leaf.element_size() for _, leaf in pairs if leaf.requires_grad)
        self.peak_prefix_leaves_mib = max(self.peak_prefix_leaves_mib, (copies + grads) / _MIB)

    def _account_saved(self, name: str, mib: float, recompute_mib: float = 0.0) -> None:
        """``mib`` is held from the phase's forward to its backward; ``recompute_mib`` on top of it
        while backward rematerialises the largest checkpointed layer."""
        total = mib + recompute_mib
        if name == "A":
            self.held_saved_mib = mib
            self.saved_mib["A"] = max(self.saved_mib["A"], total)
        elif name == "C":  # what phase C saves itself (recompute's prefix graph; one chunk's with chunks)
            self.held_saved_mib = 0.0
            self.saved_mib["C"] = max(self.saved_mib["C"], total)
        else:
            self.saved_mib[name] = max(self.saved_mib[name], total)
        held = total + (self.held_saved_mib if name == "B" else 0.0)
        self.peak_held_saved_mib = max(self.peak_held_saved_mib, held)

    def metrics(
        self, logical_tokens: int, physical_tokens: int, phases: Sequence[str] | None = None
    ) -> dict[str, float]:
        """``phases``: report these even where they did not run (zeros). verl averages a key over the ranks
        that report it, so every rank must report the same phases for the means to add up. On CUDA/NPU
        this is the mini-batch's one device synchronisation (the phases' events are read here)."""
        self._read_events()
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
        # the same peaks in verl's unit (GiB, as its perf/max_memory_allocated_gb): the largest phase's
        out["prefix/max_rss_gb"] = max(self.peak_rss_mib.values(), default=0.0) / 1024.0
        if self._accelerator:
            out["prefix/max_memory_allocated_gb"] = max(self.peak_device_mib.values(), default=0.0) / 1024.0
        if "prefix/time_s/A" in out:
            out["prefix/max_prefix_kv_mib"] = self.peak_prefix_kv_mib
        if "prefix/time_s/C" in out:
            out["prefix/max_prefix_kv_leaves_mib"] = self.peak_prefix_leaves_mib
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

    def note_prefix_leaves(self, kv: list[torch.Tensor], leaves: list[torch.Tensor]) -> None:
        pass
