"""The three-phase prefix-reuse schedule for one uid group, training and forward-only.

A: the prefix ``prompt[:-1]`` runs once with grad, its per-layer K/V captured (early exit after the
   last layer's K/V). B: suffix rows ``[prompt[-1]] + response[:-1]`` run as ordinary micro-batches
   against detached prefix leaves; each micro-batch's loss is backpropagated at once and the leaves
   accumulate dK/dV. C: one backward through the prefix graph seeded with the accumulated dK/dV.

The phase steps exist once, here, and both schedules run them: ``node_forward`` (phase A of a node, its leaves),
``train_suffixes``/``suffix_step`` and ``infer_suffixes`` (phase B under the node's path), ``filler_step`` (every
zero-loss lockstep micro-batch) and ``node_backward`` (phase C). One-level reuse is the depth-1 case of the tree
schedule (``schedule.tree.schedule``): a group's prefix is a one-node path, whose leaves ``join_path`` hands over as
they are; a chunked prefix is one node too, a ``ChunkedPrefix`` holding one set of leaves for the whole prefix.

The model is any HF causal LM (or an FSDP2 wrapper of one) called through its root ``forward``, so
wrappers see ordinary forward/backward hooks. Loss, normalisation and outputs are the caller's.

The group and phase functions take the mini-batch's ``ScheduleOptions`` (``schedule.options``) and besides
only what varies per call, at most five parameters: what is constant over a mini-batch is a field of the
options; the per-group decisions are explicit (the lockstep fillers on the ``GroupPlan``, the dormant policy
as ``train_group``'s ``dormant``); per-row temperatures ride on the ``RowLayout``. Phase C's backward takes
no options: the leaves' gradients are all it needs.

With an MoE router aux loss (``options.routers`` + ``options.aux_fn``), phase A also keeps the prefix's router
statistics (their probability sum is one more boundary leaf), each suffix row also feeds its last
response token (dense routes it too), and each micro-batch's aux sees the prefix once per row
(``verl_prefix.schedule.models.moe``). An engine that keeps routing statistics of its own (torchtitan's
expert-load counts) gets them through ``options.count_routing``: ``node_forward`` weighs a node's tokens by the
rows below it, ``suffix_forward`` a row's real tokens by one, fillers and phase C's recomputed forwards by zero.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from verl.utils.torch_functional import logprobs_from_logits

from verl_prefix.schedule.chunked import ChunkedPrefix, num_chunks
from verl_prefix.schedule.dormant import Dormant
from verl_prefix.schedule.fused_head import fused_head, scalar_temperature
from verl_prefix.schedule.grouping import GroupPlan, RowLayout
from verl_prefix.schedule.kv.container import PrefixCaptured, PrefixKV
from verl_prefix.schedule.kv.contexts import CaptureContext, ChunkCaptureContext, ServeContext
from verl_prefix.schedule.kv.seam import prefix_attention_mode
from verl_prefix.schedule.kv.shim import Handoff, scores
from verl_prefix.schedule.models import moe, recurrent
from verl_prefix.schedule.models.multimodal import (
    VisualInputs,
    counting_encoder_calls,
    is_visual_model,
    model_positions,
    text_only_call,
    visual_kwargs,
)
from verl_prefix.schedule.models.structure import LayerRoles, layer_roles
from verl_prefix.schedule.models.visual_chunks import EncodedVisuals
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.telemetry import NullMeter, PhaseMeter

# loss_fn(rows, log_probs, entropy) -> scalar loss to backpropagate. log_probs[k] are the response
# log-probs of rows[k] (length = its response), entropy likewise or None.
LossFn = Callable[[list[int], list[torch.Tensor], list[torch.Tensor] | None], torch.Tensor]


@dataclass
class SuffixBatch:
    """A right-padded suffix micro-batch of one group; row k covers positions P-1 .. P+S_k-2."""

    rows: list[int]
    input_ids: torch.Tensor  # [B, S_max]: prompt[-1] + response[:-1]
    position_ids: torch.Tensor  # [B, S_max], or [B, 4, S_max] for multimodal rows (verl's text + 3 rotary axes)
    labels: torch.Tensor  # [B, S_max]: the response tokens each position predicts
    valid: torch.Tensor  # [B, S_max] bool: positions that predict a response token
    lengths: list[int]
    tokens: torch.Tensor  # [B, S_max] bool: real (non-pad) tokens, what a router aux loss counts
    temperature: torch.Tensor  # [B]: what each row's logits are divided by


def suffix_positions(positions: torch.Tensor, prompt_len: int, response_len: int) -> torch.Tensor:
    """The positions of ``[prompt[-1]] + response[:-1]``: the suffix starts at P-1, not P (trap 4)."""
    return positions[..., prompt_len - 1 : prompt_len - 1 + response_len]


def build_suffix_batch(
    layout: RowLayout, rows: list[int], prompt_len: int, options: ScheduleOptions, include_last: bool = False
) -> SuffixBatch:
    """Right-padded suffix rows on ``options.device``. ``include_last`` also feeds each row's last response
    token, which predicts nothing but which dense training routes through every MoE layer (router aux loss)."""
    device = options.device
    # the rows' tokens after the prompt: their responses, or a tree node's tails (``prompt_len`` = path + 1)
    lengths = [layout.input_ids[i].numel() - prompt_len for i in rows]
    extra = 1 if include_last else 0
    width = max(lengths) + extra
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    axes = layout.position_ids[rows[0]].shape[:-1]  # () or (4,): multimodal rows carry one row per axis
    pos = torch.zeros(len(rows), *axes, width, dtype=torch.long)
    labels = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    real = torch.zeros(len(rows), width, dtype=torch.bool)
    for k, (i, s) in enumerate(zip(rows, lengths)):
        tokens = layout.input_ids[i]
        n = s + extra
        ids[k, :n] = tokens[prompt_len - 1 : prompt_len - 1 + n]
        labels[k, :s] = tokens[prompt_len : prompt_len + s]
        pos[k, ..., :n] = suffix_positions(layout.position_ids[i], prompt_len, n)
        pos[k, ..., n:] = pos[k, ..., n - 1 : n] + torch.arange(1, width - n + 1)
        valid[k, :s] = True
        real[k, :n] = True
    temperature = layout.temperature[rows] if layout.temperature is not None else torch.ones(len(rows))
    return SuffixBatch(
        rows, ids.to(device), pos.to(device), labels.to(device), valid.to(device), lengths, real.to(device), temperature
    )


def _num_decoder_layers(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.num_hidden_layers)


def prefix_forward(
    model: nn.Module,
    prefix_ids: torch.Tensor,
    prefix_positions: torch.Tensor,
    options: ScheduleOptions,
    earlier: PrefixKV | None = None,
    visual: VisualInputs | None = None,
) -> PrefixKV:
    """Phase A. Runs under whatever grad mode the caller set; returns graph-attached K/V (and, with
    ``options.routers``, the prefix's router statistics). Early exit (``options.early_exit``) comes after
    the last K/V or the last router, whichever runs later. With ``earlier`` (a chunked prefix,
    ``verl_prefix.schedule.chunked``) the tokens are a later chunk that attends to the earlier chunks' K/V
    the way phase B's rows do (``options.phase_b_attention``). With ``options.ulysses`` this rank runs its
    slice of the prefix and keeps its head shard of the whole prefix's K/V; router statistics are summed
    over the slices (and ``options.keep_logits`` keeps the logits of this slice's share of its last that many positions,
    ``Ulysses.kept_in_slice``: ``tree.loss.node_values`` gathers what it computes from them). ``visual``: the
    group's visual inputs (``schedule.models.multimodal``), encoded here once; the encoder's calls are counted as
    ``prefix/vision_encoder_calls`` on ``options.meter`` (a chunk of a prefix whose images were encoded once,
    ``schedule.models.visual_chunks``, runs without a meter: the encoding counts)."""
    routers, ulysses = options.routers, options.ulysses
    roles = options.layer_roles or layer_roles(model)

    def routers_done(module: nn.Module) -> None:
        if ctx.early_exit and ctx.kv.complete:
            ctx.kv.interrupted = module
            raise PrefixCaptured

    capture = routers.capture(on_complete=routers_done) if routers is not None else nullcontext([])
    with capture as router_logits:
        length = prefix_ids.shape[-1]
        ctx = _capture_context(model, options, roles, router_logits, prefix_ids, earlier)
        if ulysses is not None:
            prefix_ids, prefix_positions = ulysses.shard(prefix_ids), ulysses.shard(prefix_positions, True)
        to_keep, keep, fused = _kept_outputs(model, options, length, prefix_ids.device)
        encoder = counting_encoder_calls(model) if visual else text_only_call(model)
        with encoder as encoder_calls, fused as call:
            try:
                out = model(
                    input_ids=prefix_ids[None],
                    position_ids=model_positions(model, prefix_positions[None]),
                    use_cache=False,
                    prefix_ctx=ctx,
                    **keep,
                    **visual_kwargs(visual, prefix_ids.device),
                )
                ctx.kv.handoff = getattr(out, "handoff", None)  # a pipeline stage before the last (kv.shim)
                # under fused kernels the kept positions' packed values (fused_head)
                if options.keep_logits and ctx.kv.handoff is None:
                    if call is not None:
                        call.outputs(out)  # checks the model returned them untouched
                        ctx.kv.logits, ctx.kv.fused_dtypes = call.packed[0, -to_keep:], call.dtypes
                    else:
                        ctx.kv.logits = out.logits[0, -to_keep:]
            except PrefixCaptured:
                pass
        if visual and options.meter is not None and encoder_calls is not None:
            options.meter.count("prefix/vision_encoder_calls", encoder_calls[0])
    ctx.kv.share(roles.sources)
    if not ctx.kv.complete:
        missing = [layer for layer in range(len(ctx.kv.keys)) if not ctx.kv.captured(layer)]
        raise RuntimeError(
            f"phase A did not capture K/V (or a recurrent state) for layers {missing}; is the model a supported "
            "decoder? (recurrent.recurrent_refusal names recurrent layers reuse does not serve)"
        )
    if routers is not None:
        if ulysses is None:
            ctx.kv.router_stats = routers.stats(router_logits)
        else:
            local = routers.stats(router_logits, ulysses.real_tokens(length, prefix_ids.device))
            ctx.kv.router_stats = ulysses.sum_stats(local)
    return ctx.kv


def _capture_context(
    model: nn.Module,
    options: ScheduleOptions,
    roles: LayerRoles,
    router_logits: list,
    prefix_ids: torch.Tensor,
    earlier: PrefixKV | None,
) -> CaptureContext:
    """Phase A's attention context: a whole prefix's capture, or a later chunk's over ``earlier`` chunks' K/V (as
    phase B's rows attend). Early exit waits for the last router too (``router_logits`` all captured); a pipeline
    stage before the last never exits early (its output feeds the next stage)."""
    ready = lambda: all(lg is not None for lg in router_logits)  # noqa: E731
    early_exit = options.exits_early and scores(model)
    length, device = prefix_ids.shape[-1], prefix_ids.device
    if earlier is None:
        return CaptureContext(
            _num_decoder_layers(model),
            early_exit=early_exit,
            ready=ready,
            ulysses=options.ulysses,
            length=length if options.ulysses is not None else None,
            sources=roles.sources,  # KV-shared layers: their prefix K/V are their source layer's
            recurrent_layers=roles.recurrent,
        )
    return ChunkCaptureContext(
        _num_decoder_layers(model),
        early_exit,
        earlier,
        length,
        device,
        options.phase_b_attention,
        ready,
        options.ulysses,
        options.phase_b_refusal,
        roles.sources,
    )


def _kept_outputs(
    model: nn.Module, options: ScheduleOptions, length: int, labels_device: torch.device
) -> tuple[int, dict, AbstractContextManager]:
    """What phase A keeps of the model's output: how many last positions (``to_keep``), the call's keyword for it,
    and, for a loss-carrying trie node under fused kernels, the fused head that computes their values instead of
    logits. verl's vision-language forwards hand unknown keywords on to attention: no ``logits_to_keep`` there.
    Under Ulysses the last ``keep_logits`` positions are spread over the slices: this slice's share of them."""
    to_keep = options.keep_logits or 1
    if options.ulysses is not None and options.keep_logits:
        to_keep = options.ulysses.kept_in_slice(length, options.keep_logits)
    keep = {} if is_visual_model(model) else {"logits_to_keep": to_keep}
    fused: AbstractContextManager = nullcontext()
    if options.fused_backend and options.keep_logits:
        if options.keep_labels is None:
            raise ValueError("a loss-carrying node under fused kernels needs its labels (options.keep_labels)")
        labels = kept_labels(options, options.keep_labels, length, to_keep).to(labels_device)
        fused = fused_head(model, labels, options.fused_temperature, options.fused_backend)
    return to_keep, keep, fused


def kept_labels(options: ScheduleOptions, labels: torch.Tensor, length: int, kept: int) -> torch.Tensor:
    """The labels of the last ``kept`` positions this rank holds of a ``length``-position node whose last
    ``len(labels)`` positions carry ``labels`` (a loss-carrying trie node): under ``options.ulysses`` this slice's
    share of them, with placeholder labels before the first labelled position."""
    if options.ulysses is None:
        return labels[-kept:]
    full = torch.zeros(length, dtype=torch.long)
    full[length - len(labels) :] = labels
    return options.ulysses.shard(full)[-kept:]


def suffix_router_stats(router_logits: list, batch: SuffixBatch, options: ScheduleOptions) -> moe.RouterStats:
    """The micro-batch's own router statistics (``options.routers``) over its real tokens (summed over
    sequence slices under ``options.ulysses``)."""
    routers, ulysses = options.routers, options.ulysses
    if routers is None:
        raise ValueError("suffix_router_stats needs options.routers")
    if ulysses is None:
        return routers.stats(router_logits, batch.tokens)
    return ulysses.sum_stats(routers.stats(router_logits, ulysses.shard(batch.tokens)))


def suffix_forward(
    model: nn.Module, prefix: PrefixKV, batch: SuffixBatch, options: ScheduleOptions
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None] | Handoff:
    """Phase B forward: response log-probs (and, with ``options.calculate_entropy``, entropy) of each
    row, computed exactly as verl does, each row's logits divided by its ``batch.temperature``.

    ``options.entropy_fn`` is the engine's own (compiled, chunked or checkpointed as its config says).
    ``options.phase_b_attention`` is ``prefix_reuse.phase_b_attention``; ``options.meter`` counts which
    attention ran.

    No copy of the ``[tokens, vocab]`` logits: log-probs and entropy are row-wise, so they run on a view
    of the padded ``[B * S, vocab]`` logits (pad positions cost a little compute, no memory) and only the
    ``[B, S]`` results are indexed; a temperature other than 1 divides the logits in place.

    With ``options.ulysses`` the rows run as this rank's slice of their positions; the ``[B, S]`` results
    are gathered over the group (the gather's backward scales the local slice, see ``schedule.ulysses``).

    On a pipeline stage before the last (``kv.shim.scores``) the call's ``Handoff`` instead: the next stage
    scores the rows."""
    ulysses = options.ulysses
    rows, full_width = batch.input_ids.shape
    input_ids, position_ids, labels = batch.input_ids, batch.position_ids, batch.labels
    if ulysses is not None:
        input_ids, labels = ulysses.shard(input_ids), ulysses.shard(labels)
        position_ids = ulysses.shard(position_ids, continue_positions=True)
    query_len = full_width if ulysses is None else ulysses.padded(full_width)
    row_lengths = batch.tokens.sum(1)  # real tokens per row, MoE's extra last token included
    ctx = ServeContext(
        prefix,
        query_len,
        batch.input_ids.device,
        options.phase_b_attention,
        ulysses=ulysses,
        row_lengths=row_lengths,
        refusal=options.phase_b_refusal,
    )
    position_ids = model_positions(model, position_ids)
    fused = nullcontext()
    if options.fused_backend:  # verl's fused kernels: the LM head returns log-probs and entropy, no logits
        fused = fused_head(model, labels, scalar_temperature(batch.temperature), options.fused_backend)
    routed = batch.tokens if ulysses is None else ulysses.shard(batch.tokens)  # each real token: one dense copy
    with text_only_call(model), fused as call, options.routing(routed.float()):
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, prefix_ctx=ctx)
    _note_attention(options.meter, ctx)
    if out.logits is None:
        return out.handoff
    width = input_ids.shape[1]
    if call is not None:
        log_probs, entropy = (values.reshape(-1) for values in call.outputs(out))
        entropy = entropy if options.calculate_entropy else None
    else:
        logits = out.logits.reshape(rows * width, -1)  # a view: lm_head's output is contiguous
        temperature = batch.temperature
        if not bool((temperature == 1).all()):
            row_temperature = temperature.to(logits.device, torch.float32).repeat_interleave(width)
            logits = logits.div_(row_temperature.to(logits.dtype).unsqueeze(-1))  # lm_head's backward needs no output
        log_probs, entropy = token_outputs(logits, labels.reshape(-1), options)
    log_probs = log_probs.view(rows, width)
    entropy = entropy.view(rows, width) if entropy is not None else None
    if ulysses is not None:
        log_probs = ulysses.gather(log_probs, full_width)
        entropy = ulysses.gather(entropy, full_width) if entropy is not None else None
    split = list(log_probs[batch.valid].split(batch.lengths))
    return split, (list(entropy[batch.valid].split(batch.lengths)) if entropy is not None else None)


def token_outputs(
    logits: torch.Tensor, labels: torch.Tensor, options: ScheduleOptions
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (and, with ``options.calculate_entropy``, entropy) of ``[tokens, vocab]`` logits
    already divided by their temperature, exactly as verl computes them (the engine's ``entropy_fn``)."""
    entropy = options.entropy_fn(logits) if options.calculate_entropy else None
    log_probs = logprobs_from_logits(logits, labels, inplace_backward=not options.calculate_entropy)
    return log_probs, entropy


def _note_attention(meter: PhaseMeter | None, ctx: ServeContext) -> None:
    """Count the micro-batch under the attention it ran: merged (or merged_varlen) when every layer ran it; and
    each layer under the path that served it (``prefix/phase_b_layers/<path>``, ``kv.contexts.LAYER_PATHS``)."""
    if meter is None:
        return
    if ctx.varlen_calls > 0 and not ctx.merged_calls and not ctx.refusals:
        ran = "merged_varlen"
    else:
        ran = "merged" if ctx.merged_calls > 0 and not ctx.refusals else "concat"
    meter.count(f"prefix/phase_b_attention/{ran}")
    for reason in sorted(ctx.refusals):
        meter.count(f"prefix/phase_b_attention/concat_{reason}")
    for path in set(ctx.layer_paths.values()):  # layers per micro-batch served each way (windows apart)
        meter.count(f"prefix/phase_b_layers/{path}", sum(1 for p in ctx.layer_paths.values() if p == path))


def unshard_cut_short(model: nn.Module, modules: list[nn.Module | None]) -> None:
    """Unshard, before phase C's backward, every FSDP2 unit whose parameters phase A's graph reads but whose
    own pre-backward hook will not unshard them. FSDP2 registers that hook on a unit's forward OUTPUTS, and
    phase C backpropagates from the captured K/V, which are no unit's output; a unit's hook fires only where
    its output feeds a later layer's K/V. The units that phase B's backward resharded (freeing the storage of
    the unsharded parameters phase A's graph saved) and that nothing else unshards are then:

    - the root (the model itself): its output (logits) never feeds phase C. A model that computes something
      differentiable from root-owned parameters before the decoder layers (Gemma-4's per-layer inputs: a
      Linear projection and an RMSNorm of the embeddings) saved them in phase A;
    - the units around ``modules``: the attention module early exit cut short (its layer's post-forward never
      ran) and the last layer that computed its own K/V (``PrefixKV.last_source``), whose output feeds no
      later K/V: the last layer without early exit, the last one before Gemma's KV-shared layers with it.

    Without this their backward reads freed storage: a segmentation fault on CPU, garbage on an accelerator
    (``tests/backend/test_model_structures_engine.py``). Each unit's post-backward (reduce-scatter, reshard)
    still runs from FSDP2's own hooks. Unsharding a unit that is unsharded is a no-op."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    names = {id(m): name for name, m in model.named_modules()}
    targets = [names[id(m)] for m in modules if m is not None and id(m) in names]
    for name, module in model.named_modules():
        around = name == "" or any(t == name or t.startswith(name + ".") for t in targets)
        if around and isinstance(module, FSDPModule):
            module.unshard()


def prefix_backward(prefix: PrefixKV, leaves: PrefixKV, model: nn.Module | None = None) -> None:
    """Phase C: one backward through the prefix, seeded with the dK/dV every suffix left on the leaves.

    A root without a graph is skipped only when phase A captured it with autograd on (nothing trainable
    feeds it, e.g. frozen layers under LoRA); otherwise its gradient would be dropped silently (a
    reentrant checkpoint around the layer ran it under no_grad), which is an error.
    """
    seeded_backward(prefix, [leaf.grad for leaf in leaves.tensors()], model)


def seeded_backward(
    prefix: PrefixKV,
    seeds: list[torch.Tensor | None],
    model: nn.Module | None = None,
    extra: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> None:
    """``prefix_backward`` with the seeds given: per boundary tensor of ``prefix`` its accumulated
    gradient, or None where nothing reached it (zeros are used; see below). A chunked prefix seeds each
    chunk with its slice of the whole prefix's leaf gradients. ``extra``: more (root, gradient) pairs that run
    in the same backward (a loss-carrying tree node's log-probs and entropy, ``schedule.tree.loss``); on a
    pipeline stage before the last, the phase-A output with the next stage's gradient joins them
    (``PrefixKV.handoff``)."""
    if model is not None:
        unshard_cut_short(model, [prefix.interrupted, prefix.last_source])
    roots, grads = [], []
    num_layers = len(prefix.keys)
    seeded = set()
    for index, (root, seed) in enumerate(zip(prefix.tensors(), seeds)):
        if seed is not None and (id(root), id(seed)) in seeded:
            continue  # KV-shared layers: one root and one leaf, whose grad already holds every layer's share
        seeded.add((id(root), id(seed)))
        if not root.requires_grad:
            layers = [index // 2] if index < 2 * num_layers else range(num_layers)
            if all(prefix.captured_with_grad[layer] for layer in layers):
                continue  # a constant: no trainable parameter upstream
            what = prefix.describe(index)
            raise RuntimeError(
                f"phase C: the prefix {what} has no autograd graph: phase A ran that layer with autograd off "
                "(a reentrant activation checkpoint around the decoder layer, e.g. verl's "
                "enable_activation_offload, runs its forward under no_grad), so the prefix gradient would be "
                "dropped. Use non-reentrant checkpointing or turn prefix reuse off for this model."
            )
        roots.append(root)
        # Zeros where no suffix reached a leaf (e.g. the router leaf of a lockstep filler group): every
        # rank then gives (zero) grads to the same parameters, and FSDP2 reduce-scatters exactly those.
        grads.append(seed.to(root.dtype) if seed is not None else torch.zeros_like(root))
    if prefix.handoff is not None:  # a pipeline stage before the last: the next stage's gradient of the output
        extra = [*extra, *prefix.handoff.roots()]
    for root, grad in extra:
        roots.append(root)
        grads.append(grad.to(root.dtype))
    if roots:
        torch.autograd.backward(roots, grad_tensors=grads)


# -- the phase steps, written once: one-level reuse runs them as a depth-1 path, the tree schedule per node ----


def join_path(path: list[PrefixKV]) -> PrefixKV | None:
    """The K/V of a root-to-node path as one prefix. One node (a group's prefix under one-level reuse, a trie
    root): its own leaves as they are, no copy. Longer paths: each attention layer's leaves concatenated along
    the sequence (a graph back to every node's own leaves); a recurrent layer's state is the last node's end
    state (each node continued from its parent's, so the path's state is where its last node stopped), its
    gradient landing on that node's leaves. Router statistics are not joined: ``path_stats`` counts them per
    row. ``None`` for an empty path (a root)."""
    if len(path) <= 1:
        return path[0] if path else None
    last = path[-1]
    joined = PrefixKV(len(last.keys), last.recurrent_layers)

    def cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if parts[-1] is None else torch.cat(parts, dim=2)

    joined.keys = [cat([p.keys[layer] for p in path]) for layer in range(len(joined.keys))]
    joined.values = [cat([p.values[layer] for p in path]) for layer in range(len(joined.values))]
    joined.recurrent = list(last.recurrent)
    return joined


def path_stats(path: list[PrefixKV], suffix: moe.RouterStats, copies: int) -> moe.RouterStats:
    """What a dense micro-batch of ``copies`` full rows sees: every node of the path once per row
    (``moe.logical_stats`` node by node; one-level reuse: its prefix alone). Each node's probability sum is
    scaled on its own, so each node's leaf receives a gradient tensor of its own: a ``stack(...).sum(0)`` hands
    both leaves views of one expanded gradient, which autograd may keep as both ``.grad``s and then accumulate
    into twice."""
    stats = suffix
    for node in path:
        stats = moe.logical_stats(node.router_stats, stats, copies)
    return stats


@dataclass
class Above:
    """What a group's suffix micro-batches hang under: the path of nodes above them, root first, as each node's
    K/V leaves (one-level reuse: the group's prefix alone, a depth-1 path). ``dormant``: the policy of the node
    they hang on, ``held``: the bytes the path's phase-A graphs hold while they run, as the policies left them
    (``Dormant.note_held_in_b``; 0 without a meter)."""

    path: list[PrefixKV]
    dormant: Dormant | None = None
    held: int = 0


def node_forward(
    model: nn.Module,
    forward: Callable[[], PrefixKV],
    dormant: Dormant | None,
    options: ScheduleOptions,
    given_leaves: bool = False,
    *,
    copies: int,
) -> tuple[PrefixKV, PrefixKV, int]:
    """Phase A of one node (a group's prefix, a trie node, a lockstep filler node): ``forward()`` under the
    meter's phase (``A``; ``lockstep`` for a filler node, no row below it), autocast and the ``dormant`` policy;
    the K/V are noted on the meter. Training (a policy given): the leaves phase B and the nodes below attend to
    (at least ``options.prefix_grad_dtype``), or, with ``given_leaves`` (a chunked prefix,
    ``ChunkedPrefix.forward``), what ``forward`` returned; forward-only (``dormant`` None): the K/V themselves.
    ``copies``: the rows below the node, each of which computes its tokens in dense (``options.routing``).
    Returns (K/V, leaves, bytes phase A saved for backward)."""
    meter = options.meter or NullMeter()
    phase = "A" if copies else "lockstep"
    policy = dormant.phase_a(model, options.device) if dormant is not None else nullcontext()
    with meter.phase(phase) as saved, options.autocast(), policy, options.routing(float(copies)):
        kv = forward()
    held = saved.total if saved is not None else 0
    meter.note_prefix_kv(kv.tensors())
    if dormant is None:
        return kv, kv, held
    leaves = kv if given_leaves else kv.as_leaves(requires_grad=True, min_dtype=options.prefix_grad_dtype)
    meter.note_prefix_leaves(kv.tensors(), leaves.tensors())  # chunked: the leaves are the K/V, grads only
    return kv, leaves, held


def suffix_step(
    model: nn.Module, above: Above, batch: SuffixBatch, loss_fn: LossFn, options: ScheduleOptions
) -> torch.Tensor | Handoff:
    """Phase B of one training micro-batch: ``batch`` (built with ``include_last`` under ``options.routers``)
    attends to its path's leaves (``join_path``), its loss, plus with ``options.routers`` the aux over the
    statistics a dense micro-batch of its rows sees (``path_stats``), is backpropagated at once; the leaves
    accumulate dK/dV. Returns the loss, detached; on a pipeline stage before the last the call's ``Handoff``,
    whose backward ``train_suffixes`` runs once every micro-batch went forward."""
    meter = options.meter or NullMeter()
    routers = options.routers
    with meter.phase("B") as saved:
        with options.autocast():
            capture = routers.capture() if routers is not None else nullcontext([])
            prefix = join_path(above.path)
            with capture as router_logits:
                scored = suffix_forward(model, prefix, batch, options)
            if not isinstance(scored, tuple):
                return scored
            log_probs, entropy = scored
            loss = loss_fn(batch.rows, log_probs, entropy)
            if routers is not None:
                stats = path_stats(above.path, suffix_router_stats(router_logits, batch, options), len(batch.rows))
                loss = loss + options.aux_fn(batch.rows, stats)
        options.backward(loss)
    if saved is not None and above.dormant is not None:
        above.dormant.note_held_in_b(above.held, saved.total)
    return loss.detach()


def filler_step(
    model: nn.Module, prefix: PrefixKV, batch: SuffixBatch, options: ScheduleOptions, train: bool, phase: str = "B"
) -> Handoff | None:
    """One lockstep filler micro-batch (data-parallel ranks run the same passes): ``batch`` over ``prefix`` under
    ``options.for_fillers()``, metered as ``phase`` on ``options.meter``; training backpropagates a zero loss, so
    every rank gives (zero) grads to the same parameters. On a pipeline stage before the last: the call's
    ``Handoff`` (its backward is the caller's, after the node's other micro-batches)."""
    meter = options.meter or NullMeter()
    with meter.phase(phase):
        with options.autocast():
            scored = suffix_forward(model, prefix, batch, options.for_fillers())
        if not isinstance(scored, tuple):
            return scored
        if train:
            options.backward(scored[0][0].sum() * 0.0)
    return None


def handed_off(
    step: torch.Tensor | Handoff | None, options: ScheduleOptions, phase: str = "B"
) -> torch.Tensor | Handoff | None:
    """A training micro-batch's result; an ``eager`` handoff (virtual pipeline stages: a backward crosses the ring of
    ranks inside autograd, so every stage backpropagates a micro-batch before the next goes forward) backpropagated
    now, None in its place."""
    if getattr(step, "eager", False):
        handoffs_backward([step], options, phase)
        return None
    return step


def handoffs_backward(handoffs: list[Handoff | None], options: ScheduleOptions, phase: str = "B") -> None:
    """A pipeline stage before the last: the backward of a node's micro-batches, in the order they went forward
    (GPipe: the next stages scored each meanwhile and send its gradient back), metered as ``phase``."""
    with (options.meter or NullMeter()).phase(phase):
        for handoff in handoffs:
            if handoff is not None:
                handoff.backward()


# rebuild() -> the graph-attached K/V phase C backpropagates through, and more (root, gradient) pairs
Rebuild = Callable[[], tuple[PrefixKV, list[tuple[torch.Tensor, torch.Tensor]]]]


def node_backward(
    model: nn.Module, leaves: PrefixKV, dormant: Dormant, rebuild: Rebuild, options: ScheduleOptions, phase: str = "C"
) -> None:
    """Phase C of one node (unchunked): ``rebuild()`` under autocast gives the graph-attached K/V (phase A's, or
    under ``recompute`` the node forward again, checked: ``Dormant.phase_c_prefix``) and the (root, gradient)
    pairs that join the same backward (a loss-carrying tree node's values); one backward seeded with what phase
    B and the nodes below left on ``leaves`` (``prefix_backward``). ``phase``: what the meter counts it as."""
    meter = options.meter or NullMeter()
    with meter.phase(phase):
        with options.autocast(), options.routing(0.0):  # a recomputed forward stands for no dense token
            kv, extra = rebuild()
        if extra:
            seeded_backward(kv, [leaf.grad for leaf in leaves.tensors()], model, extra)
        else:
            prefix_backward(kv, leaves, model)
        dormant.after_phase_c()


def train_suffixes(
    model: nn.Module, layout: RowLayout, group: GroupPlan, above: Above, loss_fn: LossFn, options: ScheduleOptions
) -> list[torch.Tensor]:
    """Phase B of training: the group's suffix micro-batches under ``above`` (``suffix_step``), then its lockstep
    filler micro-batches (over ``rows[0]``, ``filler_step``). Returns each micro-batch's loss (detached; none on a
    pipeline stage before the last, which backpropagates its handoffs once all went forward)."""
    steps: list[torch.Tensor | Handoff | None] = []
    for rows in group.micro_batches:
        batch = build_suffix_batch(layout, rows, group.prompt_len, options, include_last=options.routes_last)
        steps.append(handed_off(suffix_step(model, above, batch, loss_fn, options), options))
    if group.filler_micro_batches:
        prefix = join_path(above.path)
        for _ in range(group.filler_micro_batches):
            filler = build_suffix_batch(layout, group.rows[:1], group.prompt_len, options)
            steps.append(handed_off(filler_step(model, prefix, filler, options, True), options))
    if scores(model):
        return [loss for loss in steps if isinstance(loss, torch.Tensor)]
    handoffs_backward([step for step in steps if not isinstance(step, torch.Tensor)], options)
    return []


def infer_suffixes(
    model: nn.Module,
    layout: RowLayout,
    group: GroupPlan,
    prefix: PrefixKV,
    results: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
    options: ScheduleOptions,
) -> None:
    """Phase B of a forward-only pass: the group's suffix micro-batches over ``prefix``, each row's response
    log-probs and entropy (or None) into ``results``, then the group's lockstep filler micro-batches."""
    meter = options.meter or NullMeter()
    for rows in group.micro_batches:
        batch = build_suffix_batch(layout, rows, group.prompt_len, options, include_last=options.routes_last)
        with meter.phase("B"):
            scored = suffix_forward(model, prefix, batch, options)
        if not isinstance(scored, tuple):
            continue  # a pipeline stage before the last: the last stage's results are the outputs
        log_probs, entropy = scored
        for k, i in enumerate(rows):
            results[i] = (log_probs[k], entropy[k] if entropy is not None else None)
    for _ in range(group.filler_micro_batches):
        filler_step(
            model, prefix, build_suffix_batch(layout, group.rows[:1], group.prompt_len, options), options, False
        )


# -- one-level reuse: a group is a one-node path (its prefix), chunked as ``ChunkedPrefix`` where asked ---------


def _prefix_of(layout: RowLayout, group: GroupPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's prefix tokens and positions (``[P-1]``, or ``[4, P-1]`` for multimodal rows)."""
    first = group.rows[0]
    ids = layout.input_ids[first][: group.prefix_len].to(device)
    pos = layout.position_ids[first][..., : group.prefix_len].to(device)
    return ids, pos


def train_group(
    model: nn.Module,
    layout: RowLayout,
    group: GroupPlan,
    loss_fn: LossFn,
    options: ScheduleOptions,
    dormant: Dormant | None = None,
) -> list[torch.Tensor]:
    """Run A, B, C for one group; parameter grads accumulate. Returns each micro-batch's loss (detached).

    ``loss_fn(rows, log_probs, entropy)`` is the caller's loss of one micro-batch; with ``options.routers``
    it gains ``options.aux_fn(rows, stats)`` where ``stats`` count the prefix once per row of the
    micro-batch (``moe.logical_stats``). The group's lockstep fillers (``group.filler_micro_batches``,
    ``group.min_prefix_chunks``) run with ``options.for_fillers()``. ``dormant`` says where phase A's graph
    waits until phase C (``verl_prefix.schedule.dormant``; default keep): a per-group decision, so not an
    option. The group runs as a one-node path through the tree schedule's phase steps (``node_forward``,
    ``train_suffixes``, ``node_backward``); a chunked prefix's node is a ``ChunkedPrefix`` (one set of leaves).
    """
    meter = options.meter or NullMeter()
    dormant = dormant or Dormant()
    _refuse_recurrent(model, options, dormant.policy)
    prefix_ids, prefix_pos = _prefix_of(layout, group, options.device)
    visual = layout.visual_of(group.rows[0])

    def run_prefix() -> PrefixKV:
        return prefix_forward(model, prefix_ids, prefix_pos, options, visual=visual)

    encoded = EncodedVisuals(model, visual, prefix_ids, True) if visual else None
    chunked = _chunked(model, (prefix_ids, prefix_pos), group.min_prefix_chunks, options, True, encoded)
    with prefix_attention_mode(model):
        if chunked is None:
            prefix, leaves, held = node_forward(model, run_prefix, dormant, options, copies=len(group.rows))
        else:
            keep_graphs = dormant.policy != "recompute"
            forward = lambda: chunked.forward(keep_graphs)  # noqa: E731
            _, leaves, held = node_forward(model, forward, dormant, options, True, copies=len(group.rows))
            meter.count("prefix/chunked_groups")
            meter.count("prefix/prefix_chunks", chunked.count)
        # every suffix micro-batch (fillers too) attends to the same leaves the same way
        losses = train_suffixes(model, layout, group, Above([leaves], dormant, held), loss_fn, options)
        if chunked is None:
            node_backward(model, leaves, dormant, lambda: (dormant.phase_c_prefix(prefix, run_prefix), []), options)
            return losses
        with meter.phase("C") as saved_c:
            # each chunk's backward runs inside too, as phase B's do; a recomputed chunk stands for no dense token
            with options.autocast(), options.routing(0.0):
                # a chunk's graph is freed by its own backward: the meter counts the largest one
                done = saved_c.segment if saved_c is not None else None
                chunked.backward(dormant, seeded_backward, model, on_chunk_done=done)
            _count_encodes(encoded, meter)
            dormant.after_phase_c()
    return losses


def _refuse_recurrent(model: nn.Module, options: ScheduleOptions, dormant_policy: str) -> None:
    """Before a group's phase A: what the schedule does not serve for recurrent layers is refused here
    (``recurrent.recurrent_refusal``), not found inside a layer mid-step. Models known to hold no recurrent
    layer (``options.layer_roles``) skip the walk over their modules."""
    if options.layer_roles is not None and not options.layer_roles.recurrent:
        return
    reason = recurrent.recurrent_refusal(
        model,
        ulysses=options.ulysses is not None,
        phase_b_attention=options.phase_b_attention,
        dormant_policy=dormant_policy,
    )
    if reason is not None:
        raise ValueError(f"prefix reuse cannot run this model's group: {reason}")


def _chunked(
    model: nn.Module,
    prefix: tuple[torch.Tensor, torch.Tensor],
    min_chunks: int,
    options: ScheduleOptions,
    requires_grad: bool,
    encoded: EncodedVisuals | None,
) -> ChunkedPrefix | None:
    """The group's prefix in chunks of ``options.prefix_chunk_tokens``, or None where it runs whole
    (chunking off, or one chunk and no lockstep fillers to run). Forward-only leaves (``requires_grad``
    off) keep K/V's dtype; training ones hold at least ``options.prefix_grad_dtype``. ``encoded``: the
    group's visual inputs, encoded once; each chunk takes its slice of their embeddings. ``prefix``: its
    token ids and positions."""
    prefix_ids, prefix_pos = prefix
    chunk_tokens = options.prefix_chunk_tokens
    if num_chunks(len(prefix_ids), chunk_tokens) == 1 and min_chunks <= 1:
        return None

    def run_chunk(start: int, end: int, earlier: PrefixKV | None) -> PrefixKV:
        ids, pos = prefix_ids[start:end], prefix_pos[..., start:end]
        if encoded is None:
            return prefix_forward(model, ids, pos, options, earlier)
        with encoded.chunk_call(start, end):
            visual = encoded.chunk_kwargs(ids.device)
            # the encoder ran once for the group (``encoded``, counted there): no meter for the chunk's call
            return prefix_forward(model, ids, pos, dataclasses.replace(options, meter=None), earlier, visual)

    return ChunkedPrefix(
        len(prefix_ids),
        chunk_tokens,
        run_chunk,
        requires_grad=requires_grad,
        min_dtype=options.prefix_grad_dtype if requires_grad else None,
        min_chunks=min_chunks,
        run_filler=functools.partial(_filler_chunk, model, prefix_ids[:1], prefix_pos[..., :1], options),
    )


def _filler_chunk(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, options: ScheduleOptions) -> PrefixKV:
    """A lockstep chunk (one token) that keeps a peer's chunk count: it stands for no dense token."""
    with options.routing(0.0):
        return prefix_forward(model, ids, positions, options)


def _count_encodes(encoded: EncodedVisuals | None, meter: PhaseMeter) -> None:
    """A chunked prefix with images: the encoder's runs over the group's pixels (the first chunk's; again under
    ``recompute``), counted as ``prefix/vision_encoder_calls`` like an unchunked prefix's."""
    if encoded is not None:
        meter.count("prefix/vision_encoder_calls", encoded.calls)


@torch.no_grad()
def infer_group(
    model: nn.Module, layout: RowLayout, group: GroupPlan, options: ScheduleOptions
) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """Forward-only A and B (old/ref log-probs): ``{row: (response log-probs, entropy or None)}``.
    Runs with ``options.forward_only()``: phase A always exits early and no router aux loss applies;
    phase A is chunked as in ``train_group`` (no backward). No dormant policy: only the K/V are kept."""
    options = options.forward_only()
    _refuse_recurrent(model, options, "keep")
    prefix_ids, prefix_pos = _prefix_of(layout, group, options.device)
    results: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    visual = layout.visual_of(group.rows[0])
    encoded = EncodedVisuals(model, visual, prefix_ids, False) if visual else None
    chunked = _chunked(model, (prefix_ids, prefix_pos), group.min_prefix_chunks, options, False, encoded)

    def forward() -> PrefixKV:
        if chunked is None:
            return prefix_forward(model, prefix_ids, prefix_pos, options, visual=visual)
        return chunked.forward(keep_graphs=False)

    with prefix_attention_mode(model), options.autocast():
        prefix, _, _ = node_forward(model, forward, None, options, copies=len(group.rows))
        _count_encodes(encoded if chunked is not None else None, options.meter or NullMeter())
        infer_suffixes(model, layout, group, prefix, results, options)
    return results
