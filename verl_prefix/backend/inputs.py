"""Read verl's mini-batch TensorDict into the schedule's terms: per-row tokens, lengths, uids, temperature."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NonTensorData, TensorDict
from verl.utils import tensordict_utils as tu

from verl_prefix.schedule.grouping import RowLayout
from verl_prefix.schedule.models.multimodal import VisualInputs


def row_layout(data: TensorDict) -> RowLayout:
    """Per-row token ids, positions (``[L]``, or ``[4, L]`` for multimodal rows), prompt/response lengths, uids
    and visual inputs of a verl mini-batch."""
    input_ids = list(data["input_ids"].unbind())
    position_ids = list(data["position_ids"].unbind())
    prompt_lens, response_lens = row_lengths(data)
    return RowLayout(input_ids, position_ids, prompt_lens, response_lens, uids_of(data), visual=visual_rows(data))


def visual_rows(data: TensorDict) -> list[VisualInputs | None] | None:
    """Each row's ``multi_modal_inputs`` (pixel values, grids), read once per mini-batch; ``None`` for a text row
    (verl's agent loop attaches an empty entry to each) and for a batch without any."""
    if "multi_modal_inputs" not in data.keys():
        return None
    rows = [_entry(e) for e in data["multi_modal_inputs"]]
    if len(rows) != len(data):
        raise ValueError(f"batch has {len(data)} samples but {len(rows)} multi_modal_inputs entries")
    return rows if any(r is not None for r in rows) else None


def _entry(entry: Any) -> VisualInputs | None:
    entry = entry.data if isinstance(entry, NonTensorData) else entry
    inputs = {k: v for k, v in (entry or {}).items() if v is not None}
    return inputs or None


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
