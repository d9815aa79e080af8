"""verl-prefix: shared-prefix reuse for GRPO actor updates, as a verl engine backend.

Importing the package registers the ``prefix_fsdp2``, ``prefix_torchtitan`` and ``prefix_megatron`` engines with
verl's ``EngineRegistry`` (the last two as factories: torchtitan and megatron-core load only when such an engine is
built), the ``hf`` CPU rollout with verl's rollout registries, and the trainer hooks (one selection line, groups kept
whole). It is also
a ``verl.plugins`` entry point, so ``import verl`` does this in the driver and in every Ray worker;
the CPU platform activates here when ``VERL_PLATFORM=cpu`` is set.
"""

from verl_prefix._cli_quiet import invoked_as_cli, prepare_cli_process

if invoked_as_cli():  # the `verl-prefix` command: before anything imports verl
    prepare_cli_process()

from verl_prefix.backend.platform_cpu import cpu_platform_requested, ensure_cpu_platform  # noqa: E402

if cpu_platform_requested():
    ensure_cpu_platform()

from verl_prefix.backend.config import PREFIX_BACKEND, PrefixFSDPEngineConfig, PrefixReuseConfig  # noqa: E402
from verl_prefix.backend.fsdp.engine import PrefixFSDPEngineWithLMHead, is_registered, register  # noqa: E402

register()

# prefix_torchtitan (and verl's torchtitan, which verl 0.9.1 cannot import with torchtitan 0.3.0) as factories:
# torchtitan is imported only when such an engine is built.
from verl_prefix.backend.titan import registry as _titan_registry  # noqa: E402

_titan_registry.register()

# prefix_megatron as a factory: megatron-core (optional) is imported only when such an engine is built.
from verl_prefix.backend.megatron import registry as _megatron_registry  # noqa: E402

_megatron_registry.register()

# rollout.name=hf: an HF-generate rollout on CPU, so verl's own main_ppo runs without vLLM/SGLang.
from verl_prefix.backend.trainer import rollout_hf as _rollout_hf  # noqa: E402

_rollout_hf.register()

# The trainer mode ("prefix_sync") registers on import. It needs verl's v1 trainer stack
# (TransferQueue, ray); an engine-only install without it still gets the engine.
try:
    from verl_prefix.backend.trainer import modes as _trainer  # noqa: E402, F401
except ImportError as _error:  # pragma: no cover - depends on the install
    import logging as _logging

    _logging.getLogger(__name__).warning("verl_prefix trainer mode unavailable: %s", _error)

from verl_prefix.backend.actor_config import PrefixFSDPActorConfig  # noqa: E402

__all__ = [
    "PREFIX_BACKEND",
    "PrefixFSDPActorConfig",
    "PrefixFSDPEngineConfig",
    "PrefixFSDPEngineWithLMHead",
    "PrefixReuseConfig",
    "is_registered",
]
