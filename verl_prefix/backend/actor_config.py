"""The actor config with the reuse knobs: ``actor_rollout_ref.actor._target_=verl_prefix.PrefixFSDPActorConfig``.

A subclass of verl's ``FSDPActorConfig`` so every stock field, default and validation still applies;
the knobs travel to the engine on the engine config, where ``prefix_fsdp2`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl.workers.config import FSDPActorConfig

from verl_prefix.backend.config import PREFIX_BACKEND, PrefixReuseConfig, validate_moe_aux_loss_coef
from verl_prefix.schedule.dormant import KNOB_VALUES, validate_policy

DORMANT_PREFIX_POLICIES = KNOB_VALUES


@dataclass
class PrefixFSDPActorConfig(FSDPActorConfig):
    """verl's FSDP actor config plus ``prefix_reuse`` (see ``PrefixReuseConfig`` for each knob).

    Args:
        prefix_reuse: the reuse knobs; a dict from YAML is converted and validated.
        dormant_prefix: where a group's phase-A graph waits until phase C: ``keep``, ``recompute``,
            ``offload`` (accelerators only) or ``auto`` (see ``PrefixFSDPEngineConfig``).
        dormant_prefix_budget_bytes: bytes per device the dormant prefix graph may hold (``auto``).
        moe_aux_loss_coef: coefficient of the MoE router load-balancing loss, in dense and reuse mode
            alike (verl's FSDP engine adds none); 0 keeps the backend a drop-in for the stock engine.
        record_trace_dir: record every actor-update batch there for ``verl-prefix replay``.
    """

    strategy: str = PREFIX_BACKEND
    prefix_reuse: PrefixReuseConfig = field(default_factory=PrefixReuseConfig)
    dormant_prefix: str = "keep"
    dormant_prefix_budget_bytes: int | None = None
    moe_aux_loss_coef: float = 0.0
    record_trace_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prefix_reuse, dict):
            object.__setattr__(self, "prefix_reuse", PrefixReuseConfig(**self.prefix_reuse))
        elif not isinstance(self.prefix_reuse, PrefixReuseConfig):  # an OmegaConf node
            object.__setattr__(self, "prefix_reuse", PrefixReuseConfig(**dict(self.prefix_reuse)))
        try:
            validate_policy(self.dormant_prefix, self.dormant_prefix_budget_bytes)
        except ValueError as error:
            raise ValueError(f"actor.{error}") from None
        if self.strategy != PREFIX_BACKEND:
            raise ValueError(
                f"PrefixFSDPActorConfig needs actor.strategy={PREFIX_BACKEND} (and ref.strategy, which follows "
                f"it), got {self.strategy!r}: the reuse knobs would be silently ignored by another engine"
            )
        object.__setattr__(self, "moe_aux_loss_coef", validate_moe_aux_loss_coef(self.moe_aux_loss_coef))
        super().__post_init__()
        object.__setattr__(self.engine, "prefix_reuse", self.prefix_reuse)
        object.__setattr__(self.engine, "moe_aux_loss_coef", self.moe_aux_loss_coef)
        object.__setattr__(self.engine, "record_trace_dir", self.record_trace_dir)
        object.__setattr__(self.engine, "dormant_prefix", self.dormant_prefix)
        object.__setattr__(self.engine, "dormant_prefix_budget_bytes", self.dormant_prefix_budget_bytes)
        # verl 0.9.1 declares freeze_vision_tower but its engine never reads it: prefix_fsdp2 honours it
        object.__setattr__(self.engine, "freeze_vision_tower", self.freeze_vision_tower)
