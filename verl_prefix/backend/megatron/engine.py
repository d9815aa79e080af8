"""The ``prefix_megatron`` engine backend: verl's Megatron engine with the A/B/C schedule per uid group.

verl builds the model (megatron-core's ``GPTModel`` through Megatron-Bridge or mbridge, its TP/DP groups and
distributed optimizer), loads the HF checkpoint, owns the loss, the optimizer step, the weight export for the
rollout and checkpoints; only ``forward_backward_batch`` changes, through the mini-batch driver every engine shares
(``backend.driver``). This adapter supplies the model as the one schedule calls it (``megatron.causal_lm``: the
model chunk behind an HF causal-LM call, every layer's ``core_attention`` handed to the schedule's context), so the
tree, a chunked prefix, merged phase-B attention and the dormant policies are served as on ``prefix_fsdp2``.

megatron-core's own schedule (``get_forward_backward_func``) is a per-micro-batch loop that runs each backward
itself and ends with ``finalize_model_grads`` (the data-parallel gradient reduction). Under reuse the schedule runs
its own loop: every backward is plain ``backward`` on the micro-batch's loss (megatron-core's loss scale applied,
as its ``backward_step`` applies it) inside the model's ``no_sync``, and ``finalize_model_grads`` runs once at the
end of the mini-batch (``before_finish``). verl's loss sees the same normalisation as in its own engine; rows that
cannot reuse run through verl's ``forward_step`` one chunk at a time (``run_dense``), counted under
``prefix/fallback_<reason>``. Under pipeline parallelism every stage runs the schedule on its own layers and the
stage's model call crosses the stages (``distributed.stages``); its dense rows and fillers run as pipeline
micro-batches; under virtual stages a call runs the rank's model chunks in order, relayed around the ring of ranks.
Under megatron-core's activation recompute phase A keeps its graph and phase B's recompute re-enters the call
(``megatron.recompute``). What the schedule is not built for (context parallelism, megatron FSDP, MoE routing that
depends on a call's tokens, other attention) is refused when the engine is built (``megatron.config``) or
initialised.
"""

from __future__ import annotations

import functools
import logging
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from torch import nn
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

from verl_prefix.backend.distributed.stages import StageLink, StageStep, run_micro_batches
from verl_prefix.backend.driver import MiniBatchRun, ReuseDriver
from verl_prefix.backend.megatron.causal_lm import MegatronCausalLM
from verl_prefix.backend.megatron.config import (
    built_model_refusal,
    lora_refusal,
    model_refusal,
    refusal,
    reuse_of,
)
from verl_prefix.backend.megatron.moe import (
    ExpertCounts,
    McoreRouters,
    aux_tracked,
    counted_coefficients,
    pipeline_refusal,
    replay_refusal,
    router_refusal,
    set_aux_scale,
)
from verl_prefix.backend.megatron.recompute import install as install_recompute
from verl_prefix.backend.megatron.recompute import recompute_refusal
from verl_prefix.schedule.models.moe import RouterStats
from verl_prefix.schedule.models.structure import LayerRoles
from verl_prefix.schedule.options import AuxFn, ScheduleOptions

logger = logging.getLogger(__name__)


class PrefixMegatronEngineWithLMHead(ReuseDriver, MegatronEngineWithLMHead):
    """Drop-in for verl's ``MegatronEngineWithLMHead`` selected by ``actor.strategy=prefix_megatron``."""

    def __init__(self, model_config: Any, engine_config: Any, *args: Any, **kwargs: Any) -> None:
        reason = (
            refusal(engine_config)
            or model_refusal(model_config.hf_config, engine_config)
            or lora_refusal(model_config, engine_config)
            or replay_refusal(engine_config)
        )
        if reason is not None:
            raise ValueError(reason)
        self.reuse_config = reuse_of(engine_config)
        self.causal_lm: MegatronCausalLM | None = None
        self.routers: McoreRouters | None = None  # megatron-core's MoE routers, under the aux loss
        self.expert_counts: ExpertCounts | None = None  # expert-biased routers' load counts
        self.aux_micro_batches = 1  # the mini-batch's logical micro-batches on this rank (the aux's 1/N)
        super().__init__(model_config, engine_config, *args, **kwargs)
        self.read_dormant(engine_config)

    def initialize(self) -> None:
        super().initialize()
        if not self.reuse_config.enable:
            return
        config = self.tf_config
        reason = built_model_refusal(config, self.model_config) or router_refusal(config)
        if reason is not None:
            raise ValueError(reason)
        if getattr(config, "recompute_granularity", None) is not None:
            install_recompute()  # megatron-core's recompute under the schedule's calls (``megatron.recompute``)
        # sequence parallelism splits every sequence over the TP ranks: the schedule's calls pad to a multiple
        multiple = self.engine_config.tensor_model_parallel_size if getattr(config, "sequence_parallel", False) else 1
        link = self._stage_link()
        self.causal_lm = MegatronCausalLM(list(self.module), self.model_config.hf_config, multiple, link)
        if self.engine_config.use_fused_kernels:  # still on after verl's own checks (remove padding, no MTP)
            logger.warning(
                "prefix_megatron with use_fused_kernels=true: reused rows take their log-probs from the logits "
                "(megatron-core's own forward, the same maths up to rounding; a suffix micro-batch holds its logits), "
                "dense rows run verl's fused kernels (docs/megatron.md)"
            )
        coeff, z_coeff = counted_coefficients(config)
        if coeff > 0 or z_coeff > 0:
            self.routers = self.causal_lm.routers = McoreRouters(self.causal_lm.chunks, coeff, z_coeff)
        counts = ExpertCounts(self.causal_lm.chunks)
        if counts:
            self.expert_counts = self.causal_lm.counts = counts
        reason = recompute_refusal(config, aux_counted=self.routers is not None)
        if reason is not None:
            raise ValueError(reason)
        reason = pipeline_refusal(config, link.num_stages if link is not None else 1)
        if reason is not None:
            raise ValueError(reason)

    def _stage_link(self) -> StageLink | None:
        """This rank's link to its neighbouring pipeline stages (megatron-core's pipeline group), or None."""
        from megatron.core import parallel_state as mpu

        if mpu.get_pipeline_model_parallel_world_size() == 1:
            return None
        self.link = StageLink.of_group(mpu.get_pipeline_model_parallel_group(), self.device(), len(self.module))
        return self.link

    # -- the driver's hooks ---------------------------------------------------------------------------

    def schedule_model(self) -> nn.Module:
        assert self.causal_lm is not None, "prefix_megatron: reuse is off"
        return self.causal_lm

    def compute_dtype(self) -> torch.dtype | None:
        return next(self.module[0].parameters()).dtype

    def schedule_options(self, run: MiniBatchRun, aux_fn: AuxFn) -> ScheduleOptions:
        # megatron-core's GPT layers: no KV-shared or recurrent ones
        aux = dict(routers=self.routers, aux_fn=aux_fn) if self.moe_aux_on(run.forward_only) else {}
        counts = self.expert_counts.weighted if self.expert_counts is not None else None
        return self.base_options(run, layer_roles=LayerRoles({}, frozenset()), count_routing=counts, **aux)

    def routes_last(self, forward_only: bool) -> bool:
        """Every row's last response token is routed too (dense routes it): under the aux loss, or expert bias."""
        return self.moe_aux_on(forward_only) or self.expert_counts is not None

    # -- megatron-core's router aux loss (``megatron.moe``) ---------------------------------------------------

    def moe_aux_on(self, forward_only: bool) -> bool:
        return not forward_only and self.routers is not None

    def start_mini_batch(self, run: MiniBatchRun) -> Any:
        """Under the aux loss: the mini-batch's logical micro-batches on this rank (suffix micro-batches of its
        groups and dense chunks), each of whose aux counts ``1 / N`` as megatron-core's schedule counts a dense
        micro-batch's; the routers' own aux (dense rows) gets that scale too."""
        if self.moe_aux_on(run.forward_only):
            count = sum(len(group.micro_batches) for group in run.plan.groups) + len(run.dense_chunks)
            self.aux_micro_batches = max(count, 1)
            set_aux_scale(self._loss_scale(torch.ones(1, device=run.meter.device)) / self.aux_micro_batches)
        return super().start_mini_batch(run)

    def moe_aux_term(self, stats: RouterStats, data: Any) -> tuple[torch.Tensor, dict[str, Metric]]:
        """megatron-core's aux and z-loss of one logical micro-batch (its rows' prefixes counted once per row), over
        ``N``; each logged without its coefficient, summed over the micro-batches (megatron-core's
        ``load_balancing_loss`` and ``z_loss``)."""
        routers = self.routers
        assert routers is not None
        term = routers.loss(stats) / self.aux_micro_batches
        metrics = {}
        if routers.coeff:
            metrics["moe_aux_loss"] = Metric(value=term.detach() / routers.coeff, aggregation=AggregationType.SUM)
        z = routers.z_loss(stats)
        if z is not None:
            z = z / self.aux_micro_batches
            metrics["moe_z_loss"] = Metric(value=z.detach() / routers.z_coeff, aggregation=AggregationType.SUM)
            term = term + z
        return term, metrics

    def reported_loss(self, loss: torch.Tensor, metrics: dict) -> float:
        """verl's loss without the aux and z terms, as verl's Megatron engine reports it (the routers' terms ride
        on the activations there, outside the loss)."""
        if self.routers is None:
            return loss.item()
        counted = (("moe_aux_loss", self.routers.coeff), ("moe_z_loss", self.routers.z_coeff))
        return loss.item() - sum(metrics[k].aggregate() * coeff for k, coeff in counted if k in metrics)

    def mini_batch_context(self, forward_only: bool) -> AbstractContextManager:
        """Forward-only passes keep no graph; training accumulates every micro-batch's gradients without a
        data-parallel reduction (``no_sync``), which ``finalize_model_grads`` runs once (``before_finish``)."""
        stack = ExitStack()
        if forward_only:
            stack.enter_context(torch.no_grad())
        else:
            for chunk in self.module:  # every model chunk (several under virtual pipeline stages)
                stack.enter_context(chunk.no_sync())
        return stack

    def backward(self, loss: torch.Tensor) -> None:
        """A micro-batch's backward as megatron-core's ``backward_step`` runs it: the optimizer's loss scale."""
        self._loss_scale(loss).backward()

    def _loss_scale(self, loss: torch.Tensor) -> torch.Tensor:
        scale = getattr(self.tf_config, "grad_scale_func", None)
        return scale(loss) if scale is not None else loss

    def before_finish(self, run: MiniBatchRun, metrics: dict) -> None:
        if not run.forward_only:
            self._finalize_grads()
        super().before_finish(run, metrics)

    # -- pipeline stages: each runs the schedule on its own layers (the driver matches their sends and shares the
    # last stage's outputs, ``distributed.stages``) --

    def _stage_forward(self, call: Any) -> Any:
        """A pipeline micro-batch's forward on this stage: ``call()`` on the previous stage's output (set as the
        chunk's input tensor on a stage after the first)."""

        def forward(inputs: torch.Tensor | None) -> torch.Tensor:
            if self.link is not None and not self.link.is_first:
                self.causal_lm.gpt.set_input_tensor(inputs)
            return call()

        return forward

    def _finalize_grads(self) -> None:
        """The data-parallel gradient reduction megatron-core's schedule runs after its last micro-batch."""
        from megatron.core.distributed import finalize_model_grads

        for chunk in self.module:
            if getattr(getattr(chunk, "ddp_config", None), "overlap_grad_reduce", False):
                chunk.start_grad_sync()  # every backward ran under no_sync: launch the reduction now
        finalize = getattr(self.tf_config, "finalize_model_grads_func", None) or finalize_model_grads
        finalize(self.module)

    def run_dense(self, run: MiniBatchRun, rows: list[int]) -> None:
        """One chunk of dense rows through verl's ``forward_step`` and its postprocessing (the loss unscaled:
        a chunk is one micro-batch here), backpropagated at once, recorded; under pipeline stages as one pipeline
        micro-batch (``_pipelined_dense``)."""
        if self.link is not None:
            self._pipelined_dense(run, rows)
            return
        micro = tu.index_select_tensor_dict(run.data, rows)
        tu.assign_non_tensor(micro, num_micro_batch=1)
        post = functools.partial(
            self.postprocess_micro_batch_func, forward_only=run.forward_only, loss_function=run.loss_function
        )
        aux_on = self.moe_aux_on(run.forward_only)
        before = {name: aux_tracked(name) for name in ("load_balancing_loss", "z_loss")} if aux_on else {}
        with torch.no_grad() if run.forward_only else nullcontext():
            output, loss_func = self.forward_step(
                iter([micro]), model=self.module[0], logits_processor_func=run.loss_function,
                postprocess_micro_batch_func=post,
            )  # fmt: skip
            loss, meta = loss_func(output)
            if not run.forward_only:
                self.backward(loss)
        metrics = dict(meta["metrics"])
        if aux_on:  # the routers' own terms of this chunk (megatron-core's tracker logs them without coefficients)
            for key, name, coeff in (
                ("moe_aux_loss", "load_balancing_loss", self.routers.coeff),
                ("moe_z_loss", "z_loss", self.routers.z_coeff),
            ):
                if coeff:
                    value = torch.tensor((aux_tracked(name) - before[name]) / self.aux_micro_batches)
                    metrics[key] = Metric(value=value, aggregation=AggregationType.SUM)
        run.record(rows, meta.get("model_output", {}), meta["loss"], metrics)

    def _pipelined_dense(self, run: MiniBatchRun, rows: list[int]) -> None:
        """A chunk of dense rows as one pipeline micro-batch: verl's ``forward_step`` on every stage (its packed
        inputs on the first, the previous stage's hidden states after it), its loss on the last."""
        micro = tu.index_select_tensor_dict(run.data, rows)
        tu.assign_non_tensor(micro, num_micro_batch=1)
        post = functools.partial(
            self.postprocess_micro_batch_func, forward_only=run.forward_only, loss_function=run.loss_function
        )
        held: dict = {}

        def call(chunk: nn.Module) -> torch.Tensor:
            output, held["loss_func"] = self.forward_step(
                iter([micro]), model=chunk, logits_processor_func=run.loss_function,
                postprocess_micro_batch_func=post,
            )  # fmt: skip
            return output

        def score(output: Any) -> torch.Tensor | None:
            loss, meta = held["loss_func"](output)
            run.record(rows, meta.get("model_output", {}), meta["loss"], dict(meta["metrics"]))
            return None if run.forward_only else self._loss_scale(loss)

        step = StageStep(torch.empty(0), self._stage_forward(lambda: self.causal_lm.through_chunks(call)), score)
        run_micro_batches(self.link, [step], backward=not run.forward_only)

    def run_dense_filler(self, run: MiniBatchRun) -> None:
        """Under pipeline stages a peer's dense chunk is matched by a zero-loss pipeline micro-batch."""
        if self.link is None:
            super().run_dense_filler(run)
            return
        step = StageStep(
            torch.empty(0),
            self._stage_forward(lambda: self.filler_logits(run)),
            lambda output: None if run.forward_only else output.sum() * 0.0,
        )
        with torch.no_grad() if run.forward_only else nullcontext():
            run_micro_batches(self.link, [step], backward=not run.forward_only)

    def filler_logits(self, run: MiniBatchRun) -> torch.Tensor:
        """The routers' own aux off and expert loads uncounted: a filler routes nothing that counts."""
        length = max(2, self.causal_lm.sequence_multiple if self.causal_lm is not None else 1)
        ids = torch.zeros(1, length, dtype=torch.long, device=run.meter.device)
        positions = torch.arange(length, device=ids.device)[None]
        own_aux = self.routers.own_aux_off() if self.routers is not None else nullcontext()
        uncounted = self.expert_counts.weighted(0.0) if self.expert_counts is not None else nullcontext()
        with own_aux, uncounted:
            if self.causal_lm is None:
                return self.module[0](input_ids=ids, position_ids=positions, attention_mask=None)
            return self.causal_lm.through_chunks(
                lambda chunk: chunk(input_ids=ids, position_ids=positions, attention_mask=None)
            )
