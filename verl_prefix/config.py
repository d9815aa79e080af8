"""The public YAML paths of the engine configs: ``_target_: verl_prefix.config.PrefixFSDPEngineConfig``
(``prefix_fsdp2``), ``_target_: verl_prefix.config.PrefixTorchtitanEngineConfig`` (``prefix_torchtitan``) and
``_target_: verl_prefix.config.PrefixMcoreEngineConfig`` (``prefix_megatron``).

Select it with ``actor_rollout_ref.actor.fsdp_config._target_=verl_prefix.config.PrefixFSDPEngineConfig`` to
set the reuse knobs on the engine config (what the ``prefix_fsdp2`` engine reads) instead of the actor
config (``verl_prefix.PrefixFSDPActorConfig``); ``actor_rollout_ref.actor.torchtitan._target_`` names the
TorchTitan one, ``actor_rollout_ref.actor.megatron._target_`` the Megatron one. The classes live in
``verl_prefix.backend.config``, ``verl_prefix.backend.titan.config`` and ``verl_prefix.backend.megatron.config``
(which import verl's config classes, never torchtitan or megatron-core); this module is the stable path YAML
files and command lines name, not an alias for an older one.
"""

from verl_prefix.backend.config import PREFIX_BACKEND, PrefixFSDPEngineConfig, PrefixReuseConfig
from verl_prefix.backend.megatron.config import PrefixMcoreEngineConfig
from verl_prefix.backend.titan.config import PrefixTorchtitanEngineConfig

__all__ = [
    "PREFIX_BACKEND",
    "PrefixFSDPEngineConfig",
    "PrefixMcoreEngineConfig",
    "PrefixReuseConfig",
    "PrefixTorchtitanEngineConfig",
]
