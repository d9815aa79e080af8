"""Is verl-prefix importable, and ``prefix_fsdp2`` registered, on every Ray node? A clear error if not.

verl loads plugins through the ``verl.plugins`` entry point and skips one that fails to import with a DEBUG
log. With verl-prefix installed on the driver only, a worker node then fails with Ray's unpickling error
(``No module named 'verl_prefix'``) or verl's ``Unknown backend: prefix_fsdp2``, neither of which says what
to do. The ``prefix_sync`` trainer runs ``check_plugin_on_nodes`` before it creates any worker: a probe
task on each alive node, shipped by value so it runs where the package is missing, reports what it saw.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

SKIP_ENV = "VERL_PREFIX_SKIP_NODE_CHECK"


class PluginMissingError(RuntimeError):
    """verl-prefix cannot be imported (or did not register) on some Ray node."""


def plugin_probe() -> Callable[[], dict[str, Any]]:
    """A function reporting whether ``verl_prefix`` imports and registers ``prefix_fsdp2`` in its process.

    Built as a closure over nothing from this package, so cloudpickle ships it by value: a process
    without ``verl_prefix`` can unpickle and run it (a module-level function would be pickled by name).
    """

    def probe() -> dict[str, Any]:
        import importlib as _importlib
        import os as _os
        import socket
        import sys

        report: dict[str, Any] = {
            "node": socket.gethostname(),
            "pid": _os.getpid(),
            "python": sys.executable,
            "import_error": None,
            "registered": False,
        }
        try:  # verl's plugin loading swallows this error; here it is reported
            verl_prefix = _importlib.import_module("verl_prefix")
        except Exception as exc:  # any import failure is what the report is for
            report["import_error"] = f"{type(exc).__name__}: {exc}"
            return report
        report["registered"] = bool(verl_prefix.is_registered())
        report["location"] = getattr(verl_prefix, "__file__", None)
        return report

    return probe


def package_version() -> str | None:
    """This install's version (the wheel to put on the other nodes has the same one); None for a source tree on
    ``PYTHONPATH`` that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl-prefix")
    except PackageNotFoundError:
        return None


def wheel_name(release: str | None = None) -> str:
    """The file name ``python -m build --wheel`` gives this version's wheel (pure Python: one for every node)."""
    return f"verl_prefix-{release or package_version() or '<version>'}-py3-none-any.whl"


def package_dir() -> str:
    """The directory this process imports ``verl_prefix`` from (what ``py_modules`` ships to the workers)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # verl_prefix/backend/plugin_check.py


def shipping_runtime_env(module_dir: str | None = None) -> dict[str, Any]:
    """A Ray ``runtime_env`` that ships the driver's package to every worker without installing it anywhere.

    ``py_modules`` uploads the directory and puts it on the workers' path; it carries no package metadata, so
    verl's entry-point discovery cannot see it: ``VERL_USE_EXTERNAL_MODULES`` makes ``import verl`` import it.
    """
    return {
        "py_modules": [module_dir or package_dir()],
        "env_vars": {"VERL_USE_EXTERNAL_MODULES": "verl_prefix"},
    }


def fix_commands(module_dir: str | None = None, release: str | None = None) -> list[str]:
    """The ways to give every node verl-prefix, as commands to run or to add to ``main_ppo``'s command line."""
    wheel = wheel_name(release)
    ship = shipping_runtime_env(module_dir)
    prefix = "++ray_kwargs.ray_init.runtime_env"
    return [
        f"install the wheel into every node's Python environment (the python named above): `pip install "
        f"{wheel}` (`python -m build --wheel` in a checkout writes it to dist/), or run every node from the "
        "image docker/Dockerfile builds",
        f"or install it per job from a path every node can read: `'{prefix}.pip=[/shared/path/{wheel}]'` on "
        f'main_ppo\'s command line (ray job submit: `--runtime-env-json \'{{"pip": ["/shared/path/{wheel}"]}}\'`)',
        f"or ship this driver's package to the workers (no shared filesystem): `'{prefix}.py_modules="
        f"[{ship['py_modules'][0]}]' {prefix}.env_vars.VERL_USE_EXTERNAL_MODULES=verl_prefix`",
    ]


def missing_plugin_message(problems: list[dict[str, Any]]) -> str:
    """The error for the probe reports that found no usable verl-prefix: which nodes, why, what to do."""
    lines = [
        "verl-prefix is installed where the trainer runs but not usable in the Ray worker processes of "
        f"{len(problems)} node(s), so the prefix_fsdp2 engine / prefix_sync worker cannot start there:"
    ]
    for p in problems:
        why = p.get("import_error") or "verl_prefix imported but prefix_fsdp2 is not in verl's EngineRegistry"
        lines.append(f"  node {p.get('node')} (python {p.get('python')}): {why}")
    release = package_version()
    lines.append(f"Give every node the verl-prefix the driver runs{f' ({release})' if release else ''}:")
    lines.extend(f"  - {command}" for command in fix_commands())
    lines.append(f"(Set {SKIP_ENV}=1 to skip this check.)")
    return "\n".join(lines)


def check_plugin_on_nodes(timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Run the probe on every alive Ray node (with the job's runtime_env, as workers get it).

    Returns the reports; raises ``PluginMissingError`` naming the nodes where the import failed or the
    engine did not register. Skipped (returns ``[]``) when ``VERL_PREFIX_SKIP_NODE_CHECK=1``.
    """
    if os.environ.get(SKIP_ENV, "").strip() in ("1", "true", "True"):
        return []
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_retries=0)(plugin_probe())
    nodes = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    refs = [
        remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote() for node in nodes
    ]
    try:
        reports = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise PluginMissingError(
            f"the verl-prefix install check on {len(nodes)} Ray node(s) did not finish in {timeout_s:.0f} s; "
            f"set {SKIP_ENV}=1 to skip it"
        ) from None
    problems = [r for r in reports if r["import_error"] is not None or not r["registered"]]
    if problems:
        raise PluginMissingError(missing_plugin_message(problems))
    return reports


__all__ = [
    "SKIP_ENV",
    "PluginMissingError",
    "check_plugin_on_nodes",
    "fix_commands",
    "missing_plugin_message",
    "package_dir",
    "package_version",
    "plugin_probe",
    "shipping_runtime_env",
    "wheel_name",
]
