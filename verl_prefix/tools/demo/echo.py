"""``verl-prefix demo``: a few GRPO steps on CPU, verl's stock trainer then prefix reuse, side by side.

Both runs go through ``verl_prefix.tools.cpu_loop`` (verl's v1 trainer ``step()``, its actor workers on 2 Ray
ranks, FSDP2 over gloo; HF ``generate`` stands in for the rollout). The stock run (``sync`` + ``fsdp2``)
samples; the prefix run (``prefix_sync`` + ``prefix_fsdp2``) replays those rollouts, so both train on
identical batches and their parameters can be compared step by step. Each run logs every step's metrics
through verl's ``Tracking`` to the console and to wandb (its own wandb run), as ``main_ppo`` would; the
demo ends with a table built from the same metrics.

wandb: an explicit ``WANDB_MODE`` is honoured; without one, a configured login (``WANDB_API_KEY``,
``WANDB_IDENTITY_TOKEN_FILE`` or a netrc entry for the wandb host) logs online and anything else offline.
``WANDB_DIR`` is honoured; unset, runs land under the demo's output directory. ``read_wandb_run`` reads an
offline run back from its ``.wandb`` file (the demo's test does).
"""

from __future__ import annotations

import dataclasses
import json
import netrc
import os
import statistics
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from verl_prefix._cli_quiet import hide_verl_import_warnings
from verl_prefix.tools.cpu_loop.loop import CPULoopRun, EchoTask, compare_runs, local_cluster, run_cpu_grpo

# ~0.9M parameters: small enough for 2 cores, large enough that the shared prompt dominates the update.
DEMO_MODEL: dict[str, int] = dict(
    hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384, vocab_size=512
)
# Long prompts, short answers: the shape GRPO reuse is for (each prompt is shared by n samples).
DEMO_TASK = EchoTask(prompt_len=(384, 512), max_new_tokens=16)
WORLD_SIZE = 2
PROJECT = "verl_prefix_demo"
PHASE_NAMES = {
    "A": "A prefix forward",
    "B": "B suffix micro-batches",
    "C": "C prefix backward",
    "dense": "dense rows",
    "lockstep": "lockstep fillers",
}
WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")


class DemoError(ValueError):
    """A user mistake (bad option or environment): reported as one line, exit status 2."""


@dataclass
class DemoResult:
    """Both runs, their per-step agreement and the summary the table prints."""

    dense: CPULoopRun
    prefix: CPULoopRun
    agreement: list[dict[str, float]]
    prompts: int
    n: int
    wandb_mode: str | None  # None: wandb not used (--no-wandb)
    out_dir: Path
    seconds: float
    summary: dict[str, Any] = field(default_factory=dict)


def wandb_mode(env: dict[str, str] | None = None) -> str:
    """The wandb mode the demo runs in: ``WANDB_MODE`` if set, else online with a login, else offline.

    Raises ``DemoError`` for a ``WANDB_MODE`` wandb would reject, before any slow work starts.
    """
    env = dict(os.environ if env is None else env)
    explicit = env.get("WANDB_MODE", "").strip()
    if explicit:
        if explicit not in WANDB_MODES:
            raise DemoError(f"WANDB_MODE={explicit!r} is not one of {', '.join(WANDB_MODES)}")
        return explicit
    return "online" if wandb_login_configured(env) else "offline"


def wandb_login_configured(env: dict[str, str]) -> bool:
    """Whether wandb would find credentials without prompting (an API key, a token file or a netrc entry)."""
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    candidates = [env["NETRC"]] if env.get("NETRC") else [str(home / ".netrc"), str(home / "_netrc")]
    for path in candidates:
        try:
            if netrc.netrc(path).authenticators(host):
                return True
        except (OSError, netrc.NetrcParseError):
            continue
    return False


def quiet_libraries() -> None:
    """Keep the demo's terminal readable: no known-harmless warnings or progress bars from libraries.

    TransferQueue warns on every call that it caps torch threads at the core count, verl warns that the
    critic is off for GRPO, transformers draws a bar per weight load; ``--verbose`` keeps them all.
    """
    import logging
    import warnings

    os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("transfer_queue"):
            logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"Disabled critic as algorithm\.adv_estimator")
    hide_verl_import_warnings()  # the `verl-prefix` process hid them already; cli.main called in-process has not
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


def check_options(out_dir: Path, *, steps: int, prompts: int, n: int) -> None:
    """Reject sizes and paths the loop cannot run, with the option's name (``DemoError``)."""
    if steps < 1:
        raise DemoError(f"--steps must be >= 1, got {steps}")
    if prompts < 1:
        raise DemoError(f"--prompts must be >= 1, got {prompts}")
    if n < 2:
        raise DemoError(f"--n must be >= 2 (GRPO needs a group to share a prompt), got {n}")
    if prompts * n % WORLD_SIZE:
        raise DemoError(f"--prompts x --n = {prompts * n} samples must split evenly over {WORLD_SIZE} actor ranks")
    if out_dir.exists() and not out_dir.is_dir():
        raise DemoError(f"--out-dir {out_dir} exists and is not a directory")
    wandb_dir = os.environ.get("WANDB_DIR")
    if wandb_dir and Path(wandb_dir).exists() and not Path(wandb_dir).is_dir():
        raise DemoError(f"WANDB_DIR={wandb_dir} exists and is not a directory")


def run_demo(
    out_dir: str | os.PathLike,
    *,
    steps: int = 3,
    prompts: int = 4,
    n: int = 8,
    use_wandb: bool = True,
    optimizer: str = "AdamW",
    lr: float = 1e-3,
    micro_batch_size: int = 4,
    seed: int = 0,
    verbose: bool = False,
    progress: Callable[[str], None] | None = None,
) -> DemoResult:
    """Write the demo model, run the stock loop, replay its rollouts through prefix reuse, summarise.

    Sets ``WANDB_MODE`` (see ``wandb_mode``) and a default ``WANDB_DIR`` in this process before wandb
    starts, so verl's ``Tracking`` picks them up exactly as in a ``main_ppo`` run.
    """
    from verl_prefix.harness.tiny_models import write_tiny_model

    out = Path(out_dir)
    check_options(out, steps=steps, prompts=prompts, n=n)
    mode = wandb_mode() if use_wandb else None
    say = progress or (lambda _: None)
    out.mkdir(parents=True, exist_ok=True)
    if mode is not None:
        os.environ["WANDB_MODE"] = mode
        os.environ.setdefault("WANDB_DIR", str(out.resolve()))
        Path(os.environ["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")  # the demo prints where the runs are
    start = time.perf_counter()
    model_dir = write_tiny_model(out / "model", "qwen3", **DEMO_MODEL)
    say(f"wrote a random-init Qwen3-style model to {model_dir}")
    loggers = "[console,wandb]" if mode is not None else "[console]"
    common = dict(
        steps=steps,
        num_prompts=prompts,
        n=n,
        world_size=WORLD_SIZE,
        seed=seed,
        task=DEMO_TASK,
        optimizer=optimizer,
        lr=lr,
        micro_batch_size_per_gpu=micro_batch_size,
        workdir=out,
        progress=say,
    )
    with local_cluster(log_to_driver=verbose):
        say("Ray and TransferQueue up; run 1/2: verl's sync trainer + fsdp2 (samples the rollouts)")
        dense = run_cpu_grpo(
            model_dir,
            prefix=False,
            overrides=_names(loggers, "dense-sync-fsdp2"),
            **common,
        )
        say("run 2/2: prefix_sync trainer + prefix_fsdp2 (replays the same rollouts)")
        prefix = run_cpu_grpo(
            model_dir,
            prefix=True,
            replay=dense.rollouts,
            overrides=_names(loggers, "prefix-prefix_sync-prefix_fsdp2"),
            **common,
        )
    result = DemoResult(
        dense=dense,
        prefix=prefix,
        agreement=compare_runs(dense, prefix),
        prompts=prompts,
        n=n,
        wandb_mode=mode,
        out_dir=out,
        seconds=time.perf_counter() - start,
    )
    result.summary = summarise(result)
    (out / "demo.json").write_text(json.dumps(result.summary, indent=2) + "\n")
    return result


def _names(loggers: str, experiment: str) -> list[str]:
    return [f"trainer.logger={loggers}", f"trainer.project_name={PROJECT}", f"trainer.experiment_name={experiment}"]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _phase_summary(steps: list[Any], head: str, saved_for_backward: bool) -> dict[str, dict[str, float]]:
    """Per phase that ran in any step: the median time and the peaks over steps, from the metrics under
    ``head`` (every rank reports every phase of a pass; one that never ran is all zeros)."""
    out = {}
    for phase in PHASE_NAMES:
        times = [s.metrics[f"{head}time_s/{phase}"] for s in steps if f"{head}time_s/{phase}" in s.metrics]
        if not any(times):
            continue
        kinds = ("saved_for_backward_mib", "rss_mib") if saved_for_backward else ("rss_mib",)
        out[phase] = {"time_s": _median(times)}
        for kind in kinds:
            out[phase][kind] = max(s.metrics.get(f"{head}max_{kind}/{phase}", 0.0) for s in steps)
    return out


def summarise(result: DemoResult) -> dict[str, Any]:
    """Per-step times, tokens and agreement, per-phase medians/peaks and the speedup, as plain data."""
    steps = []
    for d, p, agree in zip(result.dense.steps, result.prefix.steps, result.agreement, strict=True):
        dense_t, prefix_t = d.metrics["timing_s/update_actor"], p.metrics["timing_s/update_actor"]
        steps.append(
            {
                "step": d.step,
                "dense_update_s": dense_t,
                "prefix_update_s": prefix_t,
                "speedup": dense_t / prefix_t,
                "dense_old_log_prob_s": d.metrics.get("timing_s/old_log_prob", float("nan")),
                "prefix_old_log_prob_s": p.metrics.get("timing_s/old_log_prob", float("nan")),
                "logical_tokens": p.metrics.get("actor/prefix/logical_tokens", float("nan")),
                "physical_tokens": p.metrics.get("actor/prefix/physical_tokens", float("nan")),
                "update_rel": agree["update_rel"],
                "grad_norm_rel": agree["grad_norm_rel"],
            }
        )
    phases = _phase_summary(result.prefix.steps, "actor/prefix/", saved_for_backward=True)
    held = max(s.metrics.get("actor/prefix/max_saved_for_backward_held_mib", 0.0) for s in result.prefix.steps)
    forward_only = _phase_summary(result.prefix.steps, "actor/prefix/old_log_prob/", saved_for_backward=False)
    kv_keys = ("actor/prefix/max_prefix_kv_mib", "actor/prefix/old_log_prob/max_prefix_kv_mib")
    prefix_kv = max((s.metrics.get(k, 0.0) for s in result.prefix.steps for k in kv_keys), default=0.0)
    return {
        "config": {
            "steps": len(steps),
            "prompts": result.prompts,
            "n": result.n,
            "world_size": WORLD_SIZE,
            "model": {"family": "qwen3", **DEMO_MODEL},
            "task": dataclasses.asdict(DEMO_TASK),
        },
        "steps": steps,
        "speedup_median": _median([s["speedup"] for s in steps]),
        "phases": phases,
        "old_log_prob_phases": forward_only,
        "saved_for_backward_held_mib": held,
        "prefix_kv_mib": prefix_kv,
        "max_update_rel": max((s["update_rel"] for s in steps), default=float("nan")),
        "max_grad_norm_rel": max((s["grad_norm_rel"] for s in steps), default=float("nan")),
        "wandb_mode": result.wandb_mode,
        "wandb_runs": {"dense": result.dense.wandb_run_dir, "prefix": result.prefix.wandb_run_dir},
        "wall_s": result.seconds,
    }


def demo_report(result: DemoResult) -> str:
    """The tables and closing lines ``verl-prefix demo`` prints (markdown, so they paste into docs)."""
    s = result.summary
    rows = s["steps"]
    lines = [
        f"verl-prefix demo: {len(rows)} GRPO steps, {result.prompts} prompts x n={result.n} samples each, "
        f"{WORLD_SIZE} actor ranks (FSDP2 over gloo, CPU)",
        "",
        "| step | dense update_actor (s) | prefix update_actor (s) | speedup | dense old log-prob (s) "
        "| prefix old log-prob (s) | logical tokens/rank | physical tokens/rank | param agreement |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['dense_update_s']:.3f} | {r['prefix_update_s']:.3f} | {r['speedup']:.2f}x "
            f"| {r['dense_old_log_prob_s']:.3f} | {r['prefix_old_log_prob_s']:.3f} | {r['logical_tokens']:.0f} "
            f"| {r['physical_tokens']:.0f} | {r['update_rel']:.1e} |"
        )
    lines += [
        "",
        "| prefix run, per phase | time (s), median | saved for backward (MiB), max | RSS (MiB), max |",
        "|---|---:|---:|---:|",
    ]
    for phase, v in s["phases"].items():
        lines.append(
            f"| {PHASE_NAMES[phase]} | {v['time_s']:.3f} | {v['saved_for_backward_mib']:.1f} | {v['rss_mib']:.0f} |"
        )
    lines.append(f"| held at once (A + largest B) | | {s['saved_for_backward_held_mib']:.1f} | |")
    if s["old_log_prob_phases"]:
        lines += ["", "| prefix run, old log-prob pass | time (s), median | RSS (MiB), max |", "|---|---:|---:|"]
        for phase, v in s["old_log_prob_phases"].items():
            lines.append(f"| {PHASE_NAMES[phase]} | {v['time_s']:.3f} | {v['rss_mib']:.0f} |")
    lines.append(f"\none group's prefix K/V cache (MiB), max: {s['prefix_kv_mib']:.2f}")
    lines += [
        "",
        "(verl's stock fsdp2 engine reports no per-phase metrics; `verl-prefix bench` and `replay` measure "
        "dense memory)",
        "",
        f"update_actor speedup (median of per-step dense/prefix): {s['speedup_median']:.2f}x",
        f"parameters after each step vs the stock run: within {s['max_update_rel']:.1e} of the update "
        f"(grad norm within {s['max_grad_norm_rel']:.1e})",
        "tokens and phase times are per actor rank and update (verl's mean over ranks); memory is the max "
        "over ranks and steps",
    ]
    if result.wandb_mode is None:
        lines.append("wandb: off (--no-wandb)")
    else:
        for name, path in s["wandb_runs"].items():
            lines.append(f"wandb ({result.wandb_mode}) {name} run: {path}")
        if result.wandb_mode == "offline":
            lines.append("upload later with: wandb sync <run dir>")
    lines.append(f"wall {s['wall_s']:.1f} s | summary: {result.out_dir / 'demo.json'}")
    return "\n".join(lines)


# -- reading an offline wandb run back ---------------------------------------------------------------

_BLOCK = 32768
_HEADER = 7  # per chunk: crc32 (4), length (2), type (1); the file starts with ":W&B", 0xBEE1, version 0
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class WandbRun:
    """What an offline wandb run recorded: its names, config, per-step history and final summary."""

    name: str
    project: str
    config: dict[str, Any]
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    finished: bool  # the exit record was read: the run closed and every record before it parsed


def _records(path: Path) -> Iterator[bytes]:
    """Records of a ``.wandb`` file: a log of 32 KiB blocks of checksummed chunks (LevelDB's log layout)."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb run file")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a chunk header is zero padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        if kind == 0 and length == 0:
            pos += left
            continue
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            break  # a run still writing (or killed) ends in a partial chunk
        pos += _HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def _items(items: Any) -> dict[str, Any]:
    return {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in items}


def read_wandb_run(run_dir: str | os.PathLike) -> WandbRun:
    """Read an offline wandb run directory back (wandb ships no reader for its ``.wandb`` files).

    Parses the records with wandb's own protobuf ``Record``; history rows are the dicts passed to
    ``wandb.log`` (plus wandb's ``_step``/``_runtime``/``_timestamp``).
    """
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(Path(run_dir).glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file in {run_dir}")
    name = project = ""
    config: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    finished = False
    for raw in _records(files[0]):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name, project = record.run.display_name, record.run.project
            config.update(_items(record.run.config.update))
        elif kind == "config":
            config.update(_items(record.config.update))
        elif kind == "history":
            history.append(_items(record.history.item))
        elif kind == "summary":
            summary.update(_items(record.summary.update))
        elif kind == "exit":
            finished = True
    return WandbRun(name=name, project=project, config=config, history=history, summary=summary, finished=finished)


__all__ = [
    "DEMO_MODEL",
    "DEMO_TASK",
    "DemoError",
    "DemoResult",
    "WandbRun",
    "check_options",
    "demo_report",
    "read_wandb_run",
    "quiet_libraries",
    "run_demo",
    "summarise",
    "wandb_login_configured",
    "wandb_mode",
]
