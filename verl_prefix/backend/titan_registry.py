"""Register ``prefix_torchtitan`` (and verl's own ``torchtitan`` where verl could not) without importing
torchtitan: ``import verl`` loads this package as a plugin in every process, and torchtitan's import is
heavy. The registry holds factories; the first engine built applies the platform layer
(``platform_titan.ensure_titan_platform``) and imports the engine classes. Each factory first registers a
torchtitan flavor of the checkpoint's shapes where torchtitan has none (``titan_checkpoint_flavor``): verl
derives the flavor inside the worker that builds the engine, so that is where it must exist.

verl 0.9.1 registers its TorchTitan engine only when its import succeeds, which with torchtitan 0.3.0 it does
not (a moved module, ``platform_titan``); the factory for ``torchtitan`` builds verl's own class after the
adaptations, so the stock engine is selectable as verl documents it.
"""

from __future__ import annotations

from typing import Any

from verl.workers.engine.base import EngineRegistry

from verl_prefix.backend.titan_config import TITAN_BACKEND

DEVICES = ("cuda", "cpu")


def _prepare(args: tuple, kwargs: dict) -> Any:
    """The platform layer, then the checkpoint's flavor where torchtitan has none; verl's engine module."""
    from verl_prefix.backend.platform_titan import ensure_titan_platform
    from verl_prefix.backend.titan_checkpoint_flavor import ensure_checkpoint_flavor

    impl = ensure_titan_platform()
    model_config = kwargs["model_config"] if "model_config" in kwargs else args[0]
    ensure_checkpoint_flavor(model_config.hf_config)
    return impl


def build_prefix_torchtitan(*args: Any, **kwargs: Any) -> Any:
    """``EngineRegistry.new``'s constructor for ``prefix_torchtitan``."""
    _prepare(args, kwargs)
    from verl_prefix.backend.titan_engine import PrefixTorchtitanEngineWithLMHead

    return PrefixTorchtitanEngineWithLMHead(*args, **kwargs)


def build_stock_torchtitan(*args: Any, **kwargs: Any) -> Any:
    """``EngineRegistry.new``'s constructor for verl's own ``torchtitan`` engine, after the platform layer."""
    return _prepare(args, kwargs).TorchTitanEngineWithLMHead(*args, **kwargs)


def register() -> None:
    """Idempotent: both backends on every device in ``DEVICES`` that has none yet."""
    engines = EngineRegistry._engines.setdefault("language_model", {})
    for backend, factory in ((TITAN_BACKEND, build_prefix_torchtitan), ("torchtitan", build_stock_torchtitan)):
        registered = engines.setdefault(backend, {})
        for device in DEVICES:
            registered.setdefault(device, factory)


def release_stock() -> None:
    """Drop the ``torchtitan`` factories on the devices verl's own module registers (cuda, npu) right before that
    module is imported: its decorator refuses a key that is already there. The CPU factory stays."""
    registered = EngineRegistry._engines.get("language_model", {}).get("torchtitan", {})
    for device in ("cuda", "npu"):
        if registered.get(device) is build_stock_torchtitan:
            del registered[device]
