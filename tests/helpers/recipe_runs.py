"""Run ``recipes/grpo_cpu_smoke.sh`` (verl's own ``main_ppo`` on CPU) from a test, and read what it wrote.

A launch costs a minute or more of CPU on 2 cores, so tests start their launches in the background
(``start_recipe``), run them side by side, and wait for each (``finish_recipe``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_cpu_smoke.sh"
# the smallest job that forms groups: 2 prompts x 4 samples, one mini-batch; no checkpoint (the metrics are the
# comparison: the last value of a key wins)
SMALL_JOB = (
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "trainer.save_freq=-1",
)


def start_recipe(
    out: Path, *, mode: str, steps: int, save_at: int, env: dict | None = None, args: Sequence[str] = ()
) -> subprocess.Popen:
    """The recipe in the background (its own process group), its output to ``out/recipe.log``; ``args`` go
    to both of its ``main_ppo`` launches."""
    full_env = {
        **os.environ,
        "OUT": str(out),
        "STEPS": str(steps),
        "SAVE_AT": str(save_at),
        "MODE": mode,
        "PYTHON": sys.executable,
        "WANDB_MODE": "offline",
        **(env or {}),
    }
    out.mkdir(parents=True, exist_ok=True)
    with (out / "recipe.log").open("w") as log:
        proc = subprocess.Popen(
            ["bash", str(RECIPE), *args],
            env=full_env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: a run cut short is stopped with main_ppo and Ray
        )
    proc.relaunch = lambda: start_recipe(out, mode=mode, steps=steps, save_at=save_at, env=env, args=args)
    return proc


def stop(proc: subprocess.Popen) -> None:
    """Kill a recipe run and everything it started (its process group), if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# Ray's own words when a local cluster's raylet does not register within its fixed 30 s (``ray._private.node``):
# on 2 loaded cores (two xdist workers, each with two launches' clusters) it happens before any of the job runs
RAY_START_TIMEOUT = "The current node timed out during startup"
# Ray's words when its memory monitor kills a worker because the host is nearly full: on a 24 GiB CI machine the e2e
# tier runs four launches side by side (two xdist workers, two launches each), and a peak of theirs can cross Ray's
# threshold before any of them is wrong
RAY_MEMORY_KILL = "how to address the out of memory issue"


def finish_recipe(proc: subprocess.Popen, out: Path, timeout: float = 1200) -> str:
    """Wait for a recipe run; its log, which must end in success. A run whose local Ray cluster did not start
    (``RAY_START_TIMEOUT``), or one whose worker Ray's memory monitor killed (``RAY_MEMORY_KILL``), is launched once
    more from the start, its metrics removed and its log kept as ``recipe_ray_start_timeout.log``; any other failure,
    or a second such one, fails."""
    for attempt in (1, 2):
        try:
            proc.wait(timeout=timeout)
        finally:
            stop(proc)
        log = (out / "recipe.log").read_text()
        retryable = RAY_START_TIMEOUT in log or RAY_MEMORY_KILL in log
        if proc.returncode == 0 or attempt == 2 or not retryable or not hasattr(proc, "relaunch"):
            break
        (out / "recipe_ray_start_timeout.log").write_text(log)
        for written in out.glob("metrics_*.jsonl"):
            written.unlink()
        proc = proc.relaunch()
    assert proc.returncode == 0, log[-6000:]
    return log


def metrics(path: Path) -> dict[int, dict]:
    """verl's file logger output: ``{step: metrics}``."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(r["step"]): r["data"] for r in rows}


def ray_tmpdir(name: str) -> str:
    """A short per-worker Ray temp dir (Ray's socket paths have a length limit): a launch's own local cluster."""
    return f"/tmp/ray_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}_{name}"


def run_dense_and_prefix(
    tmp_path_factory,
    name: str,
    *,
    steps: int,
    env: dict,
    args: Sequence[str] = (),
    dense_args: Sequence[str] = (),
    one_line: str | None = None,
) -> dict[str, Path]:
    """The recipe's dense and prefix launches started together (each in its own local Ray cluster), each waited
    for: ``{"dense": out, "prefix": out}``; ``dense_args`` go to the dense launch only, after ``args``. With
    ``one_line`` (a selection override such as ``actor_rollout_ref.actor.strategy=prefix_megatron``) the prefix
    launch is the dense one plus exactly that line, as a user switching a stock recipe writes it. Both are killed if
    either fails."""
    procs = {}
    try:
        for mode in ("dense", "prefix"):
            out = tmp_path_factory.mktemp(f"{name}_{mode}")
            run_env = {**env, "RAY_TMPDIR": ray_tmpdir(f"{name}_{mode}")}
            mode_args = (*args, *dense_args) if mode == "dense" else tuple(args)
            recipe_mode = mode
            if mode == "prefix" and one_line is not None:
                recipe_mode, mode_args = "dense", (*args, *dense_args, one_line)
            run = start_recipe(out, mode=recipe_mode, steps=steps, save_at=steps, env=run_env, args=mode_args)
            procs[mode] = (run, out)
        for proc, out in procs.values():
            finish_recipe(proc, out)
        return {mode: out for mode, (_, out) in procs.items()}
    finally:
        for proc, _ in procs.values():
            stop(proc)


def assert_same_rollouts_and_update(dense: dict, prefix: dict, step: int) -> None:
    """One step's metrics of a dense and a prefix launch on identical rollouts: the same rewards, prompts and
    responses, the same gradient norm (1e-4 relative, not zero), and the sampler's log-probs the actor's in
    both."""
    import pytest

    assert "actor/prefix/groups" not in dense  # the stock engine
    for key in ("critic/score/mean", "response_length/mean", "prompt_length/mean", "prompt_length/max"):
        assert dense[key] == pytest.approx(prefix[key], rel=1e-6), (step, key)
    assert abs(prefix["actor/grad_norm"] - dense["actor/grad_norm"]) <= 1e-4 * abs(dense["actor/grad_norm"]), step
    assert dense["actor/grad_norm"] > 0, step  # the groups have reward spread: the update is not zero
    assert dense["training/rollout_probs_diff_max"] < 1e-4 and prefix["training/rollout_probs_diff_max"] < 1e-4, step


def assert_reuse_ran(prefix: dict, step: int) -> None:
    """One step's metrics of a prefix launch: the update reused (groups, fewer physical than logical tokens),
    so did the old-log-prob pass, and nothing fell back."""
    assert prefix["actor/prefix/groups"] > 0, (step, prefix)
    assert prefix["actor/prefix/physical_tokens"] < prefix["actor/prefix/logical_tokens"], (step, prefix)
    assert prefix["actor/prefix/old_log_prob/groups"] > 0, (step, prefix)
    assert not any(k.startswith("actor/prefix/fallback_") and v > 0 for k, v in prefix.items()), (step, prefix)


def assert_engine_twins_agree(runs: dict, steps: int) -> None:
    """A prefix engine's ``main_ppo`` run and its stock twin (``run_dense_and_prefix``): every step on identical
    rollouts with the same update (grad norm, PG loss), reuse in the update and in the reference policy's pass,
    and after the first update both reference passes seeing the moved policy alike (the KL loss)."""
    import pytest

    dense = metrics(runs["dense"] / "metrics_first.jsonl")
    prefix = metrics(runs["prefix"] / "metrics_first.jsonl")
    assert sorted(dense) == sorted(prefix) == list(range(1, steps + 1)), (dense.keys(), prefix.keys())
    for step in dense:
        d, p = dense[step], prefix[step]
        assert_same_rollouts_and_update(d, p, step)  # identical rollouts; TP=2's weight sync feeds the sampler
        assert p["actor/pg_loss"] == pytest.approx(d["actor/pg_loss"], rel=1e-4, abs=1e-6), step
        assert_reuse_ran(p, step)  # and the reference policy's pass too
        assert p["actor/prefix/ref_log_prob/groups"] > 0, (step, p)
        assert p["actor/prefix/ref_log_prob/physical_tokens"] < p["actor/prefix/ref_log_prob/logical_tokens"], step
    assert dense[2]["actor/kl_loss"] > 0
    assert prefix[2]["actor/kl_loss"] == pytest.approx(dense[2]["actor/kl_loss"], rel=1e-4)
