"""GRPO actor-update mini-batches as ``TrainingWorker.train_batch`` receives them (``make_grpo_batch``): verl's
v1 nested-jagged layout or the legacy padded one, groups of one uid sharing their prompt, optionally a system
block shared across groups or response stems (tree rollouts). Random tokens above the special ids.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from tensordict import NonTensorData, TensorDict

from verl_prefix.harness.tiny_models import PAD_ID, SPECIAL_TOKENS


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _pad_right(rows: list[torch.Tensor], width: int, value: float) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def make_grpo_batch(
    *,
    num_groups: int,
    group_size: int,
    prompt_lens: list[int] | int,
    response_len_range: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    pad_token_id: int = PAD_ID,
    use_kl: bool = False,
    layout: Literal["v1", "legacy"] = "v1",
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    global_batch_size: int | None = None,
    worker_settings: dict[str, Any] | None = None,
    shared_system: int = 0,
    response_stems: tuple[int, ...] = (),
    length_multiple: int = 1,
) -> TensorDict:
    """A per-rank GRPO actor-update mini-batch, as ``TrainingWorker.train_batch`` receives it.

    ``layout="v1"`` is the default trainer (``trainer.use_v1``, TransferQueue): every per-sample
    field (prompts, responses, masks, log-probs, advantages) is nested-jagged. ``layout="legacy"``
    is ``RayPPOTrainer`` (DataProto): ``prompts`` left-padded, ``responses``/masks/log-probs
    right-padded, dense ``attention_mask``, put through verl's ``left_right_2_no_padding``.
    Samples of a group are contiguous, share a ``uid`` and identical prompt tokens. The engine
    settings the worker injects (``micro_batch_size_per_gpu``...) are left to ``run_train_step``
    unless given in ``worker_settings``. ``shared_system``: every prompt starts with one block of that many
    tokens (a system prompt shared across groups, what ``prefix_reuse.tree`` computes once), before its own
    ``prompt_lens`` tokens. ``response_stems``: tree rollouts, each group's responses branching inside the
    response (what ``prefix_reuse.tree`` computes once, loss included): level ``k`` has ``2**k`` stems of
    ``response_stems[k]`` tokens (level 0 one stem for the whole group), row ``i`` taking stem
    ``i * 2**k // group_size`` of each level, then its own ``response_len_range`` tokens. ``length_multiple``:
    each response is lengthened (past ``response_len_range`` if need be) until its row's length is a multiple of
    it, so that verl's Megatron engine adds no alignment padding under sequence parallelism (it pads every row to a
    multiple of the TP size, and its routers count those padding tokens).
    """
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    lo, hi = response_len_range
    if not 1 <= lo <= hi:
        raise ValueError(f"response_len_range must satisfy 1 <= lo <= hi, got {response_len_range}")
    p_lens = [prompt_lens] * num_groups if isinstance(prompt_lens, int) else list(prompt_lens)
    if len(p_lens) != num_groups or min(p_lens) < 1:
        raise ValueError("prompt_lens must be one positive length per group")
    g = torch.Generator().manual_seed(seed)
    first = len(SPECIAL_TOKENS)

    def rand_tokens(n: int) -> torch.Tensor:
        return torch.randint(first, vocab_size, (n,), generator=g, dtype=torch.int64)

    prompts, responses, uids = [], [], []
    system = rand_tokens(shared_system) if shared_system else None  # drawn only when asked: seeds stay put
    for gi in range(num_groups):
        prompt = rand_tokens(p_lens[gi]) if system is None else torch.cat([system, rand_tokens(p_lens[gi])])
        stems = [[rand_tokens(n) for _ in range(2**k)] for k, n in enumerate(response_stems)]
        for row in range(group_size):
            r_len = int(torch.randint(lo, hi + 1, (1,), generator=g))
            prompts.append(prompt.clone())
            stem = [level[row * len(level) // group_size] for level in stems]
            r_len += -(len(prompt) + sum(len(s) for s in stem) + r_len) % length_multiple
            responses.append(torch.cat([*stem, rand_tokens(r_len)]))
            uids.append(f"uid-{seed}-{gi}")
    bsz = len(prompts)
    r_lens = [len(r) for r in responses]
    r_max = max(r_lens)
    response_mask = _pad_right([torch.ones(n, dtype=torch.int64) for n in r_lens], r_max, 0)

    # GRPO advantages through verl's own estimator: outcome score on the last response token.
    scores = torch.randn(bsz, generator=g)
    token_rewards = torch.zeros(bsz, r_max)
    token_rewards[torch.arange(bsz), torch.tensor(r_lens) - 1] = scores
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards=token_rewards, response_mask=response_mask, index=np.array(uids, dtype=object)
    )
    # Old / reference log-probs near a near-uniform policy's, so PPO ratios straddle the clip range.
    base_lp = -float(np.log(vocab_size))
    old_lp = (base_lp + 0.3 * torch.randn(bsz, r_max, generator=g)) * response_mask
    ref_lp = (base_lp + 0.3 * torch.randn(bsz, r_max, generator=g)) * response_mask

    per_sample = {"advantages": advantages, "old_log_probs": old_lp}
    if use_kl:
        per_sample["ref_log_prob"] = ref_lp

    if layout == "v1":
        # TransferQueue hands every non-scalar per-sample field back as a jagged nested tensor,
        # whether or not the lengths differ (storage managers' as_nested_tensor).
        ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
        mask_rows = [response_mask[i, :n] for i, n in enumerate(r_lens)]
        tensors = {
            "prompts": _nested(prompts),
            "responses": _nested(responses),
            "response_mask": _nested(mask_rows),
            "loss_mask": _nested(mask_rows),
            "input_ids": _nested(ids),
            "position_ids": _nested([torch.arange(len(x), dtype=torch.int64) for x in ids]),
            **{k: _nested([v[i, :n] for i, n in enumerate(r_lens)]) for k, v in per_sample.items()},
        }
        batch = tu.get_tensordict(tensor_dict={**tensors, "uid": np.array(uids, dtype=object)})
    elif layout == "legacy":
        p_max = max(len(p) for p in prompts)
        left = [torch.cat([torch.full((p_max - len(p),), pad_token_id), p]) for p in prompts]
        prompts_pad = torch.stack(left)
        responses_pad = _pad_right(responses, r_max, pad_token_id)
        prompt_mask = (prompts_pad != pad_token_id).long()
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)
        tensors = {
            "prompts": prompts_pad,
            "responses": responses_pad,
            "input_ids": torch.cat([prompts_pad, responses_pad], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            **per_sample,
        }
        batch = tu.get_tensordict(tensor_dict={**tensors, "uid": np.array(uids, dtype=object)})
        batch = left_right_2_no_padding(batch)
    else:
        raise ValueError(f"layout must be 'v1' or 'legacy', got {layout!r}")

    # What the trainer's _update_actor and the worker's train_mini_batch attach to the mini-batch.
    global_token_num = [len(p) + n for p, n in zip(prompts, r_lens)]
    tu.assign_non_tensor(
        batch,
        temperature=temperature,
        calculate_entropy=calculate_entropy,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=global_batch_size or bsz,
        global_token_num=NonTensorData(global_token_num),
        update_lr_scheduler=True,
        disable_auto_offload=True,
        **(worker_settings or {}),
    )
    return batch
