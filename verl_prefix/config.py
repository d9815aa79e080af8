"""The public YAML paths of the engine configs: ``_target_: verl_prefix.config.PrefixFSDPEngineConfig``
(``prefix_fsdp2``) and ``_target_: verl_prefix.config.PrefixTorchtitanEngineConfig`` (``prefix_torchtitan``).

Select it with ``actor_rollout_ref.actor.fsdp_config._target_=verl_prefix.config.PrefixFSDPEngineConfig`` to
set the reuse knobs on the engine config (what the ``prefix_fsdp2`` engine reads) instead of the actor
config (``verl_prefix.PrefixFSDPActorConfig``); ``actor_rollout_ref.actor.torchtitan._target_`` names the
TorchTitan one. The classes live in ``verl_prefix.backend.config`` and ``verl_prefix.backend.titan.config``
(which imports verl's config classes, never torchtitan); this module is the stable path YAML files and command
lines name, not an alias for an older one.
"""

from verl_prefix.backend.config import PREFIX_BACKEND, PrefixFSDPEngineConfig, PrefixReuseConfig
from verl_prefix.backend.titan.config import PrefixTorchtitanEngineConfig

__all__ = ["PREFIX_BACKEND", "PrefixFSDPEngineConfig", "PrefixReuseConfig", "PrefixTorchtitanEngineConfig"]
