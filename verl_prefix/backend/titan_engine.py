"""The ``prefix_torchtitan`` engine backend: verl's TorchTitan engine with the A/B/C schedule per uid group.

verl builds the model (torchtitan's parallelisms over DTensor), loads the HF checkpoint, owns the loss, the
optimizer step (torchtitan's grad clipping across TP/EP meshes) and checkpoints; only
``forward_backward_batch`` changes. Per group: phase A runs ``prompt[:-1]`` once through the model with every
layer's K/V captured at ``inner_attention`` (``titan_attention``); phase B runs the suffix rows as micro-batches
whose attention sees the prefix leaves, each micro-batch's verl loss backpropagated at once; phase C
backpropagates the prefix once, seeded with the leaves' dK/dV. Grouping, the prefix K/V container, suffix
batches and phase C's seeded backward are the schedule layer's (``verl_prefix.schedule``); only the
torchtitan-specific calls live here.

Rows that cannot reuse (short prefix, a group of one) run through verl's own ``forward_step`` and are counted
under ``prefix/fallback_<reason>`` with one log line. Data-parallel ranks keep FSDP's collectives matched with
the FSDP engine's lockstep (``backend.lockstep``: agreed shape, zero-loss fillers). What this slice does not
serve is refused when the engine is built (``titan_config.refusal``), and so is a torchtitan flavor that does
not match the checkpoint (``titan_flavor``). Under pipeline parallelism each rank holds one stage of the model
and the same three phases cross the stages by point-to-point sends (``titan_pipeline``); without it the same code
runs as a pipeline of one stage.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.tensor import DTensor
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.utils.torch_functional import logprobs_from_logits
from verl.workers.engine.utils import prepare_micro_batches

from verl_prefix.backend import fallbacks, platform_titan
from verl_prefix.backend.config import TITAN_REUSE_OFF, PrefixReuseConfig
from verl_prefix.backend.inputs import per_row_temperature
from verl_prefix.backend.lockstep import agree_on_schedule, filler_group
from verl_prefix.backend.outputs import (
    MiniBatchOutputs,
    as_micro_batch_lists,
    dense_batch_output,
    dense_chunk,
    full_length,
    micro_batch_loss,
    model_shape,
)
from verl_prefix.backend.titan_attention import InnerAttentionHooks, causal_mask, suffix_mask
from verl_prefix.backend.titan_config import model_refusal, refusal
from verl_prefix.backend.titan_flavor import check_flavor
from verl_prefix.backend.titan_moe import ExpertCounts
from verl_prefix.backend.titan_pipeline import (
    StageLink,
    StageStep,
    backward_across,
    batch_fingerprint,
    run_micro_batches,
)
from verl_prefix.backend.titan_sequence import pad_tokens, padded_length, sequence_multiple
from verl_prefix.backend.validation import agree_on_validity, check_batch
from verl_prefix.schedule.executor import build_suffix_batch, prefix_backward
from verl_prefix.schedule.flop_model import ModelShape
from verl_prefix.schedule.grouping import BatchPlan, GroupPlan, RowLayout, plan_batch
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.prefix_kv import PrefixKV
from verl_prefix.schedule.telemetry import PhaseMeter

logger = logging.getLogger(__name__)

_impl = platform_titan.ensure_titan_platform()


class PrefixTorchtitanEngineWithLMHead(_impl.TorchTitanEngineWithLMHead):
    """Drop-in for verl's ``TorchTitanEngineWithLMHead`` selected by ``actor.strategy=prefix_torchtitan``."""

    def __init__(self, model_config: Any, engine_config: Any, *args: Any, **kwargs: Any) -> None:
        reason = refusal(engine_config) or model_refusal(model_config.hf_config, engine_config)
        if reason is not None:
            raise ValueError(reason)
        reuse = getattr(engine_config, "prefix_reuse", None)
        if isinstance(reuse, Mapping):  # from YAML without a _target_
            reuse = PrefixReuseConfig(**reuse)
        self.reuse_config: PrefixReuseConfig = reuse if reuse is not None else PrefixReuseConfig()
        backend = getattr(engine_config, "spmd_backend", None)
        engine_config = platform_titan.replace_config(
            engine_config,
            strategy="torchtitan",
            spmd_backend=platform_titan.SPMD_BACKEND_RENAMES.get(backend, backend),
        )
        super().__init__(model_config, engine_config, *args, **kwargs)
        check_flavor(self.config.model_spec, model_config.hf_config)
        self.hooks: InnerAttentionHooks | None = None
        self.expert_counts: ExpertCounts | None = None

    def initialize(self) -> None:
        super().initialize()
        if len(self.module) != 1:
            raise ValueError(
                "prefix_torchtitan: one model part per rank expected (virtual pipeline stages are not built)"
            )
        dims = self.parallel_dims
        self.link = StageLink.of_mesh(dims.get_mesh("pp") if dims.pp > 1 else None, self._device())
        self.expert_counts = ExpertCounts(self.module[0])
        if self.link.num_stages > 1 and self.expert_counts:
            raise ValueError(
                "prefix_torchtitan: MoE flavors under pipeline parallelism are not tested under reuse (each stage "
                "would count its own layers' routing); set actor_rollout_ref.actor.torchtitan.pipeline_parallel_size=1"
            )
        # TP x EP: the MoE splits every sequence over the TP ranks, which must divide its length
        self.sequence_multiple = sequence_multiple(dims.tp, dims.ep, bool(self.expert_counts))
        if self.reuse_config.enable and self.expert_counts and dims.tp > 1 and dims.ep == 1:
            raise ValueError(
                "prefix_torchtitan: MoE flavors with tensor_parallel_size > 1 and expert_parallel_size 1 (the experts "
                "sharded by TP) are not tested under reuse; set "
                f"actor_rollout_ref.actor.torchtitan.expert_parallel_size > 1 (TP x EP is served), or {TITAN_REUSE_OFF}"
            )
        self.hooks = InnerAttentionHooks(self.module[0])

    # -- the mini-batch -----------------------------------------------------------------------------

    def get_per_tensor_param(self, **kwargs: Any) -> Any:
        """verl's weight sync (HF names, full tensors), with every pipeline stage's parameters on every rank."""
        weights, peft_config = super().get_per_tensor_param(**kwargs)
        return self.link.gather_named(weights), peft_config

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only: bool = False) -> Any:
        output = self._forward_backward(data, loss_function, forward_only)
        output["metrics"] = as_micro_batch_lists(output["metrics"])
        return output

    def _local_reason(self, data: TensorDict, forward_only: bool) -> tuple[str | None, RowLayout | None]:
        def check() -> tuple[str | None, RowLayout | None]:
            if not self.reuse_config.enable:
                return "disabled", None
            if forward_only and not self.reuse_config.forward_only_reuse:
                return "forward_only_disabled", None
            reason = fallbacks.batch_fallback_reason(data)
            return reason, check_batch(data, forward_only=forward_only, reuse=reason is None)

        return agree_on_validity(check, self.get_data_parallel_group())

    def _forward_backward(self, data: TensorDict, loss_function: Callable, forward_only: bool) -> Any:
        self.link.check_same(batch_fingerprint(data), "rows (token ids hashed)")
        local_reason, layout = self._local_reason(data, forward_only)
        reason = fallbacks.agree_on_fallback(local_reason, self.get_data_parallel_group())
        if reason is not None:
            if self.link.num_stages > 1:  # verl's own forward step has no pipeline: the same rows, pipelined here
                stock = functools.partial(self._pipelined_dense_batch, data, loss_function, forward_only)
            else:
                stock = functools.partial(
                    super().forward_backward_batch, data, loss_function, forward_only=forward_only
                )
            return dense_batch_output(stock, data, reason, PhaseMeter(self._device()), shape=self._flop_shape())
        assert layout is not None
        return self._reuse_batch(data, layout, loss_function, forward_only)

    def _flop_shape(self) -> ModelShape | None:
        """The model as the FLOP model prices it (``prefix/flops_*``), or None where it cannot read the config."""
        return model_shape(self.model_config.hf_config)

    def _attach_global_normalisation(self, data: TensorDict) -> None:
        """What verl's ``forward_backward_batch`` attaches before splitting: losses are shares of the mini-batch."""
        tu.assign_non_tensor(data, sp_size=self.engine_config.tensor_parallel_size)
        batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
        group = self.get_data_parallel_group()
        if group is not None:
            dist.all_reduce(batch_num_tokens, op=dist.ReduceOp.SUM, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())

    def _plan(self, data: TensorDict, layout: RowLayout) -> BatchPlan:
        max_rows = self.reuse_config.suffix_micro_batch_size or int(
            tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=1)
        )
        return plan_batch(
            layout,
            max_rows=max_rows,
            max_tokens=self.reuse_config.suffix_token_budget,
            min_prefix_len=self.reuse_config.min_prefix_len,
            min_group_size=self.reuse_config.min_group_size,
        )

    def _reuse_batch(self, data: TensorDict, layout: RowLayout, loss_function: Callable, forward_only: bool) -> Any:
        self._attach_global_normalisation(data)
        layout = RowLayout(**{**layout.__dict__, "temperature": per_row_temperature(data)})
        plan = self._plan(data, layout)
        dense_chunks = self._dense_chunks(data, plan.all_dense_rows)
        self._check_dense_lengths(data, dense_chunks)
        # data-parallel ranks hold different groups: every rank runs as many group slots, suffix micro-batches
        # and dense chunks as the busiest one (zero-loss fillers), or their FSDP collectives would not match
        lockstep = agree_on_schedule(plan, len(dense_chunks), self.get_data_parallel_group())
        device = self._device()
        meter = PhaseMeter(device)
        options = ScheduleOptions(device=device, meter=meter)
        calculate_entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        outputs = MiniBatchOutputs(keep_outputs=bool(forward_only or return_model_output))
        record = outputs.record
        grad = torch.no_grad() if forward_only else nullcontext()
        autocast = platform_titan.engine_autocast(self.engine_config, get_device_name())
        with self.trainer.train_context(), grad, autocast:
            for slot in range(lockstep.num_groups):
                num_micro = lockstep.micro_batches[slot]
                if slot < len(plan.groups):
                    group = plan.groups[slot]
                    group = dataclasses.replace(group, filler_micro_batches=num_micro - len(group.micro_batches))
                    self._group(data, layout, group, options, loss_function, forward_only, calculate_entropy, record)
                else:
                    filler_layout, slot_plan = filler_group(num_micro)
                    with meter.phase("lockstep"):
                        args = (data, filler_layout, slot_plan, options, None, forward_only, False, record)
                        self._group(*args, filler=True)
            if self.link.num_stages > 1:  # one data-parallel rank per stage (titan_config): no lockstep peers
                with meter.phase("dense"):
                    self._pipelined_dense(data, dense_chunks, loss_function, forward_only, record)
            for k in range(lockstep.num_dense_chunks if self.link.num_stages == 1 else 0):
                if k >= len(dense_chunks):
                    with meter.phase("lockstep"):
                        self._filler_dense(device, forward_only)
                    continue
                rows = dense_chunks[k]
                micro = tu.index_select_tensor_dict(data, rows)
                with meter.phase("dense"):
                    _, meta = dense_chunk(self.forward_step, micro, loss_function, forward_only, torch.Tensor.backward)
                record(rows, meta.pop("model_output", {}), meta["loss"], meta["metrics"])
        outputs.replace(self.link.share((outputs.outputs, outputs.order)))  # the last stage's, on every stage
        return outputs.finish(data, layout, plan, meter, forward_only=forward_only, shape=self._flop_shape())

    def _group(
        self,
        data: TensorDict,
        layout: RowLayout,
        group: GroupPlan,
        options: ScheduleOptions,
        loss_function: Callable | None,
        forward_only: bool,
        calculate_entropy: bool,
        record: Callable,
        filler: bool = False,
    ) -> None:
        """Phases A, B and C of one uid group on this rank's stage of torchtitan's model (the whole model without
        pipeline parallelism; ``titan_pipeline``); ``filler``: a lockstep slot, uncounted."""
        assert self.hooks is not None
        model, meter, device, link = self.module[0], options.meter, options.device, self.link
        first = group.rows[0]
        ids = layout.input_ids[first][: group.prefix_len].to(device)[None]
        pos = layout.position_ids[first][..., : group.prefix_len].to(device)[None]
        prefix = PrefixKV(self.hooks.num_layers)
        counts = self.expert_counts
        # the prefix's tokens count once per row of the group (zero for a lockstep filler); with MoE layers
        # phase A runs to the end so that the last layer routes the prefix too. Under pipeline parallelism only
        # the last stage exits early: the others' outputs feed the next stage's layers.
        copies = 0.0 if filler else float(len(group.rows))
        early_exit = self.reuse_config.early_exit and not counts and link.is_last
        ids, pos, copies = pad_tokens(ids, pos, copies, self.sequence_multiple)  # TP x EP (titan_sequence)
        mask = causal_mask(ids.shape[1], device)

        def phase_a(inputs: torch.Tensor) -> torch.Tensor | None:
            output = None
            with self.hooks.capturing(prefix, early_exit, keep=group.prefix_len), self._counted(copies):
                output = model(inputs, positions=pos, attention_masks=mask)
            return output

        with meter.phase("A"):
            prefix_in, prefix_out = link.forward(phase_a, ids, requires_grad=not forward_only)
        leaves = prefix.as_leaves(requires_grad=not forward_only)
        meter.note_prefix_leaves(prefix.tensors(), leaves.tensors())
        scoring = functools.partial(self._score, data, layout, loss_function, forward_only, calculate_entropy, record)
        with meter.phase("B"):
            steps = [
                self._suffix_step(layout, group, rows, leaves, options, scoring, filler) for rows in group.micro_batches
            ]
            run_micro_batches(link, steps, backward=not forward_only)
        if group.filler_micro_batches:  # lockstep: the same collectives, zero loss
            with meter.phase("lockstep"):
                steps = [self._filler_step(layout, group, leaves, options) for _ in range(group.filler_micro_batches)]
                run_micro_batches(link, steps, backward=not forward_only)
        if not forward_only:
            with meter.phase("C"):
                if link.num_stages == 1:
                    prefix_backward(prefix, leaves, model)
                else:  # last stage first, each seeded by the next stage's gradient of its phase-A output
                    backward_across(link, prefix, leaves, model, prefix_in, prefix_out)

    def _suffix_step(
        self,
        layout: RowLayout,
        group: GroupPlan,
        rows: list[int],
        leaves: PrefixKV,
        options: ScheduleOptions,
        scoring: Callable,
        filler: bool,
    ) -> StageStep:
        """One suffix micro-batch of ``rows`` as a pipeline step: this stage's layers serve their prefix leaves."""
        assert self.hooks is not None
        model, hooks = self.module[0], self.hooks
        # with MoE layers each row's last response token is routed too, as dense routes it
        batch = build_suffix_batch(layout, rows, group.prompt_len, options, include_last=bool(self.expert_counts))
        real = 0.0 if filler else batch.tokens.float()
        ids, pos, real = pad_tokens(batch.input_ids, batch.position_ids, real, self.sequence_multiple)
        mask = suffix_mask(len(rows), group.prefix_len, ids.shape[1], options.device)

        def forward(inputs: torch.Tensor) -> torch.Tensor:
            with hooks.serving(leaves), self._counted(real):
                return model(inputs, positions=pos, attention_masks=mask)

        return StageStep(ids, forward, functools.partial(scoring, rows, batch))

    def _score(
        self,
        data: TensorDict,
        layout: RowLayout,
        loss_function: Callable | None,
        forward_only: bool,
        calculate_entropy: bool,
        record: Callable,
        rows: list[int],
        batch: Any,
        logits: torch.Tensor,
    ) -> torch.Tensor | None:
        """The last stage's part of a suffix micro-batch: log-probs (and entropy) of the rows' responses, verl's
        loss on them, the outputs recorded; the loss to backpropagate (None when forward-only)."""
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        log_probs, entropy = [], []
        for k, length in enumerate(batch.lengths):
            row_logits = logits[k, :length] / batch.temperature[k].to(logits.dtype)
            log_probs.append(logprobs_from_logits(row_logits, batch.labels[k, :length]))
            if calculate_entropy:
                entropy.append(self.compute_entropy_from_logits(row_logits))
        model_output = {"log_probs": full_length(log_probs, layout, rows)}
        if calculate_entropy:
            model_output["entropy"] = full_length(entropy, layout, rows)
        loss, metrics = micro_batch_loss(loss_function, model_output, data, rows, self.get_data_parallel_group())
        record(rows, model_output, 1.0 if loss is None else loss.detach().item(), metrics)
        return None if forward_only else loss

    def _filler_step(
        self, layout: RowLayout, group: GroupPlan, leaves: PrefixKV, options: ScheduleOptions
    ) -> StageStep:
        """A zero-loss suffix micro-batch of one row: a lockstep peer's micro-batch, collective for collective."""
        assert self.hooks is not None
        model, hooks = self.module[0], self.hooks
        batch = build_suffix_batch(layout, group.rows[:1], group.prompt_len, options)
        ids, pos, _ = pad_tokens(batch.input_ids, batch.position_ids, 0.0, self.sequence_multiple)
        mask = suffix_mask(1, group.prefix_len, ids.shape[1], options.device)

        def forward(inputs: torch.Tensor) -> torch.Tensor:
            with hooks.serving(leaves), self._counted(0.0):
                return model(inputs, positions=pos, attention_masks=mask)

        return StageStep(ids, forward, lambda logits: logits.sum() * 0.0)

    def _pipelined_dense(
        self,
        data: TensorDict,
        chunks: list[list[int]],
        loss_function: Callable | None,
        forward_only: bool,
        record: Callable,
    ) -> None:
        """Dense chunks as pipeline micro-batches, with the model run stage by stage."""
        steps = [self._dense_step(data, rows, loss_function, forward_only, record) for rows in chunks]
        run_micro_batches(self.link, steps, backward=not forward_only)

    def _dense_step(
        self, data: TensorDict, rows: list[int], loss_function: Callable | None, forward_only: bool, record: Callable
    ) -> StageStep:
        """A chunk of dense rows with verl's own inputs (packed rows, document mask), outputs and loss
        (``prepare_model_inputs`` / ``prepare_model_outputs``), as its ``forward_step`` runs them without PP."""
        model = self.module[0]
        micro = tu.index_select_tensor_dict(data, rows).to(get_device_id())
        ids, extra_inputs, extra_kwargs, output_args = self.prepare_model_inputs(micro_batch=micro)

        def forward(inputs: torch.Tensor) -> torch.Tensor:
            return model(inputs, **extra_inputs, **extra_kwargs)

        def score(logits: torch.Tensor) -> torch.Tensor | None:
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            model_output = self.prepare_model_outputs(logits=logits, output_args=output_args, micro_batch=micro)
            loss, metrics = None, {}
            if loss_function is not None:
                group = self.get_data_parallel_group()
                loss, metrics = loss_function(model_output=model_output, data=micro, dp_group=group)
            record(rows, model_output, 1.0 if loss is None else loss.detach().item(), metrics)
            return None if forward_only else loss

        return StageStep(ids, forward, score)

    def _pipelined_dense_batch(self, data: TensorDict, loss_function: Callable | None, forward_only: bool) -> dict:
        """A whole mini-batch dense under pipeline parallelism (what verl's own engine would run, had it a
        pipelined forward step): verl's micro-batches (``prepare_micro_batches``: fixed size, or by token budget
        under dynamic batch size), verl's output layout."""
        self._attach_global_normalisation(data)
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=self.get_data_parallel_group())
        if indices is None:  # fixed size: consecutive rows
            starts = torch.tensor([0] + [len(m) for m in micro_batches]).cumsum(0).tolist()
            indices = [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])]
        return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        outputs = MiniBatchOutputs(keep_outputs=bool(forward_only or return_model_output))
        grad = torch.no_grad() if forward_only else nullcontext()
        autocast = platform_titan.engine_autocast(self.engine_config, get_device_name())
        with self.trainer.train_context(), grad, autocast:
            self._pipelined_dense(data, [list(rows) for rows in indices], loss_function, forward_only, outputs.record)
        outputs.replace(self.link.share((outputs.outputs, outputs.order)))
        return outputs.collected(data)

    def _filler_dense(self, device: torch.device, forward_only: bool) -> None:
        """A zero-loss dense micro-batch that matches a peer's dense chunk collective for collective."""
        length = padded_length(2, self.sequence_multiple)
        ids = torch.zeros(1, length, dtype=torch.long, device=device)
        pos = torch.arange(length, device=device)[None]
        with self._counted(0.0):
            logits = self.module[0](ids, positions=pos, attention_masks=causal_mask(length, device))
        if not forward_only:
            (logits.sum() * 0.0).backward()

    def _check_dense_lengths(self, data: TensorDict, chunks: list[list[int]]) -> None:
        """verl's ``forward_step`` packs a dense chunk into one sequence; under TP x EP torchtitan's MoE needs
        its length divisible by TP (verl's own engine fails deep in DTensor otherwise): say so plainly, on every
        data-parallel rank at once, before any of them enters a collective the others would not."""
        if self.sequence_multiple == 1:
            return
        lengths = data["input_ids"].offsets().diff()
        odd = [int(lengths[rows].sum()) for rows in chunks if int(lengths[rows].sum()) % self.sequence_multiple]
        reason = fallbacks.agree_on_fallback("odd_dense_chunk" if odd else None, self.get_data_parallel_group())
        if reason is not None:
            where = f"a dense chunk of {odd[0]} packed tokens" if odd else "another data-parallel rank's dense chunk"
            raise ValueError(
                f"prefix_torchtitan: {where} under tensor x expert parallelism; torchtitan's MoE splits the "
                f"sequence over the {self.sequence_multiple} TP ranks and needs a multiple of that (verl's "
                "TorchTitan engine has the same limit); the rows fell back to dense (prefix/fallback_*): lower "
                "prefix_reuse.min_prefix_len / min_group_size, or pad the batch"
            )

    def _counted(self, weights: torch.Tensor | float) -> Any:
        """MoE routing counted with ``weights`` per token (``titan_moe``); nothing to do for a dense model."""
        counts = self.expert_counts
        return counts.weighted(weights) if counts else nullcontext()

    def _dense_chunks(self, data: TensorDict, rows: list[int]) -> list[list[int]]:
        size = int(tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=1) or 1)
        return [rows[i : i + size] for i in range(0, len(rows), size)]

    def _device(self) -> torch.device:
        name = get_device_name()
        return torch.device("cpu") if name == "cpu" else torch.device(name, get_device_id())
