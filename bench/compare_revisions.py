"""Old vs new revision of this repository on the speed rows, in one interleaved run.

Each revision is checked out into its own temporary git worktree (``git worktree add --detach``). Every
measurement is the ``verl-prefix`` command (``python -m verl_prefix.tools.cli``) in a fresh interpreter with
``PYTHONPATH=<that worktree>``, old and new alternating run by run (old, new, old, new, ...) so machine noise
hits both alike; each run's seconds come from the command's own result JSON (``--out``). Per row the markdown
table and the JSON give the median over the rounds on each side, the ratio new/old of the medians, the
per-round ratios and the run-to-run noise (interquartile range over median, each side), beside the same ratio
for verl's stock ``fsdp2`` engine measured in the same runs (code neither revision changes: a control).

    python bench/compare_revisions.py --old aae6c9e --new HEAD --repeats 5
    python bench/compare_revisions.py --old aae6c9e --new aae6c9e --repeats 3   # the noise floor

Only the command line is used (its module paths inside ``verl_prefix/tools`` may move; its commands stay).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("old", "new")
CLI = ("-m", "verl_prefix.tools.cli")
KeyPath = tuple[str | int, ...]  # keys and list indices into a result JSON


@dataclass(frozen=True)
class Run:
    """One command, run once per revision per round; several rows may read one run's result JSON.

    ``argv`` follows the python executable; ``{out}`` (the result JSON), ``{work}`` (a directory of this
    revision's, e.g. for a trace ``setup`` wrote) and ``{reps}`` (timed reps inside the run) are filled in.
    ``setup`` commands run once per revision before the rounds and are not timed. ``batch`` points at what
    describes the measured batch in the result, which must be the same on both sides."""

    name: str
    argv: tuple[str, ...]
    setup: tuple[tuple[str, ...], ...] = ()
    batch: KeyPath = ()


@dataclass(frozen=True)
class Row:
    """One table row: the seconds at ``value`` in ``run``'s result JSON (the prefix engine's median over the
    run's reps), and at ``control`` the stock engine's from the same run."""

    name: str
    run: Run
    value: KeyPath
    control: KeyPath | None
    what: str


def _trace(name: str, options: str) -> tuple[str, ...]:
    """``verl-prefix trace synthetic``: one batch with ``options`` (space-separated) and the smoke bench's model."""
    fixed = f"--steps 1 --write-model smoke --seed 0 {options}"
    return (*CLI, "trace", "synthetic", "--out", f"{{work}}/{name}", *fixed.split())


def _replay(name: str) -> tuple[str, ...]:
    """``verl-prefix replay`` of the first batch of that trace: stock fsdp2 and prefix_fsdp2, ``{reps}`` reps."""
    return (*CLI, "replay", "--trace", f"{{work}}/{name}", "--steps", "1", "--reps", "{reps}", "--no-noise",
            "--no-progress", "--out", "{out}")  # fmt: skip


SMOKE = Run(
    "bench smoke",
    (*CLI, "bench", "--preset", "smoke", "--reps", "{reps}", "--no-progress", "--out", "{out}"),
    batch=("cells", 0, "response_lens"),
)
RAGGED = Run(
    "replay ragged 4x8",
    _replay("ragged4"),
    setup=(_trace("ragged4", "--groups 4 --group-size 8 --prefix-len 256:512 --suffix-len 16:96"),),
    batch=("steps", 0, "tokens"),
)
AGENTIC = Run(
    "replay agentic tree 4x8",
    _replay("agentic"),
    setup=(
        _trace("agentic", "--groups 4 --group-size 8 --system-len 512 --prefix-len 32:128 --suffix-len 32:64 --tree"),
    ),
    batch=("steps", 0, "tokens"),
)
AGENTIC_QUARTER = Run(
    "bench agentic_quarter",
    (*CLI, "bench", "--preset", "agentic_quarter", "--reps", "{reps}", "--no-progress", "--out", "{out}"),
    batch=("cells", 0, "response_lens"),
)
_CELL = ("cells", 0)
_STEP = ("steps", 0)
ROWS: dict[str, Row] = {
    row.name: row
    for row in (
        Row("update", SMOKE, (*_CELL, "prefix_median_s"), (*_CELL, "dense_median_s"),
            "`bench --preset smoke` (P512/S32-64/G8: 2 groups of G=8, responses 32-64): prefix_fsdp2 update"),
        Row("forward-only", SMOKE, (*_CELL, "infer_prefix_median_s"), (*_CELL, "infer_dense_median_s"),
            "the same runs: prefix_fsdp2 forward-only (old log-prob) pass"),
        Row("ragged 4-group", RAGGED, (*_STEP, "prefix_median_s"), (*_STEP, "dense_median_s"),
            "`trace synthetic` + `replay`: 4 groups of G=8, prompts 256-512, responses 16-96: update"),
        Row("agentic tree", AGENTIC, (*_STEP, "prefix_median_s"), (*_STEP, "dense_median_s"),
            "`trace synthetic --system-len 512 --tree` + `replay`: 4 groups of G=8 behind one 512-token system "
            "block, questions 32-128, responses 32-64, `prefix_reuse.tree`: update"),
        Row("agentic_quarter tree", AGENTIC_QUARTER, (*_CELL, "variants", "tree", "update_median_s"),
            (*_CELL, "variants", "fsdp2", "update_median_s"),
            "`bench --preset agentic_quarter` (8 groups of G=8 behind a 1024-token system block): the tree "
            "engine's update; slow on a CPU (about 20 minutes a run)"),
    )
}  # fmt: skip
DEFAULT_ROWS = ("update", "forward-only", "ragged 4-group", "agentic tree")


@dataclass
class Series:
    """One row's measurements, in round order."""

    old: list[float] = field(default_factory=list)
    new: list[float] = field(default_factory=list)
    old_control: list[float] = field(default_factory=list)
    new_control: list[float] = field(default_factory=list)


def lookup(result: Any, path: KeyPath) -> Any:
    """The value at ``path`` (keys and indices) in a result JSON."""
    for key in path:
        result = result[key]
    return result


def rel_iqr(values: Sequence[float]) -> float | None:
    """Interquartile range over median; None with fewer than two values (no spread to measure)."""
    if len(values) < 2:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(values)


def summarise(series: Series) -> dict[str, Any]:
    """Medians, the ratio new/old of the medians, per-round ratios and the noise of one row."""
    old_med, new_med = statistics.median(series.old), statistics.median(series.new)
    noise = [n for n in (rel_iqr(series.old), rel_iqr(series.new)) if n is not None]
    summary: dict[str, Any] = {
        "old_s": series.old,
        "new_s": series.new,
        "old_median_s": old_med,
        "new_median_s": new_med,
        "ratio": new_med / old_med,
        "round_ratios": [n / o for o, n in zip(series.old, series.new)],
        "old_rel_iqr": rel_iqr(series.old),
        "new_rel_iqr": rel_iqr(series.new),
        "noise": max(noise) if noise else None,
    }
    if series.old_control and series.new_control:
        summary["control_old_s"] = series.old_control
        summary["control_new_s"] = series.new_control
        summary["control_ratio"] = statistics.median(series.new_control) / statistics.median(series.old_control)
    return summary


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _load(result: dict[str, Any]) -> str:
    loads = result.get("load_average_1min")
    return f"; 1-minute load average {min(loads):.1f}-{max(loads):.1f}" if loads else ""


def markdown_table(result: dict[str, Any]) -> str:
    """The rows as a markdown table, with a header line saying what was compared on what."""
    old, new = result["old"], result["new"]
    machine = result.get("machine") or {}
    lines = [
        f"Old `{old['rev']}` ({old['sha'][:9]}) vs new `{new['rev']}` ({new['sha'][:9]}): {result['repeats']} "
        f"rounds, old and new alternating run by run, each run a fresh `verl-prefix` process reporting the median "
        f"of {result['bench_reps']} timed reps after 1 warm-up. {result['date']}; "
        f"{machine.get('processor', '?')}, {machine.get('cpu_count', '?')} CPUs, "
        f"{machine.get('torch_threads', '?')} torch threads, torch {machine.get('torch', '?')}, "
        f"cuda {machine.get('cuda')}; wall {result['wall_s']:.0f} s{_load(result)}.",
        "",
        "| row | old median (s) | new median (s) | new/old | per-round new/old | noise (IQR/median old, new) | "
        "stock fsdp2 new/old |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for name, row in result["rows"].items():
        rounds = row["round_ratios"]
        spread = f"{min(rounds):.3f}-{max(rounds):.3f}" if len(rounds) > 1 else f"{rounds[0]:.3f}"
        control = f"{row['control_ratio']:.3f}" if "control_ratio" in row else "n/a"
        flag = "" if row["same_batch"] else " (batches differ)"
        lines.append(
            f"| {name}{flag} | {row['old_median_s']:.3f} | {row['new_median_s']:.3f} | {row['ratio']:.3f} | "
            f"{spread} | {_pct(row['old_rel_iqr'])}, {_pct(row['new_rel_iqr'])} | {control} |"
        )
        notes.append(f"- {name}: {row['what']}")
    lines += ["", "Rows:", "", *notes, ""]
    lines.append(
        "new/old below 1 is faster; a ratio inside 1 +/- the noise (and the per-round range) is no measured change. "
        "The stock engine runs the same verl code in both revisions: its new/old is the machine's drift."
    )
    return "\n".join(lines) + "\n"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _execute(argv: Sequence[str], *, python: str, tree: Path, log_file: Path, timeout: float) -> float:
    """Run ``python argv`` in ``tree`` with ``PYTHONPATH=tree``; its wall seconds. Raises with the output's tail
    if it fails."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.perf_counter()
    with log_file.open("w") as out:
        proc = subprocess.run([python, *argv], cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode} in {tree}:\n{_tail(log_file)}")
    return time.perf_counter() - started


def _check_import(python: str, tree: Path) -> None:
    """The subprocesses must import this worktree's package, not an installed or editable copy."""
    code = "import importlib.util; print(importlib.util.find_spec('verl_prefix').origin)"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    origin = subprocess.run([python, "-c", code], cwd=tree, env=env, check=True, capture_output=True, text=True)
    if not Path(origin.stdout.strip()).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"PYTHONPATH={tree} imports verl_prefix from {origin.stdout.strip()}")


def _fill(argv: Sequence[str], **values: Any) -> list[str]:
    """``argv`` with each ``{name}`` replaced by ``values[name]`` (plain replacement: other braces stay)."""
    filled = []
    for arg in argv:
        for name, value in values.items():
            arg = arg.replace(f"{{{name}}}", str(value))
        filled.append(arg)
    return filled


def compare(
    old: str,
    new: str,
    rows: Sequence[Row],
    *,
    repo: Path = ROOT,
    repeats: int = 5,
    bench_reps: int = 3,
    python: str = sys.executable,
    timeout: float = 3600.0,
    out_md: Path | None = None,
    out_json: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure ``rows`` on revisions ``old`` and ``new`` of ``repo``, interleaved for ``repeats`` rounds; the
    result (also written to ``out_json`` and ``out_md`` after every round, so a run cut short keeps what it
    measured). The temporary worktrees are removed whatever happens."""
    started = time.perf_counter()
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "repeats_done": 0,
        "repeats": repeats,
        "bench_reps": bench_reps,
        "python": python,
        "order": "per round, per run: old then new",
        "load_average_1min": [os.getloadavg()[0]],  # at the start, then after each round: the machine's other work
    }
    for side, rev in zip(SIDES, (old, new)):
        result[side] = {"rev": rev, "sha": _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")}
    runs = list(dict.fromkeys(row.run for row in rows))
    series = {row.name: Series() for row in rows}
    batches: dict[str, dict[str, Any]] = {run.name: {} for run in runs}
    with tempfile.TemporaryDirectory(prefix="verl_prefix_revisions_") as tmp_name:
        tmp = Path(tmp_name)
        trees: dict[str, Path] = {}
        try:
            for side in SIDES:
                trees[side] = tmp / side
                _git(repo, "worktree", "add", "--detach", str(trees[side]), result[side]["sha"])
                _check_import(python, trees[side])
                (tmp / f"work-{side}").mkdir()
            (tmp / "out").mkdir()
            for side in SIDES:
                for run in runs:
                    for i, argv in enumerate(run.setup):
                        log(f"setup {side}: {run.name} ({i + 1}/{len(run.setup)})")
                        filled = _fill(argv, work=tmp / f"work-{side}", reps=bench_reps, out="")
                        setup_log = tmp / "out" / f"setup-{side}.log"
                        _execute(filled, python=python, tree=trees[side], log_file=setup_log, timeout=timeout)
            for rnd in range(repeats):
                for r, run in enumerate(runs):
                    for side in SIDES:
                        out = tmp / "out" / f"{side}-{r}-{rnd}.json"
                        argv = _fill(run.argv, out=out, work=tmp / f"work-{side}", reps=bench_reps)
                        wall = _execute(argv, python=python, tree=trees[side], log_file=out.with_suffix(".log"),
                                        timeout=timeout)  # fmt: skip
                        measured = json.loads(out.read_text())
                        result.setdefault("machine", measured.get("machine"))
                        batches[run.name].setdefault(side, lookup(measured, run.batch) if run.batch else None)
                        times = []
                        for row in rows:
                            if row.run != run:
                                continue
                            s = series[row.name]
                            getattr(s, side).append(float(lookup(measured, row.value)))
                            if row.control is not None:
                                getattr(s, f"{side}_control").append(float(lookup(measured, row.control)))
                            times.append(f"{row.name} {getattr(s, side)[-1]:.3f}s")
                        log(f"round {rnd + 1}/{repeats} {run.name} {side}: {', '.join(times)} (wall {wall:.0f}s)")
                result["repeats_done"] = rnd + 1
                result["load_average_1min"].append(os.getloadavg()[0])
                result["wall_s"] = time.perf_counter() - started
                result["rows"] = {
                    row.name: {
                        "what": row.what,
                        "run": row.run.name,
                        "same_batch": batches[row.run.name].get("old") == batches[row.run.name].get("new"),
                        **summarise(series[row.name]),
                    }
                    for row in rows
                }
                write_outputs(result, out_md, out_json)
        finally:
            for path in trees.values():
                subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)],
                               capture_output=True, check=False)  # fmt: skip
            subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True, check=False)
    return result


def write_outputs(result: dict[str, Any], out_md: Path | None, out_json: Path | None) -> None:
    """The markdown table and the JSON (each written whole, then moved into place)."""
    for path, text in ((out_json, json.dumps(result, indent=2) + "\n"), (out_md, None)):
        if path is None:
            continue
        if text is None:
            text = "# Old vs new revision\n\n" + markdown_table(result)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(text)
        partial.replace(path)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="rows: " + "; ".join(f"{name!r}: {row.what}" for name, row in ROWS.items()),
    )
    parser.add_argument("--old", required=True, help="the old git revision")
    parser.add_argument("--new", default="HEAD", help="the new git revision (default HEAD)")
    parser.add_argument("--repeats", type=_positive_int, default=5, help="rounds of old, new (default 5)")
    parser.add_argument("--bench-reps", type=_positive_int, default=3, help="timed reps inside each run (default 3)")
    parser.add_argument(
        "--row", action="append", choices=list(ROWS), default=None, help=f"repeatable; default {list(DEFAULT_ROWS)}"
    )
    parser.add_argument("--python", default=sys.executable, help="the interpreter to run (default this one)")
    parser.add_argument("--repo", type=Path, default=ROOT, help="the git repository (default this script's)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before it counts as failed")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/revisions.md", help="markdown table")
    parser.add_argument("--json", type=Path, default=None, help="result JSON (default: --out with .json)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison and print the table."""
    args = build_parser().parse_args(argv)
    rows = [ROWS[name] for name in (args.row or DEFAULT_ROWS)]
    out_json = args.json if args.json is not None else args.out.with_suffix(".json")
    result = compare(
        args.old,
        args.new,
        rows,
        repo=args.repo,
        repeats=args.repeats,
        bench_reps=args.bench_reps,
        python=args.python,
        timeout=args.timeout,
        out_md=args.out,
        out_json=out_json,
        log=lambda line: print(line, flush=True),
    )
    print()
    print(markdown_table(result))
    print(f"written: {args.out}, {out_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
