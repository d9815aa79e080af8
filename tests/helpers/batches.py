"""GRPO mini-batches from explicit rows, in verl's two layouts, so tests can make any group structure or
bad input: uids in any order, missing or shared, empty responses, non-finite advantages."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from tensordict import NonTensorData, TensorDict

from verl_prefix.harness.tiny_models import PAD_ID, SPECIAL_TOKENS


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def random_tokens(n: int, gen: torch.Generator, vocab: int) -> torch.Tensor:
    return torch.randint(len(SPECIAL_TOKENS), vocab, (n,), generator=gen, dtype=torch.int64)


def rows_batch(
    prompts: list[torch.Tensor],
    responses: list[torch.Tensor],
    uids: list[str] | None,
    *,
    advantages: list[torch.Tensor] | None = None,
    layout: Literal["v1", "legacy"] = "v1",
    seed: int = 0,
    vocab: int = 128,
) -> TensorDict:
    """A per-rank actor-update mini-batch as ``TrainingWorker.train_batch`` receives it (see
    ``verl_prefix.harness.grpo_batches.make_grpo_batch`` for the two layouts), one row per prompt/response pair.
    ``uids=None`` leaves the ``uid`` field out; ``advantages`` default to random per-token values."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    gen = torch.Generator().manual_seed(seed)
    r_lens = [len(r) for r in responses]
    if advantages is None:
        advantages = [torch.randn(n, generator=gen) for n in r_lens]
    base = -float(np.log(vocab))
    old_lp = [base + 0.3 * torch.randn(n, generator=gen) for n in r_lens]
    masks = [torch.ones(n, dtype=torch.int64) for n in r_lens]
    extra = {} if uids is None else {"uid": np.array(uids, dtype=object)}
    if layout == "v1":
        ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
        tensors = {
            "prompts": nested(prompts),
            "responses": nested(responses),
            "response_mask": nested(masks),
            "loss_mask": nested(masks),
            "input_ids": nested(ids),
            "position_ids": nested([torch.arange(len(x), dtype=torch.int64) for x in ids]),
            "advantages": nested(advantages),
            "old_log_probs": nested(old_lp),
        }
        batch = tu.get_tensordict(tensor_dict={**tensors, **extra})
    elif layout == "legacy":
        p_max, r_max = max(len(p) for p in prompts), max(max(r_lens), 1)
        prompts_pad = torch.stack([torch.cat([torch.full((p_max - len(p),), PAD_ID), p]) for p in prompts])

        def right(rows: list[torch.Tensor], value: float) -> torch.Tensor:
            out = torch.full((len(rows), r_max), value, dtype=rows[0].dtype)
            for i, row in enumerate(rows):
                out[i, : len(row)] = row
            return out

        response_mask = right(masks, 0)
        attention_mask = torch.cat([(prompts_pad != PAD_ID).long(), response_mask], dim=1)
        tensors = {
            "prompts": prompts_pad,
            "responses": right(responses, PAD_ID),
            "input_ids": torch.cat([prompts_pad, right(responses, PAD_ID)], dim=1),
            "attention_mask": attention_mask,
            "position_ids": torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0),
            "response_mask": response_mask,
            "advantages": right(advantages, 0.0),
            "old_log_probs": right(old_lp, 0.0),
        }
        batch = left_right_2_no_padding(tu.get_tensordict(tensor_dict={**tensors, **extra}))
    else:
        raise ValueError(f"layout must be 'v1' or 'legacy', got {layout!r}")
    tu.assign_non_tensor(
        batch,
        temperature=1.0,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=len(prompts),
        global_token_num=NonTensorData([len(p) + n for p, n in zip(prompts, r_lens)]),
        update_lr_scheduler=True,
        disable_auto_offload=True,
    )
    return batch


def groups_batch(
    groups: list[tuple[int, list[int]]], *, seed: int = 0, vocab: int = 128, layout: Literal["v1", "legacy"] = "v1"
) -> tuple[TensorDict, list[torch.Tensor], list[torch.Tensor], list[str]]:
    """``(prompt_len, response_lens)`` groups, contiguous, uids ``g0``, ``g1``...; also returns the rows."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, uids = [], [], []
    for g, (p, lens) in enumerate(groups):
        prompt = random_tokens(p, gen, vocab)
        for n in lens:
            prompts.append(prompt.clone())
            responses.append(random_tokens(n, gen, vocab))
            uids.append(f"g{g}")
    return rows_batch(prompts, responses, uids, seed=seed, vocab=vocab, layout=layout), prompts, responses, uids
