"""Alias kept for YAML written before the layout change: ``_target_=verl_prefix.config.PrefixFSDPEngineConfig``."""

from verl_prefix.backend.config import PREFIX_BACKEND, PrefixFSDPEngineConfig, PrefixReuseConfig

__all__ = ["PREFIX_BACKEND", "PrefixFSDPEngineConfig", "PrefixReuseConfig"]
