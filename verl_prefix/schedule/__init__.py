"""The schedule: shared-prefix reuse on any HF causal LM, with no knowledge of verl's engine or trainer.

``grouping`` regroups rows by uid and plans suffix micro-batches; ``kv`` captures the prefix K/V in phase A
and serves it in phase B (``kv.seam``: how both reach HF's attention); ``executor`` runs phases A/B/C per group
with the mini-batch's ``options.ScheduleOptions``; ``tree`` runs them over a trie of shared prefixes;
``attention`` holds the two-part attention kernels, windows and keyword checks; ``models`` what a model's
structure needs (recurrent layers, MoE routers, vision-language inputs); ``telemetry`` measures each phase.
Nothing here imports ``verl_prefix.backend`` or ``tools``.
"""

from verl_prefix.schedule.executor import infer_group, train_group
from verl_prefix.schedule.options import ScheduleOptions

__all__ = ["ScheduleOptions", "infer_group", "train_group"]
