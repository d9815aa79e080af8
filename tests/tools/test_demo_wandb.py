"""``verl-prefix demo`` end to end, and the per-phase telemetry read back from its offline wandb runs.

The demo runs in a subprocess as a user would run it: no ``WANDB_MODE``, no API key and a home without
a netrc, so it must choose offline by itself, and a ``WANDB_DIR`` it must honour. Both runs are then read
back from their ``.wandb`` files: the keys verl's ``Tracking`` logged under ``actor/prefix/...`` and that
their values are plausible (phase times within the update time, logical >= physical tokens, memory > 0).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.reuse import assert_reuse_ran

from verl_prefix.tools import cli
from verl_prefix.tools.demo.echo import DemoError, read_wandb_run, wandb_login_configured, wandb_mode

STEPS = 2
PHASES = ("A", "B", "C")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    home, wandb_dir, out = root / "home", root / "wandb_dir", root / "out"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    # one torch thread, as in every test process: the demo's driver samples with a tiny model, and two threads
    # on a saturated machine spin more than they compute
    env.update(HOME=str(home), WANDB_DIR=str(wandb_dir), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "verl_prefix.tools.cli", "demo", "--steps", str(STEPS), "--prompts", "2", "--n", "4"]
    proc = subprocess.run(
        [*cmd, "--out-dir", str(out)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, out, wandb_dir


def _runs(wandb_dir: Path) -> dict[str, object]:
    runs = {}
    for run_dir in sorted((wandb_dir / "wandb").glob("*run-*")):
        if run_dir.is_symlink():  # latest-run
            continue
        run = read_wandb_run(run_dir)
        runs[run.name] = (run_dir, run)
    return runs


@pytest.mark.e2e
def test_demo_prints_the_comparison_and_logs_through_tracking(demo):
    proc, out, _ = demo
    text = proc.stdout
    assert "| step | dense update_actor (s) | prefix update_actor (s) | speedup |" in text
    assert "| A prefix forward |" in text and "| C prefix backward |" in text
    assert "| prefix run, old log-prob pass |" in text
    assert "update_actor speedup (median of per-step dense/prefix):" in text
    # verl's console backend printed every step of both runs
    for step in range(1, STEPS + 1):
        assert len(re.findall(rf"^step:{step} - ", text, flags=re.MULTILINE)) == 2, step
    summary = json.loads((out / "demo.json").read_text())
    assert len(summary["steps"]) == STEPS
    # no timing assertions: the speedups are finite and derived from the logged times as the table says
    for row in summary["steps"]:
        assert math.isfinite(row["speedup"]) and row["speedup"] == row["dense_update_s"] / row["prefix_update_s"]
        assert row["logical_tokens"] > row["physical_tokens"] > 0, row  # the prefix run reused
    assert summary["speedup_median"] == statistics.median(r["speedup"] for r in summary["steps"])
    assert summary["max_update_rel"] == max(r["update_rel"] for r in summary["steps"])
    assert summary["wandb_mode"] == "offline"
    # AdamW magnifies rounding in near-zero gradient entries; the gradient norm shows the schedule is exact
    assert summary["max_grad_norm_rel"] < 1e-4
    assert summary["max_update_rel"] < 1e-2


@pytest.mark.e2e
def test_wandb_runs_are_offline_under_wandb_dir(demo):
    _, out, wandb_dir = demo
    runs = _runs(wandb_dir)
    assert set(runs) == {"dense-sync-fsdp2", "prefix-prefix_sync-prefix_fsdp2"}
    assert not (out / "wandb").exists(), "WANDB_DIR was not honoured"
    for name, (run_dir, run) in runs.items():
        assert run_dir.name.startswith("offline-run-"), run_dir
        assert run.finished, f"{name}: the run file did not parse to its exit record"
        assert run.project == "verl_prefix_demo"
        assert [row["_step"] for row in run.history] == list(range(1, STEPS + 1))
    dense, prefix = runs["dense-sync-fsdp2"][1], runs["prefix-prefix_sync-prefix_fsdp2"][1]
    assert dense.config["trainer"]["v1"]["trainer_mode"] == "sync"
    assert dense.config["actor_rollout_ref"]["actor"]["strategy"] == "fsdp2"
    assert prefix.config["trainer"]["v1"]["trainer_mode"] == "prefix_sync"
    assert prefix.config["actor_rollout_ref"]["actor"]["strategy"] == "prefix_fsdp2"
    for row in dense.history:
        assert row["timing_s/update_actor"] > 0
        assert not [k for k in row if k.startswith("actor/prefix/")]


@pytest.mark.e2e
def test_prefix_telemetry_read_back_from_wandb_is_plausible(demo):
    _, _, wandb_dir = demo
    run = _runs(wandb_dir)["prefix-prefix_sync-prefix_fsdp2"][1]
    for row in run.history:
        times = {p: row[f"actor/prefix/time_s/{p}"] for p in PHASES}
        assert all(t > 0 for t in times.values()), times
        # every rank reports every phase (zeros where it did not run), so verl's means add up
        phase_total = sum(times.values()) + row["actor/prefix/time_s/dense"] + row["actor/prefix/time_s/lockstep"]
        assert phase_total <= row["timing_s/update_actor"], (times, row["timing_s/update_actor"])
        assert row["actor/prefix/time_s/schedule"] == pytest.approx(phase_total, rel=1e-6)
        assert_reuse_ran(row, namespace="actor/prefix/")
        assert row["actor/prefix/reuse_factor"] > 1
        for p in PHASES:
            assert row[f"actor/prefix/max_rss_mib/{p}"] > 0
            assert f"actor/prefix/max_saved_for_backward_mib/{p}" in row
        # A keeps the prefix graph, B a suffix micro-batch's; C only runs backward
        assert row["actor/prefix/max_saved_for_backward_mib/A"] > 0
        assert row["actor/prefix/max_saved_for_backward_mib/B"] > 0
        assert row["actor/prefix/max_saved_for_backward_held_mib"] >= row["actor/prefix/max_saved_for_backward_mib/A"]
        assert row["actor/prefix/balance/split_groups"] == 0
        assert row["actor/prefix/max_prefix_kv_mib"] > 0
        for p in PHASES:
            assert row[f"actor/prefix/max_time_s/{p}"] >= times[p]
    assert run.summary["actor/prefix/time_s/A"] == run.history[-1]["actor/prefix/time_s/A"]


@pytest.mark.e2e
def test_forward_only_telemetry_read_back_from_wandb_is_plausible(demo):
    """The old log-prob pass runs A and B only; verl's trainer drops its metrics, ours logs them."""
    _, out, wandb_dir = demo
    old = "actor/prefix/old_log_prob/"
    for row in _runs(wandb_dir)["prefix-prefix_sync-prefix_fsdp2"][1].history:
        times = {p: row[f"{old}time_s/{p}"] for p in ("A", "B")}
        assert all(t > 0 for t in times.values()), times
        assert f"{old}time_s/C" not in row
        assert sum(times.values()) <= row["timing_s/old_log_prob"]
        assert_reuse_ran(row, namespace=old)
        assert row[f"{old}reuse_factor"] > 1
        assert row[f"{old}max_prefix_kv_mib"] > 0
        assert row[f"{old}max_rss_mib/A"] > 0
    summary = json.loads((out / "demo.json").read_text())
    assert set(summary["old_log_prob_phases"]) == {"A", "B"}
    assert summary["prefix_kv_mib"] > 0


def test_verl_reduces_peak_metrics_with_max_and_the_rest_with_mean():
    """The engine's names decide verl's reduction (``reduce_metrics``: "max" in the key -> max, "min" -> min,
    else mean, over ranks x mini-batches). Peaks must carry "max", nothing may carry "min"."""
    import torch
    from verl.utils.metric import reduce_metrics

    from verl_prefix.schedule.telemetry import PhaseMeter

    per_rank = []
    for rank in range(2):
        meter = PhaseMeter(torch.device("cpu"))
        for phase in ("A", "B", "C", "dense"):
            with meter.phase(phase):
                x = torch.ones(64 * (rank + 1), requires_grad=True)
                (x * x).sum()
        per_rank.append({f"actor/{k}": v for k, v in meter.metrics(100 + rank, 40).items()})
    # what the worker's allgather and the trainer's rename hand to reduce_metrics: one list per key
    gathered = {k: [m[k] for m in per_rank] for k in per_rank[0]}
    reduced = reduce_metrics({k: list(v) for k, v in gathered.items()})
    peaks = {k for k in gathered if "/max_" in k}
    assert peaks >= {f"actor/prefix/max_saved_for_backward_mib/{p}" for p in ("A", "B", "C", "dense")}
    assert peaks >= {f"actor/prefix/max_rss_mib/{p}" for p in ("A", "B", "C", "dense")}
    for key, values in gathered.items():
        assert "min" not in key, key
        want = max(values) if key in peaks else float(np.mean(values))
        assert "max" not in key or key in peaks, f"{key} would be max-reduced but is not a peak"
        assert reduced[key] == pytest.approx(want), key


def test_wandb_mode_follows_the_environment(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    assert wandb_mode({"HOME": str(home)}) == "offline"
    assert wandb_mode({"HOME": str(home), "WANDB_MODE": "disabled"}) == "disabled"
    assert wandb_mode({"HOME": str(home), "WANDB_MODE": "online"}) == "online"
    assert wandb_mode({"HOME": str(home), "WANDB_API_KEY": "x" * 40}) == "online"
    assert wandb_mode({"HOME": str(home), "WANDB_API_KEY": "x" * 40, "WANDB_MODE": "offline"}) == "offline"
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert wandb_login_configured({"HOME": str(home)})
    assert not wandb_login_configured({"HOME": str(home), "WANDB_BASE_URL": "https://wandb.example.com"})
    with pytest.raises(DemoError, match="WANDB_MODE"):
        wandb_mode({"WANDB_MODE": "sometimes"})


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--steps", "0"], {}, "--steps"),
        (["--n", "1"], {}, "--n must be >= 2"),
        (["--prompts", "1", "--n", "3"], {}, "split evenly"),
        ([], {"WANDB_MODE": "sometimes"}, "WANDB_MODE"),
        (["--out-dir", "FILE"], {}, "not a directory"),
    ],
)
def test_demo_mistakes_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, args, env, message):
    file = tmp_path / "a_file"
    file.write_text("")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = [str(file) if a == "FILE" else a for a in args]
    if "--out-dir" not in args:
        args += ["--out-dir", str(tmp_path / "out")]
    assert cli.main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists(), "a mistake must be reported before any work"
