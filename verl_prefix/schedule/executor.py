"""The three-phase prefix-reuse schedule for one uid group, training and forward-only.

A: the prefix ``prompt[:-1]`` runs once with grad, its per-layer K/V captured (early exit after the
   last layer's K/V). B: suffix rows ``[prompt[-1]] + response[:-1]`` run as ordinary micro-batches
   against detached prefix leaves; each micro-batch's loss is backpropagated at once and the leaves
   accumulate dK/dV. C: one backward through the prefix graph seeded with the accumulated dK/dV.

The model is any HF causal LM (or an FSDP2 wrapper of one) called through its root ``forward``, so
wrappers see ordinary forward/backward hooks. Loss, normalisation and outputs are the caller's.

With an MoE router aux loss (``routers`` + ``aux_fn``), phase A also keeps the prefix's router
statistics (their probability sum is one more boundary leaf), each suffix row also feeds its last
response token (dense routes it too), and each micro-batch's aux sees the prefix once per row
(``verl_prefix.schedule.moe``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

from verl_prefix.schedule import moe
from verl_prefix.schedule.chunked import ChunkedPrefix, num_chunks
from verl_prefix.schedule.dormant import Dormant
from verl_prefix.schedule.grouping import GroupPlan, RowLayout
from verl_prefix.schedule.prefix_kv import (
    CaptureContext,
    ChunkCaptureContext,
    PrefixCaptured,
    PrefixKV,
    ServeContext,
    prefix_attention_mode,
)
from verl_prefix.schedule.telemetry import NullMeter, PhaseMeter
from verl_prefix.schedule.ulysses import Ulysses

# loss_fn(rows, log_probs, entropy) -> scalar loss to backpropagate. log_probs[k] are the response
# log-probs of rows[k] (length = its response), entropy likewise or None.
LossFn = Callable[[list[int], list[torch.Tensor], list[torch.Tensor] | None], torch.Tensor]
# aux_fn(rows, stats) -> the scaled router aux term of a micro-batch; stats count the prefix per row.
AuxFn = Callable[[list[int], moe.RouterStats], torch.Tensor]


@dataclass
class SuffixBatch:
    """A right-padded suffix micro-batch of one group; row k covers positions P-1 .. P+S_k-2."""

    rows: list[int]
    input_ids: torch.Tensor  # [B, S_max]: prompt[-1] + response[:-1]
    position_ids: torch.Tensor  # [B, S_max]
    labels: torch.Tensor  # [B, S_max]: the response tokens each position predicts
    valid: torch.Tensor  # [B, S_max] bool: positions that predict a response token
    lengths: list[int]
    tokens: torch.Tensor  # [B, S_max] bool: real (non-pad) tokens, what a router aux loss counts


def suffix_positions(positions: torch.Tensor, prompt_len: int, response_len: int) -> torch.Tensor:
    """The positions of ``[prompt[-1]] + response[:-1]``: the suffix starts at P-1, not P (trap 4)."""
    return positions[..., prompt_len - 1 : prompt_len - 1 + response_len]


def build_suffix_batch(
    layout: RowLayout, rows: list[int], prompt_len: int, device: torch.device, include_last: bool = False
) -> SuffixBatch:
    """Right-padded suffix rows. ``include_last`` also feeds each row's last response token, which
    predicts nothing but which dense training routes through every MoE layer (router aux loss)."""
    lengths = [layout.response_lens[i] for i in rows]
    extra = 1 if include_last else 0
    width = max(lengths) + extra
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    real = torch.zeros(len(rows), width, dtype=torch.bool)
    for k, (i, s) in enumerate(zip(rows, lengths)):
        tokens = layout.input_ids[i]
        n = s + extra
        ids[k, :n] = tokens[prompt_len - 1 : prompt_len - 1 + n]
        labels[k, :s] = tokens[prompt_len : prompt_len + s]
        pos[k, :n] = suffix_positions(layout.position_ids[i], prompt_len, n)
        pos[k, n:] = pos[k, n - 1] + torch.arange(1, width - n + 1)
        valid[k, :s] = True
        real[k, :n] = True
    return SuffixBatch(
        rows, ids.to(device), pos.to(device), labels.to(device), valid.to(device), lengths, real.to(device)
    )


def num_decoder_layers(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.num_hidden_layers)


def prefix_forward(
    model: nn.Module,
    prefix_ids: torch.Tensor,
    prefix_positions: torch.Tensor,
    early_exit: bool = True,
    routers: moe.MoeRouters | None = None,
    earlier: PrefixKV | None = None,
    attention: str = "auto",
    ulysses: Ulysses | None = None,
) -> PrefixKV:
    """Phase A. Runs under whatever grad mode the caller set; returns graph-attached K/V (and, with
    ``routers``, the prefix's router statistics). Early exit comes after the last K/V or the last
    router, whichever runs later. With ``earlier`` (a chunked prefix, ``verl_prefix.schedule.chunked``)
    the tokens are a later chunk that attends to the earlier chunks' K/V the way phase B's rows do
    (``attention`` as ``phase_b_attention``). With ``ulysses`` this rank runs its slice of the prefix and
    keeps its head shard of the whole prefix's K/V; router statistics are summed over the slices."""

    def routers_done(module: nn.Module) -> None:
        if ctx.early_exit and ctx.kv.complete:
            ctx.kv.interrupted = module
            raise PrefixCaptured

    capture = routers.capture(on_complete=routers_done) if routers is not None else nullcontext([])
    with capture as router_logits:
        ready = lambda: all(lg is not None for lg in router_logits)  # noqa: E731
        length = prefix_ids.shape[-1]
        if earlier is None:
            ctx = CaptureContext(
                num_decoder_layers(model),
                early_exit=early_exit,
                ready=ready,
                ulysses=ulysses,
                length=length if ulysses is not None else None,
            )
        else:
            ctx = ChunkCaptureContext(
                num_decoder_layers(model),
                early_exit,
                earlier,
                length,
                prefix_ids.device,
                attention,
                ready,
                ulysses,
            )
        if ulysses is not None:
            prefix_ids, prefix_positions = ulysses.shard(prefix_ids), ulysses.shard(prefix_positions, True)
        try:
            model(
                input_ids=prefix_ids[None],
                position_ids=prefix_positions[None],
                use_cache=False,
                logits_to_keep=1,
                prefix_ctx=ctx,
            )
        except PrefixCaptured:
            pass
    if not ctx.kv.complete:
        raise RuntimeError("phase A did not capture K/V for every layer; is the model a supported decoder?")
    if routers is not None:
        if ulysses is None:
            ctx.kv.router_stats = routers.stats(router_logits)
        else:
            local = routers.stats(router_logits, ulysses.real_tokens(length, prefix_ids.device))
            ctx.kv.router_stats = ulysses.sum_stats(local)
    return ctx.kv


def suffix_router_stats(
    routers: moe.MoeRouters, router_logits: list, batch: SuffixBatch, ulysses: Ulysses | None = None
) -> moe.RouterStats:
    """The micro-batch's own router statistics over its real tokens (summed over sequence slices)."""
    if ulysses is None:
        return routers.stats(router_logits, batch.tokens)
    return ulysses.sum_stats(routers.stats(router_logits, ulysses.shard(batch.tokens)))


def suffix_forward(
    model: nn.Module,
    prefix: PrefixKV,
    batch: SuffixBatch,
    temperature: torch.Tensor,
    calculate_entropy: bool,
    entropy_fn: Callable[[torch.Tensor], torch.Tensor] = entropy_from_logits,
    attention: str = "auto",
    meter: PhaseMeter | None = None,
    ulysses: Ulysses | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Phase B forward: response log-probs (and entropy) of each row, computed exactly as verl does.

    ``entropy_fn`` is the engine's own (compiled, chunked or checkpointed as its config says).
    ``attention`` is ``prefix_reuse.phase_b_attention``; ``meter`` counts which attention ran.

    No copy of the ``[tokens, vocab]`` logits: log-probs and entropy are row-wise, so they run on a view
    of the padded ``[B * S, vocab]`` logits (pad positions cost a little compute, no memory) and only the
    ``[B, S]`` results are indexed; a temperature other than 1 divides the logits in place.

    With ``ulysses`` the rows run as this rank's slice of their positions; the ``[B, S]`` results are
    gathered over the group (the gather's backward scales the local slice, see ``schedule.ulysses``)."""
    rows, full_width = batch.input_ids.shape
    input_ids, position_ids, labels = batch.input_ids, batch.position_ids, batch.labels
    if ulysses is not None:
        input_ids, labels = ulysses.shard(input_ids), ulysses.shard(labels)
        position_ids = ulysses.shard(position_ids, continue_positions=True)
    query_len = full_width if ulysses is None else ulysses.padded(full_width)
    row_lengths = batch.tokens.sum(1)  # real tokens per row, MoE's extra last token included
    ctx = ServeContext(prefix, query_len, batch.input_ids.device, attention, ulysses=ulysses, row_lengths=row_lengths)
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, prefix_ctx=ctx)
    _note_attention(meter, ctx)
    width = input_ids.shape[1]
    logits = out.logits.reshape(rows * width, -1)  # a view: lm_head's output is contiguous
    if not bool((temperature == 1).all()):
        row_temperature = temperature.to(logits.device, torch.float32).repeat_interleave(width)
        logits = logits.div_(row_temperature.to(logits.dtype).unsqueeze(-1))  # lm_head's backward needs no output
    entropy = entropy_fn(logits).view(rows, width) if calculate_entropy else None
    log_probs = logprobs_from_logits(logits, labels.reshape(-1), inplace_backward=not calculate_entropy)
    log_probs = log_probs.view(rows, width)
    if ulysses is not None:
        log_probs = ulysses.gather(log_probs, full_width)
        entropy = ulysses.gather(entropy, full_width) if entropy is not None else None
    split = list(log_probs[batch.valid].split(batch.lengths))
    return split, (list(entropy[batch.valid].split(batch.lengths)) if entropy is not None else None)


def _note_attention(meter: PhaseMeter | None, ctx: ServeContext) -> None:
    """Count the micro-batch under the attention it ran: merged (or merged_varlen) when every layer ran it."""
    if meter is None:
        return
    if ctx.varlen_calls > 0 and not ctx.merged_calls and not ctx.refusals:
        ran = "merged_varlen"
    else:
        ran = "merged" if ctx.merged_calls > 0 and not ctx.refusals else "concat"
    meter.count(f"prefix/phase_b_attention/{ran}")
    for reason in sorted(ctx.refusals):
        meter.count(f"prefix/phase_b_attention/concat_{reason}")


def _unshard_interrupted(model: nn.Module, interrupted: nn.Module | None) -> None:
    """FSDP2 unshards a module for backward from a hook its post-forward registers; early exit skipped
    that post-forward, so the FSDP unit owning the last layer is unsharded here by hand. Its
    post-backward (reduce-scatter, reshard) still runs from FSDP2's own hooks."""
    if interrupted is None:
        return
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    target = next((name for name, m in model.named_modules() if m is interrupted), None)
    if target is None:
        return
    owner = None
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) and (name == "" or target == name or target.startswith(name + ".")):
            owner = module  # preorder: the last match is the nearest ancestor
    if owner is not None:
        owner.unshard()


def prefix_backward(prefix: PrefixKV, leaves: PrefixKV, model: nn.Module | None = None) -> None:
    """Phase C: one backward through the prefix, seeded with the dK/dV every suffix left on the leaves.

    A root without a graph is skipped only when phase A captured it with autograd on (nothing trainable
    feeds it, e.g. frozen layers under LoRA); otherwise its gradient would be dropped silently (a
    reentrant checkpoint around the layer ran it under no_grad), which is an error.
    """
    seeded_backward(prefix, [leaf.grad for leaf in leaves.tensors()], model)


def seeded_backward(prefix: PrefixKV, seeds: list[torch.Tensor | None], model: nn.Module | None = None) -> None:
    """``prefix_backward`` with the seeds given: per boundary tensor of ``prefix`` its accumulated
    gradient, or None where nothing reached it (zeros are used; see below). A chunked prefix seeds each
    chunk with its slice of the whole prefix's leaf gradients."""
    if model is not None:
        _unshard_interrupted(model, prefix.interrupted)
    roots, grads = [], []
    num_layers = len(prefix.keys)
    for index, (root, seed) in enumerate(zip(prefix.tensors(), seeds)):
        if not root.requires_grad:
            layers = [index // 2] if index < 2 * num_layers else range(num_layers)
            if all(prefix.captured_with_grad[layer] for layer in layers):
                continue  # a constant: no trainable parameter upstream
            what = f"{'KV'[index % 2]} of layer {index // 2}" if index < 2 * num_layers else "router statistics"
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
    if roots:
        torch.autograd.backward(roots, grad_tensors=grads)


def _prefix_of(layout: RowLayout, group: GroupPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    first = group.rows[0]
    ids = layout.input_ids[first][: group.prefix_len].to(device)
    pos = layout.position_ids[first][..., : group.prefix_len].to(device)
    return ids, pos


def train_group(
    model: nn.Module,
    layout: RowLayout,
    group: GroupPlan,
    temperature: torch.Tensor,
    loss_fn: LossFn,
    *,
    calculate_entropy: bool,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    early_exit: bool = True,
    meter: PhaseMeter | None = None,
    routers: moe.MoeRouters | None = None,
    aux_fn: AuxFn | None = None,
    entropy_fn: Callable[[torch.Tensor], torch.Tensor] = entropy_from_logits,
    phase_b_attention: str = "auto",
    prefix_grad_dtype: torch.dtype | None = torch.float32,
    dormant: Dormant | None = None,
    prefix_chunk_tokens: int | None = None,
    prefix_chunks: int = 0,
    ulysses: Ulysses | None = None,
) -> list[torch.Tensor]:
    """Run A, B, C for one group; parameter grads accumulate. Returns each micro-batch's loss (detached).

    ``temperature`` holds one value per mini-batch row. ``backward`` lets a caller scale the loss.
    With ``routers`` and ``aux_fn``, each micro-batch's loss gains ``aux_fn(rows, stats)`` where
    ``stats`` count the prefix once per row of the micro-batch (``moe.logical_stats``).
    ``phase_b_attention``: see ``ServeContext``. ``prefix_grad_dtype``: the least dtype dK/dV accumulate
    in across micro-batches (``None``: K/V's own dtype, e.g. bf16 under autocast).
    ``dormant`` says where phase A's graph waits until phase C (``verl_prefix.schedule.dormant``; keep).
    ``prefix_chunk_tokens`` runs phases A and C in chunks of that many prefix tokens
    (``verl_prefix.schedule.chunked``); ``prefix_chunks`` is the least number of prefix forwards to run
    (data-parallel lockstep: one-token filler chunks make up the difference).
    ``ulysses``: run every phase sequence-parallel over that group (``verl_prefix.schedule.ulysses``).
    """
    if (routers is None) != (aux_fn is None):
        raise ValueError("routers and aux_fn go together")
    meter = meter or NullMeter()
    dormant = dormant or Dormant()
    prefix_ids, prefix_pos = _prefix_of(layout, group, device)
    losses = []

    def run_prefix() -> PrefixKV:
        return prefix_forward(model, prefix_ids, prefix_pos, early_exit=early_exit, routers=routers, ulysses=ulysses)

    chunked = _chunked(
        model,
        prefix_ids,
        prefix_pos,
        prefix_chunk_tokens,
        prefix_chunks,
        early_exit,
        routers,
        phase_b_attention,
        min_dtype=prefix_grad_dtype,
        ulysses=ulysses,
    )
    last = len(group.micro_batches) + group.filler_micro_batches - 1
    with prefix_attention_mode(model):
        with meter.phase("A") as saved_a, autocast(), dormant.phase_a(device):
            if chunked is None:
                prefix = run_prefix()
            else:
                leaves = chunked.forward(keep_graphs=dormant.policy != "recompute")
                meter.count("prefix/chunked_groups")
                meter.count("prefix/prefix_chunks", chunked.count)
        if chunked is None:
            meter.note_prefix_kv(prefix.tensors())
            leaves = prefix.as_leaves(requires_grad=True, min_dtype=prefix_grad_dtype)
            meter.note_prefix_leaves(prefix.tensors(), leaves.tensors())
        else:
            meter.note_prefix_kv(leaves.tensors())
            meter.note_prefix_leaves(leaves.tensors(), leaves.tensors())  # the leaves are the K/V: grads only
        # every suffix micro-batch (fillers too) attends to the same leaves the same way
        serve = functools.partial(suffix_forward, model, leaves, attention=phase_b_attention, ulysses=ulysses)
        for index, rows in enumerate(group.micro_batches):
            batch = build_suffix_batch(layout, rows, group.prompt_len, device, include_last=routers is not None)
            with meter.phase("B") as saved_b:
                with autocast():
                    capture = routers.capture() if routers is not None else nullcontext([])
                    with capture as router_logits:
                        log_probs, entropy = serve(batch, temperature[rows], calculate_entropy, entropy_fn, meter=meter)
                    loss = loss_fn(rows, log_probs, entropy)
                    if routers is not None:
                        suffix_stats = suffix_router_stats(routers, router_logits, batch, ulysses)
                        stats = moe.logical_stats(leaves.router_stats, suffix_stats, copies=len(rows))
                        loss = loss + aux_fn(rows, stats)
                if index == last:
                    dormant.before_last_backward()
                backward(loss)
            _note_held(dormant, saved_a, saved_b)
            losses.append(loss.detach())
        for index in range(len(group.micro_batches), last + 1):
            batch = build_suffix_batch(layout, group.rows[:1], group.prompt_len, device)
            with meter.phase("B") as saved_b:
                with autocast():
                    log_probs, _ = serve(batch, temperature[group.rows[:1]], False)
                if index == last:
                    dormant.before_last_backward()
                backward(log_probs[0].sum() * 0.0)
        with meter.phase("C") as saved_c:
            if chunked is not None:
                with autocast():  # each chunk's backward runs inside too, as phase B's do
                    # a chunk's graph is freed by its own backward: the meter counts the largest one
                    done = saved_c.segment if saved_c is not None else None
                    chunked.backward(dormant, seeded_backward, model, on_chunk_done=done)
            else:
                with autocast():
                    prefix = dormant.phase_c_prefix(prefix, run_prefix)
                prefix_backward(prefix, leaves, model)
    return losses


def _chunked(
    model: nn.Module,
    prefix_ids: torch.Tensor,
    prefix_pos: torch.Tensor,
    chunk_tokens: int | None,
    min_chunks: int,
    early_exit: bool,
    routers: moe.MoeRouters | None,
    attention: str,
    requires_grad: bool = True,
    min_dtype: torch.dtype | None = torch.float32,
    ulysses: Ulysses | None = None,
) -> ChunkedPrefix | None:
    """The group's prefix in chunks, or None where it runs whole (chunking off, or one chunk and no
    lockstep fillers to run)."""
    if num_chunks(len(prefix_ids), chunk_tokens) == 1 and min_chunks <= 1:
        return None

    def run_chunk(start: int, end: int, earlier: PrefixKV | None) -> PrefixKV:
        return prefix_forward(
            model,
            prefix_ids[start:end],
            prefix_pos[..., start:end],
            early_exit=early_exit,
            routers=routers,
            earlier=earlier,
            attention=attention,
            ulysses=ulysses,
        )

    return ChunkedPrefix(
        len(prefix_ids),
        chunk_tokens,
        run_chunk,
        requires_grad=requires_grad,
        min_dtype=min_dtype,
        min_chunks=min_chunks,
    )


def _note_held(dormant: Dormant, saved_a: object, saved_b: object) -> None:
    """Bytes held for backward during a suffix micro-batch: phase A's graph (as the policy left it)
    plus the micro-batch's own, from the meter's per-phase counts (none without a meter)."""
    if saved_a is not None and saved_b is not None:
        dormant.note_held_in_b(saved_a.total, saved_b.total)


@torch.no_grad()
def infer_group(
    model: nn.Module,
    layout: RowLayout,
    group: GroupPlan,
    temperature: torch.Tensor,
    *,
    calculate_entropy: bool,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    meter: PhaseMeter | None = None,
    entropy_fn: Callable[[torch.Tensor], torch.Tensor] = entropy_from_logits,
    phase_b_attention: str = "auto",
    prefix_chunk_tokens: int | None = None,
    prefix_chunks: int = 0,
    ulysses: Ulysses | None = None,
) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """Forward-only A and B (old/ref log-probs): ``{row: (response log-probs, entropy or None)}``.
    ``prefix_chunk_tokens``/``prefix_chunks``: phase A in chunks, as in ``train_group`` (no backward)."""
    meter = meter or NullMeter()
    prefix_ids, prefix_pos = _prefix_of(layout, group, device)
    results: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    chunked = _chunked(
        model,
        prefix_ids,
        prefix_pos,
        prefix_chunk_tokens,
        prefix_chunks,
        True,
        None,
        phase_b_attention,
        False,
        None,
        ulysses,
    )
    with prefix_attention_mode(model), autocast():
        with meter.phase("A"):
            if chunked is None:
                prefix = prefix_forward(model, prefix_ids, prefix_pos, early_exit=True, ulysses=ulysses)
            else:
                prefix = chunked.forward(keep_graphs=False)
        meter.note_prefix_kv(prefix.tensors())
        serve = functools.partial(suffix_forward, model, prefix, attention=phase_b_attention, ulysses=ulysses)
        for rows in group.micro_batches:
            batch = build_suffix_batch(layout, rows, group.prompt_len, device)
            with meter.phase("B"):
                log_probs, entropy = serve(batch, temperature[rows], calculate_entropy, entropy_fn, meter=meter)
            for k, i in enumerate(rows):
                results[i] = (log_probs[k], entropy[k] if entropy is not None else None)
        for _ in range(group.filler_micro_batches):
            batch = build_suffix_batch(layout, group.rows[:1], group.prompt_len, device)
            with meter.phase("B"):
                serve(batch, temperature[group.rows[:1]], False)
    return results
