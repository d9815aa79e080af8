"""``verl-prefix`` command line: ``verl-prefix bench --preset smoke`` measures dense vs prefix reuse.

User mistakes print one line to stderr and exit 2, so scripts can tell them from crashes.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import sys
from pathlib import Path


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
    from verl_prefix.bench import PRESETS

    presets = "; ".join(f"{name}: {p.description}" for name, p in PRESETS.items())
    parser = _Parser(prog="verl-prefix", description="Shared-prefix reuse for verl GRPO actor updates.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{bench}")
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
    return parser


def update_table_file(path: Path, preset: str, table: str) -> None:
    """Replace this preset's table between marker comments in ``path``, or append it (creating the file)."""
    start, end = f"<!-- bench:{preset}:start -->", f"<!-- bench:{preset}:end -->"
    block = f"{start}\n{table}\n{end}"
    text = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + block + "\n"
    path.write_text(text)


def _select_platform() -> None:
    """Without CUDA, put verl on the CPU platform before any verl engine code runs."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VERL_PLATFORM", "cpu")
        os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from verl_prefix.platform_cpu import cpu_platform_requested, ensure_cpu_platform

    if cpu_platform_requested():
        ensure_cpu_platform()  # the package may have been imported before the variable was set


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    from verl_prefix.bench import BenchError, markdown_table, resolve_preset, run_bench

    try:
        resolve_preset(args.preset, args.reps, args.threads)
    except BenchError as exc:
        print(f"verl-prefix: error: {exc}", file=sys.stderr)
        return 2
    out = args.out if args.out is not None else Path("bench/results") / f"{args.preset}.json"
    for path in (out, args.table):
        if path is not None and path.exists() and path.is_dir():
            print(f"verl-prefix: error: {path} is a directory, expected a file path", file=sys.stderr)
            return 2
    if args.table is not None and not args.table.parent.is_dir():
        print(f"verl-prefix: error: directory {args.table.parent} for --table does not exist", file=sys.stderr)
        return 2
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"verl-prefix: error: cannot create {out.parent}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        result = run_bench(
            args.preset,
            reps=args.reps,
            threads=args.threads,
            out_json=out,
            command=shlex.join(["verl-prefix", *argv]),
            log=functools.partial(print, flush=True),
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
        update_table_file(args.table, args.preset, table)
        print(f"table written to {args.table}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``verl-prefix`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a mistake (2, message already printed)
        return int(exc.code or 0)
    _select_platform()
    if args.command == "bench":
        return _bench(args, argv)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
