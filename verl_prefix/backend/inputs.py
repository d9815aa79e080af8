"""Read verl's mini-batch TensorDict into the schedule's terms: per-row tokens, lengths, uids, temperature."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from verl_prefix.schedule.grouping import RowLayout


def row_layout(data: TensorDict) -> RowLayout:
    """Per-row token ids, positions, prompt/response lengths and uids of a verl mini-batch."""
    input_ids = list(data["input_ids"].unbind())
    position_ids = list(data["position_ids"].unbind())
    prompt_lens, response_lens = row_lengths(data)
    return RowLayout(input_ids, position_ids, prompt_lens, response_lens, uids_of(data))


def row_lengths(data: TensorDict) -> tuple[list[int], list[int]]:
    """Per-row prompt and response lengths, from the nested fields or (legacy layout) the attention mask."""
    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested:
        return prompts.offsets().diff().tolist(), responses.offsets().diff().tolist()
    mask = data["attention_mask"]
    return mask[:, : prompts.shape[1]].sum(dim=1).tolist(), mask[:, prompts.shape[1] :].sum(dim=1).tolist()


def uids_of(data: TensorDict) -> list[str]:
    if "uid" not in data.keys():
        raise ValueError("prefix reuse needs the `uid` of every sample (GRPO's group id); the batch has none")
    uids = tu.get(data, "uid")
    uids = uids.tolist() if hasattr(uids, "tolist") else list(uids)
    if len(uids) != len(data):
        raise ValueError(f"batch has {len(data)} samples but {len(uids)} uids")
    return [str(u) for u in uids]


def per_row_temperature(data: TensorDict) -> torch.Tensor:
    temperature = data["temperature"]
    if isinstance(temperature, torch.Tensor) and temperature.numel() == len(data):
        return temperature.float().flatten()
    return torch.full((len(data),), float(temperature))
