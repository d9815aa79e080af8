"""The ``prefix_fsdp2`` engine backend: verl's FSDP2 engine with the A/B/C schedule per uid group.

An adapter of the mini-batch driver (``backend.driver``): what it supplies is how an HF model under FSDP2 runs
a group's phases (``schedule.executor`` / ``schedule.tree.schedule``), Ulysses, the router aux loss, fused kernels and
dormant policies. Everything verl already does stays verl's: model build, FSDP2 wrapping, ``ppo_loss`` (called
per suffix micro-batch on that micro-batch's rows, with the mini-batch's global normalisation attached exactly
as the stock engine attaches it), optimizer step, checkpointing. Only ``forward_backward_batch`` changes.
Rows that cannot reuse run through the stock ``forward_step`` and are counted under ``prefix/fallback_<reason>``;
a whole mini-batch that cannot reuse runs the stock method and is counted the same way.

With ``moe_aux_loss_coef > 0`` every training micro-batch, dense or reuse, adds HF's router
load-balancing loss of that micro-batch, weighted by its share of the mini-batch's logical tokens
times ``dp_size`` (``moe_aux_term``), and logs it as ``moe_aux_loss`` (``verl_prefix.schedule.models.moe``).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_name
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from verl_prefix.backend import fallbacks, model_checks, registry
from verl_prefix.backend.config import PREFIX_BACKEND, PrefixReuseConfig, validate_moe_aux_loss_coef
from verl_prefix.backend.distributed.once import agree_on_structure
from verl_prefix.backend.driver import MiniBatchRun, ReuseDriver
from verl_prefix.backend.fsdp import refusals
from verl_prefix.schedule.fused_head import FUSED_BACKENDS, fused_backend, scalar_temperature
from verl_prefix.schedule.models import moe
from verl_prefix.schedule.models.hf_forwards import hf_causal_forward, remember_hf_forwards
from verl_prefix.schedule.models.multimodal import (
    model_positions,
    text_only_call,
    vision_encoder,
    visual_token_ids,
)
from verl_prefix.schedule.models.structure import LayerRoles, layer_roles
from verl_prefix.schedule.options import AuxFn, ScheduleOptions
from verl_prefix.schedule.telemetry import PhaseMeter
from verl_prefix.schedule.ulysses import Ulysses

logger = logging.getLogger(__name__)


_FSDP2_LOGGED: list[bool] = []


def log_fsdp2_once() -> None:
    """verl's default actor strategy is ``fsdp`` (FSDP1); ``prefix_fsdp2`` is built on verl's FSDP2 engine. Said
    once per process so that a recipe switched from ``fsdp`` knows its checkpoints and sharding are FSDP2's."""
    if not _FSDP2_LOGGED:
        _FSDP2_LOGGED.append(True)
        logger.warning(
            "prefix_fsdp2 runs verl's FSDP2 engine (torch fully_shard), whatever the recipe's FSDP version: verl's "
            "default strategy fsdp (FSDP1) is not served by reuse; checkpoints are FSDP2's, as with strategy=fsdp2"
        )


class PrefixFSDPEngineWithLMHead(ReuseDriver, FSDPEngineWithLMHead):
    """Drop-in for verl's ``FSDPEngineWithLMHead`` selected by ``actor.strategy=prefix_fsdp2``."""

    def __init__(self, model_config: Any, engine_config: Any, *args: Any, **kwargs: Any) -> None:
        reuse = getattr(engine_config, "prefix_reuse", None)
        error = refusals.multimodal_ulysses_error(
            getattr(model_config, "hf_config", None),
            reuse if reuse is not None else PrefixReuseConfig(),
            int(getattr(engine_config, "ulysses_sequence_parallel_size", 1) or 1),
        )
        if error is not None:  # from the configs, before verl builds a device mesh or the model
            raise ValueError(error)
        if getattr(engine_config, "strategy", None) == PREFIX_BACKEND:
            # verl's FSDP code branches on strategy == "fsdp2"; keep the caller's object untouched.
            engine_config = copy.copy(engine_config)
            object.__setattr__(engine_config, "strategy", "fsdp2")
            log_fsdp2_once()
        super().__init__(model_config, engine_config, *args, **kwargs)
        self.reuse_config: PrefixReuseConfig = reuse if reuse is not None else PrefixReuseConfig()
        self.moe_aux_loss_coef = getattr(engine_config, "moe_aux_loss_coef", 0.0)
        self.record_trace_dir: str | None = getattr(engine_config, "record_trace_dir", None)
        self._trace_writer: Any = None
        self._moe_routers_cache: tuple[int, moe.MoeRouters] | None = None
        self._layer_roles_cache: tuple[int, LayerRoles] | None = None
        self.freeze_vision_tower = bool(getattr(engine_config, "freeze_vision_tower", False))
        self.unpacked_dense_rows: str | None = None  # a decoder whose packed rows would cross (``_unpack_dense_rows``)
        self.read_dormant(engine_config)
        # ((the module's id, unsupported_model), the reason every rank runs it dense) once decided
        self._structure_decision: tuple[tuple[int, str], str | None] | None = None

    def _build_module(self) -> Any:
        """verl's build; HF's forwards of the classes verl's patch replaces are remembered first
        (``schedule.models.hf_forwards``): Qwen3.5's delta-net and decoder layers, and the vision-language families'
        attention, which verl's remove-padding patch replaces (``schedule.models.multimodal.hf_attention`` serves the
        schedule with it)."""
        remember_hf_forwards()
        return super()._build_module()

    def initialize(self) -> None:
        """verl's build, then what the model's structure decides once, before any step, on every rank alike:
        whether the schedule can serve it at all, agreed by every rank (``prefix_reuse.unsupported_model``: dense
        with the reason, or raise), and a knob this model cannot run with (``merged_varlen`` with sliding
        windows; Ulysses, ``merged_varlen`` or remove-padding with recurrent layers) is an error here."""
        super().initialize()
        if self.freeze_vision_tower:
            self._freeze_vision_tower()
        self._unpack_dense_rows()
        if self._structure_reason() is not None:
            return
        error = (
            refusals.windowed_varlen_error(self.module, self.reuse_config)
            or refusals.recurrent_settings_error(self.module, self.reuse_config, self.use_ulysses_sp)
            or refusals.recurrent_packed_error(self.module, self.reuse_config, self.use_remove_padding)
        )
        if error is not None:
            raise ValueError(error)

    def _unpack_dense_rows(self) -> None:
        """Under ``use_remove_padding`` with a decoder that builds its attention masks without the position ids
        (``model_checks.packed_masks_without_positions``: GPT-OSS, Afmoe, OPT, Bloom... under eager or sdpa), verl's
        packed rows would attend across sequences; the rows that run through verl's forward (dense chunks, the
        stock path) run padded instead, one sequence a row, as reuse's groups run. Ulysses needs packed rows: an
        error naming the fix."""
        if not self.use_remove_padding:
            return
        decoder = model_checks.packed_masks_without_positions(self.module)
        if decoder is None:
            return
        if self.use_ulysses_sp:
            raise ValueError(
                f"{decoder} builds its attention masks without the position ids, so verl's packed rows (which "
                "Ulysses needs) attend across sequences under this attention implementation: set "
                "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1, or a flash attention "
                "implementation (actor_rollout_ref.model.override_config.attn_implementation)"
            )
        self.unpacked_dense_rows = decoder
        logger.warning(
            "%s builds its attention masks without the position ids: verl's packed rows (use_remove_padding=true) "
            "would attend across sequences, so the rows that run through verl's forward run padded instead "
            "(verl's own engine computes the packed rows wrongly; docs/configuration.md)",
            decoder,
        )

    def _freeze_vision_tower(self) -> None:
        """``actor.freeze_vision_tower``: the vision encoder's parameters stop requiring grad, so neither phase C
        nor a dense micro-batch trains them and the optimizer skips them. verl 0.9.1 declares the flag but its
        engine never reads it (the stock engine trains the tower whatever it says)."""
        tower = vision_encoder(self.module)
        if tower is None:
            logger.warning("actor.freeze_vision_tower=true, but %s has no vision encoder", type(self.module).__name__)
            return
        tower.requires_grad_(False)
        logger.warning("actor.freeze_vision_tower=true: the vision encoder's parameters are frozen")

    # -- MoE router aux loss ------------------------------------------------------------------------

    @property
    def moe_aux_loss_coef(self) -> float:
        """Coefficient of the router load-balancing loss; 0 leaves verl's loss untouched."""
        return self._moe_aux_loss_coef

    @moe_aux_loss_coef.setter
    def moe_aux_loss_coef(self, value: float) -> None:
        self._moe_aux_loss_coef = validate_moe_aux_loss_coef(value)

    def moe_aux_on(self, forward_only: bool) -> bool:
        return not forward_only and self._moe_aux_loss_coef > 0

    def _moe_routers(self) -> moe.MoeRouters:
        """The model's routers; raises a clear error for a model whose router statistics we do not serve."""
        if self._moe_routers_cache is None or self._moe_routers_cache[0] != id(self.module):
            self._moe_routers_cache = (id(self.module), moe.MoeRouters(self.module))
        return self._moe_routers_cache[1]

    def moe_aux_term(self, stats: moe.RouterStats, data: TensorDict) -> tuple[torch.Tensor, Metric]:
        """``coef * w * aux`` with ``w = tokens(micro-batch) / tokens(mini-batch, all ranks) * dp_size``.

        HF's aux is a mean over one forward call; weighting each micro-batch by its share of the
        mini-batch's logical tokens makes the sum over micro-batches a token-weighted mean, and
        ``dp_size`` undoes FSDP's gradient averaging, as verl's token-mean losses do. With one
        micro-batch on one rank the term is exactly ``coef * HF aux``. The logged value is ``w * aux``
        (summed over micro-batches, like verl's ``pg_loss``): the mini-batch's token-weighted mean aux.
        """
        total = tu.get_non_tensor_data(data=data, key="moe_aux_num_tokens", default=None)
        if total is None:
            raise RuntimeError("moe_aux_num_tokens is missing: the mini-batch was not normalised for the aux loss")
        weight = stats.tokens * self.get_data_parallel_size() / total
        aux = self._moe_routers().loss(stats) * weight
        return self._moe_aux_loss_coef * aux, Metric(value=aux.detach(), aggregation=AggregationType.SUM)

    def forward_step(self, micro_batch: TensorDict, loss_function: Callable, forward_only: bool) -> Any:
        """verl's dense ``forward_step``, plus the router aux loss of the micro-batch when it is on.

        The routers' logits are captured by forward hooks during verl's own model call; the wrapped
        loss function (called by verl right after the model) adds the weighted aux term.
        """
        if self.unpacked_dense_rows is not None:  # one sequence a row (``_unpack_dense_rows``)
            tu.assign_non_tensor(micro_batch, use_remove_padding=False)
        unfused = self._fused_head_unreadable(micro_batch)
        if unfused:  # verl's fused forward would read the sharded head: its unfused path, HF's forward, instead
            tu.assign_non_tensor(micro_batch, use_fused_kernels=False)
        with text_only_call(self.module), hf_causal_forward(self.module) if unfused else nullcontext():
            return self._forward_step(micro_batch, loss_function, forward_only)

    def _fused_head_unreadable(self, micro_batch: TensorDict) -> bool:
        """Whether verl's fused forward would fail on this micro-batch: fused kernels on, and the LM head its own
        FSDP2 unit (untied embeddings), whose weight verl 0.9.1's fused forward reads outside FSDP's hooks
        (``aten.mm.default got mixed torch.Tensor and DTensor``; verl's own fsdp2 engine fails the same way). Those
        dense rows then run verl's unfused path: the same log-probs up to rounding, with the logits materialised."""
        if not tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
            return False
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.module.get_output_embeddings(), FSDPModule):
            return False
        if "unfused" not in fallbacks.LOGGED_REASONS:
            fallbacks.LOGGED_REASONS.add("unfused")
            logger.warning(
                "rows that run dense use verl's unfused log-probs: its fused forward cannot read an LM head FSDP2 "
                "shards on its own (untied embeddings); reused rows use verl's fused kernels (schedule.fused_head)"
            )
        return True

    def _forward_step(self, micro_batch: TensorDict, loss_function: Callable, forward_only: bool) -> Any:
        if not self.moe_aux_on(forward_only) or loss_function is None:
            return super().forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)
        routers = self._moe_routers()
        with routers.capture() as logits:

            def loss_with_aux(model_output: dict, data: TensorDict, dp_group: Any = None) -> tuple:
                loss, metrics = loss_function(model_output=model_output, data=data, dp_group=dp_group)
                stats = routers.stats(logits, _dense_token_mask(data, logits[0].shape[0]))
                term, metric = self.moe_aux_term(stats, data)
                return loss + term, {**metrics, "moe_aux_loss": metric}

            return super().forward_step(micro_batch, loss_function=loss_with_aux, forward_only=forward_only)

    # -- what can reuse (the driver's hooks) --------------------------------------------------------

    def _model_fallback_reason(self, forward_only: bool) -> str | None:
        """A reason the whole mini-batch must run dense because of the model or the knobs, or None."""
        if self.reuse_config.enable and self._structure_reason() is not None:
            return self._structure_reason()
        return fallbacks.model_fallback_reason(
            self.module, self.reuse_config, forward_only=forward_only
        ) or fallbacks.recurrent_fallback_reason(self.module)

    def reuse_reason(self, data: TensorDict, forward_only: bool) -> str | None:
        return (
            self._model_fallback_reason(forward_only)
            or fallbacks.batch_fallback_reason(data)
            or fallbacks.multimodal_fallback_reason(self.module, self.reuse_config, data)
            or fallbacks.length_fallback_reason(self.module, data, ulysses=self.use_ulysses_sp)
        )

    def _structure_reason(self) -> str | None:
        """Why the schedule cannot serve this model's structure (``schedule.models.capability``), agreed by every
        rank, or None. Decided at ``initialize`` (a collective every rank runs there); a module swapped in
        afterwards is decided again before its first mini-batch's first collective, on every rank alike."""
        key = (id(self.module), self.reuse_config.unsupported_model)
        if self._structure_decision is None or self._structure_decision[0] != key:
            reason = agree_on_structure(self.module, self.reuse_config.unsupported_model, self.agreement_group())
            self._structure_decision = (key, reason)
        return self._structure_decision[1]

    def before_mini_batch(self, data: TensorDict) -> None:
        if self.reuse_config.enable:
            self._structure_reason()  # decided before the mini-batch's first collective (a no-op once decided)

    def agreement_group(self) -> Any:
        """Where ranks agree on the path a mini-batch takes: FSDP's collectives (and, under Ulysses, the
        all-to-alls) span every rank, so every rank of the data-parallel x sequence-parallel mesh."""
        return None if self.use_ulysses_sp else self.get_data_parallel_group()

    def sequence_parallel_size(self) -> int:
        return self.ulysses_sequence_parallel_size

    def visual_token_ids(self) -> Any:
        return visual_token_ids(self.module)

    def _ulysses(self) -> Ulysses | None:
        """The sequence-parallel group the schedule shards over (verl's Ulysses mesh), or None."""
        return Ulysses(self.ulysses_parallel_group) if self.use_ulysses_sp else None

    def refuse_dense(self, reason: str, dense_runs: int) -> None:
        """A clear error instead of verl's dense Ulysses path where it is silently wrong (not flash attention)."""
        if not self.use_ulysses_sp or dense_runs == 0:
            return
        error = fallbacks.dense_under_ulysses_error(self.module, reason)
        if error is None and self.moe_aux_on(forward_only=False):
            error = (
                f"rows fall back to the stock engine ({reason}) under Ulysses with moe_aux_loss_coef > 0: the dense "
                "path's router statistics would cover one slice of each sequence"
            )
        if error is not None:
            raise ValueError(error)

    def new_meter(self, device: torch.device) -> PhaseMeter:
        return PhaseMeter(device, model=self.module)

    # -- the mini-batch's groups --------------------------------------------------------------------

    def _autocast(self) -> Callable[[], AbstractContextManager]:
        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        if dtype == torch.float32 or dtype == torch.float64:
            return nullcontext
        return lambda: torch.autocast(device_type=get_device_name(), dtype=dtype)

    def _entropy_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Entropy exactly as the stock ``prepare_model_outputs`` computes it: the engine's (maybe
        compiled) function, chunked or checkpointed as the engine config says."""
        config = self.engine_config
        if config.entropy_checkpointing:
            return lambda logits: torch.utils.checkpoint.checkpoint(self.compute_entropy_from_logits, logits)
        if config.entropy_from_logits_with_chunking:
            return functools.partial(self.compute_entropy_from_logits, chunk_size=config.entropy_from_logits_chunk_size)
        return self.compute_entropy_from_logits

    def backward(self, loss: torch.Tensor) -> None:
        scaler = getattr(self, "scaler", None)
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def schedule_model(self) -> nn.Module:
        return self.module

    def compute_dtype(self) -> torch.dtype | None:
        return getattr(self, "_autocast_dtype", None)

    def schedule_options(self, run: MiniBatchRun, aux_fn: AuxFn) -> ScheduleOptions:
        """What every group of the mini-batch runs with (built once per mini-batch, from what every rank agreed:
        the phase-B kernels' refusal). Under verl's fused kernels the LM head returns log-probs at the batch's one
        temperature."""
        aux_on = self.moe_aux_on(run.forward_only)
        fused = bool(tu.get_non_tensor_data(data=run.data, key="use_fused_kernels", default=False))
        temperature = run.layout.temperature
        return self.base_options(
            run,
            entropy_fn=self._entropy_fn(),
            autocast=self._autocast(),
            ulysses=self._ulysses(),
            routers=self._moe_routers() if aux_on else None,
            aux_fn=aux_fn if aux_on else None,
            layer_roles=self._layer_roles(),
            fused_backend=self._fused_backend() if fused else None,
            fused_temperature=scalar_temperature(temperature) if fused and temperature is not None else 1.0,
        )

    def _fused_backend(self) -> str:
        """The backend of verl's fused kernels this model was patched with (``use_fused_kernels``)."""
        backend = fused_backend(self.module)
        if backend is None:
            options = getattr(self.model_config, "fused_kernel_options", None) or {}
            raise ValueError(
                "the batch asks for use_fused_kernels but verl did not patch this model with fused kernels "
                f"(fused_kernel_options.impl_backend={options.get('impl_backend')!r}; verl accepts "
                f"{', '.join(FUSED_BACKENDS)})"
            )
        return backend

    def _layer_roles(self) -> LayerRoles:
        """The model's KV-shared and recurrent layers, found once per model (not once per group)."""
        if self._layer_roles_cache is None or self._layer_roles_cache[0] != id(self.module):
            self._layer_roles_cache = (id(self.module), layer_roles(self.module))
        return self._layer_roles_cache[1]

    def filler_logits(self, run: MiniBatchRun) -> torch.Tensor:
        device = run.meter.device
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        with self._autocast()(), text_only_call(self.module):
            positions = model_positions(self.module, torch.arange(2, device=device)[None])
            return self.module(input_ids=ids, position_ids=positions, use_cache=False).logits

    def train_batch(self, data: TensorDict, loss_function: Callable) -> Any:
        if self.record_trace_dir:
            self._record(data, loss_function)
        return super().train_batch(data, loss_function)

    def _record(self, data: TensorDict, loss_function: Callable) -> None:
        """Write this update's batch to the trace before anything changes it (``record_trace_dir``)."""
        from verl_prefix.backend.trace import TraceWriter, rank_trace_dir, record_train_batch

        if self._trace_writer is None:
            directory = rank_trace_dir(self.record_trace_dir)
            resume = (directory / "manifest.json").exists()
            self._trace_writer = TraceWriter(directory, model_ref=str(self.model_config.path), append=resume)
        record_train_batch(self._trace_writer, self, data, loss_function)


def _dense_token_mask(data: TensorDict, router_rows: int) -> torch.Tensor:
    """Which rows of a dense forward's router logits are real tokens, in verl's two input layouts:
    packed (remove-padding; trailing pad only) or right-padded ``[B, longest]``."""
    lengths = data["input_ids"].offsets().diff()
    positions = torch.arange(router_rows, device=lengths.device)
    if tu.get_non_tensor_data(data=data, key="use_remove_padding", default=True):
        return positions < lengths.sum()
    width = int(lengths.max())
    if router_rows != len(lengths) * width:
        raise RuntimeError(f"router logits have {router_rows} rows, the padded batch {len(lengths)} x {width}")
    return (torch.arange(width, device=lengths.device)[None] < lengths[:, None]).reshape(-1)


def register() -> None:
    """Register ``prefix_fsdp2`` for every device verl's FSDP engine runs on (idempotent)."""
    registry.register_class(PrefixFSDPEngineWithLMHead, PREFIX_BACKEND, ("cuda", "npu", "cpu"))


def is_registered() -> bool:
    """True when ``prefix_fsdp2`` is in verl's engine registry (plugin failures are silent in verl)."""
    return registry.is_registered(PREFIX_BACKEND)
