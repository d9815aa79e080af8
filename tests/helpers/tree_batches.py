"""verl actor-update batches of given rows (prompt, response, uid) for tree tests: rows that share response
tokens (tree rollouts) or whose prompt continues another row (per-turn samples), which ``make_grpo_batch``'s
random rows never do. The v1 layout (nested-jagged per-sample fields) ``make_grpo_batch`` documents."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch
from tensordict import NonTensorData, TensorDict
from verl.utils import tensordict_utils as tu

from verl_prefix.harness.tiny_models import SPECIAL_TOKENS


def tokens(gen: torch.Generator, n: int, vocab: int) -> torch.Tensor:
    """``n`` random non-special token ids."""
    return torch.randint(len(SPECIAL_TOKENS), vocab, (n,), generator=gen, dtype=torch.int64)


def rows_batch(
    rows: list[tuple[torch.Tensor, torch.Tensor, str]], *, vocab: int, seed: int = 0, use_kl: bool = True
) -> TensorDict:
    """A mini-batch of ``(prompt, response, uid)`` rows: a random advantage per row, old and reference
    log-probs near a uniform policy's (so PPO ratios straddle the clip range), entropy asked for."""
    gen = torch.Generator().manual_seed(seed)
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    lens = [len(r) for _, r, _ in rows]
    base = -math.log(vocab)
    per_sample = {
        "advantages": [torch.randn(1, generator=gen).expand(n).clone() for n in lens],
        "old_log_probs": [base + 0.3 * torch.randn(n, generator=gen) for n in lens],
    }
    if use_kl:
        per_sample["ref_log_prob"] = [base + 0.3 * torch.randn(n, generator=gen) for n in lens]
    ids = [torch.cat([p, r]) for p, r, _ in rows]
    masks = [torch.ones(n, dtype=torch.int64) for n in lens]
    tensors = {
        "prompts": nested([p for p, _, _ in rows]),
        "responses": nested([r for _, r, _ in rows]),
        "response_mask": nested(masks),
        "loss_mask": nested(masks),
        "input_ids": nested(ids),
        "position_ids": nested([torch.arange(len(x), dtype=torch.int64) for x in ids]),
        **{k: nested(v) for k, v in per_sample.items()},
    }
    batch = tu.get_tensordict(tensor_dict={**tensors, "uid": np.array([u for _, _, u in rows], dtype=object)})
    tu.assign_non_tensor(
        batch,
        temperature=1.0,
        calculate_entropy=True,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=len(rows),
        global_token_num=NonTensorData([len(x) for x in ids]),
        update_lr_scheduler=True,
        disable_auto_offload=True,
    )
    return batch


def shared_loss_batch(seed: int = 0, vocab: int = 128) -> TensorDict:
    """Loss on shared tokens (``test_tree_loss_engine``, ``test_titan_schedule``): tree rollouts (uid ``t``): a
    10-token prompt; five responses share a 6-token stem, then two 4-token stems (rows 0-1, rows 2-4); row 0 ends
    on its stem. Per-turn samples ``c0..c2``: turn k's prompt is turn k-1's prompt and response, then a user turn."""
    gen = torch.Generator().manual_seed(seed)
    rand = functools.partial(tokens, gen, vocab=vocab)
    prompt, stem, left, right = rand(10), rand(6), rand(4), rand(4)
    tails = [rand(0), rand(3), rand(2), rand(5), rand(3)]
    halves = [left, left, right, right, right]
    rows = [(prompt, torch.cat([stem, half, tail]), "t") for half, tail in zip(halves, tails)]
    rows += per_turn_rows(rand, 8, [(0, 5), (3, 4), (2, 6)])
    return rows_batch(rows, vocab=vocab, seed=seed)


def per_turn_rows(
    rand: Callable[[int], torch.Tensor], first: int, turns: list[tuple[int, int]]
) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """Per-turn samples ``c0, c1, ...`` of one conversation: a ``first``-token opening, then per turn ``(user,
    answer)`` a user turn of that many tokens and an answer; turn k's prompt is turn k-1's prompt and answer."""
    rows, turn = [], rand(first)
    for k, (user, answer) in enumerate(turns):
        turn = torch.cat([turn, rand(user)])
        response = rand(answer)
        rows.append((turn, response, f"c{k}"))
        turn = torch.cat([turn, response])
    return rows
