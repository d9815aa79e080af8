"""megatron-core's MoE routers under the schedule: the router load-balancing (aux) loss counted logically.

megatron-core's ``TopKRouter`` adds the Switch-style aux loss inside every training forward call, over that call's
tokens and per MoE layer (``switch_load_balancing_loss_func``)::

    aux_l = coeff * E / (topk * T^2) * sum_e counts[l, e] * prob_sum[l, e]

with ``counts`` the tokens whose top-k scores pick expert ``e`` (no gradient), ``prob_sum`` the router scores summed
over the call's ``T`` tokens, and its gradient scaled by ``MoEAuxLossAutoScaler`` (megatron-core's schedule sets
``loss_scale / num_microbatches``). Per call is per dense micro-batch in verl's engine; under reuse a call is a
prefix, or suffixes without their prefix, so the router's own aux would count each prefix once per group.

``McoreRouters`` gives the schedule what ``schedule.models.moe.MoeRouters`` gives it for HF models: each router's
logits of a call (``capture``) and their statistics as sums (``stats``: ``[layers, E]`` counts and score sums,
from megatron-core's own ``compute_routing_scores_for_aux_loss``), so that every suffix micro-batch sees its rows'
prefix once per row (``moe.logical_stats``), and the aux of a micro-batch is megatron-core's formula on those sums
(``aux_loss``). The router's own aux is switched off inside schedule calls (``own_aux``) and stays on for dense
rows through verl's ``forward_step``, whose gradient scale the engine sets (``set_aux_scale``). Under sequence
parallelism each TP rank routes its slice of a call's positions: the captured logits are gathered over the TP ranks
first, so every rank computes the whole call's aux and sends each slice only its own gradient.

Expert bias (DeepSeek-V3's aux-loss-free balancing, ``moe_router_enable_expert_bias``): every training forward adds
the tokens each expert was routed to ``local_tokens_per_expert``, by which ``finalize_model_grads`` moves the bias.
``ExpertCounts`` makes that count logical through the schedule's ``count_routing`` seam (as ``prefix_torchtitan``'s
counts): a prefix's tokens once per row below it, suffix rows' real tokens (their last response token included)
once, padding, lockstep fillers and phase C's recomputed forwards not at all; verl's dense rows count for themselves.
Under sequence parallelism each TP rank weighs its own slice of the positions (the counts are summed over the TP
ranks by ``finalize_model_grads``); under megatron-core's recompute the weights go with the call's state into the
recomputed forward, which is where a recomputed layer routes with a graph (and counts).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from verl_prefix.backend.megatron.config import MEGATRON_REUSE_OFF, reuse_of
from verl_prefix.schedule.models.moe import RouterStats, valid_router_rows

OVERRIDE = "actor_rollout_ref.actor.megatron.override_transformer_config"


def aux_coefficient(tf_config: Any) -> float:
    """``moe_aux_loss_coeff`` of the ``aux_loss`` load-balancing type (0: no aux loss)."""
    kind, coeff = tf_config.moe_router_load_balancing_type, tf_config.moe_aux_loss_coeff
    kinds = kind if isinstance(kind, (list, tuple)) else [kind]
    coeffs = coeff if isinstance(coeff, (list, tuple)) else [coeff] * len(kinds)
    return float(sum(c for k, c in zip(kinds, coeffs) if k == "aux_loss" and c))


def z_coefficient(tf_config: Any) -> float:
    """``moe_z_loss_coeff`` (0: no router z-loss)."""
    return float(getattr(tf_config, "moe_z_loss_coeff", None) or 0.0)


def counted_coefficients(tf_config: Any) -> tuple[float, float]:
    """The aux loss's and the z-loss's coefficients of an MoE model (both 0 for a dense one): what the schedule
    counts per logical micro-batch (``McoreRouters``)."""
    if not getattr(tf_config, "num_moe_experts", None):
        return 0.0, 0.0
    return aux_coefficient(tf_config), z_coefficient(tf_config)


def router_refusal(tf_config: Any) -> str | None:
    """Why reuse cannot run the MoE routing of the model verl built, or None (a dense model: None).

    Served: top-k routing with no load-balancing loss, megatron-core's per-micro-batch ``aux_loss``, the router
    z-loss and expert bias (each counted per row, under sequence parallelism too). What depends on which tokens share
    a call other than through those is refused."""
    if not getattr(tf_config, "num_moe_experts", None):
        return None
    kind = tf_config.moe_router_load_balancing_type
    kinds = list(kind) if isinstance(kind, (list, tuple)) else [kind]
    checks: list[tuple[str, Any, str]] = [
        (
            "moe_router_load_balancing_type",
            [k for k in kinds if k not in ("none", "aux_loss")],
            "per-sequence, global-batch and sinkhorn balancing are not counted logically yet (served: none, aux_loss)",
        ),
        ("moe_input_jitter_eps", tf_config.moe_input_jitter_eps, "input jitter samples noise per forward"),
        (
            "moe_expert_capacity_factor",
            tf_config.moe_expert_capacity_factor,
            "token dropping decides by each call's tokens which ones an expert drops",
        ),
        ("moe_router_force_load_balancing", tf_config.moe_router_force_load_balancing, "random routing logits"),
    ]
    for key, value, why in checks:
        if value:
            return (
                f"prefix_megatron: {key}={value!r} is refused with reuse on ({why}); change it under {OVERRIDE}, or "
                f"{MEGATRON_REUSE_OFF} for verl's Megatron engine"
            )
    return None


def pipeline_refusal(tf_config: Any, pipeline_stages: int) -> str | None:
    """Why the router aux loss or z-loss cannot run under pipeline stages, or None: a stage before the last would
    have to add its own layers' terms to a loss only the last stage holds (expert bias is served: its counts are each
    stage's own)."""
    aux, z = counted_coefficients(tf_config)
    if pipeline_stages <= 1 or not (aux or z):
        return None
    key, value = ("moe_aux_loss_coeff", aux) if aux else ("moe_z_loss_coeff", z)
    return (
        f"prefix_megatron: {key}={value} with pipeline_model_parallel_size={pipeline_stages} is refused with reuse "
        "on (a stage before the last would add its layers' aux or z-loss to a loss only the last stage holds); "
        f"set {OVERRIDE}.moe_router_load_balancing_type=none (verl's Megatron-Bridge loader sets it), "
        f"pipeline_model_parallel_size=1, or {MEGATRON_REUSE_OFF}"
    )


def replay_refusal(engine_config: Any) -> str | None:
    """Router replay (R2/R3) records or replays routes per dense micro-batch: refused under reuse (nothing with
    reuse off)."""
    mode = getattr(getattr(engine_config, "router_replay", None), "mode", "disabled")
    if mode in (None, "disabled") or not reuse_of(engine_config).enable:
        return None
    return (
        f"prefix_megatron: router_replay.mode={mode!r} is refused with reuse on (routes are recorded and replayed "
        "per dense micro-batch); set actor_rollout_ref.actor.megatron.router_replay.mode=disabled, or "
        f"{MEGATRON_REUSE_OFF}"
    )


def aux_loss(stats: RouterStats, num_experts: int, topk: int, coeff: float) -> torch.Tensor:
    """megatron-core's ``switch_load_balancing_loss_func`` summed over the layers, from sums over one logical
    micro-batch (``stats.tokens`` tokens)."""
    tokens = stats.tokens
    if tokens == 0:
        return stats.prob_sum.sum() * 0.0
    per_layer = torch.sum(stats.prob_sum * stats.counts.to(stats.prob_sum.dtype), dim=-1)
    return (per_layer * (num_experts * coeff / (topk * tokens * tokens))).sum()


class McoreRouters:
    """The ``TopKRouter`` modules of one megatron-core model in forward order, as the schedule's ``routers``."""

    def __init__(self, model: nn.Module, coeff: float, z_coeff: float = 0.0) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.modules: list[nn.Module] = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not self.modules:
            raise ValueError("prefix_megatron: an MoE config without TopKRouter modules in the built model")
        first = self.modules[0]
        self.num_experts = int(first.config.num_moe_experts)
        self.top_k = int(first.topk)
        self.score_function = first.score_function
        self.coeff = coeff
        self.z_coeff = z_coeff
        self.model_name = type(model).__name__
        self.own_aux = True  # megatron-core's per-call aux and z-loss: off inside schedule calls
        self.real_length: int | None = None  # a call padded at the end: its real positions (sequence parallel)
        for router in self.modules:
            stock = router.is_aux_loss_enabled
            router.is_aux_loss_enabled = lambda stock=stock: self.own_aux and stock()
            stock_z = router.apply_z_loss
            router.apply_z_loss = lambda logits, padding_mask=None, stock=stock_z: (
                stock(logits, padding_mask=padding_mask) if self.own_aux else logits
            )

    @contextmanager
    def own_aux_off(self, real_length: int | None = None) -> Iterator[None]:
        """A schedule call: the routers add no aux of their own; ``real_length`` positions are real."""
        saved = self.own_aux, self.real_length
        self.own_aux, self.real_length = False, real_length
        try:
            yield
        finally:
            self.own_aux, self.real_length = saved

    @contextmanager
    def capture(self, on_complete: Callable[[nn.Module], None] | None = None) -> Iterator[list[torch.Tensor | None]]:
        """Each router's gating logits of one call, batch-major ``[B * L, E]`` over the real positions, graph
        attached; only a router's first call counts. ``on_complete(router)`` once every router has run."""
        captured: list[torch.Tensor | None] = [None] * len(self.modules)
        saved = [router.__dict__.get("gating") for router in self.modules]

        def wrap(i: int, router: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
            stock = type(router).gating.__get__(router)

            def gating(input: torch.Tensor) -> torch.Tensor:
                logits = stock(input)  # [L, B, E]; under sequence parallelism this TP rank's slice of L
                if captured[i] is None:
                    real = whole_sequence(logits, router.config)
                    real = real if self.real_length is None else real[: self.real_length]
                    captured[i] = real.transpose(0, 1).reshape(-1, self.num_experts)
                    if on_complete is not None and all(c is not None for c in captured):
                        on_complete(router)
                return logits

            return gating

        for i, router in enumerate(self.modules):
            router.gating = wrap(i, router)
        try:
            yield captured
        finally:
            for router, before in zip(self.modules, saved):
                del router.gating
                if before is not None:
                    router.gating = before

    def stats(self, logits: list[torch.Tensor | None], valid: torch.Tensor | None = None) -> RouterStats:
        """Sums over the tokens ``valid`` marks (row-major over the call's ``[B, L]``; None: all), per layer."""
        from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

        counts, sums, z_sums, tokens = [], [], [], 0
        for layer_logits in valid_router_rows(logits, valid, self.model_name):
            routing_map, scores = compute_routing_scores_for_aux_loss(layer_logits, self.top_k, self.score_function)
            counts.append(routing_map.sum(dim=0))
            sums.append(scores.sum(dim=0))
            if self.z_coeff:  # megatron-core's z_loss_func, as a sum over the call's tokens
                z_sums.append(torch.square(torch.logsumexp(layer_logits, dim=-1)).sum())
            tokens = layer_logits.shape[0]
        z_sum = torch.stack(z_sums) if z_sums else None
        return RouterStats(torch.stack(counts), torch.stack(sums), tokens, len(logits), z_sum)

    def loss(self, stats: RouterStats) -> torch.Tensor:
        """The aux of one logical micro-batch (0 without it)."""
        if not self.coeff:
            return stats.prob_sum.sum() * 0.0
        return aux_loss(stats, self.num_experts, self.top_k, self.coeff)

    def z_loss(self, stats: RouterStats) -> torch.Tensor | None:
        """megatron-core's router z-loss of one logical micro-batch, summed over the layers: each layer's
        ``coeff * mean(logsumexp(logits)^2)`` over the micro-batch's tokens (None without it)."""
        if stats.z_sum is None:
            return None
        return stats.z_sum.sum() * (self.z_coeff / max(stats.tokens, 1))


def set_aux_scale(scale: torch.Tensor) -> None:
    """The gradient scale of the routers' own aux (dense rows through verl's ``forward_step``), as megatron-core's
    schedule sets it before each micro-batch."""
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(scale)


def aux_tracked(name: str = "load_balancing_loss") -> float:
    """megatron-core's logged aux so far (``load_balancing_loss``, or ``z_loss``: summed over layers, without the
    coefficient)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(name)
    return float(entry["values"].sum()) if entry is not None else 0.0


def whole_sequence(logits: torch.Tensor, config: Any) -> torch.Tensor:
    """A call's router logits over its whole sequence: under sequence parallelism gathered from the TP ranks,
    each of which then computes the same aux; the gradient of each rank's copy goes back to its own slice only
    (``tensor_parallel_output_grad=False``), so the slices' gradients add up to the aux's once."""
    if not getattr(config, "sequence_parallel", False):
        return logits
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(logits, tensor_parallel_output_grad=False)


def _sequence_slice(per_position: torch.Tensor, config: Any) -> torch.Tensor:
    """This TP rank's positions of a ``[s, ...]`` tensor under sequence parallelism (megatron-core scatters every
    sequence over the TP ranks in equal contiguous slices before the layers: each rank's router sees its own)."""
    if not getattr(config, "sequence_parallel", False):
        return per_position
    from megatron.core import parallel_state as mpu

    size, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    return per_position.chunk(size, dim=0)[rank]


class ExpertCounts:
    """Every expert-biased router's load count with per-token weights while ``weighted`` is active."""

    def __init__(self, model: nn.Module) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter) and m.enable_expert_bias]
        self.weights: torch.Tensor | None = None
        self.shape: tuple[int, int, int] | None = None  # the call's rows, padded length, real length
        for router in self.routers:
            router._apply_expert_bias = functools.partial(self._count, router, router._apply_expert_bias)

    def __bool__(self) -> bool:
        return bool(self.routers)

    @contextmanager
    def weighted(self, weights: torch.Tensor | float) -> Iterator[None]:
        """Each routed token counts ``weights`` (``[B, L]`` over the call's real positions, or a scalar): the rows
        below a prefix, 1 for real suffix tokens, 0 for padding, fillers and phase C's recomputed forwards."""
        outer, self.weights = self.weights, torch.as_tensor(weights, dtype=torch.float32)
        try:
            yield
        finally:
            self.weights = outer

    @contextmanager
    def call(self, rows: int, length: int, real: int) -> Iterator[None]:
        """A schedule call of ``rows`` x ``length`` tokens, real up to ``real`` (padded past it)."""
        outer, self.shape = self.shape, (rows, length, real)
        try:
            yield
        finally:
            self.shape = outer

    def _count(self, router: nn.Module, stock: Callable, routing_map: torch.Tensor, padding_mask: Any = None) -> None:
        if self.weights is None:  # verl's own forward: the router counts each token once
            return stock(routing_map, padding_mask=padding_mask)
        if not torch.is_grad_enabled():  # megatron-core counts training forwards only
            return None
        weights = self.weights.to(routing_map.device)
        if self.shape is not None:  # a schedule call: [B, real] weights, zero past the real positions
            rows, length, real = self.shape
            weights = torch.nn.functional.pad(weights.expand(rows, real), (0, length - real)).t()  # [s, b]
            weights = _sequence_slice(weights, router.config).reshape(-1)
        elif weights.dim() != 0:
            raise RuntimeError("prefix_megatron: per-token expert-count weights outside a schedule call")
        else:  # one weight for every token of a call of the engine's own (a zero-loss filler)
            weights = weights.expand(routing_map.shape[0])
        if weights.numel() != routing_map.shape[0]:
            raise RuntimeError(f"prefix_megatron: {routing_map.shape[0]} routed tokens, {weights.numel()} weights")
        with torch.no_grad():
            counts = (routing_map.to(weights.dtype) * weights[:, None]).sum(dim=0)
            router.local_tokens_per_expert += counts.to(router.local_tokens_per_expert.dtype)
        return None
