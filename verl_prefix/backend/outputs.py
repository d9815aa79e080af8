"""Assemble what the schedule computed into what verl's worker expects back: full-sequence nested
log-probs, the micro-batch order, metrics as per-micro-batch lists, token counts and fallback counts. Both
engines (``prefix_fsdp2`` and ``prefix_torchtitan``) end a mini-batch here (``MiniBatchOutputs``,
``dense_batch_output``, ``dense_chunk``), so they return the same thing."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.seqlen_balancing import restore_dynamic_batch
from verl.workers.engine.utils import detach_tree, postprocess_batch_func

from verl_prefix.backend import fallbacks
from verl_prefix.schedule.flop_model import BatchFlops, ModelShape, batch_flops, flop_metrics, sequence_flops
from verl_prefix.schedule.grouping import BatchPlan, RowLayout
from verl_prefix.schedule.telemetry import PhaseMeter
from verl_prefix.schedule.tree.trie import TrieNode

logger = logging.getLogger(__name__)
_UNPRICED: set[str] = set()  # model types whose config the FLOP model could not read, logged once each


def full_length(values: list[torch.Tensor], layout: RowLayout, rows: list[int]) -> torch.Tensor:
    """Place response values into verl's full-sequence nested layout (prompt+response per row).

    Position ``p`` holds what predicts token ``p+1``, so row i's response values sit at
    ``[P-1, P-1+S)``; positions the schedule never computes hold zeros.
    """
    pieces, lengths = [], []
    for i, v in zip(rows, values):
        p, s = layout.prompt_lens[i], layout.response_lens[i]
        pieces += [v.new_zeros(p - 1), v, v.new_zeros(1)]
        lengths.append(p + s)
    flat = torch.cat(pieces)
    offsets = torch.tensor([0] + lengths, device=flat.device).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(flat, offsets)


def micro_batch_loss(
    loss_function: Callable | None, model_output: dict, data: TensorDict, rows: list[int], dp_group: Any
) -> tuple[torch.Tensor | None, dict]:
    """verl's loss (and its metrics) on the outputs of ``rows``, as ``TrainingWorker`` computes it per
    micro-batch; ``(None, {})`` where the pass has no loss function (forward-only without one)."""
    if loss_function is None:
        return None, {}
    micro = tu.index_select_tensor_dict(data, rows)
    return loss_function(model_output=model_output, data=micro, dp_group=dp_group)


def static_bsz(data: TensorDict) -> TensorDict:
    """postprocess_batch_func reorders only under dynamic bsz; we always reorder ourselves."""
    view = data.select()  # empty view keeps batch size; carry only the flags postprocess reads
    tu.assign_non_tensor(view, use_dynamic_bsz=False)
    return view


def as_micro_batch_lists(metrics: dict[str, Any]) -> dict[str, Any]:
    """verl's worker chains per-micro-batch lists across mini-batches: plain numbers become one-item lists."""
    return {k: [v] if isinstance(v, int | float) else v for k, v in metrics.items()}


def fallback_metrics(dense_rows: dict[str, list[int]] | dict[str, int], groups: int) -> dict[str, float]:
    """``prefix/groups``, ``prefix/fallback_<reason>`` per reason and their sum ``prefix/dense_samples`` (one key
    a dashboard can check for zero whatever the reasons)."""
    metrics = {"prefix/groups": float(groups)}
    for reason, rows in dense_rows.items():
        metrics[f"prefix/fallback_{reason}"] = float(rows if isinstance(rows, int) else len(rows))
    metrics["prefix/dense_samples"] = sum(v for k, v in metrics.items() if k.startswith("prefix/fallback_"))
    return metrics


def model_shape(hf_config: Any) -> ModelShape | None:
    """The FLOP model's shape of the engine's model, or ``None`` (one warning per model type) where its config
    lacks a dimension the model reads: the run then logs no ``prefix/flops_*``, and trains as before."""
    try:
        return ModelShape.from_config(hf_config)
    except (AttributeError, TypeError, ValueError) as exc:
        kind = str(getattr(hf_config, "model_type", type(hf_config).__name__))
        if kind not in _UNPRICED:
            _UNPRICED.add(kind)
            logger.warning(
                "verl-prefix: no prefix/flops_* metrics for %s, the FLOP model cannot read it: %s", kind, exc
            )
        return None


def token_counts(layout: RowLayout, plan: BatchPlan, routed_last_token: bool = False) -> tuple[int, int]:
    """(logical, physical): what dense would compute, and what the schedule computed. With the MoE aux
    loss on, suffix rows also feed their last response token (``routed_last_token``)."""
    logical = physical = 0
    for group in plan.groups:
        suffix = sum(layout.response_lens[i] for i in group.rows)
        logical += len(group.rows) * group.prompt_len + suffix
        physical += group.prefix_len + suffix + (len(group.rows) if routed_last_token else 0)
    for i in plan.all_dense_rows:
        logical += layout.prompt_lens[i] + layout.response_lens[i]
        physical += layout.prompt_lens[i] + layout.response_lens[i]
    return logical, physical


def _common_dtypes(model_outputs: list[dict]) -> None:
    """Cast each floating key's tensors, in place in the dicts, to the widest dtype any micro-batch gave it."""
    widest: dict[str, torch.dtype] = {}
    for out in model_outputs:
        for key, value in out.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                widest[key] = torch.promote_types(widest.get(key, value.dtype), value.dtype)
    for out in model_outputs:
        for key, dtype in widest.items():
            value = out.get(key)
            if isinstance(value, torch.Tensor) and value.dtype != dtype:
                out[key] = value.to(dtype)


class MiniBatchOutputs:
    """What a mini-batch's micro-batches returned, in the order they ran, and the output verl's worker expects
    from them. Both engines (``prefix_fsdp2``, ``prefix_torchtitan``) record and finish here, so they return the
    same thing: verl's postprocessing, the rows put back in order, fallback counts with their log line, and the
    token and phase metrics."""

    def __init__(self, keep_outputs: bool) -> None:
        self.keep_outputs = keep_outputs  # forward-only passes, or verl's return_model_output
        self.outputs: list[dict] = []
        self.order: list[list[int]] = []

    @classmethod
    def of_batch(cls, data: TensorDict, forward_only: bool) -> MiniBatchOutputs:
        """Outputs kept on forward-only passes and where verl asks for them (``return_model_output``)."""
        returns = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        return cls(keep_outputs=bool(forward_only or returns))

    def record(self, rows: list[int], model_output: dict, loss: float, metrics: dict) -> None:
        model_output = detach_tree(model_output) if self.keep_outputs else {}
        self.outputs.append({"model_output": model_output, "loss": loss, "metrics": metrics})
        self.order.append(rows)

    def collected(self, data: TensorDict) -> dict:
        """verl's postprocessing of the recorded micro-batches, rows back in the batch's order. Micro-batches whose
        values came in different dtypes (verl's fused kernels give fp32 log-probs; dense rows that ran verl's
        unfused path, the model's dtype) are joined in the widest, exactly."""
        _common_dtypes([entry["model_output"] for entry in self.outputs])
        output = postprocess_batch_func(output_lst=self.outputs, indices=self.order, data=static_bsz(data))
        if output["model_output"]:
            output["model_output"] = {
                k: restore_dynamic_batch(v, self.order) for k, v in output["model_output"].items()
            }
        return output

    def replace(self, recorded: tuple[list[dict], list[list[int]]]) -> None:
        """Take another rank's records (``(outputs, order)``): a pipeline stage that computed no loss returns the
        last stage's (``distributed.stages.StageLink.share``)."""
        self.outputs, self.order = recorded

    def finish(
        self,
        data: TensorDict,
        layout: RowLayout,
        plan: BatchPlan,
        meter: PhaseMeter,
        *,
        forward_only: bool,
        routed_last_token: bool = False,
        extra_metrics: dict[str, float] | None = None,
        saved_tokens: int = 0,
        shape: ModelShape | None = None,
        roots: Sequence[TrieNode] | None = None,
    ) -> dict:
        """The mini-batch's output. ``extra_metrics`` go in before the phase metrics; ``saved_tokens`` are
        physical tokens a shared-prefix tree did not recompute (``prefix/tree_saved_tokens``). With the model's
        ``shape`` the FLOP model prices the batch as it ran (``roots``: the trie it ran under the tree)."""
        output = self.collected(data)
        output["metrics"].update(fallback_metrics(plan.dense_rows, groups=len(plan.groups)))
        fallbacks.log_fallbacks(reason for reason, rows in plan.dense_rows.items() if rows)
        logical, physical = token_counts(layout, plan, routed_last_token=routed_last_token)
        output["metrics"].update(extra_metrics or {})
        phases = ("A", "B", "dense", "lockstep") if forward_only else ("A", "B", "C", "dense", "lockstep")
        phase_metrics = meter.metrics(logical, physical - saved_tokens, phases=phases)
        output["metrics"].update(phase_metrics)
        if shape is not None:
            flops = batch_flops(shape, layout, plan, roots, routed_last_token=routed_last_token and roots is None)
            output["metrics"].update(flop_metrics(flops, phase_metrics["prefix/time_s/schedule"]))
        return output


def dense_batch_output(
    run: Callable[[], dict], data: TensorDict, reason: str, meter: PhaseMeter, shape: ModelShape | None = None
) -> dict:
    """A whole mini-batch through the stock engine (``run``), counted as ``prefix/fallback_<reason>`` with one
    log line (``disabled`` too: a run that selected ``prefix_fsdp2`` sees that reuse is off), every token logical
    and physical; with the model's ``shape``, its FLOPs dense on both sides (a saving of exactly 1). A pipeline stage
    before the last has no outputs (verl's Megatron engine returns ``{}``) and gets none."""
    with meter.phase("dense"):
        output = run()
    if "metrics" not in output:  # a pipeline stage before the last: verl's Megatron engine returns {} there
        return output
    tokens = int(data["input_ids"].offsets()[-1])
    output["metrics"].update(fallback_metrics({reason: len(data)}, groups=0))
    fallbacks.log_fallbacks([reason])
    phase_metrics = meter.metrics(logical_tokens=tokens, physical_tokens=tokens)
    output["metrics"].update(phase_metrics)
    if shape is not None:
        lengths = data["input_ids"].offsets().diff().tolist()
        total = sum(sequence_flops(shape, int(n)) for n in lengths)
        output["metrics"].update(flop_metrics(BatchFlops(total, total), phase_metrics["prefix/time_s/schedule"]))
    return output


def dense_chunk(
    step: Callable[..., tuple[torch.Tensor, dict]],
    micro: TensorDict,
    loss_function: Callable | None,
    forward_only: bool,
    backward: Callable[[torch.Tensor], None],
) -> tuple[torch.Tensor, dict]:
    """One chunk of dense rows through the stock engine's ``forward_step``: under ``torch.no_grad()`` when
    forward-only (no graph kept for log-probs nobody differentiates), else backpropagated with ``backward``."""
    with torch.no_grad() if forward_only else nullcontext():
        loss, meta = step(micro, loss_function=loss_function, forward_only=forward_only)
        if not forward_only:
            backward(loss)
    return loss, meta
