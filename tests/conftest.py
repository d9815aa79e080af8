"""Shared test setup: verl on CPU in this single process, tiny local models, no network.

The environment must be set before anything imports verl: verl resolves its platform once per
process and loads ``verl.plugins`` entry points on import.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("VERL_PLATFORM", "cpu")
if os.environ["VERL_PLATFORM"] == "cpu":
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

import verl_prefix  # noqa: E402, F401  (activates the CPU platform before verl resolves one)
from verl_prefix.tools.testing import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: ``tiny_model(family, **kwargs) -> Path``, one directory per distinct argument set."""
    cache: dict[tuple, Path] = {}

    def make(family: str = "qwen3", **kwargs) -> Path:
        key = (family, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = write_tiny_model(tmp_path_factory.mktemp(f"tiny_{family}"), family, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_model) -> Path:
    return tiny_model("qwen3")
