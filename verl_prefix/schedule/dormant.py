"""Dormant-prefix memory policies: where a group's phase-A graph waits while its suffixes run (phase B).

``keep`` holds phase A's graph (every activation it saved for backward) on the device from A to C.
``recompute`` runs phase A without a graph (no_grad: only the K/V, and the MoE router-probability sums,
are kept as boundary tensors), then phase C re-runs the prefix forward with grad, checks that it gives
back the K/V phase B attended to, and backpropagates the accumulated dK/dV through it: one more prefix
forward, and only the K/V sit in memory during phase B. ``offload`` (``HostOffload``) moves phase A's
activations to host memory as autograd saves them (each storage once; parameters, buffers and the K/V
stay) and brings them back one decoder layer at a time during phase C, the next layer's copy overlapping
the current layer's backward: about nothing of the graph on the device in phase B, about two layers' worth
in phase C. ``auto`` (``choose_policy``) picks per group from a model-shape estimate (``GraphEstimate``):
keep where the graph fits a byte budget, else whichever of offload and recompute lowers the peak.

Forward-only passes (``infer_group``) keep only the K/V already: no policy applies there.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from verl_prefix.schedule.kv.container import PrefixKV

logger = logging.getLogger(__name__)

POLICIES = ("keep", "offload", "recompute")  # cheapest first: what ``auto`` tries in this order
KNOB_VALUES = ("keep", "recompute", "offload", "auto")
_MIB = 1024.0**2


def validate_policy(policy: object, budget_bytes: object = None) -> str:
    """The knob's value, or a ``ValueError`` a user can act on (``auto`` needs a budget)."""
    if policy not in KNOB_VALUES:
        raise ValueError(f"dormant_prefix={policy!r} is not supported; choose one of {KNOB_VALUES}")
    if budget_bytes is not None and (
        isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1
    ):
        raise ValueError(
            f"dormant_prefix_budget_bytes must be a positive integer (bytes per device), got {budget_bytes!r}"
        )
    if policy == "auto" and budget_bytes is None:
        raise ValueError(
            "dormant_prefix=auto needs dormant_prefix_budget_bytes (bytes per device the prefix graph may hold)"
        )
    return policy


def refuse_offload_on(device: torch.device) -> None:
    """``offload`` moves saved tensors from the device to host memory; a CPU run has nowhere to move them."""
    if device.type == "cpu":
        raise ValueError(
            "dormant_prefix=offload moves phase A's saved tensors from the accelerator to pinned host memory; "
            "this run's device is the CPU, where they already are. Use keep or recompute."
        )


class DormantStats:
    """What ran per group and what it held, as ``prefix/`` metrics (per mini-batch, summed over groups)."""

    def __init__(self) -> None:
        self.policies: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.held_in_b: dict[str, int] = defaultdict(int)  # policy -> max bytes held for backward during B
        self.offloaded_bytes = 0
        self.restored_bytes = 0
        self.offload_resident: dict[str, int] = defaultdict(int)  # phase -> most graph bytes left on the device
        self.host_slab_bytes = 0  # most host memory the offload pool held (its slabs, leased or free)
        self.recompute_max_diff = 0.0

    def note_group(self, policy: str, reason: str) -> None:
        self.policies[policy] += 1
        self.reasons[reason] += 1

    def note_held_in_b(self, policy: str, nbytes: int) -> None:
        self.held_in_b[policy] = max(self.held_in_b[policy], nbytes)

    def note_offload(self, store: HostOffload) -> None:
        """One offloaded group's store after its phase C: bytes moved each way, and what stayed resident in
        phase B (restored early, or a moved storage something else still held) and in phase C."""
        self.offloaded_bytes += store.offloaded_bytes
        self.restored_bytes += store.restored_bytes
        resident_b = store.peak_resident["B"] + store.unfreed_in_b
        self.offload_resident["B"] = max(self.offload_resident["B"], resident_b)
        self.offload_resident["C"] = max(self.offload_resident["C"], store.peak_resident["C"])
        self.host_slab_bytes = max(self.host_slab_bytes, store.lease.pool.peak_bytes)

    def metrics(self) -> dict[str, float]:
        """``prefix/policy/<name>`` groups per policy, ``prefix/policy_reason/<why>``, and per policy the
        largest ``prefix/max_saved_for_backward_held_in_B_mib/<name>``: phase A's graph still held
        plus the suffix micro-batch's own (what a policy exists to shrink). With offload, the bytes moved
        out and back, the most of the graph left on the device in phases B and C
        (``prefix/max_offload_resident_mib/<phase>``) and the most host memory its slabs held
        (``prefix/offload_host_mib``, ``PinnedPool``)."""
        out: dict[str, float] = {f"prefix/policy/{p}": float(n) for p, n in self.policies.items()}
        out.update({f"prefix/policy_reason/{r}": float(n) for r, n in self.reasons.items()})
        out.update({f"prefix/max_saved_for_backward_held_in_B_mib/{p}": b / _MIB for p, b in self.held_in_b.items()})
        if self.policies.get("offload"):
            out["prefix/offloaded_mib"] = self.offloaded_bytes / _MIB
            out["prefix/offload_restored_mib"] = self.restored_bytes / _MIB
            out["prefix/offload_host_mib"] = self.host_slab_bytes / _MIB
            for phase in ("B", "C"):
                out[f"prefix/max_offload_resident_mib/{phase}"] = self.offload_resident[phase] / _MIB
        if self.policies.get("recompute"):
            out["prefix/max_recompute_kv_diff"] = self.recompute_max_diff
        return out


class Offloaded:
    """One device storage phase A saved for backward, moved to host memory once (``HostOffload``).

    Held only by the handles autograd keeps for the saved tensors that view it: its host copy until phase
    C restores it, then its device copy until the last backward node that saved it has run and autograd
    has dropped the handles (and with them this object, which releases the device copy)."""

    __slots__ = ("__weakref__", "device", "event", "group", "host", "key", "nbytes", "version")

    def __init__(self, key: int, nbytes: int, version: int, group: int) -> None:
        self.key = key  # the source storage's identity (its address, held by the store's weak reference)
        self.nbytes = nbytes
        self.version = version  # the source's version counter when it was copied
        self.group = group  # the pack group (decoder layer) whose backward first needs it
        self.host: torch.Tensor | None = None
        self.device: torch.Tensor | None = None
        self.event: object = None


class _Handle:
    """What autograd holds for one saved tensor: the storage's entry and the view into it."""

    __slots__ = ("dtype", "entry", "offset", "size", "stride")

    def __init__(self, entry: Offloaded, tensor: torch.Tensor) -> None:
        self.entry = entry
        self.dtype, self.offset = tensor.dtype, tensor.storage_offset()
        self.size, self.stride = tensor.size(), tensor.stride()


def _device_storage(tensor: torch.Tensor, device: torch.device) -> torch.UntypedStorage | None:
    """The storage a saved tensor views, if it is a plain strided tensor on ``device``; else None (left alone)."""
    if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.layout != torch.strided:
        return None  # tensor subclasses (DTensor, nested, fake) own no storage of their own
    if tensor.device.type != device.type or (device.index is not None and tensor.device.index != device.index):
        return None
    if tensor.is_conj() or tensor.is_neg():
        return None
    storage = tensor.untyped_storage()
    return storage if storage.nbytes() > 0 else None


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (the first ``ModuleList`` as long as ``num_hidden_layers``), or []."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    count = int(getattr(text, "num_hidden_layers", 0) or 0)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and count and len(module) == count:
            return list(module)
    return []


_ALIGN = 512  # bytes: where each copy starts in a slab
SLAB_BYTES = 64 * 2**20


def _round_up(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class PinnedPool:
    """The host memory ``offload`` copies into: slabs that each group's store leases and gives back after its
    phase C, reused group after group, and released (unpinned and freed) at the end of each mini-batch.

    One pinned buffer per saved storage from ``torch.empty(pin_memory=True)`` went through torch's caching host
    allocator, which rounds each to a power of two and keeps every block for the life of the process: up to 2x
    the offloaded bytes per rank, never returned (8 ranks a node, beside vLLM's sleep-mode copies). Here slabs
    are ordinary host tensors of exact sizes, page-locked with ``cudaHostRegister`` (``pin``; the CPU stand-in
    leaves them pageable) and unregistered on ``release``. A store fills its slabs in order (``PinnedLease``);
    a storage above a quarter of a slab gets a slab of its own size, so a slab wastes under a quarter of itself.
    ``held_bytes``: slabs held now (leased or free); ``peak_bytes``: the most held since the last release."""

    def __init__(self, pin: bool = True, slab_bytes: int = SLAB_BYTES) -> None:
        self.pin, self.slab_bytes = pin, slab_bytes
        self.held_bytes = 0
        self.peak_bytes = 0
        self._free: list[torch.Tensor] = []
        self._forget: dict[int, weakref.finalize] = {}  # slab address -> unpins and uncounts it once

    @property
    def free_slabs(self) -> tuple[torch.Tensor, ...]:
        """The slabs no store holds now (smallest first)."""
        return tuple(self._free)

    def take(self, nbytes: int) -> torch.Tensor:
        """A slab of at least ``nbytes``: the smallest free one that fits, else a new one of ``nbytes``."""
        for i, slab in enumerate(self._free):  # kept smallest first
            if slab.numel() >= nbytes:
                return self._free.pop(i)
        slab = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin:
            error = int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), nbytes, 1))  # 1: portable
            if error:
                raise RuntimeError(f"dormant_prefix=offload: cudaHostRegister of {nbytes} bytes failed ({error})")
        # a slab a failed group dropped without giving it back is unpinned before its memory is freed (registered
        # memory freed as it is would stay registered to the driver, and the next registration there would fail)
        self._forget[slab.data_ptr()] = weakref.finalize(slab, self._unpin, slab.data_ptr(), nbytes)
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return slab

    def give_back(self, slabs: Sequence[torch.Tensor]) -> None:
        """A store is done with ``slabs`` (its copies have completed): free for the next store."""
        self._free = sorted([*self._free, *slabs], key=torch.Tensor.numel)

    def release(self) -> int:
        """Unpin and free every slab no store holds; returns the bytes released."""
        released = sum(slab.numel() for slab in self._free)
        for slab in self._free:
            self._forget.pop(slab.data_ptr())()
        self._free = []
        self.peak_bytes = self.held_bytes
        return released

    def _unpin(self, address: int, nbytes: int) -> None:
        self._forget.pop(address, None)
        if self.pin:
            torch.cuda.cudart().cudaHostUnregister(address)
        self.held_bytes -= nbytes


class PinnedLease:
    """One store's slabs: copies are laid out one after another (``_ALIGN``-aligned) in the current slab."""

    def __init__(self, pool: PinnedPool) -> None:
        self.pool = pool
        self.slabs: list[torch.Tensor] = []
        self._current: torch.Tensor | None = None
        self._offset = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory (a uint8 view into a slab) this lease holds until ``close``."""
        if nbytes > self.pool.slab_bytes // 4:  # its own slab: no large tail left unused
            self.slabs.append(self.pool.take(_round_up(nbytes)))
            return self.slabs[-1][:nbytes]
        if self._current is None or self._offset + nbytes > self._current.numel():
            self._current = self.pool.take(self.pool.slab_bytes)
            self.slabs.append(self._current)
            self._offset = 0
        view = self._current[self._offset : self._offset + nbytes]
        self._offset = _round_up(self._offset + nbytes)
        return view

    def close(self) -> None:
        slabs, self.slabs, self._current = self.slabs, [], None
        self.pool.give_back(slabs)


_POOLS: dict[bool, PinnedPool] = {}


def process_pool(pin: bool) -> PinnedPool:
    """This process's pool (pinned for accelerators; pageable for the CPU stand-in): shared by every store."""
    if pin not in _POOLS:
        _POOLS[pin] = PinnedPool(pin=pin)
    return _POOLS[pin]


def release_pinned_memory() -> int:
    """End of a mini-batch: unpin and free the offload slabs no store holds (bytes released)."""
    return sum(pool.release() for pool in _POOLS.values())


class HostOffload:
    """``offload``'s saved-tensor store: phase A's activations go to host memory as autograd saves them,
    each storage once, and phase C brings them back one decoder layer at a time.

    - **What moves** (``stays``): a saved tensor's *storage*, compared by identity, not by type. A storage
      the device keeps anyway stays: a parameter's (``linear`` saves ``weight.t()``, a view; under FSDP2
      the unsharded parameters, collected by forward pre-hooks as each module runs), a buffer's, and the
      prefix K/V's (phase B attends to them), the earlier chunks' K/V leaves a chunk reads (they are
      written through ``.data`` after being saved, so a copy would go stale), and the model call's own
      inputs (token ids, positions: the caller holds them). A storage saved again, unchanged (same version
      counter), maps to its first copy plus the view's offset, size and strides: nothing is copied twice,
      with or without chunks.
    - **When it moves back**: every pack is tagged with the decoder layer running (a forward pre-hook on
      each layer and on the model opens a new group). Backward runs the groups in reverse; the first
      unpack of a group starts restoring the group backward reaches next, so its copy overlaps this
      one's backward. A restored storage lives until autograd drops the last handle to it.
    - **Copies**: on an accelerator, pinned host memory (slabs leased from ``PinnedPool``, given back by
      ``close`` after phase C) and a side stream (as ``save_on_cpu`` pins; the
      device-to-host copy waits for the compute stream and ``record_stream`` keeps its source until read;
      unpack waits on the restore's event). On the CPU (the stand-in the tests and ``dormant_memory`` use)
      "device" and "host" are both the CPU and the copies are synchronous clones; the scheduling, the
      bookkeeping and the order are the same code.

    Bookkeeping, per store (one group): ``offloaded_bytes`` and ``restored_bytes`` moved each way,
    ``resident_bytes`` restored and not yet released, its peak per phase (``peak_resident``),
    ``unfreed_in_b`` (device bytes of moved storages something else still held when phase C began; the
    store itself holds none), ``stayed`` (the saved storages left in place, by key), and with ``record`` a
    ``log`` of every transition:
    ``(phase, "offload" | "resave" | "restore" | "release", storage key, bytes, group, resident bytes after)``
    ("resave": a later layer saved a moved storage again, e.g. RoPE's cos/sin, which every layer saves; it is
    restored with the last layer that saved it and released after the first).
    """

    def __init__(self, device: torch.device, record: bool = False, pool: PinnedPool | None = None) -> None:
        self.device = device
        accel = device.type in ("cuda", "npu", "xpu")
        self.lease = PinnedLease(pool if pool is not None else process_pool(pin=device.type == "cuda"))
        self._module = torch.get_device_module(device.type) if accel else None
        self._stream = self._module.Stream(device=device) if accel else None
        self.phase = "A"
        self.offloaded_bytes = 0
        self.restored_bytes = 0
        self.resident_bytes = 0
        self.peak_resident = {"A": 0, "B": 0, "C": 0}
        self.unfreed_in_b = 0
        self.stayed: dict[int, int] = {}  # storage key -> bytes of the saved storages left in place
        self.log: list[tuple] | None = [] if record else None
        self._kept: dict[int, StorageWeakRef] = {}  # storages that stay (parameters, buffers, K/V)
        self._moved: dict[int, tuple[weakref.ref, StorageWeakRef]] = {}  # storage key -> (entry, source)
        self._groups: list[list[weakref.ref]] = [[]]  # entries per pack group, until restored
        self._prefetched: set[int] = set()
        self._context: object = None  # the prefix context (capture) of the forward running
        self._layer = -1

    # -- what stays -------------------------------------------------------------------------------------

    def _keep(self, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        try:
            ref = StorageWeakRef(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError):  # a sharded DTensor parameter: its local shard is not saved
            return
        self._kept[ref.cdata] = ref

    def stays(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> bool:
        """Whether a saved tensor is left where it is: its storage is one the device keeps anyway."""
        kv = getattr(self._context, "kv", None)
        if kv is not None and 0 <= self._layer < len(kv.keys):  # this layer's K/V, captured before attention saves them
            self._keep(kv.keys[self._layer])
            self._keep(kv.values[self._layer])
        key = StorageWeakRef(storage).cdata
        ref = self._kept.get(key)
        if isinstance(tensor, nn.Parameter) or (ref is not None and not ref.expired()):
            self.stayed[key] = storage.nbytes()
            return True
        return False

    def _keep_module(self, module: nn.Module, args: object) -> None:
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            self._keep(tensor)  # after FSDP2's pre-forward: the unsharded parameters

    def _enter(self, layer: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._groups.append([])
        self._layer = layer
        if layer < 0:  # the model's own inputs (token ids, positions): the caller holds them
            for tensor in (*args, *kwargs.values()):
                if isinstance(tensor, torch.Tensor):
                    self._keep(tensor)
        context = kwargs.get("prefix_ctx")
        if context is not None and context is not self._context:
            self._context = context
            served = getattr(getattr(context, "serve", None), "prefix", None)  # a chunk's earlier K/V leaves
            for tensor in served.tensors() if served is not None else ():
                self._keep(tensor)

    # -- moving out -------------------------------------------------------------------------------------

    def already_moved(self, storage: torch.UntypedStorage, tensor: torch.Tensor) -> Offloaded | None:
        """The entry of an earlier save of this storage, if it is unchanged since (same version counter)."""
        found = self._moved.get(StorageWeakRef(storage).cdata)
        entry = found[0]() if found is not None else None
        if entry is None or found[1].expired() or entry.version != tensor._version:
            return None
        return entry

    def pack(self, tensor: torch.Tensor) -> object:
        storage = _device_storage(tensor, self.device)
        if storage is None or self.stays(tensor, storage):
            return tensor
        group = len(self._groups) - 1
        entry = self.already_moved(storage, tensor)
        if entry is None:
            source = StorageWeakRef(storage)
            entry = Offloaded(source.cdata, storage.nbytes(), tensor._version, group)
            entry.host = self.copy_to_host(storage)
            self.offloaded_bytes += entry.nbytes
            self._moved[source.cdata] = (weakref.ref(entry), source)
            self._groups[group].append(weakref.ref(entry))
            self._note("offload", entry)
        elif entry.group != group:  # saved again in a later layer: backward needs it there first
            entry.group = group
            self._groups[group].append(weakref.ref(entry))
            self._note("resave", entry)
        return _Handle(entry, tensor)

    def copy_to_host(self, storage: torch.UntypedStorage) -> torch.Tensor:
        source = _as_bytes(storage)
        host = self.lease.take(source.numel())
        if self._stream is None:
            return host.copy_(source)
        self._stream.wait_stream(self._module.current_stream(self.device))
        with self._module.stream(self._stream):
            host.copy_(source, non_blocking=True)
        source.record_stream(self._stream)  # the allocator keeps the block until the copy has read it
        return host

    # -- moving back ------------------------------------------------------------------------------------

    def unpack(self, handle: object) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle
        entry = handle.entry
        if entry.device is None:  # backward reached a group nothing prefetched (its first, or out of order)
            self._restore(entry.group)
        self.prefetch_after(entry.group)
        data = self.wait(entry)
        view = torch.empty(0, dtype=handle.dtype, device=data.device)
        return view.set_(data.untyped_storage(), handle.offset, handle.size, handle.stride)

    def prefetch_after(self, group: int) -> None:
        """Backward has reached ``group``: start restoring the group it reaches next (the nearest earlier
        one with entries still alive), so that the copy overlaps this group's backward."""
        if group in self._prefetched:
            return
        self._prefetched.add(group)
        for earlier in range(group - 1, -1, -1):
            if self._restore(earlier):
                return

    def _restore(self, group: int) -> bool:
        refs, self._groups[group] = self._groups[group], []
        restored = False
        for ref in refs:
            entry = ref()
            if entry is None or entry.device is not None or entry.group != group:
                continue  # dead (its graph never reached), already restored, or regrouped later
            entry.device, entry.event = self.copy_to_device(entry.host)
            entry.host = None
            weakref.finalize(entry, self._release, entry.key, entry.nbytes, group)
            self.resident_bytes += entry.nbytes
            self.restored_bytes += entry.nbytes
            self._note("restore", entry)
            restored = True
        return restored

    def copy_to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object]:
        if self._stream is None:
            return host.clone(), None
        with self._module.stream(self._stream):
            data = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            data.copy_(host, non_blocking=True)
            event = self._module.Event()
            event.record(self._stream)
        return data, event

    def wait(self, entry: Offloaded) -> torch.Tensor:
        """The entry's device copy, usable on the current stream."""
        if entry.event is not None:
            current = self._module.current_stream(self.device)
            current.wait_event(entry.event)
            entry.device.record_stream(current)
        return entry.device

    def _release(self, key: int, nbytes: int, group: int) -> None:
        self.resident_bytes -= nbytes
        self._note("release", None, key, nbytes, group)

    def _note(self, what: str, entry: Offloaded | None, key: int = 0, nbytes: int = 0, group: int = -1) -> None:
        if entry is not None:
            key, nbytes, group = entry.key, entry.nbytes, entry.group
        self.peak_resident[self.phase] = max(self.peak_resident[self.phase], self.resident_bytes)
        if self.log is not None:
            self.log.append((self.phase, what, key, nbytes, group, self.resident_bytes))

    # -- phases -----------------------------------------------------------------------------------------

    @contextmanager
    def saving(self, model: nn.Module | None = None) -> Iterator[HostOffload]:
        """Phase A: the saved-tensor hooks, and (given the model) what stays and the layer groups."""
        with ExitStack() as stack:
            if model is not None:
                for tensor in (*model.parameters(), *model.buffers()):
                    self._keep(tensor)
                for module in model.modules():
                    if next(module.parameters(recurse=False), None) is not None:
                        stack.callback(module.register_forward_pre_hook(self._keep_module).remove)
                enter = functools.partial(self._enter, -1)  # a forward (a chunk) starts: embeddings first
                stack.callback(model.register_forward_pre_hook(enter, with_kwargs=True).remove)
                for index, layer in enumerate(decoder_layers(model)):
                    enter = functools.partial(self._enter, index)
                    stack.callback(layer.register_forward_pre_hook(enter, with_kwargs=True).remove)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack))
            yield self
        self._kept, self._context = {}, None
        self.phase = "B"
        self._note("phase", None)

    def close(self) -> None:
        """Phase C is done: once this store's copies have completed, its host slabs go back to the pool."""
        if self._stream is not None:
            self._stream.synchronize()  # once per group: the last restores may still read the slabs
        self.lease.close()

    def begin_phase_c(self) -> None:
        """Phase C starts (idempotent): measure what phase B really left on the device."""
        if self.phase == "C":
            return
        self.unfreed_in_b = sum(
            entry.nbytes
            for ref, source in self._moved.values()
            if (entry := ref()) is not None and not source.expired()
        )
        self.phase = "C"


def default_store(device: torch.device) -> HostOffload:
    """The production store: refuses a CPU device (nothing to move to). Tests and ``dormant_memory`` build
    ``HostOffload`` on the CPU directly: the stand-in that runs the same scheduling with synchronous copies."""
    refuse_offload_on(device)
    return HostOffload(device)


def kv_difference(
    phase_a: PrefixKV, recomputed: PrefixKV, also: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
) -> float:
    """Largest difference between the boundary tensors phase B used and those phase C recomputed,
    relative to the largest phase-A magnitude (one device sync per group). Router top-k counts must
    match exactly (they are integers): any difference there is reported as infinite. ``also``: more
    (phase A's, recomputed) pairs held to the same test (a loss-carrying tree node's log-probs and entropies)."""
    if phase_a.router_stats is not None and not torch.equal(
        phase_a.router_stats.counts, recomputed.router_stats.counts
    ):
        return float("inf")
    diffs, scales = [], []
    for a, b in [*zip(phase_a.tensors(), recomputed.tensors()), *also]:
        if a.shape != b.shape:
            return float("inf")
        if a.numel() == 0:  # a block without a token mixer (``schedule.models.mamba``): an empty state
            continue
        diffs.append((a.detach() - b.detach()).abs().max())
        scales.append(a.detach().abs().max())
    return (torch.stack(diffs).max() / torch.stack(scales).max().clamp_min(1e-30)).item()


def recompute_tolerance(dtype: torch.dtype) -> float:
    """A few rounding units of the K/V dtype: a deterministic kernel gives 0; a shifted position, a
    different mask or another prefix gives O(1)."""
    return 8 * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


@dataclass
class Dormant:
    """One group's policy (never ``auto``: ``choose_policy`` resolves that) and how it runs.

    ``store_factory(device)`` builds ``offload``'s saved-tensor store (injectable for tests);
    ``check_recompute`` raises if phase C's recomputed K/V are not the ones phase B attended to.
    The executor calls ``phase_a`` around phase A, ``phase_c_prefix`` before each backward of phase C
    (one per chunk with a chunked prefix) and ``after_phase_c`` once phase C is done.
    """

    policy: str = "keep"
    reason: str = "configured"
    stats: DormantStats | None = None
    store_factory: Callable[[torch.device], HostOffload] = default_store
    check_recompute: bool = True
    _store: HostOffload | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"a group's dormant policy must be one of {POLICIES}, got {self.policy!r}")

    def phase_a(self, model: nn.Module, device: torch.device) -> object:
        """The context phase A's prefix forward runs in under this policy (``model``: offload hooks its
        modules for the layer groups and the parameters that stay)."""
        if self.stats is not None:
            self.stats.note_group(self.policy, self.reason)
        if self.policy == "recompute":
            return torch.no_grad()
        if self.policy == "offload":
            self._store = self.store_factory(device)
            return self._store.saving(model)
        return nullcontext()

    def note_held_in_b(self, phase_a_bytes: int, micro_batch_bytes: int) -> None:
        if self.stats is not None:
            self.stats.note_held_in_b(self.policy, phase_a_bytes + micro_batch_bytes)

    def recompute_mismatch(
        self, prefix: PrefixKV, recomputed: PrefixKV, also: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
    ) -> str | None:
        """The error when phase C's recomputed boundary tensors (and ``also``'s pairs) are not the ones phase B
        used, else None (the largest difference goes to the stats either way)."""
        diff = kv_difference(prefix, recomputed, also)
        if self.stats is not None:
            self.stats.recompute_max_diff = max(self.stats.recompute_max_diff, diff)
        tolerance = recompute_tolerance(prefix.tensors()[0].dtype)  # layer 0's K (or conv context)
        if diff <= tolerance:
            return None
        return (
            f"dormant_prefix=recompute: phase C's recomputed prefix K/V differ from phase A's by {diff:.3e} "
            f"(relative; tolerance {tolerance:.1e}): the prefix forward is not deterministic here, so the "
            "gradient would not be the one phase B's losses define. Use dormant_prefix=keep or offload."
        )

    def settle_recompute(self, mismatch: str | None) -> None:
        """Raise a recompute mismatch. Called on every recompute, mismatch or not, so that a data-parallel
        engine can agree first (``verl_prefix.backend.distributed.once.AgreedDormant``): a mismatch on one rank only (an
        MoE top-k flip, a nondeterministic kernel) must stop every rank before phase C's backward."""
        if mismatch is not None:
            raise RuntimeError(mismatch)

    def phase_c_prefix(
        self,
        prefix: PrefixKV,
        rerun: Callable[[], PrefixKV],
        also: Callable[[PrefixKV], Sequence[tuple[torch.Tensor, torch.Tensor]]] | None = None,
    ) -> PrefixKV:
        """The graph-attached prefix phase C backpropagates through: phase A's own, or (``recompute``)
        ``rerun()`` under grad, checked against what phase B attended to. ``also(recomputed)``: more
        (phase A's, recomputed) pairs the check covers, taken under grad (a tree node's log-probs)."""
        if self._store is not None:
            self._store.begin_phase_c()  # the store restores layer by layer as backward unpacks
        if self.policy != "recompute":
            return prefix
        with torch.enable_grad():
            recomputed = rerun()
            pairs = also(recomputed) if also is not None else ()
        if self.check_recompute:
            self.settle_recompute(self.recompute_mismatch(prefix, recomputed, pairs))
        return recomputed

    def after_phase_c(self) -> None:
        """Phase C is done: offload's figures go to the stats (the store holds no tensor by now)."""
        store, self._store = self._store, None
        if store is not None:
            store.close()
        if store is not None and self.stats is not None:
            self.stats.note_offload(store)


@dataclass(frozen=True)
class GraphEstimate:
    """A model-shape estimate of phase A's saved activations, per decoder layer (the last one cut short
    by early exit), in bytes of the compute dtype."""

    layer_bytes: tuple[int, ...]

    @property
    def total(self) -> int:
        """``keep``'s dormant graph (and what ``recompute`` rebuilds whole in phase C)."""
        return sum(self.layer_bytes)

    @property
    def offload_resident(self) -> int:
        """What ``offload`` holds of it at most in phase C: the layer backward runs through plus the one
        being prefetched (the largest two adjacent layers)."""
        pairs = [a + b for a, b in zip(self.layer_bytes, self.layer_bytes[1:])]
        return max(pairs, default=self.total)


def compute_dtype(model: nn.Module, autocast_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype activations are computed in: a half-precision autocast dtype where autocast runs (verl's
    FSDP engines autocast to the mixed-precision ``param_dtype``), else the parameters' (the master
    weights' dtype is not the activations' under mixed precision)."""
    if autocast_dtype is not None and autocast_dtype.is_floating_point and autocast_dtype.itemsize < 4:
        return autocast_dtype
    return next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)


def estimate_prefix_graph(
    model: nn.Module, prefix_len: int, dtype: torch.dtype | None = None, logit_positions: int = 0, context: int = 0
) -> GraphEstimate:
    """A model-shape estimate of the activations phase A saves for backward (``keep``'s dormant graph,
    parameters excluded: they are held anyway), per layer, for a phase A with early exit. ``dtype``: the
    compute dtype (``compute_dtype``; default the parameters'). ``logit_positions`` > 0: a phase A without
    early exit that runs the LM head over its last that many positions (a loss-carrying tree node): the last
    layer whole, plus the final norm and the logits with their log-softmax (rougher: not fitted). ``context``:
    tokens before these the forward attends to (a tree node's ancestors), widening eager attention's scores.

    Per prefix token, a Llama-style decoder layer (RMSNorms, q/k/v/o, RoPE, SwiGLU MLP) saves about
    ``3 q_dim + 3 kv_dim + 4 intermediate`` values of the compute dtype and, per RMSNorm, its input in fp32
    (HF's RMSNorm upcasts) plus its output (``4 + size`` bytes per element): two ``hidden``-wide norms, and
    q/k norms (Qwen3) over ``q_dim + kv_dim``; early exit leaves the last layer at its input norm, the q/k/v
    projections and half the q/k norms. An MoE layer saves its router logits and each token's ``top_k``
    expert MLP inputs instead of a dense MLP's (rougher: not fitted). Eager attention adds ``heads * P * P``
    probabilities per full layer (fp32, plus their cast to a half-precision compute dtype). With gradient
    checkpointing each layer keeps only its input (``hidden``). ``tests/schedule/test_dormant_policies.py``
    checks the total within 25% of the counted saved activations of its tiny dense models in fp32 and bf16.
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = (dtype or compute_dtype(model)).itemsize
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    layers = int(text.num_hidden_layers)
    if getattr(model, "is_gradient_checkpointing", False):
        return GraphEstimate((prefix_len * hidden * size,) * layers)
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if experts:
        top_k = int(text.num_experts_per_tok)
        inter = int(getattr(text, "moe_intermediate_size", None) or text.intermediate_size)
        mlp = experts + top_k * (hidden + 4 * inter)
    else:
        mlp = 4 * int(text.intermediate_size)
    norm = 4 + size  # bytes per normalised element: the fp32 input and the output
    qk_norm = any(name.endswith("q_norm") for name, _ in model.named_modules())
    qk = (q_dim + kv_dim) * norm if qk_norm else 0
    full = 2 * hidden * norm + (3 * q_dim + 3 * kv_dim + mlp) * size + qk
    last = hidden * norm + 2 * (q_dim + kv_dim) * size + qk // 2
    quadratic = 0
    if (getattr(text, "_attn_implementation", None) or "eager") == "eager":
        quadratic = heads * prefix_len * (prefix_len + context) * (4 if size == 4 else 4 + size)
    if logit_positions > 0:
        vocab = int(text.vocab_size)
        head = hidden * norm * prefix_len + logit_positions * vocab * (size + 4)
        return GraphEstimate((full * prefix_len + quadratic,) * (layers - 1) + (full * prefix_len + quadratic + head,))
    return GraphEstimate((full * prefix_len + quadratic,) * (layers - 1) + (last * prefix_len,))


def estimate_prefix_graph_bytes(model: nn.Module, prefix_len: int, dtype: torch.dtype | None = None) -> int:
    """``estimate_prefix_graph(...).total``: keep's dormant graph in bytes."""
    return estimate_prefix_graph(model, prefix_len, dtype).total


def choose_policy(estimate: GraphEstimate, budget_bytes: int, device: torch.device) -> tuple[str, str]:
    """``auto``: ``keep`` where the estimated graph fits ``budget_bytes``, else a policy that lowers the peak.

    ``keep`` holds the whole graph from A to C. ``recompute`` holds none of it in phase B and rebuilds it
    whole in phase C (never above keep's). ``offload`` (accelerators only) holds none of it in phase B and
    about two layers of it in phase C (``GraphEstimate.offload_resident``): chosen only where that is below
    the whole graph, i.e. where it lowers the peak (not for a one-layer model), else recompute.
    Returns (policy, reason).
    """
    if estimate.total <= budget_bytes:
        return "keep", "fits_budget"
    if device.type == "cpu":
        return "recompute", "over_budget_cpu"
    if estimate.offload_resident < estimate.total:
        return "offload", "over_budget"
    return "recompute", "over_budget_offload_no_gain"
