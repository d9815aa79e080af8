"""One public import path per public name, and every path the docs, configs and recipes name resolves."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT_FILES = [*DOC_FILES, *sorted((ROOT / "configs").rglob("*.yaml")), *sorted((ROOT / "recipes").glob("*.sh"))]

# (module, attribute): the public paths the README, docs/, configs/ and recipes/ name
DOCUMENTED = [
    ("verl_prefix", "PrefixFSDPActorConfig"),
    ("verl_prefix", "PrefixFSDPEngineConfig"),
    ("verl_prefix", "PrefixReuseConfig"),
    ("verl_prefix", "is_registered"),
    ("verl_prefix.config", "PrefixFSDPEngineConfig"),  # the YAML `_target_` path of the engine config
    ("verl_prefix.config", "PrefixTorchtitanEngineConfig"),  # ... and of prefix_torchtitan's
    ("verl_prefix.backend.titan_config", "PrefixTorchtitanEngineConfig"),  # its _target_ in earlier releases
    ("verl_prefix.backend.trace", "recording"),
    ("verl_prefix.backend.trace", "load_trace"),
    ("verl_prefix.tools.synthetic_trace", "synthetic_trace"),
    ("verl_prefix.tools.cpu_loop", "run_cpu_grpo"),
    ("verl_prefix.tools.cpu_loop", "local_cluster"),
    ("verl_prefix.tools.cpu_loop", "compare_runs"),
    ("verl_prefix.tools.demo", "read_wandb_run"),
    ("verl_prefix.tools.cli", "main"),
    ("verl_prefix.tools.flops", "predicted_speedup"),
    ("verl_prefix.schedule", "train_group"),
    ("verl_prefix.schedule", "infer_group"),
    ("verl_prefix.schedule", "ScheduleOptions"),
]

# modules that only re-exported names for import paths older than the package layout; gone
REMOVED_ALIASES = ["verl_prefix.cli", "verl_prefix.demo", "verl_prefix.trace", "verl_prefix.cpu_loop"]


@pytest.mark.parametrize(("module", "name"), DOCUMENTED)
def test_documented_import_paths(module, name):
    assert callable(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize("module", REMOVED_ALIASES)
def test_alias_modules_are_gone(module):
    # by file, not by import: an older editable install of the package may still serve the old module
    package = Path(importlib.import_module("verl_prefix").__file__).parent
    name = module.rpartition(".")[2]
    assert not (package / f"{name}.py").exists() and not (package / name).exists(), module


def test_every_dotted_path_the_docs_name_resolves():
    """Each ``verl_prefix.x.y`` the docs, configs and recipes write imports: as a module, or as a module's name."""
    found = set()
    for path in TEXT_FILES:
        found |= set(re.findall(r"\bverl_prefix(?:\.\w+)+", path.read_text()))
    assert len(found) >= 10
    for dotted in sorted(found):
        assert not any(dotted == old or dotted.startswith(f"{old}.") for old in REMOVED_ALIASES), dotted
        try:
            importlib.import_module(dotted)
            continue
        except ModuleNotFoundError:
            pass
        module, _, name = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), name), dotted


def test_the_config_module_is_the_engine_config_yaml_path():
    from verl_prefix import config
    from verl_prefix.backend import config as backend_config

    assert config.PrefixFSDPEngineConfig is backend_config.PrefixFSDPEngineConfig
    assert "public YAML path" in config.__doc__


def test_yaml_targets_resolve():
    """The ``_target_`` paths the shipped config and the docs use instantiate through Hydra's resolver."""
    from hydra.utils import get_class

    assert get_class("verl_prefix.PrefixFSDPActorConfig").__name__ == "PrefixFSDPActorConfig"
    assert get_class("verl_prefix.config.PrefixFSDPEngineConfig").__name__ == "PrefixFSDPEngineConfig"
    found = []
    for path in [*sorted((ROOT / "configs").glob("prefix_grpo*.yaml")), *DOC_FILES]:
        found += re.findall(r"_target_[=:]\s*(verl_prefix[\w.]+)", path.read_text())
    assert len(found) >= 4
    assert "verl_prefix.config.PrefixFSDPEngineConfig" in found
    for target in found:
        assert isinstance(get_class(target), type), target


def test_entry_points_point_at_importable_code():
    from importlib.metadata import entry_points

    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    assert re.findall(r'^verl-prefix = "(.+)"$', scripts, re.M) == ["verl_prefix.tools.cli:main"]
    (script,) = entry_points(group="console_scripts", name="verl-prefix")
    assert callable(script.load())
    (plugin,) = entry_points(group="verl.plugins", name="verl_prefix")
    assert plugin.value == "verl_prefix"


def test_strategy_and_trainer_mode_names():
    """The names a recipe writes: ``actor.strategy=prefix_fsdp2 | prefix_torchtitan`` select engines registered
    with verl, and ``trainer.v1.trainer_mode=prefix_sync`` a trainer verl's registry returns."""
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.workers.engine.base import EngineRegistry

    import verl_prefix  # noqa: F401  (registers on import)

    engines = EngineRegistry._engines.get("language_model", {})
    assert {"prefix_fsdp2", "prefix_torchtitan"} <= set(engines), sorted(engines)
    assert get_trainer_cls("prefix_sync").__name__ == "PrefixPPOTrainer"


def test_the_earlier_titan_target_is_the_same_class():
    """A recipe written against the TorchTitan config's earlier ``_target_`` resolves to the one class."""
    from hydra.utils import get_class

    from verl_prefix import config

    old = get_class("verl_prefix.backend.titan_config.PrefixTorchtitanEngineConfig")
    assert old is config.PrefixTorchtitanEngineConfig
