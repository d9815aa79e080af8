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
# count_routing(weights) -> the context a model call runs in: each routed token counted ``weights`` times
CountRouting = Callable[[torch.Tensor | float], AbstractContextManager]


def _uncounted(count_routing: CountRouting) -> CountRouting:
    """``count_routing`` with every weight zero: lockstep fillers stand for no dense token."""

    def zero(weights: torch.Tensor | float) -> AbstractContextManager:
        return count_routing(0.0)

    return zero


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
    logits. None: logits, as verl computes them without fused kernels. ``count_routing``: an engine's own routing
    statistics, counted per token (torchtitan's expert-load counts, ``backend.titan.moe``): every model call runs
    inside ``count_routing(weights)``, the dense copies each token stands for (``routing``): phase A's tokens once
    per row below the node, a suffix row's real tokens once (its last token routed, as dense routes it), padding,
    lockstep fillers (``for_fillers``) and phase C's recomputed forwards not at all; phase A then runs to the end
    (the last layer routes the prefix too).
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
    count_routing: CountRouting | None = None

    def __post_init__(self) -> None:
        if (self.routers is None) != (self.aux_fn is None):
            raise ValueError("routers and aux_fn go together")

    def for_fillers(self) -> ScheduleOptions:
        """The same options for lockstep filler work (zero-loss micro-batches and groups that only keep
        data-parallel ranks in step): neither metered nor asked for entropy."""
        uncounted = _uncounted(self.count_routing) if self.count_routing is not None else None
        return dataclasses.replace(self, meter=None, calculate_entropy=False, count_routing=uncounted)

    @property
    def routes_last(self) -> bool:
        """Whether suffix rows also feed their last response token (it predicts nothing, but dense routes it
        through every MoE layer): under a router aux loss (``routers``) or counted routing (``count_routing``)."""
        return self.routers is not None or self.count_routing is not None

    @property
    def exits_early(self) -> bool:
        """Whether phase A may stop after the last layer's K/V: not where it keeps logits, nor where routing
        is counted (the last layer's MoE must route the prefix, on every rank alike)."""
        return self.early_exit and not self.keep_logits and self.count_routing is None

    def routing(self, weights: torch.Tensor | float) -> AbstractContextManager:
        """The context of a model call whose tokens stand for ``weights`` dense copies each (``count_routing``)."""
        return self.count_routing(weights) if self.count_routing is not None else nullcontext()

    def forward_only(self) -> ScheduleOptions:
        """The options a forward-only pass runs with: early exit always (unless routing is counted,
        ``exits_early``), no router aux loss."""
        if self.early_exit and self.routers is None:
            return self
        return dataclasses.replace(self, early_exit=True, routers=None, aux_fn=None)
