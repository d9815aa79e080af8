"""Register ``prefix_torchtitan`` without importing torchtitan: ``import verl`` loads this package as a plugin in
every process, and torchtitan's import is heavy. The registry holds factories; the first engine built applies the
platform layer (``platform_titan.ensure_titan_platform``) and imports the engine classes. Each factory first
registers a torchtitan flavor of the checkpoint's shapes where torchtitan has none (``titan_checkpoint_flavor``):
verl derives the flavor inside the worker that builds the engine, so that is where it must exist.

Importing the plugin leaves verl's own ``torchtitan`` backend as verl registered it. verl 0.9.1 registers that
engine only when its import succeeds, which with torchtitan 0.3.0 it does not (a moved module, ``platform_titan``);
the adapted stock engine (the dense twin the tests and benchmarks compare against) is opt-in: ``register_stock``,
called by a process that builds it, or ``VERL_PREFIX_STOCK_TORCHTITAN=1`` in the environment of every process
that imports verl (a Ray job's workers too), which adds a factory for ``torchtitan`` on the devices verl left empty.
"""

from __future__ import annotations

import os
from typing import Any

from verl.workers.engine.base import EngineRegistry

from verl_prefix.backend.titan_config import TITAN_BACKEND

DEVICES = ("cuda", "cpu")
STOCK_ENV = "VERL_PREFIX_STOCK_TORCHTITAN"
STOCK_BACKEND = "torchtitan"


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


def stock_requested() -> bool:
    """True when the environment opts in to the adapted stock ``torchtitan`` engine (``STOCK_ENV``)."""
    return os.environ.get(STOCK_ENV, "").strip().lower() in ("1", "true", "yes")


def _register(backend: str, factory: Any) -> None:
    """``factory`` for ``backend`` on every device in ``DEVICES`` that has no engine yet (verl's stay)."""
    registered = EngineRegistry._engines.setdefault("language_model", {}).setdefault(backend, {})
    for device in DEVICES:
        registered.setdefault(device, factory)


def register() -> None:
    """Idempotent: ``prefix_torchtitan`` on every device in ``DEVICES``; the stock one only where requested."""
    _register(TITAN_BACKEND, build_prefix_torchtitan)
    if stock_requested():
        register_stock()


def register_stock() -> None:
    """Idempotent opt-in: verl's ``torchtitan`` engine, through the platform layer, on the devices where verl
    registered none (its own registrations are kept)."""
    _register(STOCK_BACKEND, build_stock_torchtitan)


def release_stock() -> None:
    """Drop the ``torchtitan`` factories on the devices verl's own module registers (cuda, npu) right before that
    module is imported: its decorator refuses a key that is already there. The CPU factory stays."""
    engines = EngineRegistry._engines.get("language_model", {})
    registered = engines.get(STOCK_BACKEND, {})
    for device in ("cuda", "npu"):
        if registered.get(device) is build_stock_torchtitan:
            del registered[device]
    if STOCK_BACKEND in engines and not registered:
        del engines[STOCK_BACKEND]  # nothing of ours left: verl's decorator recreates the entry as it would
