"""verl's ``EngineRegistry``, written in one place.

verl registers engine classes with a decorator that refuses a key already taken and takes only ``BaseEngine``
subclasses. The plugin needs three more things, each here once: registration that is idempotent (``import verl``
loads the plugin in every process, sometimes twice), lazy factories (``prefix_torchtitan`` and ``prefix_megatron``
import torchtitan or megatron-core only when such an engine is built), and taking back a factory of ours before verl's
own module registers the same key (``titan.platform.release_stock``). No other module touches the registry's table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from verl.workers.engine.base import EngineRegistry

LANGUAGE_MODEL = "language_model"


def registered_devices(backend: str, model_type: str = LANGUAGE_MODEL) -> dict[Any, Any]:
    """A copy of what verl's registry holds for ``backend``: device (or (device, vendor)) -> class or factory."""
    return dict(EngineRegistry._engines.get(model_type, {}).get(backend, {}))


def is_registered(backend: str, model_type: str = LANGUAGE_MODEL) -> bool:
    return backend in EngineRegistry._engines.get(model_type, {})


def register_class(engine_class: type, backend: str, devices: Iterable[str], model_type: str = LANGUAGE_MODEL) -> None:
    """verl's own decorator for the ``devices`` that have no engine for ``backend`` yet (theirs stay)."""
    missing = [d for d in devices if d not in registered_devices(backend, model_type)]
    if missing:
        EngineRegistry.register(model_type=model_type, backend=backend, device=missing)(engine_class)


def register_factory(
    factory: Callable[..., Any], backend: str, devices: Iterable[str], model_type: str = LANGUAGE_MODEL
) -> None:
    """A lazy constructor for ``backend`` on the ``devices`` that have none yet: ``EngineRegistry.new`` calls what the
    table holds, and verl's decorator accepts only engine classes."""
    table = EngineRegistry._engines.setdefault(model_type, {}).setdefault(backend, {})
    for device in devices:
        table.setdefault(device, factory)


def unregister(
    backend: str, devices: Iterable[str], owned: Callable[[Any], bool], model_type: str = LANGUAGE_MODEL
) -> None:
    """Take back the entries of ``backend`` on ``devices`` for which ``owned`` holds (ours, never verl's), and the
    backend's entry once nothing is left, so that verl's decorator can register the key as it would."""
    engines = EngineRegistry._engines.get(model_type, {})
    table = engines.get(backend, {})
    for device in devices:
        if owned(table.get(device)):
            del table[device]
    if backend in engines and not table:
        del engines[backend]
