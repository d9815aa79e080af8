"""One mini-batch, whatever the engine: the driver every ``prefix_*`` engine runs ``forward_backward_batch`` through.

verl calls ``forward_backward_batch(data, loss_function, forward_only)`` once per mini-batch. The driver:

1. **checks and plans locally** (``_local``, no collective): the rank's fallback reason (the engine's
   ``reuse_reason``), the batch's checks (``validation.check_batch``), its groups (``grouping.plan_batch``: rows or a
   token budget per suffix micro-batch, as verl sizes its own), its dense chunks, its trie (``local_trie``), its
   phase-B kernels (``kernel_refusal``) and dormant choices (``group_policies``);
2. **agrees once** (``distributed.mini_batch``): one gather of every rank's ``RankReport``; every rank derives the
   same ``Agreement`` (a bad batch anywhere raises the same ``BatchRejected`` everywhere);
3. runs the whole mini-batch through the **stock engine** where any rank must (``stock_batch``, counted as
   ``prefix/fallback_<reason>``), else **normalises** the loss as the stock engine does (``batch_num_tokens``,
   ``dp_size``, ``sp_size``), runs every **group slot** in lockstep (``run_group`` / ``run_filler_group``, or the
   tree, ``run_tree``), the **dense rows** (``run_dense`` / ``run_dense_filler``), and **finishes** the output and
   metrics (``outputs.MiniBatchOutputs``).

An engine is an adapter: a subclass of its verl engine with ``ReuseDriver`` first in its bases, supplying only
what differs (how its model runs a group's three phases, its groups, its stock path). What every engine shares
lives here, once.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name

from verl_prefix.backend import fallbacks
from verl_prefix.backend.config import PrefixReuseConfig
from verl_prefix.backend.distributed.dormant_agreement import agree_on_node_policies, group_policies, slot_policies
from verl_prefix.backend.distributed.lockstep import LockstepPlan, filler_group, in_lockstep
from verl_prefix.backend.distributed.mini_batch import (
    Agreement,
    RankReport,
    agree,
    error_message,
    exchange,
    local_refusal,
    model_head_dim,
)
from verl_prefix.backend.distributed.once import AgreedDormant
from verl_prefix.backend.distributed.stages import StageLink, batch_fingerprint
from verl_prefix.backend.inputs import per_row_temperature
from verl_prefix.backend.outputs import (
    MiniBatchOutputs,
    as_micro_batch_lists,
    dense_batch_output,
    dense_chunk,
    full_length,
    micro_batch_loss,
    model_shape,
)
from verl_prefix.backend.trees import local_trie, padded_trie
from verl_prefix.backend.validation import check_batch
from verl_prefix.schedule.dormant import (
    Dormant,
    DormantStats,
    default_store,
    refuse_offload_on,
    release_pinned_memory,
    validate_policy,
)
from verl_prefix.schedule.executor import LossFn, infer_group, train_group
from verl_prefix.schedule.flop_model import ModelShape
from verl_prefix.schedule.grouping import BatchPlan, GroupPlan, RowLayout, plan_batch
from verl_prefix.schedule.kv.contexts import LAYER_PATHS
from verl_prefix.schedule.kv.shim import scores
from verl_prefix.schedule.models import moe
from verl_prefix.schedule.options import AuxFn, ScheduleOptions
from verl_prefix.schedule.telemetry import PhaseMeter
from verl_prefix.schedule.tree.dormant import NodePolicy
from verl_prefix.schedule.tree.lockstep import filler_passes, trie_shape
from verl_prefix.schedule.tree.schedule import infer_tree, train_tree
from verl_prefix.schedule.tree.trie import TrieNode, run_order, tree_metrics, trie_stats
from verl_prefix.schedule.tree.visuals import VisualTokens


@dataclass
class MiniBatchRun:
    """One mini-batch on the reuse path, as every rank agreed to run it."""

    data: TensorDict  # the mini-batch, on the device
    layout: RowLayout
    plan: BatchPlan
    lockstep: LockstepPlan
    dense_chunks: list[list[int]]
    agreement: Agreement
    loss_function: Callable | None
    forward_only: bool
    calculate_entropy: bool
    meter: PhaseMeter
    outputs: MiniBatchOutputs
    roots: list[TrieNode] | None = None  # the padded trie under ``prefix_reuse.tree``
    policies: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # per group slot: dormant policy
    state: Any = None  # the engine's own per-mini-batch state (``start_mini_batch``)

    @property
    def record(self) -> Callable[[list[int], dict, float, dict], None]:
        return self.outputs.record


@dataclass
class _Local:
    """What this rank planned before the exchange (its report's details)."""

    layout: RowLayout
    plan: BatchPlan
    dense_chunks: list[list[int]]
    roots: list[TrieNode] | None
    policies: list[tuple[str, str]]


class ReuseDriver:
    """The mini-batch driver, mixed in first: ``class PrefixXEngine(ReuseDriver, verl's XEngine)``.

    The engine supplies ``reuse_config`` and the hooks below; the ones with a body here are the common case."""

    reuse_config: PrefixReuseConfig
    dormant_prefix: str = "keep"  # ``dormant_prefix`` and its ``auto`` budget (engines that serve the policies)
    dormant_prefix_budget_bytes: int | None = None
    offload_store_factory: Callable = staticmethod(default_store)  # offload's saved-tensor store (tests inject one)
    # this rank's link to its pipeline stages (``distributed.stages``), set by an engine whose model is split into
    # stages: the stages check they hold the same rows, flush their sends after each group and share the last
    # stage's outputs
    link: StageLink | None = None
    _optimizer_seconds: float = 0.0

    # -- what the engine supplies -------------------------------------------------------------------

    def agreement_group(self) -> Any:
        """The ranks that must take the same path (the data-parallel group, or every rank under Ulysses)."""
        return self.get_data_parallel_group()

    def sequence_parallel_size(self) -> int:
        """verl's ``sp_size`` of the loss's normalisation."""
        return 1

    def reuse_reason(self, data: TensorDict, forward_only: bool) -> str | None:
        """This rank's reason to run the whole mini-batch dense (``disabled``: the stock engine, unchecked)."""
        if not self.reuse_config.enable:
            return "disabled"
        if forward_only and not self.reuse_config.forward_only_reuse:
            return "forward_only_disabled"
        return fallbacks.batch_fallback_reason(data)

    def moe_aux_on(self, forward_only: bool) -> bool:
        """Whether the router load-balancing loss is added (``moe_aux_loss_coef > 0``, training)."""
        return False

    def routes_last(self, forward_only: bool) -> bool:
        """Whether every row's last response token runs too (it predicts nothing; dense routes it through the
        MoE layers): under the router aux loss, or an engine's own routing counts (``count_routing``)."""
        return self.moe_aux_on(forward_only)

    def visual_token_ids(self) -> Any:
        """The model's image/video placeholder ids (``grouping.plan_batch``), or None."""
        return None

    def dense_refusal(self, data: TensorDict, chunks: list[list[int]]) -> str | None:
        """A dense chunk of this rank the engine cannot run (its description), or None."""
        return None

    def dense_refusal_error(self, mine: str | None) -> str:
        """The error every rank raises where some rank's ``dense_refusal`` was not None (``mine``: this rank's)."""
        raise NotImplementedError

    def refuse_dense(self, reason: str, dense_runs: int) -> None:
        """Raise where running ``dense_runs`` dense micro-batches for ``reason`` would be silently wrong."""

    def stock_batch(self, data: TensorDict, loss_function: Callable | None, forward_only: bool) -> dict:
        """The whole mini-batch through the stock engine (the verl engine after this class in the bases)."""
        return super().forward_backward_batch(data, loss_function, forward_only=forward_only)  # type: ignore[misc]

    def new_meter(self, device: torch.device) -> PhaseMeter:
        return PhaseMeter(device)

    def mini_batch_context(self, forward_only: bool) -> AbstractContextManager:
        """What the reuse path runs inside (an engine's train context, grad mode, autocast)."""
        return nullcontext()

    def read_dormant(self, engine_config: Any) -> None:
        """The dormant policy and its ``auto`` budget from the engine's config, checked once for every engine
        (``schedule.dormant.validate_policy``); ``offload`` under reuse needs an accelerator to offload from."""
        budget = getattr(engine_config, "dormant_prefix_budget_bytes", None)
        self.dormant_prefix = validate_policy(getattr(engine_config, "dormant_prefix", "keep"), budget)
        self.dormant_prefix_budget_bytes = budget
        self.offload_store_factory = default_store
        if self.reuse_config.enable and self.dormant_prefix == "offload":
            refuse_offload_on(self.device())

    def before_mini_batch(self, data: TensorDict) -> None:
        """What the engine checks before the mini-batch's first collective: under pipeline stages, that every
        stage holds the same rows (each receive must match a send)."""
        if self.link is not None:
            self.link.check_same(batch_fingerprint(data), "rows (token ids hashed)")

    # -- groups through the one schedule (``schedule.executor``, ``schedule.tree.schedule``) --------------------

    def schedule_model(self) -> nn.Module:
        """The model as the schedule calls it: an HF causal LM (``model(input_ids, position_ids, prefix_ctx,
        ...) -> .logits``), or an engine's stand-in for one."""
        raise NotImplementedError

    def schedule_options(self, run: MiniBatchRun, aux_fn: AuxFn) -> ScheduleOptions:
        """What every group of the mini-batch runs with: the engine's autocast, entropy, backward, Ulysses,
        routers, fused kernels, with the phase-B refusal every rank agreed on (``run.agreement``)."""
        raise NotImplementedError

    def base_options(self, run: MiniBatchRun, **engine: Any) -> ScheduleOptions:
        """The options every engine sets alike (the mini-batch's device, entropy and meter, the reuse knobs, the
        agreed phase-B refusal, the engine's ``backward``), plus the ``engine``'s own fields."""
        reuse = self.reuse_config
        return ScheduleOptions(
            device=run.meter.device,
            calculate_entropy=run.calculate_entropy,
            backward=self.backward,
            early_exit=reuse.early_exit,
            meter=run.meter,
            phase_b_attention=reuse.phase_b_attention,
            phase_b_refusal=run.agreement.kernel_refusal,
            prefix_chunk_tokens=reuse.prefix_chunk_tokens,
            **engine,
        )

    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the model computes in (autocast over fp32 master weights), or None: the parameters'."""
        return None

    def moe_aux_term(self, stats: moe.RouterStats, data: TensorDict) -> tuple[torch.Tensor, Any]:
        """The router aux loss term of a micro-batch and its metric, logged as ``moe_aux_loss`` (or a dict of
        metrics by name, for an engine that adds more than one router term) (engines with ``moe_aux_on``)."""
        raise NotImplementedError

    def reported_loss(self, loss: torch.Tensor, metrics: dict) -> float:
        """The loss a scheduled micro-batch reports: what it backpropagated (the aux term included, where the stock
        engine reports its aux inside the loss too)."""
        return loss.item()

    def kernel_refusal(self, device: torch.device, forward_only: bool) -> tuple[str, str] | None:
        """Why phase B's merged kernels cannot serve on this rank, or None: asked once per attention setting,
        compute dtype, device and pass kind (every rank's answer travels in the mini-batch's exchange)."""
        attention = self.reuse_config.phase_b_attention
        dtype = self.compute_dtype() or torch.bfloat16
        key = (attention, dtype, device, forward_only)
        answers = self.__dict__.setdefault("_kernel_answers", {})
        if key not in answers:
            head_dim = model_head_dim(self.schedule_model())
            answers[key] = local_refusal(attention, device, dtype, head_dim, not forward_only)
        return answers[key]

    def local_trie(self, layout: RowLayout, plan: BatchPlan, forward_only: bool) -> list[TrieNode] | None:
        """This rank's trie under ``prefix_reuse.tree`` (None: one-level reuse)."""
        if not self.reuse_config.tree:
            return None
        return local_trie(
            layout,
            plan,
            self.reuse_config.min_shared_tokens,
            own_last=self.routes_last(forward_only),  # every row's last token routed in its tail (trees.md)
            chunk_tokens=self.reuse_config.prefix_chunk_tokens,
            visual=VisualTokens.of(self.schedule_model()),  # images keyed by content in the trie (tree_visuals)
        )

    def dormant_knob(self) -> str:
        """``dormant_prefix``: where phase A's graph waits for phase C."""
        return self.dormant_prefix

    def group_policies(self, plan: BatchPlan, device: torch.device, forward_only: bool) -> list[tuple[str, str]]:
        """``(dormant policy, reason)`` per own group (``distributed.dormant_agreement.group_policies``; ``auto``
        estimates each group's graph in the compute dtype)."""
        knob, budget = self.dormant_prefix, self.dormant_prefix_budget_bytes
        return group_policies(knob, budget, self.schedule_model(), plan, device, self.compute_dtype())

    def start_mini_batch(self, run: MiniBatchRun) -> Any:
        """The options every group of the mini-batch runs with, its loss closures and dormant counters."""
        for attention in ("merged", "concat", "merged_varlen"):  # every rank reports each, zero where none ran
            run.meter.count(f"prefix/phase_b_attention/{attention}", 0.0)
        for path in LAYER_PATHS:
            run.meter.count(f"prefix/phase_b_layers/{path}", 0.0)
        pending: list[tuple[list[int], dict, dict]] = []  # the running group's micro-batches, in order
        loss_fn, aux_fn = self._group_losses(run, pending)
        options = self.schedule_options(run, aux_fn)
        return ScheduledRun(options, options.for_fillers(), loss_fn, pending, DormantStats(), self.reported_loss)

    def run_group(self, run: MiniBatchRun, slot: int, group: GroupPlan) -> None:
        """Phases A, B and C of one group, in the lockstep shape of its slot, its outputs recorded."""
        state, model = run.state, self.schedule_model()
        if run.forward_only:
            self._record_inferred(run, group, infer_group(model, run.layout, group, state.options))
            self._flush_stages()
            return
        dormant = self._dormant(run, slot, counted=True)
        state.record_pending(run, train_group(model, run.layout, group, state.loss_fn, state.options, dormant))
        self._flush_stages()

    def run_filler_group(self, run: MiniBatchRun, slot: int) -> None:
        """A group slot this rank has no group for, run with the filler options. With the aux on, real groups'
        phase A runs to the last router and phase C seeds the router leaf: the filler (``options.routers`` set)
        touches the same parameters, or FSDP2's reduce-scatters would differ in size; it has no real micro-batch,
        so its loss and aux never run."""
        layout, group = filler_group(run.lockstep.micro_batches[slot], run.lockstep.prefix_chunks[slot])
        model, options = self.schedule_model(), run.state.filler_options
        if run.forward_only:
            infer_group(model, layout, group, options)
        else:
            train_group(model, layout, group, no_loss, options, self._dormant(run, slot, counted=False))
        self._flush_stages()

    def run_tree(self, run: MiniBatchRun) -> None:
        """Every reuse group of the mini-batch through the tree schedule (``prefix_reuse.tree``), recorded per
        micro-batch as the one-level path records them; each node under its dormant policy."""
        assert run.roots is not None
        state, model = run.state, self.schedule_model()
        if run.forward_only:
            results = infer_tree(model, run.layout, run.roots, state.options)
            for group in run.plan.groups:
                self._record_inferred(run, group, results)
            self._flush_stages()
            return
        policies = self._node_policies(run.roots, run.meter.device, state.dormant_stats)
        state.record_pending(run, train_tree(model, run.layout, run.roots, state.loss_fn, state.options, policies))
        self._flush_stages()

    def _flush_stages(self) -> None:
        """Under pipeline stages: every send of the group in flight waited for (their tensors kept alive till then)."""
        if self.link is not None:
            self.link.flush()

    def before_finish(self, run: MiniBatchRun, metrics: dict) -> None:
        """The engine's own metrics of the mini-batch, before the output is assembled from ``run.outputs``: the
        tree's (``prefix/tree_*``). Under pipeline stages the last stage scored the rows: every stage returns its
        outputs."""
        if self.link is not None:
            run.outputs.replace(self.link.share((run.outputs.outputs, run.outputs.order)))
        if run.roots is not None:
            stats = {**tree_metrics(trie_stats(run.roots)), "prefix/tree_lockstep_fillers": filler_passes(run.roots)}
            metrics.update({k: float(v) for k, v in stats.items()})

    def after_mini_batch(self, run: MiniBatchRun, metrics: dict) -> None:
        """Metrics that go in after the phase metrics, and releases at the end of the mini-batch."""
        if not isinstance(run.state, ScheduledRun):
            return
        metrics.update(run.state.dormant_stats.metrics())
        release_pinned_memory()  # offload's host slabs: held from one group to the next, not past the mini-batch
        if run.state.options.ulysses is not None:
            metrics.update(run.state.options.ulysses.metrics())

    def _group_losses(self, run: MiniBatchRun, pending: list[tuple[list[int], dict, dict]]) -> tuple[LossFn, AuxFn]:
        """verl's loss on a suffix micro-batch's rows, and its router aux term; both note the micro-batch
        (rows, model output, metrics) in ``pending`` for ``ScheduledRun.record_pending`` once the group has run."""
        layout, dp_group = run.layout, self.get_data_parallel_group()

        def loss_fn(rows: list[int], log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None) -> torch.Tensor:
            model_output = {"log_probs": full_length(log_probs, layout, rows)}
            if entropy is not None:
                model_output["entropy"] = full_length(entropy, layout, rows)
            loss, metrics = micro_batch_loss(run.loss_function, model_output, run.data, rows, dp_group)
            pending.append((rows, model_output, metrics))
            return loss

        def aux_fn(rows: list[int], stats: moe.RouterStats) -> torch.Tensor:
            term, metric = self.moe_aux_term(stats, run.data)
            pending[-1][2].update(metric if isinstance(metric, dict) else {"moe_aux_loss": metric})
            return term

        return loss_fn, aux_fn

    def _record_inferred(
        self, run: MiniBatchRun, group: GroupPlan, results: dict[int, tuple[torch.Tensor, torch.Tensor | None]]
    ) -> None:
        """A forward-only group's micro-batches recorded as verl's outputs (``results``: row -> log-probs,
        entropy), each with verl's loss where one is given. Nothing on a pipeline stage before the last: the last
        stage's results are the outputs (``kv.shim.scores``)."""
        if not scores(self.schedule_model()):
            return
        layout, dp_group = run.layout, self.get_data_parallel_group()
        for rows in group.micro_batches:
            model_output = {"log_probs": full_length([results[i][0] for i in rows], layout, rows)}
            if run.calculate_entropy:
                model_output["entropy"] = full_length([results[i][1] for i in rows], layout, rows)
            loss, metrics = micro_batch_loss(run.loss_function, model_output, run.data, rows, dp_group)
            run.record(rows, model_output, 1.0 if loss is None else loss.detach().item(), metrics)

    def _dormant(self, run: MiniBatchRun, slot: int, counted: bool) -> Dormant:
        """The slot's agreed dormant policy; its recompute check agreed by every rank (``AgreedDormant``)."""
        policy, why = run.policies[slot]
        stats = run.state.dormant_stats if counted else None
        factory, group = self.offload_store_factory, self.agreement_group()
        return AgreedDormant(policy, why, stats=stats, store_factory=factory, group=group)

    def _node_policies(self, roots: list[TrieNode], device: torch.device, stats: DormantStats) -> NodePolicy:
        """Each trie node's ``dormant_prefix`` policy (``auto``: from its own estimate, recomputed nodes agreed
        by every rank position by position, lockstep fillers included), counted per real node in
        ``prefix/policy/<name>``."""
        nodes = run_order(roots)
        knob, budget, group = self.dormant_prefix, self.dormant_prefix_budget_bytes, self.agreement_group()
        chosen = agree_on_node_policies(knob, budget, self.schedule_model(), nodes, device, group, self.compute_dtype())
        by_node = {id(node): choice for node, choice in zip(nodes, chosen)}
        factory = self.offload_store_factory

        def policy(node: TrieNode) -> Dormant:
            name, why = by_node[id(node)]
            counted = None if node.filler else stats  # a filler's policy is its position's, not counted
            return AgreedDormant(name, why, stats=counted, store_factory=factory, group=group)

        return policy

    def run_dense(self, run: MiniBatchRun, rows: list[int]) -> None:
        """One chunk of dense rows through the stock ``forward_step``, recorded."""
        micro = tu.index_select_tensor_dict(run.data, rows)
        _, meta = dense_chunk(self.forward_step, micro, run.loss_function, run.forward_only, self.backward)
        run.record(rows, meta.pop("model_output", {}), meta["loss"], meta["metrics"])

    def backward(self, loss: torch.Tensor) -> None:
        """A micro-batch's backward (an engine with a loss scaler scales it)."""
        loss.backward()

    def run_dense_filler(self, run: MiniBatchRun) -> None:
        """A zero-loss dense micro-batch matching a peer's dense chunk, collective for collective: the engine's model
        on a dummy row (``filler_logits``), backpropagated at zero in training."""
        with torch.no_grad() if run.forward_only else nullcontext():
            logits = self.filler_logits(run)
            if not run.forward_only:
                self.backward(logits.sum() * 0.0)

    def filler_logits(self, run: MiniBatchRun) -> torch.Tensor:
        """The engine's model on a dummy row of a few tokens, in its own call convention (the lockstep filler's
        forward: every collective a dense chunk's forward makes, no loss), inside whatever the engine's dense
        forwards run in (autocast, router and counting switches)."""
        raise NotImplementedError

    # -- the mini-batch -----------------------------------------------------------------------------

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only: bool = False) -> Any:
        output = self._forward_backward(data, loss_function, forward_only)
        if "metrics" in output:  # verl's Megatron engine returns {} on every pipeline stage but the last
            output["metrics"] = as_micro_batch_lists(output["metrics"])
        return output

    def _forward_backward(self, data: TensorDict, loss_function: Callable | None, forward_only: bool) -> dict:
        self.before_mini_batch(data)
        device = self.device()
        mine, local, own_error = self._local(data, loss_function, forward_only, device)
        agreement = agree(exchange(mine, self.agreement_group()), mine, self.reuse_config.phase_b_attention, own_error)
        if self.moe_aux_on(forward_only) and loss_function is not None:
            tu.assign_non_tensor(data, moe_aux_num_tokens=agreement.moe_tokens)
        if agreement.reason is not None:
            if agreement.reason != "disabled":  # reuse switched off is the stock engine, as the user asked
                self.refuse_dense(agreement.reason, len(data))
            stock = functools.partial(self.stock_batch, data, loss_function, forward_only)
            return dense_batch_output(stock, data, agreement.reason, self.new_meter(device), shape=self.flop_shape())
        assert local is not None and agreement.lockstep is not None, "a rank that reuses has planned its batch"
        if agreement.dense_refused:
            raise ValueError(self.dense_refusal_error(mine.dense_refusal))
        self._attach_global_normalisation(data, agreement.loss_tokens)
        # on the agreed count, so that every rank refuses together (a rank without dense rows fills in for them)
        reasons = ", ".join(r for r, rows in local.plan.dense_rows.items() if rows) or "another rank's rows"
        self.refuse_dense(reasons, agreement.lockstep.num_dense_chunks)
        run = MiniBatchRun(
            data=data.to(device) if device.type != "cpu" else data,
            layout=local.layout,
            plan=local.plan,
            lockstep=agreement.lockstep,
            dense_chunks=local.dense_chunks,
            agreement=agreement,
            loss_function=loss_function,
            forward_only=forward_only,
            calculate_entropy=bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False)),
            meter=self.new_meter(device),
            outputs=MiniBatchOutputs.of_batch(data, forward_only),
            roots=padded_trie(local.roots, agreement.tries) if local.roots is not None else None,
            policies=slot_policies(
                "keep" if forward_only else self.dormant_knob(),
                local.policies,
                agreement.recompute,
                agreement.lockstep.num_groups,
            ),
        )
        run.state = self.start_mini_batch(run)
        with self.mini_batch_context(forward_only):
            self._run_groups(run)
            self.run_dense_chunks(run)
        return self._finish(run, data)

    def _local(
        self, data: TensorDict, loss_function: Callable | None, forward_only: bool, device: torch.device
    ) -> tuple[RankReport, _Local | None, BaseException | None]:
        """This rank's report, plan and own error; no collective (an error here reaches the peers through the
        exchange, before any of them enters a collective the others would not)."""
        try:
            report = RankReport(dp_rank=self.get_data_parallel_rank(), reason=self.reuse_reason(data, forward_only))
            if self.moe_aux_on(forward_only) and loss_function is not None:
                report.moe_tokens = int(data["input_ids"].offsets()[-1])  # logical tokens, every row
            if report.reason == "disabled":  # reuse off: the stock engine, which checks nothing
                return report, None, None
            layout = check_batch(data, forward_only=forward_only, reuse=report.reason is None)
            if "loss_mask" in data.keys():
                report.loss_tokens = data["loss_mask"].sum().item()
            if report.reason is not None:
                return report, None, None
            assert layout is not None
            layout = dataclasses.replace(layout, temperature=per_row_temperature(data))
            plan = self._plan(data, layout, forward_only)
            chunks = self._dense_chunks(data, plan.all_dense_rows)
            report.lockstep = LockstepPlan.of_plan(plan, len(chunks), self.reuse_config.prefix_chunk_tokens)
            report.dense_refusal = self.dense_refusal(data, chunks)
            report.kernel = self.kernel_refusal(device, forward_only)
            roots = self.local_trie(layout, plan, forward_only)
            report.trie = trie_shape(roots) if roots is not None else None
            policies = [] if forward_only or roots is not None else self.group_policies(plan, device, forward_only)
            report.recompute = [policy == "recompute" for policy, _ in policies]
            return report, _Local(layout, plan, chunks, roots, policies), None
        except Exception as exc:  # any local failure must reach the peers before they enter a collective
            return RankReport(dp_rank=self.get_data_parallel_rank(), error=error_message(exc)), None, exc

    def _plan(self, data: TensorDict, layout: RowLayout, forward_only: bool) -> BatchPlan:
        """The rank's groups and suffix micro-batches: ``suffix_micro_batch_size`` / ``suffix_token_budget`` where
        set, else verl's own sizing (``micro_batch_size_per_gpu``, or under ``use_dynamic_bsz`` the token budget
        ``max_token_len_per_gpu``)."""
        use_dynamic_bsz = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=False)
        max_rows = self.reuse_config.suffix_micro_batch_size
        if max_rows is None and not use_dynamic_bsz:
            max_rows = int(tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=1))
        max_tokens = self.reuse_config.suffix_token_budget
        if max_tokens is None and use_dynamic_bsz:
            max_tokens = int(tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=0)) or None
        return plan_batch(
            layout,
            max_rows=max_rows,
            max_tokens=max_tokens,
            min_prefix_len=self.reuse_config.min_prefix_len,
            min_group_size=self.reuse_config.min_group_size,
            extra_tokens_per_row=1 if self.routes_last(forward_only) else 0,  # the routed last token
            visual_token_ids=self.visual_token_ids(),
        )

    def _dense_chunks(self, data: TensorDict, rows: list[int]) -> list[list[int]]:
        """Dense rows in micro-batches of verl's size; the loss is globally normalised, so the split is free."""
        if not rows:
            return []
        size = int(tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=1) or 1)
        return [rows[i : i + size] for i in range(0, len(rows), size)]

    def _attach_global_normalisation(self, data: TensorDict, loss_tokens: int) -> None:
        """What the stock engine attaches before splitting (its all-reduce, here from the exchange): loss terms
        are shares of the mini-batch."""
        tu.assign_non_tensor(data, sp_size=self.sequence_parallel_size())
        tu.assign_non_tensor(data, batch_num_tokens=loss_tokens)
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())

    def _run_groups(self, run: MiniBatchRun) -> None:
        """Every group slot every rank agreed on: this rank's group, or a filler where it has none."""
        if run.roots is not None:
            self.run_tree(run)
            return
        for slot in range(run.lockstep.num_groups):
            if slot >= len(run.plan.groups):
                with run.meter.phase("lockstep"):
                    self.run_filler_group(run, slot)
                continue
            group = in_lockstep(
                run.plan.groups[slot], run.lockstep.micro_batches[slot], run.lockstep.prefix_chunks[slot]
            )
            self.run_group(run, slot, group)

    def run_dense_chunks(self, run: MiniBatchRun) -> None:
        """The rank's dense chunks, then fillers up to the agreed count."""
        for k in range(run.lockstep.num_dense_chunks):
            if k >= len(run.dense_chunks):
                with run.meter.phase("lockstep"):
                    self.run_dense_filler(run)
                continue
            with run.meter.phase("dense"):
                self.run_dense(run, run.dense_chunks[k])

    def _finish(self, run: MiniBatchRun, data: TensorDict) -> dict:
        extra: dict[str, float] = {}
        self.before_finish(run, extra)
        output = run.outputs.finish(
            data,
            run.layout,
            run.plan,
            run.meter,
            forward_only=run.forward_only,
            routed_last_token=self.moe_aux_on(run.forward_only),
            extra_metrics=extra,
            saved_tokens=int(extra.get("prefix/tree_saved_tokens", 0)),
            shape=self.flop_shape(),
            roots=run.roots,
        )
        self.after_mini_batch(run, output["metrics"])
        return output

    # -- shared by every engine -----------------------------------------------------------------------

    def flop_shape(self) -> ModelShape | None:
        """The model as the FLOP model prices it (``prefix/flops_*``), or None where it cannot read the config."""
        return model_shape(self.model_config.hf_config)

    def device(self) -> torch.device:
        name = get_device_name()
        return torch.device("cpu") if name == "cpu" else torch.device(name, get_device_id())

    def optimizer_step(self) -> float:
        start = time.perf_counter()
        grad_norm = super().optimizer_step()  # type: ignore[misc]
        self._optimizer_seconds = time.perf_counter() - start
        return grad_norm

    def train_batch(self, data: TensorDict, loss_function: Callable) -> Any:
        outputs = super().train_batch(data, loss_function)  # type: ignore[misc]
        if "metrics" in outputs:  # not on a pipeline stage before the last (verl returns {} there)
            outputs["metrics"]["prefix/time_s/optimizer"] = [self._optimizer_seconds]
        return outputs


@dataclass
class ScheduledRun:
    """A mini-batch's state where its groups run through the one schedule: the groups' options, the loss closures
    and the dormant counters."""

    options: ScheduleOptions
    filler_options: ScheduleOptions
    loss_fn: LossFn
    pending: list[tuple[list[int], dict, dict]]  # the running group's micro-batches (rows, output, metrics)
    dormant_stats: DormantStats
    reported: Callable[[torch.Tensor, dict], float]  # the loss a micro-batch reports (``ReuseDriver.reported_loss``)

    def record_pending(self, run: MiniBatchRun, losses: list[torch.Tensor]) -> None:
        """Record the group's micro-batches in the order they ran, each with the loss it reports."""
        for (rows, model_output, metrics), loss in zip(self.pending, losses, strict=True):
            run.record(rows, model_output, self.reported(loss, metrics), metrics)
        self.pending.clear()


def no_loss(rows: list[int], log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None) -> torch.Tensor:
    """A filler group's loss function: it has no real micro-batch, so this never runs."""
    raise AssertionError("a filler group has no real micro-batches")
