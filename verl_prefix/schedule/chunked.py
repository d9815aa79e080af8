"""Chunked prefix (``prefix_reuse.prefix_chunk_tokens``): phase A runs the prefix in chunks, phase C
backpropagates it chunk by chunk from the last.

Chunk ``i`` covers prefix tokens ``[s_i, e_i)``. Its forward attends to the K/V of tokens ``[0, s_i)``
held as (views of) the whole prefix's K/V leaves, exactly as a suffix row attends to the prefix in
phase B (``ChunkCaptureContext`` serves them through ``ServeContext``), and captures its own K/V,
which are then written into the leaves at ``[s_i, e_i)``. The first chunk is plain capture. Phase B
attends to the whole leaves, so dK/dV of every prefix token accumulate there; phase C runs chunk by
chunk from the last: chunk ``k``'s K/V roots are seeded with the leaf gradient at ``[s_k, e_k)`` (from
the suffixes and from every later chunk, whose backward already ran), and its own backward deposits
dK/dV on ``[0, s_k)``. Exact by construction: the same K/V, the same causal attention, the chain rule
split at the chunk boundaries.

With ``recompute`` phase A keeps no graph and phase C rebuilds chunk ``k``'s graph right before its
own backward, so only one chunk's activations exist at a time: memory then grows with the K/V
(``2 x layers x kv width`` per token) rather than with the activations. ``keep`` and ``offload`` keep
(or offload) every chunk's graph from A to C. Router statistics (MoE aux loss) of the chunks sum;
every chunk's probability-sum root (and z-sum root) is seeded with the one router leaf's gradient.

A recurrent layer (``schedule.models.recurrent``) has no K/V to slice: chunk ``i`` ends in its own state (conv
context and recurrent state), kept as leaves of their own (``states[i]``); chunk ``i+1`` continues from
them (a chunk shorter than the conv window takes part of its context from even earlier chunks through
them) and phase B from the last chunk's. In phase C chunk ``i``'s state roots are seeded with those
leaves' gradients, which chunk ``i+1``'s backward (or phase B) left there.

Leaves are written through ``.data``: an earlier chunk's graph saved a view of ``[0, s_i)`` only, which
later writes (``[s_j, e_j)``, ``j >= i``) never touch, so no saved value changes behind autograd's back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from verl_prefix.schedule.dormant import Dormant
from verl_prefix.schedule.kv.container import PrefixKV
from verl_prefix.schedule.models.moe import RouterStats
from verl_prefix.schedule.models.recurrent import RecurrentState

# run_chunk(start, end, earlier) -> the chunk's captured K/V (graph-attached under grad). ``earlier`` is
# None for the first chunk; a filler chunk is run by ``ChunkedPrefix``'s ``run_filler``.
RunChunk = Callable[[int, int, PrefixKV | None], PrefixKV]
# seeded_backward(prefix, seeds, model): one backward through ``prefix`` seeded per boundary tensor
SeededBackward = Callable[[PrefixKV, list[torch.Tensor | None], nn.Module | None], None]


def validate_chunk_tokens(value: object) -> int | None:
    """``prefix_chunk_tokens`` as an int (or None: off); 0 means off too."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"prefix_reuse.prefix_chunk_tokens must be a positive integer, 0 or null (off), got {value!r}")
    return value


def chunk_bounds(prefix_len: int, chunk_tokens: int | None) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``prefix_len`` tokens; one chunk when chunking is off or the
    prefix fits in one."""
    if not chunk_tokens or chunk_tokens >= prefix_len:
        return [(0, prefix_len)]
    return [(s, min(s + chunk_tokens, prefix_len)) for s in range(0, prefix_len, chunk_tokens)]


def num_chunks(prefix_len: int, chunk_tokens: int | None) -> int:
    """How many prefix forwards phase A runs for a prefix (what data-parallel ranks agree on)."""
    return len(chunk_bounds(prefix_len, chunk_tokens))


def _view(full: PrefixKV, start: int, end: int, detach: bool = False) -> PrefixKV:
    view = PrefixKV(len(full.keys), full.recurrent_layers)
    view.keys = [None if k is None else k[:, :, start:end] for k in full.keys]
    view.values = [None if v is None else v[:, :, start:end] for v in full.values]
    if detach:
        view.keys = [None if k is None else k.detach() for k in view.keys]
        view.values = [None if v is None else v.detach() for v in view.values]
    return view


def with_states(view: PrefixKV, states: list[RecurrentState | None], detach: bool = False) -> PrefixKV:
    """``view`` with its recurrent layers holding ``states`` (a chunk's end states; detached copies of the
    tensors with ``detach``)."""
    if detach:
        states = [
            None if r is None else RecurrentState(r.conv.detach(), r.state.detach(), r.conv_dtype) for r in states
        ]
    view.recurrent = list(states)
    return view


def _sum_stats(parts: list[RouterStats]) -> RouterStats:
    z_sums = [p.z_sum for p in parts]
    return RouterStats(
        counts=sum(p.counts for p in parts[1:]) + parts[0].counts,
        prob_sum=torch.stack([p.prob_sum.detach() for p in parts]).sum(0),
        tokens=sum(p.tokens for p in parts),
        layers=parts[0].layers,
        z_sum=None if z_sums[0] is None else torch.stack([z.detach() for z in z_sums]).sum(0),
    )


@dataclass
class _Chunk:
    start: int
    end: int
    record: PrefixKV | None  # graph-attached roots (keep/offload) or detached values (recompute, no grad)
    filler: bool = False


class ChunkedPrefix:
    """One group's prefix in chunks: ``forward`` is phase A, ``leaves`` what phase B attends to,
    ``backward`` phase C.

    ``requires_grad=False`` (forward-only passes): the chunks run under the caller's no_grad and
    ``leaves`` are plain tensors. ``min_chunks``: lockstep across data-parallel ranks; every forward
    and backward issues FSDP collectives, so a group with fewer chunks than a peer's group in the same
    slot runs one-token filler chunks (zero-seeded in phase C) up to the agreed count: ``run_filler``, by
    default ``run_chunk(0, 1, None)`` (a prefix with images runs its fillers as text calls).
    """

    def __init__(
        self,
        prefix_len: int,
        chunk_tokens: int | None,
        run_chunk: RunChunk,
        *,
        requires_grad: bool,
        min_dtype: torch.dtype | None = torch.float32,
        min_chunks: int = 0,
        run_filler: Callable[[], PrefixKV] | None = None,
    ) -> None:
        self.bounds = chunk_bounds(prefix_len, chunk_tokens)
        self.prefix_len = prefix_len
        self.run_chunk = run_chunk
        self.run_filler = run_filler or (lambda: run_chunk(0, 1, None))
        self.requires_grad = requires_grad
        self.min_dtype = min_dtype
        self.fillers = max(0, min_chunks - len(self.bounds))
        self.leaves: PrefixKV | None = None
        self.chunks: list[_Chunk] = []
        # per real chunk, its recurrent layers' end states as leaves: the next chunk (or phase B) starts there
        self.states: list[list[RecurrentState | None]] = []

    @property
    def count(self) -> int:
        """Prefix forwards phase A runs (fillers included)."""
        return len(self.bounds) + self.fillers

    def _allocate(self, first: PrefixKV) -> PrefixKV:
        full = PrefixKV(len(first.keys), first.recurrent_layers)

        def empty(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            dtype = t.dtype if self.min_dtype is None else torch.promote_types(t.dtype, self.min_dtype)
            shape = (*t.shape[:2], self.prefix_len, *t.shape[3:])
            return torch.empty(shape, dtype=dtype, device=t.device).requires_grad_(self.requires_grad)

        full.keys = [empty(k) for k in first.keys]
        full.values = [empty(v) for v in first.values]
        return full

    def _state_leaves(self, kv: PrefixKV) -> list[RecurrentState | None]:
        """A chunk's recurrent end states as leaves (at least ``min_dtype``, like the K/V)."""

        def leaf(t: torch.Tensor) -> torch.Tensor:
            dtype = t.dtype if self.min_dtype is None else torch.promote_types(t.dtype, self.min_dtype)
            return t.detach().to(dtype).requires_grad_(self.requires_grad)

        return [None if r is None else RecurrentState(leaf(r.conv), leaf(r.state), r.conv_dtype) for r in kv.recurrent]

    def forward(self, keep_graphs: bool) -> PrefixKV:
        """Phase A under the caller's grad mode and policy context. ``keep_graphs``: hold each chunk's
        graph-attached K/V until phase C (keep/offload); otherwise only their values, in the leaves."""
        stats: list[RouterStats] = []
        for start, end in self.bounds:
            earlier = with_states(_view(self.leaves, 0, start), self.states[-1]) if start else None
            kv = self.run_chunk(start, end, earlier)
            if self.leaves is None:
                self.leaves = self._allocate(kv)
            with torch.no_grad():
                for dst, src in zip(self.leaves.keys + self.leaves.values, kv.keys + kv.values):
                    if dst is not None:
                        dst.data[:, :, start:end].copy_(src.detach())
            self.states.append(self._state_leaves(kv))
            if kv.router_stats is not None:
                stats.append(kv.router_stats)
            detached = _view(self.leaves, start, end, detach=True)
            record = kv if keep_graphs else with_states(detached, self.states[-1], detach=True)
            if not keep_graphs and kv.router_stats is not None:
                record.router_stats = kv.router_stats.detached_leaf(False)
            self.chunks.append(_Chunk(start, end, record))
        for _ in range(self.fillers):
            kv = self.run_filler()
            self.chunks.append(_Chunk(0, 1, kv, filler=True))
        self.leaves.recurrent = self.states[-1]  # phase B continues from the last chunk's state
        if stats:
            self.leaves.router_stats = _sum_stats(stats).detached_leaf(self.requires_grad)
        return self.leaves

    def backward(
        self,
        dormant: Dormant,
        seeded_backward: SeededBackward,
        model: nn.Module | None,
        on_chunk_done: Callable[[], None] | None = None,
    ) -> None:
        """Phase C, last chunk first: each chunk's roots (phase A's, or rebuilt now under
        ``recompute``) seeded with the leaf gradient of its tokens; fillers with zeros.
        ``on_chunk_done`` runs after each chunk's backward (the meter's ``SavedBytes.segment``)."""
        leaves = self.leaves
        router_seeds = [t.grad for t in leaves.router_stats.boundary()] if leaves.router_stats is not None else []
        for index in reversed(range(len(self.chunks))):
            chunk = self.chunks[index]
            self.chunks[index] = None  # phase A's graph of this chunk goes with its backward
            earlier = (
                with_states(_view(leaves, 0, chunk.start), self.states[index - 1])
                if chunk.start and not chunk.filler
                else None
            )
            rerun = self.run_filler if chunk.filler else lambda c=chunk, e=earlier: self.run_chunk(c.start, c.end, e)
            roots = dormant.phase_c_prefix(chunk.record, rerun)
            chunk.record = None
            if chunk.filler:
                seeds: list[torch.Tensor | None] = [None] * len(roots.tensors())
            else:
                seeds = []
                for layer in range(len(leaves.keys)):
                    if layer in leaves.recurrent_layers:
                        # the state this chunk ended in: its gradient came from the next chunk (or phase B)
                        seeds.extend(leaf.grad for leaf in self.states[index][layer].tensors())
                        continue
                    for leaf in (leaves.keys[layer], leaves.values[layer]):
                        grad = leaf.grad
                        seeds.append(grad[:, :, chunk.start : chunk.end].clone() if grad is not None else None)
                if roots.router_stats is not None:
                    seeds.extend(router_seeds)
            seeded_backward(roots, seeds, model)
            del roots
            if on_chunk_done is not None:
                on_chunk_done()
