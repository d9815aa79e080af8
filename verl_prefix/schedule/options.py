"""What every phase of a mini-batch runs with: one frozen ``ScheduleOptions``, built once per mini-batch.

The executor's functions take it and, besides, only what varies per call: the model, the rows (``RowLayout``),
the group (``GroupPlan``, with its lockstep fillers), the caller's loss and the group's dormant policy. A
feature that is constant over a mini-batch (a sliding window, recurrent state, multimodal inputs, a prefix
tree) becomes a field here, not one more parameter on every executor function.

The defaults are the schedule's own: ``ScheduleOptions(device=...)`` is a plain fp32/fp64 run with early
exit, ``auto`` phase-B attention, fp32 dK/dV accumulation, no chunking, no sequence parallelism, no MoE aux
loss, no meter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from verl.utils.torch_functional import entropy_from_logits

from verl_prefix.schedule.models import moe
from verl_prefix.schedule.models.structure import LayerRoles
from verl_prefix.schedule.telemetry import PhaseMeter
from verl_prefix.schedule.ulysses import Ulysses

# aux_fn(rows, stats) -> the scaled router aux term of a micro-batch; stats count the prefix per row.
AuxFn = Callable[[list[int], moe.RouterStats], torch.Tensor]


@dataclass(frozen=True)
class ScheduleOptions:
    """The mini-batch's schedule settings (frozen: one object serves every group of the mini-batch).

    ``calculate_entropy``: phase B also returns each row's entropy (``entropy_fn``, the engine's own:
    compiled, chunked or checkpointed as its config says). ``autocast``: a factory of the compute-dtype
    context every phase runs in. ``backward``: how a micro-batch's loss is backpropagated (a caller may
    scale it). ``early_exit``: phase A stops after the last layer's K/V (or the last router, whichever runs
    later). ``meter``: per-phase time/memory and which phase-B attention ran (``None``: not metered).
    ``phase_b_attention``: see ``kv.contexts.ServeContext``. ``phase_b_refusal``: why the merged kernels cannot
    serve on some data-parallel rank, as the ranks agreed before the mini-batch (``schedule.attention.preflight``):
    ``auto`` then runs concat on every rank, counted as ``concat_<reason>``. ``prefix_grad_dtype``: the least
    dtype dK/dV accumulate in across micro-batches (``None``: K/V's own, e.g. bf16 under autocast).
    ``prefix_chunk_tokens``: phases A and C in chunks of that many prefix tokens (``schedule.chunked``).
    ``ulysses``: every phase sequence-parallel over that group (``schedule.ulysses``). ``routers`` and
    ``aux_fn`` (together or neither): each training micro-batch's loss gains ``aux_fn(rows, stats)``, the
    stats counting the prefix once per row (``schedule.models.moe``); forward-only passes ignore them.
    ``layer_roles``: the model's KV-shared and recurrent layers (``structure.layer_roles``), decided once by the
    caller; ``None``: found from the model at every phase A. ``keep_logits``: phase A runs the whole model
    (no early exit) and keeps the logits of its last that many positions on the returned ``PrefixKV``
    (``logits``): a tree node whose tokens carry loss (``schedule.tree.loss``); 0 for every other phase A. Under
    ``ulysses`` it keeps this rank's share of them (``Ulysses.kept_in_slice``: the positions are spread over the
    slices). ``fused_backend``: verl's fused kernels (``model.use_fused_kernels``, ``schedule.fused_head``) compute
    log-probs and entropy from the final hidden states, no logits materialised; phase A then keeps those positions'
    log-probs and entropies (``[positions, 2]``, at ``fused_temperature``, the batch's one temperature: verl's fused
    kernels take no per-row one) of ``keep_labels`` (the node's labels) in ``PrefixKV.logits`` instead of their
    logits. None: logits, as verl computes them without fused kernels.
    """

    device: torch.device
    calculate_entropy: bool = False
    entropy_fn: Callable[[torch.Tensor], torch.Tensor] = entropy_from_logits
    autocast: Callable[[], AbstractContextManager] = nullcontext
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    early_exit: bool = True
    meter: PhaseMeter | None = None
    phase_b_attention: str = "auto"
    phase_b_refusal: str | None = None
    prefix_grad_dtype: torch.dtype | None = torch.float32
    prefix_chunk_tokens: int | None = None
    ulysses: Ulysses | None = None
    routers: moe.MoeRouters | None = None
    aux_fn: AuxFn | None = None
    layer_roles: LayerRoles | None = None
    keep_logits: int = 0
    fused_backend: str | None = None
    fused_temperature: float = 1.0
    keep_labels: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.routers is None) != (self.aux_fn is None):
            raise ValueError("routers and aux_fn go together")

    def for_fillers(self) -> ScheduleOptions:
        """The same options for lockstep filler work (zero-loss micro-batches and groups that only keep
        data-parallel ranks in step): neither metered nor asked for entropy."""
        return dataclasses.replace(self, meter=None, calculate_entropy=False)

    def forward_only(self) -> ScheduleOptions:
        """The options a forward-only pass runs with: early exit always, no router aux loss."""
        if self.early_exit and self.routers is None:
            return self
        return dataclasses.replace(self, early_exit=True, routers=None, aux_fn=None)
