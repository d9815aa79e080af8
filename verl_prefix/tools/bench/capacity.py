"""Capacity search (``verl-prefix bench --preset capacity``): for a model, G, a suffix length and a memory
budget, the longest prefix whose update fits, for verl's stock ``fsdp2`` engine (each micro-batch size
given; the table takes its best) and for ``prefix_fsdp2`` under each dormant policy (and chunked).

Every probe is a fresh process: it builds the engine, then runs one update (zero_grad + forward/backward,
no optimizer step) on one GRPO group (prompt of P+1 tokens, G responses of S tokens). On CPU the figure is
the process's peak RSS during the update above its RSS once the engine (the loaded model) is built
(``VmHWM`` reset before the update, after a warm-up update on a 64-token prefix); it fits when that is
within the budget, and a probe whose high-water mark passes the budget is stopped there and reported over
(the CPU stand-in for an out-of-memory error; it keeps a long search cheap and inside the machine's RAM).
On CUDA the figure is the allocator's peak above what the built engine holds, and the budget is enforced:
``torch.cuda.set_per_process_memory_fraction`` caps the process at built + budget, and a probe fits when
it does not raise an out-of-memory error (the real OOM boundary).

The search is a binary search over a coarse ascending grid of prefix lengths, assuming that a longer
prefix never needs less memory: the answer is the longest grid point that fits, with the next grid point
probed and not fitting (or the answer is the grid's end: a lower bound). With ``repeats`` > 1 a grid point
is probed in that many fresh processes (fewer once a majority is certain) and fits when most of them do:
a CPU process's peak RSS depends on the allocator's state, which differs between identical processes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_prefix.tools.measure import run_fresh


@dataclass(frozen=True)
class CapacitySpec:
    """What a capacity preset searches. ``engines``: ``fsdp2:<micro-batch rows>`` (the stock engine),
    ``<policy>`` or ``<policy>:<prefix_chunk_tokens>`` (``prefix_fsdp2``, policy keep/recompute/offload)."""

    model: Any  # a bench_presets.ModelSpec: its vocab_size and write(directory)
    group_size: int
    suffix_len: int
    budget_mib: float
    grid: tuple[int, ...]
    engines: tuple[str, ...]
    micro_batch_size: int = 4  # prefix_fsdp2's suffix rows per phase-B micro-batch
    dtype: str = "float32"
    overrides: tuple[str, ...] = ()
    timeout_s: float = 1800.0
    # fresh processes per grid point; the point fits when most of them do (CPU peaks move with the
    # allocator's state by 10-30% between identical processes; a GPU allocator's peak does not)
    repeats: int = 1


def parse_engine(name: str) -> dict[str, Any]:
    """``"fsdp2:2"`` -> stock with 2 rows per micro-batch; ``"recompute:512"`` -> prefix_fsdp2, recompute,
    chunks of 512; a ``ValueError`` for anything else."""
    kind, _, arg = name.partition(":")
    if kind == "fsdp2":
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"engine {name!r}: the stock engine needs its micro-batch rows, e.g. fsdp2:1")
        return {"stock": True, "rows": int(arg)}
    if kind not in ("keep", "recompute", "offload"):
        raise ValueError(f"engine {name!r}: choose fsdp2:<rows>, keep, recompute or offload (optionally :<chunk>)")
    if arg and (not arg.isdigit() or int(arg) < 1):
        raise ValueError(f"engine {name!r}: the chunk size must be a positive integer")
    return {"stock": False, "policy": kind, "chunk": int(arg) if arg else None}


def validate_spec(spec: CapacitySpec) -> None:
    """Reject a spec before any probe runs."""
    for name in spec.engines:
        parse_engine(name)
    if not spec.grid or list(spec.grid) != sorted(set(spec.grid)) or spec.grid[0] < 1:
        raise ValueError(f"capacity grid must be distinct ascending positive prefix lengths, got {spec.grid}")
    if spec.budget_mib <= 0 or spec.group_size < 2 or spec.suffix_len < 1 or spec.repeats < 1:
        raise ValueError("capacity needs budget_mib > 0, group_size >= 2, suffix_len >= 1 and repeats >= 1")


def search(grid: tuple[int, ...], fits: Callable[[int], bool]) -> dict[str, Any]:
    """Binary search for the longest ``grid`` point that ``fits`` (monotone: fits at n => fits below n).

    Returns ``longest`` (None when even the first point does not fit), ``first_over`` (the next grid point,
    probed and not fitting; None when ``longest`` is the grid's end) and ``probes`` in the order run."""
    probes: list[tuple[int, bool]] = []

    def probe(i: int) -> bool:
        ok = fits(grid[i])
        probes.append((grid[i], ok))
        return ok

    lo, hi = -1, len(grid)  # grid[lo] fits (or lo = -1), grid[hi] does not (or hi = len)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return {
        "longest": grid[lo] if lo >= 0 else None,
        "first_over": grid[hi] if hi < len(grid) else None,
        "probes": probes,
    }


def probe(spec: CapacitySpec, engine: str, prefix_len: int, model_dir: Path) -> dict[str, Any]:
    """One update in a fresh process (``capacity_probe.main`` through ``measure.run_fresh``); ``fits`` and the
    measured peak above the built engine (MiB)."""
    request = json.dumps(
        {
            "spec": {**dataclasses.asdict(spec), "model": None},
            "vocab": spec.model.vocab_size,
            "engine": engine,
            "prefix_len": prefix_len,
            "model_dir": str(model_dir),
            "threads": torch.get_num_threads(),
        }
    )
    start = time.perf_counter()
    code, stdout, stderr = run_fresh("verl_prefix.tools.bench.capacity_probe", request, timeout_s=spec.timeout_s)
    if code is None:
        return {"fits": False, "error": f"timed out after {spec.timeout_s:.0f} s", "wall_s": spec.timeout_s}
    wall = time.perf_counter() - start
    lines = stdout.strip().splitlines()
    if code != 0 or not lines:
        # a killed or crashed probe (e.g. the kernel's OOM killer) did not fit; say so in the result
        return {"fits": False, "error": f"exit {code}: {stderr[-500:]}", "wall_s": wall}
    result = json.loads(lines[-1])
    result["wall_s"] = wall
    return result


def run_capacity(
    spec: CapacitySpec,
    *,
    log: Callable[[str], None] = print,
    probe_fn: Callable[[CapacitySpec, str, int, Path], dict[str, Any]] | None = None,
    model_dir: Path | None = None,
    jobs: int = 1,
    on_engine_done: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Search every engine of ``spec``; ``probe_fn`` (default ``probe``) is injectable (tests check the
    search on a fake). ``jobs`` engines search at once (each probe is its own process, so two jobs use two
    cores; the memory measured is per process and does not change). ``on_engine_done`` gets the result so
    far after each engine (a long search cut short keeps what it found)."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    probe_fn = probe_fn or probe
    validate_spec(spec)
    if jobs < 1:
        raise ValueError(f"capacity jobs must be >= 1, got {jobs}")
    results: dict[str, Any] = {}

    def search_engine(engine: str, directory: Path) -> None:
        measured: dict[int, dict[str, Any]] = {}

        def fits(prefix_len: int) -> bool:
            runs: list[dict[str, Any]] = []
            while not _decided(runs, spec.repeats):
                r = probe_fn(spec, engine, prefix_len, directory)
                runs.append(r)
                log(
                    f"capacity {engine} P={prefix_len}: peak {r.get('peak_above_mib', float('nan')):.0f} MiB "
                    f"-> {'fits' if r['fits'] else 'over'}" + (f" ({r['error'][:80]})" if r.get("error") else "")
                )
            measured[prefix_len] = _combine(runs)
            return bool(measured[prefix_len]["fits"])

        found = search(spec.grid, fits)
        found["measured"] = {str(k): v for k, v in measured.items()}
        results[engine] = found
        if on_engine_done is not None:
            on_engine_done(_summary(spec, results))

    with tempfile.TemporaryDirectory(prefix="verl_prefix_capacity_") as tmp:
        directory = model_dir or spec.model.write(Path(tmp) / "model")
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for future in [pool.submit(search_engine, engine, directory) for engine in spec.engines]:
                future.result()  # re-raise a failed search here
    return _summary(spec, results)


def _decided(runs: list[dict[str, Any]], repeats: int) -> bool:
    """A majority of ``repeats`` probes agree (no need to run the rest)."""
    fit = sum(bool(r["fits"]) for r in runs)
    return max(fit, len(runs) - fit) > repeats // 2


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One grid point's verdict from its probes: the majority, the median peak, every probe's figure. A
    single probe is reported as it is."""
    if len(runs) == 1:
        return runs[0]
    peaks = [r.get("peak_above_mib", math.inf) for r in runs]  # a crashed probe counts as over
    fit = sum(bool(r["fits"]) for r in runs)
    return {
        "fits": fit * 2 > len(runs),
        "peak_above_mib": statistics.median(peaks),
        "peaks_mib": peaks,
        "probes": runs,
    }


def _summary(spec: CapacitySpec, results: dict[str, Any]) -> dict[str, Any]:
    """The result JSON's ``capacity`` object: the spec, each searched engine (in the spec's order) and the
    stock engine at its best micro-batch size."""
    engines = {e: results[e] for e in spec.engines if e in results}
    stock = [e for e in engines if parse_engine(e)["stock"]]
    best = max(stock, key=lambda e: engines[e]["longest"] or 0) if stock else None
    return {
        "model": dataclasses.asdict(spec.model),
        "group_size": spec.group_size,
        "suffix_len": spec.suffix_len,
        "budget_mib": spec.budget_mib,
        "grid": list(spec.grid),
        "micro_batch_size": spec.micro_batch_size,
        "dtype": spec.dtype,
        "repeats": spec.repeats,
        "engines": engines,
        "stock_best": best,
        "complete": len(engines) == len(spec.engines),
    }


def capacity_table(result: dict[str, Any]) -> str:
    """Markdown: per engine the longest prefix that fits, the first grid point over, and the ratio to the
    stock engine at its best micro-batch size."""
    best = result.get("stock_best")
    base = result["engines"][best]["longest"] if best else None
    lines = [
        "| engine | longest prefix that fits | next grid point (over) "
        "| peak above model at the longest (MiB; median (min-max) of its probes) | vs stock best |",
        "|---|---:|---:|---:|---:|",
    ]
    for engine, r in result["engines"].items():
        longest, over = r["longest"], r["first_over"]
        at_longest = r["measured"].get(str(longest), {}) if longest else {}
        ratio = f"{longest / base:.2f}x" if longest and base else "-"
        label = engine + (" (best stock)" if engine == best else "")
        lines.append(
            f"| {label} | {longest if longest else 'none'}{'' if over or not longest else ' (grid end)'} | "
            f"{over if over else '-'} | {_peak_cell(at_longest)} | {ratio} |"
        )
    return "\n".join(lines)


def _peak_cell(measured: dict[str, Any]) -> str:
    """``median (min-max)`` over a point's probes, or the one probe's peak."""
    if "peak_above_mib" not in measured:
        return "-"
    peaks = measured.get("peaks_mib")
    spread = f" ({min(peaks):.0f}-{max(peaks):.0f})" if peaks else ""
    return f"{measured['peak_above_mib']:.0f}{spread}"


def _stopped(measured: dict[str, Any]) -> bool:
    """An over-budget grid point whose probes were stopped at the budget (their peaks are lower bounds)."""
    runs = measured.get("probes", [measured])
    return not measured["fits"] and any(r.get("stopped_over_budget") for r in runs)


def plot_capacity(result: dict[str, Any], path: Path) -> Path:
    """Every probe's peak above the model against the prefix length, per engine, with the budget line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for engine, r in result["engines"].items():
        points = sorted((int(p), m["peak_above_mib"]) for p, m in r["measured"].items() if "peak_above_mib" in m)
        if points:
            (line,) = ax.plot(*zip(*points), marker="o", label=f"{engine} (longest {r['longest'] or 'none'})")
            stopped = [(int(p), m["peak_above_mib"]) for p, m in r["measured"].items() if _stopped(m)]
            if stopped:  # stopped at the budget: the true peak is higher
                ax.plot(*zip(*stopped), linestyle="", marker="^", markersize=10, color=line.get_color())
    ax.axhline(result["budget_mib"], color="k", linestyle="--", label=f"budget {result['budget_mib']:.0f} MiB")
    if any(_stopped(m) for r in result["engines"].values() for m in r["measured"].values()):
        ax.plot([], [], linestyle="", marker="^", color="gray", label="over: stopped at the budget")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("peak above loaded model (MiB)")
    model = result["model"]
    ax.set_title(
        f"capacity: G={result['group_size']}, suffix {result['suffix_len']}, "
        f"model h{model['hidden_size']}xL{model['num_layers']}, {result['dtype']}"
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    """``python -m verl_prefix.tools.bench.capacity RESULT.json PLOT.png``: the table and the plot of a
    ``verl-prefix bench --preset capacity`` result."""
    import argparse

    parser = argparse.ArgumentParser(description="table and plot of a capacity result")
    parser.add_argument("result", type=Path)
    parser.add_argument("plot", type=Path)
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())["capacity"]
    print(capacity_table(result))
    print(f"plot: {plot_capacity(result, args.plot)}")


if __name__ == "__main__":
    main()
