"""Every decision data-parallel ranks must share, in one place (DESIGN trap 15: a rank that raises between two
collectives leaves its peers waiting; FSDP's collectives only match when every rank runs the same passes).

- ``mini_batch``: the one exchange per mini-batch. Each rank checks its batch, plans its groups and asks its
  kernels locally, with no collective; one gather carries every rank's ``RankReport`` (validity, fallback reason,
  loss-token counts, lockstep shape, trie shape, phase-B kernel refusal, dormant choices); every rank then derives
  the same ``Agreement`` from the same reports.
- ``once``: what is decided once per model (its structure) and the recompute check inside phase C.
- ``lockstep``: the agreed shape of a mini-batch and the filler groups that keep ranks in step.
- ``collectives``: the primitives (where a collective's tensors live, gathering objects and flagged payloads).
"""
