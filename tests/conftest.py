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
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Ray records "the current cluster" under its temp dir and a bare ray.init() joins it: workers running Ray
    # tests side by side (a two-node Cluster here, a local one there) must not find each other's
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/ray_{os.environ['PYTEST_XDIST_WORKER']}")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

# one intra-op thread per xdist worker (the workers share the cores), two in a serial run
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

import verl_prefix  # noqa: E402, F401  (activates the CPU platform before verl resolves one)
from verl_prefix.harness.tiny_models import write_tiny_model  # noqa: E402


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


@pytest.fixture(scope="module")
def engine_pairs(tiny_model):
    """Factory: ``engine_pairs(dtype="float64", kv_heads=None)`` -> a stock/prefix engine pair on a tiny qwen3
    (``helpers.engine_pairs``), one per dtype and KV-head count in a test file, built on first use."""
    from helpers.engine_pairs import build_pair

    built: dict[tuple, tuple] = {}

    def pair(dtype: str = "float64", kv_heads: int | None = None) -> tuple:
        if (dtype, kv_heads) not in built:
            model_dir = tiny_model("qwen3", **({} if kv_heads is None else {"num_kv_heads": kv_heads}))
            built[dtype, kv_heads] = build_pair(model_dir, dtype)
        return built[dtype, kv_heads]

    return pair


@pytest.fixture(scope="module")
def qwen3_pair(engine_pairs) -> tuple:
    """The fp64 pair of ``engine_pairs``."""
    return engine_pairs()


# Test files that take minutes (measured with --durations), longest first. Under xdist each file runs on one
# worker in collection order, so starting these first keeps one long file from finishing last on its own.
SLOWEST_FILES = (
    # end to end (`-m e2e`)
    "test_main_ppo_cpu.py",
    "test_main_ppo_titan_cpu.py",
    "test_main_ppo_vl_cpu.py",
    "test_grpo_loop_ray.py",
    "test_demo_wandb.py",
    # the rest: multi-rank (gloo) files and files that build many engine pairs
    "test_titan_engine.py",
    "test_trace_replay.py",
    "test_recurrent.py",
    "test_mamba_engine.py",
    "test_chunked_prefix_engine.py",
    "test_recurrent_engine.py",
    "test_multimodal_engine.py",
    "test_dormant_policies_engine.py",
    "test_tree_loss_engine.py",
    "test_two_ranks.py",
    "test_ulysses_engine.py",
    "test_bench_cli.py",
    "test_tree_engine.py",
    "test_recipe_keys.py",
    "test_recipe_sets.py",
    "test_capacity.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FILES)))  # stable: the rest keep their order
