"""The optional Megatron stack a test module needs: skip the module, with the reason, where it is not installed."""

from __future__ import annotations

import importlib.util

import pytest


def require_megatron_stack() -> None:
    """Call at module level: megatron-core 0.16.1 and Megatron-Bridge 0.3.1 (``scripts/setup.sh`` installs both)."""
    pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 is an optional dependency (scripts/setup.sh)")
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("megatron-bridge 0.3.1 is an optional dependency (scripts/setup.sh)", allow_module_level=True)
