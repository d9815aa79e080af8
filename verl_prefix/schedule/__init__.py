"""The schedule: shared-prefix reuse on any HF causal LM, with no knowledge of verl's engine or trainer.

``grouping`` regroups rows by uid and plans suffix micro-batches; ``prefix_kv`` captures the prefix K/V in
phase A and serves it in phase B; ``executor`` runs phases A/B/C per group with the mini-batch's
``options.ScheduleOptions``; ``moe`` keeps the router aux loss exact; ``telemetry`` measures each phase.
Nothing here imports ``verl_prefix.backend`` or ``tools``.
"""

from verl_prefix.schedule.executor import infer_group, train_group
from verl_prefix.schedule.options import ScheduleOptions

__all__ = ["ScheduleOptions", "infer_group", "train_group"]
