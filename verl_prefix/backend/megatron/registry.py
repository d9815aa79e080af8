"""Register ``prefix_megatron`` without importing megatron-core: ``import verl`` loads this package as a plugin in
every process, and megatron-core (optional) is heavy. The registry holds a factory; the first engine built applies
the platform layer (``megatron.platform.ensure_megatron_platform``: nothing on a CUDA host) and imports the engine.
verl's own ``megatron`` backend stays as verl registered it.
"""

from __future__ import annotations

from typing import Any

from verl.workers.engine.base import EngineRegistry

from verl_prefix.backend.megatron.config import MEGATRON_BACKEND

DEVICES = ("cuda", "npu", "cpu")


def build_prefix_megatron(*args: Any, **kwargs: Any) -> Any:
    """``EngineRegistry.new``'s constructor for ``prefix_megatron``."""
    from verl_prefix.backend.megatron.platform import ensure_megatron_platform

    ensure_megatron_platform()
    from verl_prefix.backend.megatron.engine import PrefixMegatronEngineWithLMHead

    return PrefixMegatronEngineWithLMHead(*args, **kwargs)


def register() -> None:
    """Idempotent: ``prefix_megatron`` on every device in ``DEVICES`` that has no engine for it yet."""
    registered = EngineRegistry._engines.setdefault("language_model", {}).setdefault(MEGATRON_BACKEND, {})
    for device in DEVICES:
        registered.setdefault(device, build_prefix_megatron)
