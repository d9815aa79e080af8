"""``offload``'s CPU stand-in store for tests, and the residency claims read from its log.

``RecordingStore`` is ``HostOffload`` on the CPU with its transition log on (every offload, restore and
release with the bytes the store then holds on the "device"), plus an oracle of its own for claim (a): a
saved tensor that is a parameter or a view of one *by type* (``linear`` saves ``weight.t()``; FSDP2's
unsharded parameters are ``nn.Parameter`` too), checked at every pack that moved bytes. The store itself
decides by storage identity, so the oracle is an independent route. The negative controls subclass it with
one claim broken each.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from verl_prefix.schedule import dormant as D


def is_parameter_view(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


class RecordingStore(D.HostOffload):
    """The stand-in store with its log on; every instance is kept (one per offloaded group)."""

    instances: list[RecordingStore] = []

    def __init__(self, device: torch.device, pool: D.PinnedPool | None = None) -> None:
        super().__init__(device, record=True, pool=pool)
        self.parameter_bytes_moved = 0
        RecordingStore.instances.append(self)

    def pack(self, tensor: torch.Tensor) -> object:
        before = self.offloaded_bytes
        handle = super().pack(tensor)
        if self.offloaded_bytes > before and is_parameter_view(tensor):
            self.parameter_bytes_moved += self.offloaded_bytes - before
        return handle


class TypeOnlyStore(RecordingStore):
    """Negative control for (a): leaves only objects that *are* ``nn.Parameter`` (the old rule)."""

    def stays(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> bool:
        return isinstance(tensor, nn.Parameter)


class NoDedupeStore(RecordingStore):
    """Negative control for (b): copies a storage again each time it is saved."""

    def already_moved(self, storage: torch.UntypedStorage, tensor: torch.Tensor) -> D.Offloaded | None:
        return None


class AllAtOnceStore(RecordingStore):
    """Negative control for (c), phase C: the first unpack restores every group at once."""

    def prefetch_after(self, group: int) -> None:
        for earlier in range(group - 1, -1, -1):
            super().prefetch_after(earlier + 1)


class SourceKeepingStore(RecordingStore):
    """Negative control for (c), phase B: holds on to every device tensor it copied."""

    def copy_to_host(self, storage: torch.UntypedStorage) -> torch.Tensor:
        self.sources = [*getattr(self, "sources", []), storage]
        return super().copy_to_host(storage)


def storage_key(tensor: torch.Tensor) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(tensor.untyped_storage()).cdata


def claims(store: RecordingStore, model: nn.Module) -> dict[str, int]:
    """What the store's log says about the residency claims (all bytes):

    - ``parameter_bytes_moved``: (a), by the type oracle, plus any moved storage that is a parameter's now;
    - ``storages_moved_twice`` and ``restored_twice``: (b);
    - ``resident_in_b``: (c), what the store held restored during phase B plus the moved storages something
      else still kept alive when phase C began;
    - ``resident_in_c`` and ``bound_in_c``: (c), the most the store held during phase C, and the largest
      restored bytes of two groups backward reaches one after the other (the layer it runs and the one
      prefetched) plus the storages several layers saved (``shared``: RoPE's cos/sin, restored with the
      last layer that saved them and needed until the first).
    """
    params = set()
    for p in model.parameters():
        try:
            params.add(storage_key(p))
        except (RuntimeError, NotImplementedError):  # FSDP2's sharded DTensor: the oracle covers its unsharded views
            pass
    moved = Counter(key for _, what, key, *_ in store.log if what == "offload")
    restored = Counter(key for _, what, key, *_ in store.log if what == "restore")
    groups: Counter[int] = Counter()
    for _, what, _key, nbytes, group, _ in store.log:
        if what == "restore":
            groups[group] += nbytes
    order = [groups[g] for g in sorted(groups)]
    pairs = [a + b for a, b in zip(order, order[1:])] or order
    shared = {key: n for _, what, key, n, *_ in store.log if what == "resave"}
    return {
        "parameter_bytes_moved": store.parameter_bytes_moved
        + sum(n for _, what, key, n, *_ in store.log if what == "offload" and key in params),
        "storages_moved_twice": sum(1 for n in moved.values() if n > 1),
        "restored_twice": sum(1 for n in restored.values() if n > 1),
        "resident_in_b": store.peak_resident["B"] + store.unfreed_in_b,
        "resident_in_c": store.peak_resident["C"],
        "two_layers": max(pairs, default=0),
        "shared": sum(shared.values()),
        "bound_in_c": max(pairs, default=0) + sum(shared.values()),
        "restored": store.restored_bytes,
    }
