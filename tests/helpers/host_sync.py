"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode``: count the ops that would make the host wait for the
device on CUDA, by the aten ops a region dispatches (forward and backward).

On CUDA these block the host until the stream drains: a value read back (``item``/``tolist``:
``_local_scalar_dense``), a result whose size depends on the data (``nonzero``, ``masked_select``, boolean-mask
indexing and ``index_put`` with a boolean index, ``repeat_interleave`` without ``output_size``), and a tensor made
from host data inside the region (``torch.tensor``: ``lift_fresh``, a pageable host-to-device copy there). The CPU
runs the same ops through the same dispatcher, so the count is the code's, not the device's. ``paused()`` leaves a
region uncounted (the CPU reference kernels, which loop over sequences on the host where CUDA runs one kernel).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_ALWAYS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.lift_fresh.default,
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
}
_BY_BOOL_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _bool_index(indices: object) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class HostSyncCounter(TorchDispatchMode):
    """Counts, by op name, the dispatched ops that synchronise the host on CUDA (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if not self._paused:
            if func in _ALWAYS and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size")):
                self.syncs[str(func)] += 1
            elif func in _BY_BOOL_INDEX and _bool_index(args[1]):
                self.syncs[f"{func} (boolean index)"] += 1
        return func(*args, **kwargs)

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
