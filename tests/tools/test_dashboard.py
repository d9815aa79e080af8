"""Both dashboards draw the keys the engine and verl's trainer actually log.

The logged keys come from real code, not a list: one prefix_fsdp2 update and one forward-only pass on a
tiny model (a group of one falls back, so a fallback key is among them), the group balancer's metrics, the
phase meter on an accelerator device (the device-memory keys) and verl's trainer source for ``timing_s/``.
The runs the HTML page reads are written by verl's own ``Tracking`` (wandb offline and its ``file`` logger),
and the page is loaded in headless Chromium: no console error, every panel drawn.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_prefix.backend.trainer.balance import balance_groups
from verl_prefix.harness import grpo_batches, verl_engine
from verl_prefix.schedule.telemetry import PHASES, PhaseMeter
from verl_prefix.tools.report import dashboard as D
from verl_prefix.tools.report.dashboard_spec import SECTIONS, all_panels

VOCAB = 128
STEPS = 3
DENSE, PREFIX = "dense-sync-fsdp2", "prefix-prefix_sync-prefix_fsdp2"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install -y chromium)"
)


def _worker_perf_keys() -> set[str]:
    """``actor/perf/<name>`` for every ``final_metrics["perf/<name>"]`` verl's training worker logs."""
    from verl.workers import engine_workers

    return {f"actor/{k}" for k in re.findall(r'final_metrics\["(perf/\w+)"\]', inspect.getsource(engine_workers))}


def _trainer_timing_keys() -> set[str]:
    """``timing_s/<name>`` for every ``marked_timer("<name>", ...)`` in verl's v1 trainer (metric_utils
    turns timing_raw into ``timing_s/...``)."""
    from verl.trainer.ppo import metric_utils
    from verl.trainer.ppo.v1 import trainer_base

    assert 'f"timing_s/{name}"' in inspect.getsource(metric_utils.compute_timing_metrics)
    return {f"timing_s/{n}" for n in re.findall(r'marked_timer\("(\w+)"', inspect.getsource(trainer_base))}


@pytest.fixture(scope="module")
def logged(tiny_model):
    """The engine's real update and old-log-prob metrics, keyed as verl's trainer logs them."""
    engine, loss_fn, _ = verl_engine.build_verl_engine(
        tiny_model("qwen3"), backend="prefix_fsdp2", micro_batch_size_per_gpu=2
    )
    # two groups of 4 share their prompts; a group of one cannot (fallback_small_group)
    batch = grpo_batches.make_grpo_batch(
        num_groups=3, group_size=1, prompt_lens=[40, 40, 40], response_len_range=(2, 5), vocab_size=VOCAB, seed=3
    )
    grouped = grpo_batches.make_grpo_batch(
        num_groups=2, group_size=4, prompt_lens=[48, 40], response_len_range=(2, 6), vocab_size=VOCAB, seed=4
    )
    update, update_small = (
        verl_engine.run_train_step(engine, loss_fn, grouped),
        verl_engine.run_train_step(engine, loss_fn, batch),
    )
    infer = verl_engine.run_infer(engine, grouped)
    infer_small = verl_engine.run_infer(engine, batch)
    # verl logs the update's metrics under actor/; the reusing step's values win where both report a key
    actor = {
        f"actor/{k}": v
        for r in (update_small, update)
        for k, v in r["reduced_metrics"].items()
        if k.startswith("prefix/")
    }
    old = {}
    for r in (infer_small, infer):  # the ref pass runs the same forward-only schedule (ref.strategy follows)
        for head in ("actor/prefix/old_log_prob/", "actor/prefix/ref_log_prob/"):
            old.update(
                {
                    f"{head}{k.removeprefix('prefix/')}": v
                    for k, v in verl_engine.reduce_step_metrics(r["metrics"]).items()
                    if k.startswith("prefix/")
                }
            )
    plan = balance_groups(prompt_lens=[5, 5, 7, 7], response_lens=[2, 3, 2, 4], uids=list("aabb"), dp_size=2)
    balance = {f"actor/{k}": v for k, v in plan.metrics().items()}
    device = {f"actor/{k}": v for k, v in PhaseMeter(torch.device("cuda")).metrics(10, 5, phases=PHASES).items()}
    timing = dict.fromkeys(_trainer_timing_keys() | _worker_perf_keys(), 1.0)
    engine_keys = {**actor, **old, **balance}
    return {"engine": engine_keys, "all": {**engine_keys, **device, **timing}}


def test_engine_reused_and_fell_back(logged):
    m = logged["engine"]
    assert m["actor/prefix/groups"] > 0 and m["actor/prefix/physical_tokens"] < m["actor/prefix/logical_tokens"]
    assert m["actor/prefix/fallback_small_group"] > 0
    assert any(k.startswith("actor/prefix/old_log_prob/fallback_") for k in m), sorted(m)


def test_every_panel_key_is_logged(logged):
    keys = logged["all"]
    for panel in all_panels():
        for key in panel.metric_keys():
            assert key in keys, f"{panel.title}: {key} is not a key verl or the engine logs"
    fallbacks = [p for p in all_panels() if p.pattern is not None]
    assert len(fallbacks) == 3
    for panel in fallbacks:
        matched = [k for k in keys if panel.matches(k)]
        assert matched and all("fallback_" in k for k in matched), (panel.title, matched)
        assert panel.label(matched[0]) == matched[0].rsplit("fallback_", 1)[1]
    # the update's and the forward-only passes' fallbacks stay apart, titled by what they count
    update, old, ref = fallbacks
    assert not update.matches("actor/prefix/old_log_prob/fallback_small_group")
    assert not old.matches("actor/prefix/fallback_small_group")
    assert not ref.matches("actor/prefix/old_log_prob/fallback_small_group")
    assert all(p.unit == "samples per rank and mini-batch" for p in fallbacks)
    # a structure the capability check does not know is plotted under its own name
    unknown = "actor/prefix/fallback_unknown_structure:future_attention"
    assert update.matches(unknown) and update.label(unknown) == "unknown_structure:future_attention"


def test_spec_has_what_the_issue_asks_for():
    keys = {k for p in all_panels() for k in p.metric_keys()}
    assert "timing_s/update_actor" in keys
    for phase in ("A", "B", "C", "dense", "lockstep"):
        for kind in ("time_s", "max_time_s", "max_saved_for_backward_mib", "max_rss_mib", "max_peak_device_mib"):
            assert f"actor/prefix/{kind}/{phase}" in keys
    for key in ("logical_tokens", "physical_tokens", "reuse_factor", "groups"):
        assert f"actor/prefix/{key}" in keys
    assert len({p.id for p in all_panels()}) == len(all_panels())


def test_quick_check_row_comes_first():
    """The first section answers: did reuse run (reuse factor), did anything fall back, what did it save, per
    pass (update, old and ref log-probs), and the update's measured time beside its dense estimate."""
    first = SECTIONS[0]
    keys = {k for p in first.panels for k in p.metric_keys()}
    for head in ("actor/prefix/", "actor/prefix/old_log_prob/", "actor/prefix/ref_log_prob/"):
        for name in ("reuse_factor", "dense_samples", "flops_saved_ratio"):
            assert f"{head}{name}" in keys
    assert {"actor/prefix/time_s/schedule", "actor/prefix/est_dense_time_s"} <= keys
    ref = [k for p in all_panels() for k in p.metric_keys() if k.startswith("actor/prefix/ref_log_prob/")]
    assert "actor/prefix/ref_log_prob/time_s/A" in ref and "timing_s/ref" in {
        k for p in all_panels() for k in p.metric_keys()
    }


def test_quick_check_summary(runs):
    """Per reuse run: reuse factors above 1, the samples run dense, the FLOP-model saving and the measured
    update speed-up over the stock run on the same page (its update_actor median over this run's)."""
    found = D.find_runs([runs / "wandb"])
    (row,) = D.quick_check(found)
    assert row["run"] == PREFIX
    for label in ("update", "old log-prob", "ref log-prob"):
        assert row[label]["reuse_factor"] > 1 and row[label]["flops_saved_ratio"] > 1
        assert row[label]["dense_samples"] == 0  # the reusing step's value, which the fixture keeps
    assert row["measured_speedup"] == pytest.approx(3.2 / 1.4)  # medians of 3.0 + 0.1 s and 1.2 + 0.1 s
    assert D.quick_check([r for r in found if r.name == PREFIX])[0]["measured_speedup"] is None
    page = D.render_html(found)
    assert page.index("update speed-up vs a stock run") < page.index('class="panel"')


def test_wandb_workspace_spec_offline():
    pytest.importorskip("wandb_workspaces", reason="pip install 'verl-prefix[dashboard]'")
    workspace = D.build_workspace("my-entity", "my-project")
    view = workspace._to_model().model_dump(by_alias=True, exclude_none=True)
    assert (view["entity"], view["project"], view["displayName"]) == ("my-entity", "my-project", D.WORKSPACE_NAME)
    sections = view["spec"]["section"]["panelBankConfig"]["sections"]
    assert [s["name"] for s in sections] == [s.name for s in SECTIONS]
    for built, spec in zip(sections, SECTIONS, strict=True):
        assert len(built["panels"]) == len(spec.panels)
        for panel, want in zip(built["panels"], spec.panels, strict=True):
            config = panel["config"]
            assert panel["viewType"] == "Run History Line Plot"
            assert config["xAxis"] == "_step"
            assert config["metrics"] == want.metric_keys()
            if want.pattern is not None:
                assert config["useMetricRegex"] and config["metricRegex"] == f"^{want.pattern}$"
                assert any(
                    re.fullmatch(config["metricRegex"], f"actor/prefix/{head}fallback_small_group")
                    for head in ("", "old_log_prob/", "ref_log_prob/")
                )


def test_wandb_command_without_login_is_one_line(monkeypatch, tmp_path, capsys):
    pytest.importorskip("wandb_workspaces")
    from verl_prefix.tools import cli

    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert cli.main(["dashboard", "wandb", "--entity", "e", "--project", "p"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("verl-prefix: error: could not save the workspace to e/p")


# -- runs written by verl's Tracking ------------------------------------------------------------------


_WRITE_RUNS = """
import json, sys
from verl.utils.tracking import Tracking
runs, steps = json.loads(sys.stdin.read()), int(sys.argv[1])
for name, (base, update_s, old_s) in runs.items():
    tracker = Tracking("dash_test", name, default_backend=["wandb", "file"])
    for step in range(1, steps + 1):
        data = {k: v * (1 + 0.1 * step) for k, v in base.items()}
        data["timing_s/update_actor"] = update_s + 0.1 * step
        data["timing_s/old_log_prob"] = old_s + 0.05 * step
        data["timing_s/ref"] = old_s + 0.05 * step
        data["actor/perf/max_memory_allocated_gb"] = data["actor/perf/cpu_memory_used_gb"] = 1.0
        data["timing_s/step"] = 2 * update_s + 0.2 * step
        tracker.log(data, step=step)
    tracker.finish()
"""


@pytest.fixture(scope="module")
def runs(logged, tmp_path_factory):
    """A dense and a prefix run through verl's ``Tracking`` with wandb (offline) and its file logger, in a
    fresh process (wandb reads WANDB_DIR once per process)."""
    root = tmp_path_factory.mktemp("runs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true", VERL_FILE_LOGGER_ROOT=str(root / "files")
    )
    spec = {DENSE: ({"actor/pg_loss": 0.1}, 3.0, 1.0), PREFIX: (logged["engine"], 1.2, 0.4)}
    proc = subprocess.run(
        [sys.executable, "-c", _WRITE_RUNS, str(STEPS)],
        input=json.dumps(spec),
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def test_find_runs_reads_wandb_and_file_logger(runs):
    from_wandb = {r.name: r for r in D.find_runs([runs / "wandb"])}
    from_files = {r.name: r for r in D.find_runs(sorted((runs / "files").rglob("*.jsonl")))}
    assert set(from_wandb) == set(from_files) == {DENSE, PREFIX}
    for name in (DENSE, PREFIX):
        w, f = from_wandb[name], from_files[name]
        assert w.steps == f.steps == [1.0, 2.0, 3.0]
        assert w.series("timing_s/update_actor") == f.series("timing_s/update_actor")  # both JSON floats
        assert [v for _, v in w.series("timing_s/update_actor")] == pytest.approx(
            [(3.0 if name == DENSE else 1.2) + 0.1 * s for s in (1, 2, 3)]
        )
    assert from_wandb[PREFIX].keys() >= {"actor/prefix/reuse_factor", "actor/prefix/fallback_small_group"}
    both = D.find_runs([runs])  # a directory holding both kinds: four runs, names kept apart
    assert len(both) == 4 and len({r.name for r in both}) == 4


def test_bad_paths_are_dashboard_errors(tmp_path):
    with pytest.raises(D.DashboardError, match="does not exist"):
        D.find_runs([tmp_path / "missing"])
    with pytest.raises(D.DashboardError, match="no offline wandb run"):
        D.find_runs([tmp_path])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.text(max_size=30), min_size=1, max_size=4))
def test_garbage_jsonl_is_rejected(tmp_path, lines):
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(lines) + "\n")
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            records.append(None)
    valid = [isinstance(r, dict) and "step" in r and isinstance(r.get("data"), dict) for r in records]
    if all(valid) or (valid[0] and all(v or not line.strip() for v, line in zip(valid, lines))):
        return  # a valid file logger file: covered by test_find_runs_reads_wandb_and_file_logger
    with pytest.raises(D.DashboardError):
        D.find_runs([path])


class _Panels(HTMLParser):
    """Per panel section: its data-lines count, polylines and whether it shows an empty note."""

    def __init__(self) -> None:
        super().__init__()
        self.panels: dict[str, dict] = {}
        self.body: dict[str, str] = {}
        self._current: str | None = None
        self._depth = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if tag == "section" and "panel" in (a.get("class") or ""):
            self._current, self._depth = a["id"], 0
            self.panels[a["id"]] = {"lines": int(a["data-lines"]), "polylines": 0, "empty": False}
        if self._current is None:
            return
        if tag == "section":
            self._depth += 1
        if tag == "polyline" and len(a.get("points", "").split()) >= 1:
            self.panels[self._current]["polylines"] += 1
        if tag == "div" and a.get("class") == "empty":
            self.panels[self._current]["empty"] = True

    def handle_endtag(self, tag):
        if tag == "section" and self._current is not None:
            self._depth -= 1
            if self._depth == 0:
                self._current = None


def _chromium(page: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", *extra]
    return subprocess.run([*cmd, page.as_uri()], capture_output=True, text=True, timeout=120, check=False)


def _console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]


def test_html_is_self_contained(runs):
    page = D.render_html(D.find_runs([runs / "wandb"]))
    assert "http://" not in page and "https://" not in page and "<script src" not in page and "<link" not in page
    assert page.count('class="panel"') == len(all_panels())


@pytest.mark.e2e
@needs_chromium
def test_html_page_draws_every_panel_in_chromium(runs, tmp_path):
    from verl_prefix.tools import cli

    out = tmp_path / "dash.html"
    assert cli.main(["dashboard", "html", str(runs / "wandb"), "--out", str(out)]) == 0
    proc = _chromium(out, "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not _console_errors(proc.stderr), _console_errors(proc.stderr)
    dom = _Panels()
    dom.feed(proc.stdout)
    assert len(dom.panels) == len(all_panels()) == int(dom.body["data-panels"]) == int(dom.body["data-drawn"])
    for panel_id, panel in dom.panels.items():
        if panel_id == "panel-device-allocator-peak":  # CPU runs log no device memory: the panel says so
            assert panel["empty"] and panel["polylines"] == 0, panel_id
        else:
            assert panel["lines"] > 0 and panel["polylines"] == panel["lines"], (panel_id, panel)
    # dense vs prefix on the update-time panel, one line per run
    assert dom.panels["panel-update-actor-time"]["lines"] == 2
    shot = tmp_path / "dash.png"
    proc = _chromium(out, f"--screenshot={shot}", "--window-size=1300,1600", "--hide-scrollbars")
    assert shot.stat().st_size > 10_000, proc.stderr[-2000:]


@pytest.mark.e2e
@needs_chromium
def test_chromium_check_sees_a_script_error(runs, tmp_path):
    """Negative control: the console-error check fails on a page whose script throws."""
    page = D.render_html(D.find_runs([runs / "wandb"])).replace("(function(){", "(function(){ undefinedCall();", 1)
    out = tmp_path / "broken.html"
    out.write_text(page)
    proc = _chromium(out, "--dump-dom")
    assert _console_errors(proc.stderr), proc.stderr[-2000:]
    dom = _Panels()
    dom.feed(proc.stdout)
    assert "data-drawn" not in dom.body
