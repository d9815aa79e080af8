"""verl-prefix on the driver but not on a worker node: the error says so, and says what to do.

The missing package is simulated the way a node without it behaves: worker processes whose ``PYTHONPATH``
puts a ``verl_prefix`` first that cannot be imported. The probe must run there (it is shipped by value),
and the prefix_sync trainer's node check raises the message naming the node. A negative control shows the
simulation really hides the package: a function pickled by reference cannot be loaded there.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from ray import cloudpickle

from verl_prefix.backend import plugin_check
from verl_prefix.backend.plugin_check import (
    SKIP_ENV,
    PluginMissingError,
    check_plugin_on_nodes,
    fix_commands,
    missing_plugin_message,
    plugin_probe,
    shipping_runtime_env,
    wheel_name,
)

SIMULATED = "simulated: verl-prefix is not installed on this node"
_RUN_PICKLED = (
    "import sys, json; from ray import cloudpickle; "
    "fn = cloudpickle.loads(sys.stdin.buffer.read()); print(json.dumps(fn()))"
)


@pytest.fixture
def node_without_plugin(tmp_path):
    """A PYTHONPATH whose ``verl_prefix`` fails to import, shadowing any installed one."""
    package = tmp_path / "verl_prefix"
    package.mkdir()
    (package / "__init__.py").write_text(f"raise ModuleNotFoundError({SIMULATED!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path)
    return env


def _run_pickled(fn, env, cwd) -> subprocess.CompletedProcess:
    """Run ``fn`` in a fresh interpreter (``python -c`` puts ``cwd`` first on sys.path: not the checkout)."""
    return subprocess.run(
        [sys.executable, "-c", _RUN_PICKLED],
        input=cloudpickle.dumps(fn),
        env=env,
        cwd=cwd,
        capture_output=True,
        timeout=300,
        check=False,
    )


def test_probe_runs_where_the_package_is_missing(node_without_plugin, tmp_path):
    proc = _run_pickled(plugin_probe(), node_without_plugin, tmp_path)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    report = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert report["import_error"] == f"ModuleNotFoundError: {SIMULATED}"
    assert report["registered"] is False
    message = missing_plugin_message([report])
    assert SIMULATED in message and report["node"] in message
    assert "Give every node the verl-prefix the driver runs" in message and "runtime_env" in message


def test_negative_control_the_simulation_hides_the_package(node_without_plugin, tmp_path):
    proc = _run_pickled(plugin_check.missing_plugin_message, node_without_plugin, tmp_path)  # pickled by reference
    assert proc.returncode != 0
    assert SIMULATED in proc.stderr.decode()


def test_probe_reports_a_working_install(tmp_path):
    proc = _run_pickled(plugin_probe(), dict(os.environ), tmp_path)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    report = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert report["import_error"] is None and report["registered"] is True


def test_message_for_an_import_that_did_not_register():
    message = missing_plugin_message([{"node": "n1", "python": "/py", "import_error": None, "registered": False}])
    assert "node n1" in message and "prefix_fsdp2 is not in verl's EngineRegistry" in message


def _overrides(command: str) -> list[str]:
    """The Hydra overrides in a fix's first backticked command, split as a shell would."""
    return shlex.split(command.split("`")[1])


def _main_ppo_runtime_env(overrides: list[str]) -> dict:
    """The ``runtime_env`` verl's ``main_ppo`` passes to ``ray.init`` for these command-line overrides."""
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    from verl_prefix.harness.verl_engine import compose_ppo_config

    config = compose_ppo_config(overrides)
    merged = OmegaConf.merge(get_ppo_ray_runtime_env(config), config.ray_kwargs.ray_init.runtime_env)
    return OmegaConf.to_container(merged)


def test_fix_commands_are_what_main_ppo_passes_to_ray():
    """Each fix the message gives is a command that works: the wheel's real name, and main_ppo overrides that
    compose on verl's config into the runtime_env they describe."""
    install, per_job, ship = fix_commands(module_dir="/srv/driver/verl_prefix", release="1.2.3")
    assert "`pip install verl_prefix-1.2.3-py3-none-any.whl`" in install and "docker/Dockerfile" in install
    assert wheel_name("1.2.3") == "verl_prefix-1.2.3-py3-none-any.whl"
    wheel = "/shared/path/verl_prefix-1.2.3-py3-none-any.whl"
    assert _main_ppo_runtime_env(_overrides(per_job))["pip"] == [wheel]
    submit_json = per_job.split("--runtime-env-json '")[1].split("'")[0]
    assert json.loads(submit_json) == {"pip": [wheel]}
    shipped = _main_ppo_runtime_env(_overrides(ship))
    want = shipping_runtime_env("/srv/driver/verl_prefix")
    assert shipped["py_modules"] == want["py_modules"] == ["/srv/driver/verl_prefix"]
    assert shipped["env_vars"]["VERL_USE_EXTERNAL_MODULES"] == want["env_vars"]["VERL_USE_EXTERNAL_MODULES"]
    assert want["env_vars"]["VERL_USE_EXTERNAL_MODULES"] == "verl_prefix"


def test_skip_switch(monkeypatch):
    monkeypatch.setenv(SKIP_ENV, "1")
    assert check_plugin_on_nodes() == []


def test_trainer_checks_nodes_before_creating_workers(monkeypatch):
    from verl_prefix.backend.trainer import modes as trainer

    calls = []

    def missing() -> None:
        calls.append("check")
        raise PluginMissingError("verl-prefix missing on node x")

    monkeypatch.setattr(trainer, "check_plugin_on_nodes", missing)
    with pytest.raises(PluginMissingError, match="missing on node x"):
        trainer.PrefixPPOTrainer._init_resource_pool_mgr(object())  # no worker mapping touched before it
    assert calls == ["check"]


@pytest.mark.e2e
def test_ray_node_without_the_package_fails_with_the_message(node_without_plugin, tmp_path, monkeypatch):
    """A real local Ray cluster whose workers cannot import verl_prefix (the job's runtime_env; Ray also puts
    the driver's working directory on the workers' path, so that is not the checkout either)."""
    import ray

    assert not ray.is_initialized()
    monkeypatch.chdir(tmp_path)
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": node_without_plugin["PYTHONPATH"]}},
    )
    try:
        with pytest.raises(PluginMissingError) as info:
            check_plugin_on_nodes(timeout_s=300)
    finally:
        ray.shutdown()
    message = str(info.value)
    assert "not usable in the Ray worker processes of 1 node(s)" in message
    assert f"ModuleNotFoundError: {SIMULATED}" in message
    assert "Give every node the verl-prefix the driver runs" in message
    # the message's py_modules fix, as main_ppo would pass it to ray.init, on the same node without the package
    # (no entry point there either: verl's discovery is off, VERL_USE_EXTERNAL_MODULES alone imports it)
    runtime_env = _main_ppo_runtime_env(_overrides(fix_commands()[2]))
    runtime_env["env_vars"].update(PYTHONPATH=node_without_plugin["PYTHONPATH"], VERL_USE_EXTERNAL_PLUGINS="none")
    (tmp_path / "driver").mkdir()
    monkeypatch.chdir(tmp_path / "driver")  # Ray puts the driver's directory first on the workers' path
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)

    def verl_imports_the_plugin() -> bool:  # what a verl worker process does: only `import verl`
        import sys as _sys

        import verl  # noqa: F401

        return "verl_prefix" in _sys.modules

    try:
        (report,) = check_plugin_on_nodes(timeout_s=300)
        assert ray.get(ray.remote(num_cpus=0)(verl_imports_the_plugin).remote(), timeout=300)
    finally:
        ray.shutdown()
    assert report["import_error"] is None and report["registered"] is True
    assert "py_modules_files" in report["location"]  # Ray's copy of the driver's package, not an install
