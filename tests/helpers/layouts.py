"""Row layouts of random GRPO groups for schedule-level tests (no verl batch needed)."""

from __future__ import annotations

import torch

from verl_prefix.schedule.grouping import RowLayout

VOCAB = 101


def make_layout(groups: list[tuple[int, list[int]]], seed: int = 0, vocab: int = VOCAB) -> RowLayout:
    """Rows for ``(prompt_len, response_lens)`` groups, uids "g0", "g1", ... contiguous."""
    gen = torch.Generator().manual_seed(seed)
    ids, pos, p_lens, r_lens, uids = [], [], [], [], []
    for g, (p, responses) in enumerate(groups):
        prompt = torch.randint(0, vocab, (p,), generator=gen)
        for s in responses:
            row = torch.cat([prompt, torch.randint(0, vocab, (s,), generator=gen)])
            ids.append(row)
            pos.append(torch.arange(len(row)))
            p_lens.append(p)
            r_lens.append(s)
            uids.append(f"g{g}")
    return RowLayout(ids, pos, p_lens, r_lens, uids)


def token_weights(layout: RowLayout, dtype: torch.dtype) -> list[torch.Tensor]:
    """A random weight per response token: a loss whose gradient reaches every log-prob differently."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(s, generator=gen).to(dtype) for s in layout.response_lens]


def suffix_only_mask(query_len: int, prefix_len: int, device: torch.device | None) -> torch.Tensor:
    """The negative control's wrong phase-B mask: suffix queries see no prefix at all."""
    keep = torch.ones(query_len, query_len, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.zeros(query_len, prefix_len, dtype=torch.bool, device=device), keep], 1)[None, None]


def use_suffix_only_mask(mp) -> None:
    """Break every spelling of phase B's mask: eager's explicit one, sdpa's bottom-right bias, and the
    merged two-part attention (its prefix part dropped from the merge)."""
    from verl_prefix.schedule.attention import merged as merged_attention
    from verl_prefix.schedule.kv import contexts

    mp.setattr(contexts, "causal_keep_mask", suffix_only_mask)
    mp.setattr(contexts, "prefix_causal_bias", lambda q, k: suffix_only_mask(q, k - q, None))
    mp.setattr(merged_attention, "merge", lambda out1, lse1, out2, lse2: (out2, lse2))
