"""Register ``prefix_torchtitan`` without importing torchtitan: ``import verl`` loads this package as a plugin in
every process, and torchtitan's import is heavy. The registry holds factories; the first engine built applies the
platform layer (``titan.platform.ensure_titan_platform``) and imports the engine classes. Each factory first
registers a torchtitan flavor of the checkpoint's shapes where torchtitan has none (``titan.checkpoint_flavor``):
verl derives the flavor inside the worker that builds the engine, so that is where it must exist.

Importing the plugin leaves verl's own ``torchtitan`` backend as verl registered it. verl 0.9.1 registers that
engine only when its import succeeds, which with torchtitan 0.3.0 it does not (a moved module, ``titan.platform``);
the adapted stock engine (the dense twin the tests and benchmarks compare against) is opt-in: ``register_stock``,
called by a process that builds it, or ``VERL_PREFIX_STOCK_TORCHTITAN=1`` in the environment of every process
that imports verl (a Ray job's workers too), which adds a factory for ``torchtitan`` on the devices verl left empty.
"""

from __future__ import annotations

import os
from typing import Any

from verl_prefix.backend.registry import register_factory
from verl_prefix.backend.titan.config import TITAN_BACKEND
from verl_prefix.backend.titan.platform import STOCK_BACKEND, STOCK_FACTORY_MARK

DEVICES = ("cuda", "cpu")
STOCK_ENV = "VERL_PREFIX_STOCK_TORCHTITAN"


def _prepare(args: tuple, kwargs: dict) -> Any:
    """The platform layer, then the checkpoint's flavor where torchtitan has none; verl's engine module."""
    from verl_prefix.backend.titan.checkpoint_flavor import ensure_checkpoint_flavor
    from verl_prefix.backend.titan.platform import ensure_titan_platform

    impl = ensure_titan_platform()
    model_config = kwargs["model_config"] if "model_config" in kwargs else args[0]
    ensure_checkpoint_flavor(model_config.hf_config)
    return impl


def build_prefix_torchtitan(*args: Any, **kwargs: Any) -> Any:
    """``EngineRegistry.new``'s constructor for ``prefix_torchtitan``."""
    _prepare(args, kwargs)
    from verl_prefix.backend.titan.engine import PrefixTorchtitanEngineWithLMHead

    return PrefixTorchtitanEngineWithLMHead(*args, **kwargs)


def build_stock_torchtitan(*args: Any, **kwargs: Any) -> Any:
    """``EngineRegistry.new``'s constructor for verl's own ``torchtitan`` engine, after the platform layer."""
    return _prepare(args, kwargs).TorchTitanEngineWithLMHead(*args, **kwargs)


# marked so that the platform layer (below this module) finds it without importing it back (``release_stock``)
setattr(build_stock_torchtitan, STOCK_FACTORY_MARK, True)


def stock_requested() -> bool:
    """True when the environment opts in to the adapted stock ``torchtitan`` engine (``STOCK_ENV``)."""
    return os.environ.get(STOCK_ENV, "").strip().lower() in ("1", "true", "yes")


def _register(backend: str, factory: Any) -> None:
    """``factory`` for ``backend`` on every device in ``DEVICES`` that has no engine yet (verl's stay)."""
    register_factory(factory, backend, DEVICES)


def register() -> None:
    """Idempotent: ``prefix_torchtitan`` on every device in ``DEVICES``; the stock one only where requested."""
    _register(TITAN_BACKEND, build_prefix_torchtitan)
    if stock_requested():
        register_stock()


def register_stock() -> None:
    """Idempotent opt-in: verl's ``torchtitan`` engine, through the platform layer, on the devices where verl
    registered none (its own registrations are kept)."""
    _register(STOCK_BACKEND, build_stock_torchtitan)
