"""``verl-prefix`` command line: benchmark, make and replay traces, plot results.

- ``verl-prefix bench --preset smoke``: dense vs prefix reuse on one synthetic batch per cell;
- ``verl-prefix trace synthetic --out DIR ...`` / ``verl-prefix trace show DIR``: make or inspect a trace
  (real runs record one with ``verl_prefix.backend.trace.recording``);
- ``verl-prefix replay --trace DIR [--model DIR]``: each traced batch through both engines, drift vs noise;
- ``verl-prefix report RESULT.json --out DIR``: PNG plots of a bench or replay result;
- ``verl-prefix smoke-data --out DIR``: the tiny model and GSM8K-shaped parquet files ``recipes/grpo_cpu_smoke.sh``
  trains on with verl's own ``main_ppo``;
- ``verl-prefix demo``: a few GRPO steps on CPU, verl's stock trainer then prefix reuse on the same
  rollouts, logged through verl's ``Tracking`` (console + wandb), ending in a comparison table.
- ``verl-prefix dashboard wandb --entity E --project P``: a wandb workspace with the engine's panels;
  ``verl-prefix dashboard html RUN [RUN ...] --out FILE``: the same panels as one offline HTML page.

User mistakes print one line to stderr and exit 2, so scripts can tell them from crashes.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verl_prefix.tools.bench.presets import ModelSpec


class _Parser(argparse.ArgumentParser):
    """argparse that reports a mistake as one line (no usage dump) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (separate so tests and docs can inspect it)."""
    from verl_prefix.tools.bench.presets import PRESETS

    presets = "; ".join(f"{name}: {p.description}" for name, p in PRESETS.items())
    parser = _Parser(prog="verl-prefix", description="Shared-prefix reuse for verl GRPO actor updates.")
    commands = "{demo,bench,trace,replay,report,smoke-data,dashboard,models,compat}"
    sub = parser.add_subparsers(dest="command", required=True, metavar=commands)
    bench = sub.add_parser(
        "bench",
        help="time verl's fsdp2 engine against prefix_fsdp2 on the same GRPO batch",
        description="Time verl's fsdp2 engine against prefix_fsdp2 on identical GRPO batches, interleaved.",
    )
    bench.add_argument("--preset", choices=list(PRESETS), default="smoke", help=f"default smoke. {presets}")
    bench.add_argument("--reps", type=_positive_int, default=None, help="timed reps per cell after 1 warm-up")
    bench.add_argument(
        "--threads", type=_positive_int, default=None, help="torch CPU threads (default: the preset's, 1 on CPU)"
    )
    bench.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/<preset>.json)")
    bench.add_argument("--table", type=Path, default=None, help="markdown file to write/update with the table")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument(
        "--cell", action="append", default=None, metavar="NAME", help="run only this cell of the preset (repeatable)"
    )
    bench.add_argument(
        "--compile",
        action="store_true",
        help="both engines with verl's use_torch_compile (the conservative comparison)",
    )
    bench.add_argument(
        "--jobs",
        type=_positive_int,
        default=1,
        help="capacity presets: engines searched at once, one probe process each (default 1)",
    )
    _add_trace_parser(sub)
    _add_replay_parser(sub)
    _add_demo_parser(sub)
    models = sub.add_parser(
        "models",
        help="the model coverage matrix: every decoder family of the installed transformers and its column",
        description="Build a tiny random model of every causal-LM family of the installed transformers (twice where "
        "it has lengths besides the window: at the default build's lengths and with every length shorter than the "
        "matrix's prompt), run the capability check and the engine's per-batch length reasons, and print (or "
        "--write) the coverage page (docs/models.md); the matrix tests prove the exact-under-reuse column against "
        "dense.",
    )
    models.add_argument("--write", type=Path, default=None, metavar="PAGE", help="write the page here")
    models.add_argument("--family", action="append", default=None, help="only this family (repeatable)")
    compat = sub.add_parser(
        "compat",
        help="the compatibility matrix: engines by verl features, and every training-side key of verl's YAML",
        description="Print (or --write) docs/compatibility.md from verl_prefix/backend/recipe_keys.py; --readme "
        "rewrites the compact table between the README's compatibility markers. The tests check both pages against "
        "this render and every claim against a named test.",
    )
    compat.add_argument("--write", type=Path, default=None, metavar="PAGE", help="write the page here")
    compat.add_argument("--readme", type=Path, default=None, metavar="README", help="rewrite this README's block")
    compat.add_argument(
        "--megatron",
        type=Path,
        default=None,
        metavar="PAGE",
        help="rewrite this page's table of verl's Megatron recipes",
    )
    smoke = sub.add_parser(
        "smoke-data",
        help="write the tiny model and GSM8K-shaped (or geo3k-shaped image) parquet files the CPU recipe trains on",
        description="Write DIR/model (a tiny random-init model with its tokenizer) and DIR/data/{train,test}.parquet "
        "(verl's RL dataset format) for recipes/grpo_cpu_smoke.sh. --task vl: a tiny Qwen2.5-VL with its "
        "processor and image prompts in the layout of verl's geo3k example.",
    )
    smoke.add_argument("--out", type=Path, required=True, help="directory to write model/ and data/ into")
    smoke.add_argument(
        "--task",
        choices=("text", "agentic", "vl"),
        default="text",
        help="text (GSM8K-shaped, default), agentic (the same behind one shared system message, for "
        "prefix_reuse.tree) or vl (image prompts)",
    )
    smoke.add_argument(
        "--family",
        choices=("llama", "qwen3", "qwen3_5", "gpt_oss"),
        default="llama",
        help="--task text's model: llama (default), qwen3 (the TorchTitan and Megatron engines'), qwen3_5 "
        "(Qwen3.5's gated delta-net decoder) or gpt_oss (sliding windows, attention sinks, experts)",
    )
    smoke.add_argument("--train", type=_positive_int, default=64, help="training prompts (default 64)")
    smoke.add_argument("--test", type=_positive_int, default=8, help="validation prompts (default 8)")
    smoke.add_argument("--seed", type=int, default=0)
    report = sub.add_parser(
        "report",
        help="PNG plots of a bench or replay result JSON",
        description="Plot a bench result (speedup vs P/S and vs G beside the FLOP model, per-phase memory) or "
        "a replay result (per-step speedup, parameter drift vs noise floor, per-phase memory).",
    )
    report.add_argument("result", type=Path, help="a bench or replay result JSON")
    report.add_argument("--out", type=Path, required=True, help="directory for the PNGs (created)")
    _add_dashboard_parser(sub)
    return parser


def _add_dashboard_parser(sub: argparse._SubParsersAction) -> None:
    dash = sub.add_parser(
        "dashboard",
        help="dashboards of the engine's metrics: a wandb workspace, or one offline HTML page",
        description="Panels for update time (dense vs prefix), per-phase time and memory, logical vs physical "
        "tokens, the reuse factor and fallbacks by reason, as a wandb workspace or a self-contained HTML page.",
    )
    dsub = dash.add_subparsers(dest="dashboard_command", required=True, metavar="{wandb,html}")
    wb = dsub.add_parser(
        "wandb",
        help="create the workspace in a wandb project (needs a wandb login and pip install 'verl-prefix[dashboard]')",
    )
    wb.add_argument("--entity", required=True, help="wandb entity (user or team)")
    wb.add_argument("--project", required=True, help="wandb project the runs log to (trainer.project_name)")
    wb.add_argument("--name", default=None, help="workspace name")
    page = dsub.add_parser(
        "html",
        help="one self-contained HTML page from runs on disk (no network needed to view it)",
        description="RUN: an offline wandb run directory, a verl file-logger JSONL (trainer.logger=[file]), or a "
        "directory searched for both (e.g. the demo's --out-dir).",
    )
    page.add_argument("runs", nargs="+", type=Path, metavar="RUN")
    page.add_argument("--out", type=Path, required=True, help="the HTML file to write")
    page.add_argument("--title", default=None, help="page title (default: the run names)")


def _length(text: str) -> int | tuple[int, int]:
    """``N`` or ``LO:HI`` (inclusive), as the synthetic trace options take them."""
    try:
        if ":" in text:
            lo, hi = (int(x) for x in text.split(":", 1))
            if not 1 <= lo <= hi:
                raise ValueError
            return lo, hi
        value = int(text)
        if value < 1:
            raise ValueError
        return value
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a length N >= 1 or a range LO:HI, got {text!r}") from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


MODEL_SPECS = ("tiny", "smoke", "29m")


def _add_trace_parser(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser(
        "trace",
        help="make (synthetic) or inspect an update-batch trace",
        description="Traces hold the batches an actor engine trains on. Real runs record them with "
        "verl_prefix.backend.trace.recording; 'synthetic' makes one with chosen length distributions.",
    )
    tsub = trace.add_subparsers(dest="trace_command", required=True, metavar="{synthetic,show}")
    syn = tsub.add_parser(
        "synthetic",
        help="write a synthetic GRPO trace",
        description="Write a trace of GRPO mini-batches: GROUPS uid groups of GROUP_SIZE samples per step; "
        "prompt (shared prefix) and response lengths drawn uniformly from N or LO:HI.",
    )
    syn.add_argument("--out", type=Path, required=True, help="trace directory (created)")
    syn.add_argument("--steps", type=_positive_int, default=4, help="batches (default 4)")
    syn.add_argument("--groups", type=_positive_int, default=2, help="uid groups per batch (default 2)")
    syn.add_argument("--group-size", type=_positive_int, default=8, help="responses per prompt (default 8)")
    syn.add_argument("--prefix-len", type=_length, default=(384, 640), help="prompt length N or LO:HI")
    syn.add_argument("--suffix-len", type=_length, default=(32, 64), help="response length N or LO:HI")
    syn.add_argument("--vocab-size", type=_positive_int, default=None, help="default: the model's")
    syn.add_argument("--micro-batch-size", type=_positive_int, default=4, help="ppo_micro_batch_size_per_gpu")
    syn.add_argument("--lr", type=_positive_float, default=1e-5, help="actor learning rate for replay")
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument(
        "--system-len", type=int, default=0, help="a system block of N tokens in front of every prompt of a step"
    )
    syn.add_argument("--tree", action="store_true", help="record prefix_reuse.tree=true: replay runs the tree")
    model = syn.add_mutually_exclusive_group()
    model.add_argument(
        "--write-model",
        choices=MODEL_SPECS,
        default=None,
        help="also write a random-init Qwen3-style model into OUT/model and reference it (tiny: 20K params; "
        "smoke: the smoke bench's 1M; 29m: the cpu/gpu presets')",
    )
    model.add_argument("--model-ref", default=None, help="model directory the trace refers to")
    syn.add_argument("--force", action="store_true", help="replace a trace already in --out")
    show = tsub.add_parser("show", help="print a trace's manifest summary")
    show.add_argument("dir", type=Path)


def _add_replay_parser(sub: argparse._SubParsersAction) -> None:
    rep = sub.add_parser(
        "replay",
        help="replay a trace through fsdp2 and prefix_fsdp2: speed, memory, parameter drift",
        description="Run each traced batch through verl's fsdp2 and prefix_fsdp2 from the same model (both "
        "stepping their optimizers) and a second fsdp2 with another micro-batch partition (noise floor).",
    )
    rep.add_argument("--trace", type=Path, required=True, help="trace directory")
    rep.add_argument("--model", type=Path, default=None, help="HF model directory (default: the trace's model_ref)")
    rep.add_argument("--steps", type=_positive_int, default=None, help="replay the first N batches (default all)")
    rep.add_argument("--reps", type=_positive_int, default=2, help="timed forward-backward reps per step")
    rep.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    rep.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default 1 on CPU)")
    rep.add_argument("--no-noise", action="store_true", help="skip the noise-floor engine")
    rep.add_argument("--out", type=Path, default=Path("bench/results/replay.json"), help="result JSON")
    rep.add_argument("--table", type=Path, default=None, help="markdown file to write/update with the table")
    rep.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_demo_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="a few GRPO steps on CPU: verl's stock trainer, then prefix reuse on the same rollouts",
        description="Run verl's v1 trainer step() on CPU (2 Ray actor ranks, FSDP2 over gloo; HF generate stands "
        "in for the rollout) with the stock sync trainer and fsdp2, then with prefix_sync and prefix_fsdp2 "
        "replaying the same rollouts. Both runs log through verl's Tracking to the console and wandb (offline "
        "unless WANDB_MODE says otherwise or a wandb login is configured; WANDB_DIR is honoured). Prints "
        "per-step update times, the speedup, per-phase time and memory, tokens and parameter agreement.",
    )
    demo.add_argument(
        "--task",
        choices=("echo", "agentic"),
        default="echo",
        help="echo (default): the GRPO loop, stock then prefix reuse; agentic: stock, one-level reuse and the "
        "tree updating side by side on batches whose groups share a system block (no Ray, no wandb)",
    )
    demo.add_argument("--steps", type=_positive_int, default=3, help="GRPO steps per run (default 3)")
    demo.add_argument("--prompts", type=_positive_int, default=4, help="prompts per step (default 4)")
    demo.add_argument("--n", type=_positive_int, default=8, help="samples per prompt, rollout.n (default 8)")
    demo.add_argument(
        "--out-dir",
        type=Path,
        default=Path("outputs/demo"),
        help="model, demo.json and (without WANDB_DIR) the wandb runs (default outputs/demo)",
    )
    demo.add_argument("--no-wandb", action="store_true", help="log to the console only")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--verbose", action="store_true", help="show the Ray workers' and libraries' own output")


def _smoke_data(args: argparse.Namespace) -> int:
    if args.task == "vl":
        if args.family != "llama":
            print("smoke-data: --family is the text task's model (--task vl writes a Qwen2.5-VL)", file=sys.stderr)
            return 2
        from verl_prefix.tools.smoke.vl import write_smoke_vl

        paths = write_smoke_vl(args.out, train=args.train, test=args.test, seed=args.seed)
    else:
        from verl_prefix.tools.smoke.text import AGENTIC_SYSTEM_WORDS, write_smoke

        system_words = AGENTIC_SYSTEM_WORDS if args.task == "agentic" else 0
        paths = write_smoke(
            args.out, train=args.train, test=args.test, seed=args.seed, family=args.family, system_words=system_words
        )
    print(f"model: {paths['model']}\ndata: {paths['data']}")
    return 0


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    from verl_prefix.tools.bench.presets import BenchError, resolve_preset
    from verl_prefix.tools.bench.runner import run_bench
    from verl_prefix.tools.bench.tables import grad_check_failures, markdown_table, update_table_file

    try:
        resolve_preset(args.preset, args.reps, args.threads, args.cell)
    except BenchError as exc:
        print(f"verl-prefix: error: {exc}", file=sys.stderr)
        return 2
    suffix = "-compile" if args.compile else ""
    out = args.out if args.out is not None else Path("bench/results") / f"{args.preset}{suffix}.json"
    for path, what in ((out, "--out"), (args.table, "--table")):
        problem = _writable_file(path, what)
        if problem is not None:
            return _fail(problem)
    try:
        result = run_bench(
            args.preset,
            reps=args.reps,
            threads=args.threads,
            out_json=out,
            command=shlex.join(["verl-prefix", *argv]),
            log=functools.partial(print, flush=True),
            progress=not args.no_progress,
            compile=args.compile,
            cells=args.cell,
            jobs=args.jobs,
        )
    except BenchError as exc:
        print(f"verl-prefix: error: {exc}", file=sys.stderr)
        return 2
    table = markdown_table(result)
    machine = result["machine"]
    print()
    print(table)
    print()
    print(
        f"{result['date']} | {machine['processor']} ({machine['cpu_count']} CPUs, {machine['torch_threads']} "
        f"torch threads) | torch {machine['torch']} | wall {result['wall_s']:.1f}s | saved {out}"
    )
    if args.table is not None:
        update_table_file(args.table, args.preset + ("-compile" if args.compile else ""), table)
        print(f"table written to {args.table}")
    failures = grad_check_failures(result)
    if failures:  # saved and tabled as measured; the exit status says the gradients disagreed
        print("verl-prefix: gradient check failed: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def _fail(message: object) -> int:
    """A user mistake: one line on stderr, exit status 2."""
    print(f"verl-prefix: error: {message}", file=sys.stderr)
    return 2


def _writable_file(path: Path | None, what: str) -> str | None:
    """Why ``path`` cannot be written as a file, or None; checked before any slow work."""
    if path is None:
        return None
    if path.is_dir():
        return f"{path} is a directory, expected a file path for {what}"
    if what == "--table" and not path.parent.is_dir():
        return f"directory {path.parent} for --table does not exist"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {path.parent}: {exc.strerror}"
    return None


def _trace(args: argparse.Namespace) -> int:
    from verl_prefix.backend.trace import TraceError, load_trace
    from verl_prefix.tools.synthetic_trace import synthetic_trace

    try:
        if args.trace_command == "show":
            trace = load_trace(args.dir)
            m = trace.manifest
            rows = sum(s.rows for s in trace.steps)
            print(
                f"{trace.dir}: {len(trace)} batches ({rows} samples), source {m.get('source')}, "
                f"created {m.get('created')}, model_ref {trace.model_ref}"
            )
            print(f"versions: {json.dumps(m.get('versions'))}")
            print(f"config: {json.dumps(trace.config)}")
            for s in trace.steps:
                print(f"  {s.file}: step {s.step}, {s.rows} rows, {s.groups} groups, {s.tokens} tokens")
            return 0
        out = args.out
        if out.exists() and not out.is_dir():
            return _fail(f"{out} exists and is not a directory")
        if (out / "manifest.json").exists() and not args.force:
            return _fail(f"{out} already holds a trace; pass --force to replace it")
        model_ref, vocab = args.model_ref, args.vocab_size
        spec = None
        if args.write_model is not None:
            spec = _model_spec(args.write_model)
            model_ref = "model"
            if vocab is None:
                vocab = spec.vocab_size
            elif vocab > spec.vocab_size:
                return _fail(f"--vocab-size {vocab} exceeds the {args.write_model} model's {spec.vocab_size}")
        elif model_ref is not None:
            if Path(model_ref).is_dir():
                model_ref = str(Path(model_ref).resolve())  # replay resolves relative refs against the trace
            if vocab is None:
                vocab = _model_vocab(Path(model_ref))
        if vocab is None:
            return _fail("give --vocab-size, --write-model or a --model-ref directory with a config.json")
        synthetic_trace(
            out,
            steps=args.steps,
            groups=args.groups,
            group_size=args.group_size,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            vocab_size=vocab,
            seed=args.seed,
            micro_batch_size=args.micro_batch_size,
            lr=args.lr,
            model_ref=model_ref,
            overwrite=args.force,
            system_len=args.system_len,
            prefix_reuse={"tree": True} if args.tree else None,
        )
        if spec is not None:
            spec.write(out / "model")
    except TraceError as exc:
        return _fail(exc)
    print(
        f"wrote {args.steps} batches to {out}" + (f" and a {args.write_model} model to {out / 'model'}" if spec else "")
    )
    return 0


def _model_spec(name: str) -> ModelSpec:
    from verl_prefix.tools.bench.presets import MODEL_29M, SMOKE_MODEL, ModelSpec

    tiny = ModelSpec(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=64)
    return {"tiny": tiny, "smoke": SMOKE_MODEL, "29m": MODEL_29M}[name]


def _model_vocab(path: Path) -> int | None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(vocab) if vocab else None


def _replay(args: argparse.Namespace, argv: list[str]) -> int:
    from verl_prefix.backend.trace import TraceError, load_trace
    from verl_prefix.tools.bench.tables import update_table_file
    from verl_prefix.tools.replay import replay, replay_table

    for path, what in ((args.out, "--out"), (args.table, "--table")):
        problem = _writable_file(path, what)
        if problem:
            return _fail(problem)
    try:
        load_trace(args.trace)  # a missing or corrupt trace fails here, before any engine is built
        if args.model is not None and not args.model.exists():
            return _fail(f"model directory {args.model} does not exist")
        result = replay(
            args.trace,
            args.model,
            steps=args.steps,
            reps=args.reps,
            dtype=args.dtype,
            threads=args.threads,
            noise=not args.no_noise,
            out_json=args.out,
            command=shlex.join(["verl-prefix", *argv]),
            progress=not args.no_progress,
            log=functools.partial(print, flush=True),
        )
    except TraceError as exc:
        return _fail(exc)
    table = replay_table(result)
    summary, machine = result["summary"], result["machine"]
    print()
    print(table)
    print()
    print(
        f"median speedup {summary['ratio_median']:.2f}x (FLOP model {summary['predicted_speedup_median']:.2f}x) | "
        f"max drift {summary['max_drift']:.1e} vs noise floor {summary['max_noise_floor']:.1e} ({result['dtype']})"
    )
    print(
        f"{result['date']} | {machine['processor']} ({machine['cpu_count']} CPUs, {machine['torch_threads']} "
        f"torch threads) | torch {machine['torch']} | wall {result['wall_s']:.1f}s | saved {args.out}"
    )
    if args.table is not None:
        update_table_file(args.table, "replay", table)
        print(f"table written to {args.table}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from verl_prefix.tools.report.plots import ReportError, write_report

    try:
        paths = write_report(args.result, args.out)
    except ReportError as exc:
        return _fail(exc)
    for path in paths:
        print(path)
    return 0


def _demo(args: argparse.Namespace) -> int:
    import time

    from verl_prefix.tools.demo.echo import DemoError, check_options, demo_report, quiet_libraries, run_demo, wandb_mode

    start = time.perf_counter()
    if not args.verbose:
        quiet_libraries()

    def progress(message: str) -> None:
        print(f"[demo {time.perf_counter() - start:5.1f}s] {message}", flush=True)

    if args.task == "agentic":
        from verl_prefix.tools.demo.agentic import agentic_report, run_agentic_demo

        try:
            summary = run_agentic_demo(
                args.out_dir, steps=args.steps, prompts=args.prompts, n=args.n, seed=args.seed, progress=progress
            )
        except DemoError as exc:
            return _fail(exc)
        print()
        print(agentic_report(summary))
        return 0
    try:
        check_options(args.out_dir, steps=args.steps, prompts=args.prompts, n=args.n)
        if not args.no_wandb:
            wandb_mode()  # an invalid WANDB_MODE fails here, before any slow work
    except DemoError as exc:
        return _fail(exc)
    try:
        result = run_demo(
            args.out_dir,
            steps=args.steps,
            prompts=args.prompts,
            n=args.n,
            use_wandb=not args.no_wandb,
            seed=args.seed,
            verbose=args.verbose,
            progress=progress,
        )
    except DemoError as exc:
        return _fail(exc)
    print()
    print(demo_report(result))
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from verl_prefix.tools.report.dashboard import WORKSPACE_NAME, DashboardError, save_workspace, write_html

    try:
        if args.dashboard_command == "html":
            problem = _writable_file(args.out, "--out")
            if problem is not None:
                return _fail(problem)
            print(write_html(args.runs, args.out, title=args.title))
            return 0
        print(save_workspace(args.entity, args.project, args.name or WORKSPACE_NAME))
    except DashboardError as exc:
        return _fail(exc)
    return 0


def _models(args: argparse.Namespace) -> int:
    """``verl-prefix models``: the coverage page from the capability check over every family."""
    import logging

    from verl_prefix.harness import model_zoo

    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows = model_zoo.matrix_rows(args.family)
    page = model_zoo.render(rows)
    if args.write is None:
        print(page, end="")
        return 0
    args.write.write_text(page)
    counts = ", ".join(f"{status}: {sum(r.status == status for r in rows)}" for status in model_zoo.COLUMNS)
    print(f"wrote {args.write} ({counts})")
    return 0


def _compat(args: argparse.Namespace) -> int:
    """``verl-prefix compat``: the compatibility page (and the README's compact table) from ``recipe_keys``."""
    from verl_prefix.backend import recipe_keys

    page = recipe_keys.render()
    if args.megatron is not None:
        from verl_prefix.backend.megatron import recipes

        try:
            args.megatron.write_text(recipes.with_table(args.megatron.read_text()))
        except ValueError as exc:
            return _fail(exc)
        print(f"rewrote the Megatron recipe table of {args.megatron} ({len(recipes.RECIPES)} recipes)")
        if args.write is None and args.readme is None:
            return 0
    if args.write is None and args.readme is None:
        print(page, end="")
        return 0
    if args.write is not None:
        args.write.write_text(page)
        print(f"wrote {args.write} ({len(recipe_keys.MATRIX)} features, {len(recipe_keys.KEYS)} keys)")
    if args.readme is not None:
        try:
            text = recipe_keys.with_readme_block(args.readme.read_text())
        except ValueError as exc:
            return _fail(exc)
        args.readme.write_text(text)
        print(f"rewrote the compatibility block of {args.readme}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``verl-prefix`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a mistake (2, message already printed)
        return int(exc.code or 0)
    if args.command == "report":
        return _report(args)
    if args.command == "smoke-data":
        return _smoke_data(args)
    if args.command == "dashboard":
        return _dashboard(args)
    if args.command == "models":
        return _models(args)
    if args.command == "compat":
        return _compat(args)
    from verl_prefix.tools.measure import select_platform

    select_platform()
    if args.command == "trace":
        return _trace(args)
    if args.command == "bench":
        return _bench(args, argv)
    if args.command == "replay":
        return _replay(args, argv)
    if args.command == "demo":
        return _demo(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
