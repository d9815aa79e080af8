"""A mini-batch's checks on one rank, no collectives: a rank that raises between two collectives leaves its
peers waiting until the collective timeout (DESIGN trap 15), so each rank checks its own batch locally and the
outcome travels in the mini-batch's one exchange (``backend.distributed.mini_batch``): when any rank's batch is
bad, every rank raises the same ``BatchRejected`` naming each bad rank and its samples.

What is checked (``check_batch``), on every path while reuse is enabled:

- always: every sample has a prompt and a response token, and (updates) finite advantages and a
  ``loss_mask``. The stock engine trains an empty response as nothing and turns a non-finite advantage
  into a skipped optimizer step with one warning; here both are errors, whichever path the batch takes;
- when this rank would reuse (no local fallback reason): every sample has a ``uid``. A rank that falls back
  to dense for its own reason does not need uids, so it does not check them; its peers still do, and any
  rejection stops every rank. Samples that share a uid but not their prompt are no error: they reuse in
  sub-groups of identical prompts (``grouping.split_uid_groups``; too small a sub-group runs dense as
  ``prompt_mismatch``).

With ``prefix_reuse.enable=false`` the engine is the stock one and checks nothing.
"""

from __future__ import annotations

from tensordict import TensorDict

from verl_prefix.backend.inputs import row_layout, row_lengths
from verl_prefix.schedule.grouping import RowLayout, split_uid_groups, validate_rows


class BatchRejected(ValueError):
    """Raised on every data-parallel rank when any rank's mini-batch is invalid (message names the samples)."""


def check_batch(data: TensorDict, *, forward_only: bool, reuse: bool) -> RowLayout | None:
    """This rank's checks, no collectives; returns the row layout when the batch would reuse.

    ``reuse`` says whether this rank would run the A/B/C schedule (no local fallback reason): only then are
    uids needed and checked.
    """
    advantages = None
    if not forward_only:
        if "loss_mask" not in data.keys():
            raise ValueError("the mini-batch has no `loss_mask`; an update needs it to normalise the loss")
        advantages = data["advantages"]
        advantages = advantages.to_padded_tensor(0.0) if advantages.is_nested else advantages
    if not reuse:
        prompt_lens, response_lens = row_lengths(data)
        validate_rows(prompt_lens, response_lens, advantages)
        return None
    layout = row_layout(data)
    validate_rows(layout.prompt_lens, layout.response_lens, advantages)
    return split_uid_groups(layout)
