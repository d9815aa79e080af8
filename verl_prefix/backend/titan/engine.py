"""The ``prefix_torchtitan`` engine backend: verl's TorchTitan engine with the A/B/C schedule per uid group.

verl builds the model (torchtitan's parallelisms over DTensor), loads the HF checkpoint, owns the loss, the
optimizer step (torchtitan's grad clipping across TP/EP meshes) and checkpoints; only
``forward_backward_batch`` changes, through the mini-batch driver (``backend.driver``) every engine shares:
this adapter supplies how torchtitan's model runs a group's phases. Per group: phase A runs ``prompt[:-1]``
once through the model with every
layer's K/V captured at ``inner_attention`` (``titan.attention``); phase B runs the suffix rows as micro-batches
whose attention sees the prefix leaves, each micro-batch's verl loss backpropagated at once; phase C
backpropagates the prefix once, seeded with the leaves' dK/dV. Grouping, the prefix K/V container, suffix
batches and phase C's seeded backward are the schedule layer's (``verl_prefix.schedule``); only the
torchtitan-specific calls live here.

Rows that cannot reuse (short prefix, a group of one) run through verl's own ``forward_step`` and are counted
under ``prefix/fallback_<reason>`` with one log line. Data-parallel ranks keep FSDP's collectives matched with
the driver's lockstep (``backend.distributed``: agreed shape, zero-loss fillers). What this slice does not
serve is refused when the engine is built (``titan.config.refusal``), and so is a torchtitan flavor that does
not match the checkpoint (``titan.flavor``).

A group's phases are the one schedule's, as ``prefix_fsdp2`` runs them (``schedule.executor.train_group`` /
``infer_group``, ``schedule.tree.schedule``): torchtitan's model behind an HF causal-LM call (``titan.causal_lm``),
so the tree, a chunked prefix, merged phase-B attention and the dormant policies are served here too, MoE flavors
included (torchtitan's expert-load counts take the schedule's routing weights, ``ScheduleOptions.count_routing``:
the prefix once per row below it, each row's last token routed). Under pipeline parallelism each rank holds one
stage of the model and runs the same schedule on it; its model call crosses the stages by point-to-point sends
(``distributed.stages``), and dense rows run as pipeline micro-batches (verl's own engine has no pipelined step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.tensor import DTensor
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.workers.engine.utils import prepare_micro_batches

from verl_prefix.backend.config import TITAN_REUSE_OFF, PrefixReuseConfig
from verl_prefix.backend.distributed.collectives import is_distributed
from verl_prefix.backend.distributed.stages import StageLink, StageStep, run_micro_batches
from verl_prefix.backend.driver import MiniBatchRun, ReuseDriver
from verl_prefix.backend.outputs import MiniBatchOutputs
from verl_prefix.backend.titan import platform as titan_platform
from verl_prefix.backend.titan.attention import InnerAttentionHooks, causal_mask
from verl_prefix.backend.titan.causal_lm import TitanCausalLM
from verl_prefix.backend.titan.config import model_refusal, refusal
from verl_prefix.backend.titan.flavor import check_flavor
from verl_prefix.backend.titan.moe import ExpertCounts
from verl_prefix.backend.titan.sequence import padded_length, sequence_multiple
from verl_prefix.schedule.models.structure import LayerRoles
from verl_prefix.schedule.options import AuxFn, ScheduleOptions

logger = logging.getLogger(__name__)

_impl = titan_platform.ensure_titan_platform()


class PrefixTorchtitanEngineWithLMHead(ReuseDriver, _impl.TorchTitanEngineWithLMHead):
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
        engine_config = titan_platform.replace_config(
            engine_config,
            strategy="torchtitan",
            spmd_backend=titan_platform.SPMD_BACKEND_RENAMES.get(backend, backend),
        )
        super().__init__(model_config, engine_config, *args, **kwargs)
        check_flavor(self.config.model_spec, model_config.hf_config)
        self.hooks: InnerAttentionHooks | None = None
        self.expert_counts: ExpertCounts | None = None
        self.causal_lm: TitanCausalLM | None = None  # the one schedule's model (``scheduled``)
        self.read_dormant(engine_config)

    def initialize(self) -> None:
        super().initialize()
        if len(self.module) != 1:
            raise ValueError(
                "prefix_torchtitan: one model part per rank expected (virtual pipeline stages are not built)"
            )
        dims = self.parallel_dims
        self.link = StageLink.of_mesh(dims.get_mesh("pp") if dims.pp > 1 else None, self.device())
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
        link = self.link if self.link.num_stages > 1 else None
        self.causal_lm = TitanCausalLM(
            self.module[0], self.hooks, self.model_config.hf_config, self.expert_counts, self.sequence_multiple, link
        )

    # -- the mini-batch -----------------------------------------------------------------------------

    def get_per_tensor_param(self, **kwargs: Any) -> Any:
        """verl's weight sync (HF names, full tensors), with every pipeline stage's parameters on every rank."""
        weights, peft_config = super().get_per_tensor_param(**kwargs)
        return self.link.gather_named(weights), peft_config

    # -- the driver's hooks ---------------------------------------------------------------------------

    def sequence_parallel_size(self) -> int:
        return self.engine_config.tensor_parallel_size

    def stock_batch(self, data: TensorDict, loss_function: Callable | None, forward_only: bool) -> dict:
        if self.link.num_stages > 1:  # verl's own forward step has no pipeline: the same rows, pipelined here
            return self._pipelined_dense_batch(data, loss_function, forward_only)
        return super().stock_batch(data, loss_function, forward_only)

    def mini_batch_context(self, forward_only: bool) -> AbstractContextManager:
        stack = ExitStack()
        stack.enter_context(self.trainer.train_context())
        stack.enter_context(torch.no_grad() if forward_only else nullcontext())
        stack.enter_context(titan_platform.engine_autocast(self.engine_config, get_device_name()))
        return stack

    def schedule_model(self) -> nn.Module:
        assert self.causal_lm is not None, "initialize() builds the schedule's model"
        return self.causal_lm

    def compute_dtype(self) -> torch.dtype | None:
        return torch.float32 if self.engine_config.mixed_precision_param == "float32" else torch.bfloat16

    def schedule_options(self, run: MiniBatchRun, aux_fn: AuxFn) -> ScheduleOptions:
        return self.base_options(  # autocast: the mini-batch's context (``mini_batch_context``)
            run,
            entropy_fn=self.compute_entropy_from_logits,
            layer_roles=LayerRoles({}, frozenset()),  # torchtitan's decoders: no KV-shared or recurrent layers
            count_routing=self._counted if self.expert_counts else None,  # MoE: expert-load counts (titan.moe)
        )

    def routes_last(self, forward_only: bool) -> bool:
        """MoE flavors route every row's last response token, as dense does (the expert-load counts)."""
        return bool(self.expert_counts)

    # -- pipeline stages: each runs the schedule on its own part, the sends matched (``distributed.stages``) -------

    def run_dense_chunks(self, run: MiniBatchRun) -> None:
        if self.link.num_stages == 1:
            super().run_dense_chunks(run)
            return
        with run.meter.phase("dense"):  # one data-parallel rank per stage (titan.config): no lockstep peers
            self._pipelined_dense(run.data, run.dense_chunks, run.loss_function, run.forward_only, run.record)

    def filler_logits(self, run: MiniBatchRun) -> torch.Tensor:
        device = run.meter.device
        length = padded_length(2, self.sequence_multiple)
        ids = torch.zeros(1, length, dtype=torch.long, device=device)
        pos = torch.arange(length, device=device)[None]
        with self._counted(0.0):
            return self.module[0](ids, positions=pos, attention_masks=causal_mask(length, device))

    def dense_refusal(self, data: TensorDict, chunks: list[list[int]]) -> str | None:
        """verl's ``forward_step`` packs a dense chunk into one sequence; under TP x EP torchtitan's MoE needs
        its length divisible by TP (verl's own engine fails deep in DTensor otherwise): said plainly, on every
        data-parallel rank at once (the driver's exchange), before any of them enters a collective."""
        if self.sequence_multiple == 1:
            return None
        lengths = data["input_ids"].offsets().diff()
        odd = [int(lengths[rows].sum()) for rows in chunks if int(lengths[rows].sum()) % self.sequence_multiple]
        return f"a dense chunk of {odd[0]} packed tokens" if odd else None

    def dense_refusal_error(self, mine: str | None) -> str:
        where = mine or "another data-parallel rank's dense chunk"
        return (
            f"prefix_torchtitan: {where} under tensor x expert parallelism; torchtitan's MoE splits the "
            f"sequence over the {self.sequence_multiple} TP ranks and needs a multiple of that (verl's "
            "TorchTitan engine has the same limit); the rows fell back to dense (prefix/fallback_*): lower "
            "prefix_reuse.min_prefix_len / min_group_size, or pad the batch"
        )

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
        tokens = data["loss_mask"].sum().to(get_device_id())
        if is_distributed(self.get_data_parallel_group()):
            dist.all_reduce(tokens, op=dist.ReduceOp.SUM, group=self.get_data_parallel_group())
        self._attach_global_normalisation(data, tokens.item())
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=self.get_data_parallel_group())
        if indices is None:  # fixed size: consecutive rows
            starts = torch.tensor([0] + [len(m) for m in micro_batches]).cumsum(0).tolist()
            indices = [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])]
        outputs = MiniBatchOutputs.of_batch(data, forward_only)
        grad = torch.no_grad() if forward_only else nullcontext()
        autocast = titan_platform.engine_autocast(self.engine_config, get_device_name())
        with self.trainer.train_context(), grad, autocast:
            self._pipelined_dense(data, [list(rows) for rows in indices], loss_function, forward_only, outputs.record)
        outputs.replace(self.link.share((outputs.outputs, outputs.order)))
        return outputs.collected(data)

    def _counted(self, weights: torch.Tensor | float) -> Any:
        """MoE routing counted with ``weights`` per token (``titan.moe``); nothing to do for a dense model."""
        counts = self.expert_counts
        return counts.weighted(weights) if counts else nullcontext()
