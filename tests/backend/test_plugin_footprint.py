"""Importing the plugin leaves verl's own engines (their entries and their classes' methods), trainers and rollouts
as verl registers them.

Each case is a fresh interpreter (verl loads plugins once per process, on ``import verl``) that dumps verl's
registries: verl alone (``VERL_USE_EXTERNAL_PLUGINS=none``) against verl with this plugin, loaded the way verl
loads it (the ``verl.plugins`` entry point) and imported explicitly. Without opt-ins the plugin only adds names of
its own (``prefix_*`` engines, the ``prefix_sync`` trainer, the ``hf`` rollout); the opt-ins add exactly what
docs/configuration.md says: ``VERL_PLATFORM=cpu`` device ``cpu`` for verl's FSDP engines,
``VERL_PREFIX_STOCK_TORCHTITAN=1`` the adapted ``torchtitan`` engine on the devices verl left empty,
``VERL_PREFIX_MEGATRON_CPU=1`` (on a host without an accelerator) verl's ``megatron`` engine for ``cpu`` through
the Megatron platform layer, and ``McoreEngineConfig`` accepting float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from verl_prefix.backend.megatron.registry import CPU_ENV as MEGATRON_CPU_ENV
from verl_prefix.backend.titan.registry import STOCK_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_DUMP = """
import json, os, sys
import verl
import verl.workers.engine  # verl's own engine registrations (FSDP, and whichever optional engines import)
if os.environ.get("IMPORT_PLUGIN"):
    import verl_prefix
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
from verl.workers.config import McoreEngineConfig
from verl.workers.engine.base import EngineRegistry
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.replica import RolloutReplicaRegistry

def name(obj):
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"

def methods(cls):  # where each method of the class and its bases comes from: a patch shows as another module
    if not isinstance(cls, type):
        return []
    return sorted(
        f"{base.__qualname__}.{key}:{getattr(value, '__module__', None)}"
        for base in cls.__mro__ for key, value in vars(base).items() if callable(value)
    )

print(json.dumps({
    "methods": {
        f"{model_type}/{backend}/{key}": methods(cls)
        for model_type, backends in EngineRegistry._engines.items()
        for backend, per in backends.items() for key, cls in per.items()
    },
    "engines": {
        model_type: {backend: {str(key): name(cls) for key, cls in per.items()} for backend, per in backends.items()}
        for model_type, backends in EngineRegistry._engines.items()
    },
    "trainers": {key: name(cls) for key, cls in TRAINER_REGISTRY.items()},
    "replicas": {key: name(loader) for key, loader in RolloutReplicaRegistry._registry.items()},
    "rollouts": {str(key): str(value) for key, value in rollout_base._ROLLOUT_REGISTRY.items()},
    "plugin_loaded": "verl_prefix" in sys.modules,
    "mcore_config_patched": getattr(McoreEngineConfig.__post_init__, "_verl_prefix_megatron_cpu", False),
    "wrapped": sorted(
        f"{owner}.{key}"
        for owner, obj in (
            ("PPOTrainer", __import__("verl.trainer.ppo.v1.trainer_base", fromlist=["x"]).PPOTrainer),
            ("RayPPOTrainer", __import__("verl.trainer.ppo.ray_trainer", fromlist=["x"]).RayPPOTrainer),
            ("monkey_patch", __import__("verl.models.transformers.monkey_patch", fromlist=["x"])),
        )
        for key, value in vars(obj).items()
        if callable(value) and getattr(value, "_verl_prefix", False)
    ),
}))
"""
# what importing the plugin wraps in verl (docs/configuration.md, "What importing the plugin changes in verl")
WRAPPED = [
    "PPOTrainer._balance_batch",
    "PPOTrainer._compute_old_log_prob",
    "PPOTrainer._compute_ref_log_prob",
    "PPOTrainer._init_resource_pool_mgr",
    "RayPPOTrainer._balance_batch",
    "monkey_patch.patch_forward_with_backends",
]
_OWN_ENV = (
    "VERL_PLATFORM",
    "VERL_ENGINE_DEVICE",
    "VERL_USE_EXTERNAL_PLUGINS",
    STOCK_ENV,
    MEGATRON_CPU_ENV,
    "IMPORT_PLUGIN",
)


def _registries(**env: str) -> dict:
    """verl's registries in a fresh interpreter with ``env`` (none of this file's variables inherited)."""
    clean = {k: v for k, v in os.environ.items() if k not in _OWN_ENV}
    clean["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, clean.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-c", _DUMP], env={**clean, **env}, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _flat(engines: dict) -> dict[tuple[str, str, str], str]:
    return {(m, b, d): cls for m, backends in engines.items() for b, per in backends.items() for d, cls in per.items()}


@pytest.fixture(scope="module")
def stock():
    """verl alone: no plugin discovered."""
    found = _registries(VERL_USE_EXTERNAL_PLUGINS="none")
    assert not found["plugin_loaded"]
    return found


def _added(stock: dict, found: dict) -> dict:
    """What ``found`` has beyond ``stock``; fails if any stock entry changed or vanished."""
    before, after = _flat(stock["engines"]), _flat(found["engines"])
    changed = {key: (cls, after.get(key)) for key, cls in before.items() if after.get(key) != cls}
    assert not changed, f"verl's own engine entries changed: {changed}"
    patched = {key: sorted(set(found["methods"][key]) ^ set(m)) for key, m in stock["methods"].items()}
    assert not any(patched.values()), f"verl's engine classes changed: { {k: v for k, v in patched.items() if v} }"
    for registry in ("trainers", "replicas", "rollouts"):
        kept = {k: v for k, v in found[registry].items() if k in stock[registry]}
        assert kept == stock[registry], registry
    return {
        "engines": {key: cls for key, cls in after.items() if key not in before},
        **{r: sorted(set(found[r]) - set(stock[r])) for r in ("trainers", "replicas", "rollouts")},
    }


def test_plugin_adds_only_its_own_names(stock):
    """Loaded by ``import verl`` (the entry point) or imported explicitly: verl's entries stay, ours are new."""
    for found in (_registries(), _registries(VERL_USE_EXTERNAL_PLUGINS="none", IMPORT_PLUGIN="1")):
        assert found["plugin_loaded"]
        added = _added(stock, found)
        new_backends = {backend for _, backend, _ in added["engines"]}
        assert new_backends == {"prefix_fsdp2", "prefix_torchtitan", "prefix_megatron"}, added["engines"]
        assert all(model == "language_model" for model, _, _ in added["engines"]), added["engines"]
        assert added["trainers"] == ["prefix_sync"]
        assert added["replicas"] == ["hf"] and added["rollouts"] == [str(("hf", "async"))]
        # verl's own backends: not ours to fill (the Megatron platform registers verl's for cpu only when applied)
        assert not {"torchtitan", "megatron"} & {b for _, b, _ in added["engines"]}
        # the documented wrappers, each calling verl's own method unless a prefix engine is selected
        # (tests/backend/test_trainer_balance.py) or only remembering HF's forward before verl patches it
        assert found["wrapped"] == WRAPPED, found["wrapped"]
        assert not found["mcore_config_patched"]  # verl's Megatron config validation as verl wrote it
    assert stock["wrapped"] == []


def test_opt_ins_add_exactly_what_is_documented(stock):
    """``VERL_PLATFORM=cpu``: verl's FSDP classes for device ``cpu``; ``VERL_PREFIX_STOCK_TORCHTITAN=1``: the
    adapted ``torchtitan`` factory where verl registered none; ``VERL_PREFIX_MEGATRON_CPU=1`` (this host has no
    accelerator): verl's ``megatron`` for ``cpu`` through the platform layer, and its engine config taking float32.
    Nothing verl registered is replaced."""
    found = _registries(VERL_PLATFORM="cpu", **{STOCK_ENV: "1", MEGATRON_CPU_ENV: "1"})
    added = {key: cls for key, cls in _added(stock, found)["engines"].items() if not key[1].startswith("prefix_")}
    fsdp = {
        ("language_model", backend, "cpu"): "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"
        for backend in ("fsdp", "fsdp2")
    } | {
        ("value_model", backend, "cpu"): "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithValueHead"
        for backend in ("fsdp", "fsdp2")
    }
    verl_titan = set(stock["engines"].get("language_model", {}).get("torchtitan", {}))
    titan = {
        ("language_model", "torchtitan", device): "verl_prefix.backend.titan.registry.build_stock_torchtitan"
        for device in ("cuda", "cpu")
        if device not in verl_titan
    }
    cpu_host = not torch.cuda.is_available()  # with an accelerator the Megatron opt-in changes nothing
    megatron = {("language_model", "megatron", "cpu"): "verl_prefix.backend.megatron.registry.build_stock_megatron"}
    assert added == fsdp | titan | (megatron if cpu_host else {})
    assert found["mcore_config_patched"] == cpu_host
