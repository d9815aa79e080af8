"""What phase B's attention holds for backward, per suffix micro-batch: measured on the running engine
(``count_attention_saved``) and predicted from the shapes (``attention_kv_bytes``). The bench's variant
cells report both, so merged, concat and merged_varlen can be compared by memory as well as time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from verl_prefix.tools.bench.presets import PHASE_B_ATTENTIONS, Cell, ModelSpec


@contextmanager
def count_attention_saved() -> Iterator[list[int]]:
    """Bytes phase B's attention calls save for backward, one total per suffix micro-batch (all layers).

    Wraps ``ServeContext.attend`` (one context per micro-batch) with a saved-tensors hook that counts each
    storage once (parameters excluded) and hands every tensor on to the hook outside (the engine's own
    ``prefix/max_saved_for_backward_mib/B`` counter), so both counts stay whole. Recomputes in backward
    (gradient checkpointing) are not counted. The list is filled as micro-batches run."""
    import weakref

    from verl_prefix.schedule.kv.contexts import ServeContext

    original = ServeContext.attend
    totals: list[int] = []
    index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    seen: dict[int, set[int]] = {}

    def attend(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() != -1 or not torch.is_grad_enabled():
            return original(self, *args, **kwargs)  # a checkpoint's recompute, or forward-only
        if self not in index:
            index[self] = len(totals)
            totals.append(0)
            seen[index[self]] = set()
        slot = index[self]
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = top if top is not None else (lambda t: t, lambda t: t)

        def pack(tensor: torch.Tensor) -> Any:
            if not isinstance(tensor, torch.nn.Parameter) and not isinstance(tensor._base, torch.nn.Parameter):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen[slot]:
                    seen[slot].add(storage.data_ptr())
                    totals[slot] += storage.nbytes()
            return outer_pack(tensor)

        with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack):
            return original(self, *args, **kwargs)

    ServeContext.attend = attend
    try:
        yield totals
    finally:
        ServeContext.attend = original


def suffix_repeated_on_cuda(model: ModelSpec) -> bool:
    """Whether ``merged`` repeats the suffix K/V to the query heads on this machine: only on CUDA where torch's
    flash op is not asked to take GQA natively (``attention.merged.native_gqa``)."""
    if not torch.cuda.is_available() or model.num_heads == model.num_kv_heads:
        return False
    from verl_prefix.schedule.attention.merged import native_gqa

    head_dim = model.hidden_size // model.num_heads
    query = torch.empty(1, model.num_heads, 1, head_dim, dtype=torch.bfloat16, device="cuda")
    return not native_gqa(query, model.num_kv_heads)


def attention_kv_bytes(
    model: ModelSpec,
    variant: str,
    *,
    prefix_len: int,
    suffix_len: int,
    rows: int,
    repeat_suffix: bool = False,
    suffix_tokens: int | None = None,
) -> dict[str, int]:
    """K/V bytes one phase-B micro-batch hands its attention kernels, all layers, in fp32, from the shapes.

    ``concat``: every row gets ``cat(prefix, suffix)`` with K/V heads repeated to the query heads (what
    ``sdpa_lower_right`` passes sdpa and sdpa saves). ``merged``: the one ``[1, kv_heads, P, d]`` prefix
    plus the suffix rows' K/V, repeated to the query heads only with ``repeat_suffix``
    (``suffix_repeated_on_cuda``: where torch's CUDA flash op does not take GQA; the CPU op takes it).
    ``merged_varlen``: the one prefix plus only the real suffix tokens (``suffix_tokens``, default
    ``rows x suffix_len``) at KV heads (no pads, no repeat). Also returned: one prefix copy and the suffix rows'
    K/V at KV heads, the issue's yardstick."""
    head_dim = model.hidden_size // model.num_heads
    unit = 2 * model.num_layers * head_dim * 4  # K and V, every layer, fp32
    one_prefix = unit * model.num_kv_heads * prefix_len
    suffix_rows = unit * rows * model.num_kv_heads * suffix_len
    if variant == "concat":
        held = unit * rows * model.num_heads * (prefix_len + suffix_len)
    elif variant == "merged":
        held = one_prefix + unit * rows * (model.num_heads if repeat_suffix else model.num_kv_heads) * suffix_len
    elif variant == "merged_varlen":
        tokens = rows * suffix_len if suffix_tokens is None else suffix_tokens
        held = one_prefix + unit * model.num_kv_heads * tokens
    else:
        raise ValueError(f"phase-B attention variant must be one of {PHASE_B_ATTENTIONS}, got {variant!r}")
    return {"held": held, "one_prefix_copy": one_prefix, "suffix_rows": suffix_rows}


def largest_micro_batch_tokens(response_lens: list[int], cell: Cell) -> int:
    """Real suffix tokens (``response + 1`` a row, as ``attention_kv_bytes``'s ``suffix_len``) of the
    fullest micro-batch a group can form: what ``merged_varlen`` packs at most."""
    rows = min(cell.micro_batch_size, cell.group_size)
    groups = [response_lens[g : g + cell.group_size] for g in range(0, len(response_lens), cell.group_size)]
    return max(sum(sorted(lens)[-rows:]) + rows for lens in groups)
