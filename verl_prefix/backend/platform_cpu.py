"""verl on CPU: a platform plugin selected by ``VERL_PLATFORM=cpu``.

verl 0.9.1 resolves its device through ``verl.plugin.platform``; on a machine without a GPU the
auto-detection falls back to "nvidia" (device "cuda"), and the FSDP engines are registered only for
cuda/npu. This module registers a "cpu" platform (gloo, no-op streams/memory stats) and, when
activated, registers verl's stock FSDP engines for device "cpu" so that ``EngineRegistry.new`` finds
them. Importing it is harmless on a GPU machine: the platform is never auto-detected, only chosen
through the environment variable.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform, set_platform

logger = logging.getLogger(__name__)

PLATFORM_NAME = "cpu"


class _CPUDeviceModule(types.ModuleType):
    """Stands in for ``torch.cuda`` where verl calls ``get_torch_device().<fn>()``.

    CPU has no caching allocator, so allocator statistics read 0 (not measured) rather than
    raising; ``mem_get_info`` reports host memory. Anything not defined here falls through to
    ``torch.cpu`` (streams, events, synchronize, device_count).
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # keep module identity (__file__, __path__...) our own
            raise AttributeError(name)
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> str:
        # verl passes this to ``.to()`` / ``torch.device()``; an int would mean cuda:N.
        return "cpu"

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, Any]:
        return {}

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)


_DEVICE_MODULE = _CPUDeviceModule("verl_prefix_cpu_device")


def cpu_device_module() -> types.ModuleType:
    """The stand-in for ``torch.cuda`` on CPU (torchtitan's ``device_module`` on this platform too)."""
    return _DEVICE_MODULE


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """verl platform for host CPU: device "cpu", gloo collectives, no profiler ranges."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: only VERL_PLATFORM=cpu selects it.
        return False

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # No device visibility on CPU; a name nobody sets keeps verl's env plumbing inert.
        return "VERL_CPU_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # What one "GPU" slot of verl's resource pools asks Ray for (see ``slot_resource``).
        return slot_resource()

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        # Ray actors on CPU ask for nothing beyond their default CPU.
        return {}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


SLOT_RESOURCE = "verl_cpu_slot"


def slot_resource() -> str:
    """The Ray resource that stands for one accelerator of ``trainer.n_gpus_per_node`` on CPU.

    A cluster whose nodes declare ``verl_cpu_slot`` (``ray start --resources='{"verl_cpu_slot": N}'``) gets
    exactly N actor ranks per node, as N GPUs would; without it, ranks take one logical CPU each and Ray
    places them wherever CPUs are free (enough on one machine).
    """
    import ray

    if ray.is_initialized() and ray.cluster_resources().get(SLOT_RESOURCE, 0) > 0:
        return SLOT_RESOURCE
    return "CPU"


def cpu_platform_requested() -> bool:
    """True when the environment asks verl to run on CPU."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def _register_cpu_engines() -> None:
    """Register verl's stock FSDP engines for device "cpu" (verl registers them for cuda/npu only)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    from verl_prefix.backend.registry import register_class

    for model_type, engine_cls in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            register_class(engine_cls, backend, [PLATFORM_NAME], model_type)


def _patch_process_group_backend() -> None:
    """Make verl's Ray workers start a plain gloo process group on CPU.

    ``initialize_global_process_group_ray`` defaults to ``f"cpu:gloo,{device}:{comm}"``, which on this
    platform is ``"cpu:gloo,cpu:gloo"``; torch rejects it ("Duplicate device type cpu in backend string").
    The wrapper only fills in the default: an explicit ``backend`` is passed through unchanged.
    """
    import verl.utils.distributed as dist_utils

    original = dist_utils.initialize_global_process_group_ray
    if getattr(original, "_verl_prefix_cpu", False):
        return

    def initialize_global_process_group_ray(timeout_second: Any = None, backend: str | None = None) -> Any:
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray._verl_prefix_cpu = True  # type: ignore[attr-defined]
    dist_utils.initialize_global_process_group_ray = initialize_global_process_group_ray
    # Modules that already imported the function by name keep their own reference.
    for name in ("verl.workers.engine_workers", "verl.checkpoint_engine.base"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "initialize_global_process_group_ray", None) is original:
            module.initialize_global_process_group_ray = initialize_global_process_group_ray


def _patch_fsdp2_offload_pinning() -> None:
    """Let verl's FSDP2 engine build forward-only models (the reference policy) on CPU.

    verl gives every ``forward_only`` FSDP2 engine ``CPUOffloadPolicy(pin_memory=True)``; pinning host
    memory needs an accelerator, and torch raises "Cannot access accelerator device when none is
    available". The policy stays (the parameters already live on the host); only pinning is dropped.
    """
    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl

    policy_cls = fsdp_impl.CPUOffloadPolicy
    if policy_cls is None or getattr(policy_cls, "_verl_prefix_cpu", False):
        return

    class UnpinnedCPUOffloadPolicy(policy_cls):  # type: ignore[misc, valid-type]
        _verl_prefix_cpu = True

        def __init__(self, pin_memory: bool = False) -> None:
            super().__init__(pin_memory=False)

    fsdp_impl.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy


def _patch_resource_check() -> None:
    """Count CPU slots, not GPUs, when verl checks that the cluster can hold its resource pools.

    ``ResourcePoolManager._check_resource_available`` sums each node's "GPU"/"NPU" and refuses a CPU cluster
    ("Total available GPUs 0 is less than total desired GPUs"). On this platform the same check counts
    ``slot_resource()``: declared slots, or logical CPUs.
    """
    from verl.single_controller.ray.base import ResourcePoolManager

    if getattr(ResourcePoolManager._check_resource_available, "_verl_prefix_cpu", False):
        return

    def _check_resource_available(self: Any) -> None:
        import ray

        name = slot_resource()
        per_node = ray._private.state.available_resources_per_node()
        available = sum(info.get(name, 0) for info in per_node.values())
        required = sum(n for nodes in self.resource_pool_spec.values() for n in nodes)
        if available < required:
            raise ValueError(
                f"the Ray cluster has {available:g} free {name!r} for {required} CPU actor ranks "
                f"(trainer.nnodes x trainer.n_gpus_per_node); give nodes more (ray start --num-cpus / --resources)"
            )

    _check_resource_available._verl_prefix_cpu = True  # type: ignore[attr-defined]
    ResourcePoolManager._check_resource_available = _check_resource_available


def ensure_cpu_platform() -> None:
    """Make verl in this process run on CPU; idempotent.

    Sets ``VERL_PLATFORM=cpu`` (refusing a conflicting value), replaces an already-resolved
    non-CPU platform singleton, registers the FSDP engines for device "cpu", makes verl's Ray
    workers initialise a gloo process group, keeps FSDP2 from pinning memory (forward-only engines), and
    makes verl's resource-pool check count CPU slots.
    """
    current = os.environ.get("VERL_PLATFORM", "").strip().lower()
    if current and current != PLATFORM_NAME:
        raise RuntimeError(f"ensure_cpu_platform: VERL_PLATFORM={current!r} conflicts with the CPU platform")
    os.environ["VERL_PLATFORM"] = PLATFORM_NAME
    if get_platform().device_name != "cpu":
        logger.warning("verl platform was resolved before VERL_PLATFORM=cpu took effect; replacing it")
        set_platform(PlatformCPU())
    _register_cpu_engines()
    _patch_process_group_backend()
    _patch_fsdp2_offload_pinning()
    _patch_resource_check()
