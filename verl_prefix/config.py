"""The public YAML path of the engine config: ``_target_: verl_prefix.config.PrefixFSDPEngineConfig``.

Select it with ``actor_rollout_ref.actor.fsdp_config._target_=verl_prefix.config.PrefixFSDPEngineConfig`` to
set the reuse knobs on the engine config (what the ``prefix_fsdp2`` engine reads) instead of the actor
config (``verl_prefix.PrefixFSDPActorConfig``). The classes live in ``verl_prefix.backend.config``; this
module is the stable path YAML files and command lines name, not an alias for an older one.
"""

from verl_prefix.backend.config import PREFIX_BACKEND, PrefixFSDPEngineConfig, PrefixReuseConfig

__all__ = ["PREFIX_BACKEND", "PrefixFSDPEngineConfig", "PrefixReuseConfig"]
