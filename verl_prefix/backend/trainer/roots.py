"""Which uid groups of a batch share a trie root (``prefix_reuse.tree``), for the balancer to keep together.

The tree schedule computes a shared run of prompt tokens (a system block) once per rank and mini-batch: only
where the groups that share it sit in the same (rank, mini-batch) slot. Before the batch is placed, this finds
the families: groups whose prefixes (``prompt[:-1]``, what the trie is built from) start with the same
``min_shared_tokens`` tokens, a root the trie keeps (a shorter one is merged into its children), and how many
tokens every group of the family shares (the root's length, what a slot saves per extra group it holds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedRoot:
    """A family of groups: ``key`` names it within the batch, ``tokens`` is the prefix every group shares."""

    key: int
    tokens: int


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def shared_roots(
    prompts: Sequence[torch.Tensor | Sequence[int]], uids: Sequence[str], min_shared_tokens: int
) -> list[SharedRoot | None]:
    """Per sample, the family its group belongs to, or ``None`` where no other group shares its root (or its
    prefix is shorter than ``min_shared_tokens``). ``prompts`` are the samples' prompt tokens without padding."""
    if min_shared_tokens < 1:
        raise ValueError(f"min_shared_tokens must be >= 1, got {min_shared_tokens}")
    if len(prompts) != len(uids):
        raise ValueError(f"{len(prompts)} prompts for {len(uids)} uids")
    prefix_of: dict[str, list[int]] = {}
    for prompt, uid in zip(prompts, uids):
        if str(uid) not in prefix_of:
            tokens = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            prefix_of[str(uid)] = tokens[:-1]
    families: dict[tuple[int, ...], list[str]] = {}
    for uid, prefix in prefix_of.items():
        if len(prefix) >= min_shared_tokens:
            families.setdefault(tuple(prefix[:min_shared_tokens]), []).append(uid)
    root_of: dict[str, SharedRoot] = {}
    for key, members in enumerate(m for m in families.values() if len(m) > 1):
        first = prefix_of[members[0]]
        tokens = min(_common_length(first, prefix_of[uid]) for uid in members[1:])
        root_of.update((uid, SharedRoot(key, tokens)) for uid in members)
    return [root_of.get(str(uid)) for uid in uids]


def prompt_rows(prompts: object, tags: Sequence[dict]) -> list[torch.Tensor]:
    """Each sample's prompt tokens from TransferQueue's ``prompts`` field (jagged rows, or left-padded rows:
    the last ``prompt_len`` tokens of each, as the sample's tag says)."""
    if isinstance(prompts, torch.Tensor) and prompts.is_nested:
        rows = list(prompts.unbind())
    else:
        rows = list(prompts)
    if len(rows) != len(tags):
        raise ValueError(f"{len(rows)} prompt rows for {len(tags)} samples")
    out = []
    for row, tag in zip(rows, tags):
        row = torch.as_tensor(row)
        length = int(tag.get("prompt_len", row.shape[-1]))
        out.append(row[row.shape[-1] - length :])
    return out
