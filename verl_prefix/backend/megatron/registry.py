"""Register ``prefix_megatron`` without importing megatron-core: ``import verl`` loads this package as a plugin in
every process, and megatron-core (optional) is heavy. The registry holds a factory; the first engine built applies
the platform layer (``megatron.platform.ensure_megatron_platform``: nothing on a CUDA host) and imports the engine.

Importing the plugin leaves verl's own ``megatron`` backend as verl registered it (cuda/npu), and verl's
``McoreEngineConfig`` as verl wrote it. It wraps verl's ``constants_ppo._uses_megatron`` (``megatron_env``): on
Hopper/Ampere ``main_ppo`` gives every worker ``CUDA_DEVICE_MAX_CONNECTIONS=1`` when the actor or critic runs
Megatron, which it decides by ``strategy == "megatron"``; ``prefix_megatron`` is Megatron too.

Two things a ``main_ppo`` run of a Megatron engine on CPU needs before any
engine is built are opt-in, ``VERL_PREFIX_MEGATRON_CPU=1`` in the environment of every process that imports verl
(the driver, and a Ray job's workers through its runtime env), and only on a host without an accelerator:

- the platform's ``engine_config`` adaptation (``McoreEngineConfig`` accepts float32): verl's ``main_ppo``
  validates the actor config in the driver, and each worker builds it, before any engine applies the platform;
- verl's own ``megatron`` engine for ``cpu`` (``register_stock``; verl registers it for cuda/npu only): a factory
  that applies the platform layer, then builds verl's class. The platform layer registers that class for ``cpu``
  too, but only in a process that applies it, which a worker building the stock engine (the dense twin of a
  ``prefix_megatron`` run) never does first.
"""

from __future__ import annotations

import os
from typing import Any

from verl_prefix.backend.megatron.config import MEGATRON_BACKEND
from verl_prefix.backend.registry import register_factory

DEVICES = ("cuda", "npu", "cpu")
CPU_ENV = "VERL_PREFIX_MEGATRON_CPU"
STOCK_BACKEND = "megatron"  # verl's engine name (``actor.strategy``)
STOCK_DEVICES = ("cpu",)  # verl registers its own for cuda/npu


def build_prefix_megatron(*args: Any, **kwargs: Any) -> Any:
    """``EngineRegistry.new``'s constructor for ``prefix_megatron``."""
    from verl_prefix.backend.megatron.platform import ensure_megatron_platform

    ensure_megatron_platform()
    from verl_prefix.backend.megatron.engine import PrefixMegatronEngineWithLMHead

    return PrefixMegatronEngineWithLMHead(*args, **kwargs)


def build_stock_megatron(*args: Any, **kwargs: Any) -> Any:
    """``EngineRegistry.new``'s constructor for verl's own ``megatron`` language-model engine on CPU, after the
    platform layer."""
    from verl_prefix.backend.megatron.platform import ensure_megatron_platform

    ensure_megatron_platform()
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    return MegatronEngineWithLMHead(*args, **kwargs)


def cpu_requested() -> bool:
    """True when the environment opts in to verl's Megatron engine on CPU (``CPU_ENV``) and this host has no
    accelerator (with one, the opt-in changes nothing)."""
    if os.environ.get(CPU_ENV, "").strip().lower() not in ("1", "true", "yes"):
        return False
    from verl_prefix.backend.megatron.platform import host_device

    return host_device() == "cpu"


def megatron_env() -> None:
    """Idempotent: verl's ``_uses_megatron`` (which sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` for Megatron workers on
    Hopper/Ampere) also true for ``prefix_megatron``; verl's own answer for every other strategy."""
    from omegaconf import OmegaConf
    from verl.trainer import constants_ppo

    stock = constants_ppo._uses_megatron
    if getattr(stock, "_verl_prefix", False):
        return

    def uses_megatron(config: Any) -> bool:
        if config is not None:
            for key in ("actor_rollout_ref.actor.strategy", "critic.strategy"):
                if OmegaConf.select(config, key, default=None) == MEGATRON_BACKEND:
                    return True
        return stock(config)

    uses_megatron._verl_prefix = True  # type: ignore[attr-defined]
    constants_ppo._uses_megatron = uses_megatron


def register() -> None:
    """Idempotent: ``prefix_megatron`` on every device in ``DEVICES`` that has no engine for it yet, and counted as
    Megatron where verl sets its workers' environment (``megatron_env``); where ``cpu_requested``, the float32 engine
    config and verl's ``megatron`` engine for ``cpu``."""
    register_factory(build_prefix_megatron, MEGATRON_BACKEND, DEVICES)
    megatron_env()
    if cpu_requested():
        from verl_prefix.backend.megatron.platform import patch_engine_config

        patch_engine_config()
        register_stock()


def register_stock() -> None:
    """Idempotent opt-in: verl's ``megatron`` language-model engine, through the platform layer, for ``cpu`` where
    verl registered none (its own registrations are kept)."""
    register_factory(build_stock_megatron, STOCK_BACKEND, STOCK_DEVICES)
