"""The ``_target_`` path of ``prefix_torchtitan``'s engine config in earlier releases' docs and shipped YAML:
``actor_rollout_ref.actor.torchtitan._target_=verl_prefix.backend.titan_config.PrefixTorchtitanEngineConfig``.

A user's recipe written against it keeps resolving (the class is ``verl_prefix.config``'s, one object). New
configs name ``verl_prefix.config.PrefixTorchtitanEngineConfig``, beside the FSDP engine's.
"""

from verl_prefix.backend.titan.config import PrefixTorchtitanEngineConfig

__all__ = ["PrefixTorchtitanEngineConfig"]
