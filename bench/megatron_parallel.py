"""prefix_megatron against verl's Megatron engine at TP=2 and PP=2, two CPU ranks over gloo, fp32: one interleaved
run per layout (both engines built in the same ranks from the same checkpoint, their update and forward-only passes
alternating rep by rep), medians and ratios, beside the FLOP model's prediction.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python bench/megatron_parallel.py --reps 3 \\
        --out bench/results/megatron_parallel.json --table docs/benchmarks.md

A rep's time is the slower rank's (the step ends when both have). The gradients of the first rep are compared per
rank (the worst parameter's relative difference) so a row is never a speed-up of a wrong update. The same cell as the
one-rank Megatron preset's, at a prefix of 1024 so that a layout fits a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"TP=2": dict(tensor_parallel_size=2), "PP=2": dict(pipeline_model_parallel_size=2)}
BEGIN, END = "<!-- bench:megatron-parallel:start -->", "<!-- bench:megatron-parallel:end -->"


def _cell():
    from verl_prefix.tools.bench.presets import SMOKE_MODEL, Cell

    return Cell("P1024/S128/G8/megatron", SMOKE_MODEL, 1, 8, 1024, (128, 128), micro_batch_size=1, engine="megatron")


def _rank(rank: int, port: int, model_dir: str, layout: str, reps: int, results: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
        VERL_PLATFORM="cpu", VERL_ENGINE_DEVICE="cpu",
    )  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss
    from verl_prefix.tools.bench.presets import cell_batch
    from verl_prefix.tools.bench.runner import max_rel_grad_diff
    from verl_prefix.tools.measure import time_infer, time_update

    cell = _cell()
    loss_fn, _ = ppo_loss([f"ppo_micro_batch_size_per_gpu={cell.micro_batch_size}"])
    reuse = PrefixReuseConfig(min_prefix_len=cell.min_prefix_len, suffix_micro_batch_size=cell.micro_batch_size)
    settings = dict(lr=0.0, micro_batch_size_per_gpu=cell.micro_batch_size, **LAYOUTS[layout])
    engines = {
        "dense": build_megatron_engine(model_dir, **settings),
        "prefix": build_megatron_engine(model_dir, backend="prefix_megatron", prefix_reuse=reuse, **settings),
    }
    batch = cell_batch(cell)
    times: dict[str, list[float]] = {k: [] for k in ("dense", "prefix", "infer_dense", "infer_prefix")}
    grad_diff = None

    def slowest(seconds: float) -> float:
        value = torch.tensor([seconds])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    for rep in range(1 + reps):
        outputs = {}
        for key, engine in engines.items():
            seconds, outputs[key] = time_update(engine, loss_fn, batch, capture_grads=rep == 0)
            if rep:
                times[key].append(slowest(seconds))
            else:
                slowest(seconds)
        if rep == 0:
            grad_diff = max_rel_grad_diff(outputs["dense"]["grads"], outputs["prefix"]["grads"])[0]
        for key, engine in engines.items():
            seconds = slowest(time_infer(engine, batch))
            if rep:
                times[f"infer_{key}"].append(seconds)
    results[rank] = {"times": times, "max_rel_grad_diff": grad_diff}
    dist.destroy_process_group()


def measure(layout: str, model_dir: str, reps: int) -> dict:
    from verl_prefix.harness.verl_engine import free_port

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, model_dir, layout, reps, results)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        results = dict(results)
    if len(results) != 2:
        raise SystemExit(f"{layout}: a rank died")
    times = results[0]["times"]
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "layout": layout,
        "reps": reps,
        "median_s": median,
        "update_speedup": statistics.median(d / p for d, p in zip(times["dense"], times["prefix"])),
        "infer_speedup": statistics.median(d / p for d, p in zip(times["infer_dense"], times["infer_prefix"])),
        "max_rel_grad_diff": max(results[r]["max_rel_grad_diff"] for r in (0, 1)),
    }


def predicted(model_dir: str) -> float:
    from transformers import AutoConfig

    from verl_prefix.schedule.flop_model import ModelShape
    from verl_prefix.tools.bench.presets import cell_batch
    from verl_prefix.tools.flops import predicted_speedup

    batch = cell_batch(_cell())
    shape = ModelShape.from_config(AutoConfig.from_pretrained(model_dir))
    prompts = [int(p.numel()) for p in batch["prompts"].unbind()]
    responses = [int(r.numel()) for r in batch["responses"].unbind()]
    return predicted_speedup(shape, [(prompts[0], responses)])


def table(result: dict) -> str:
    lines = [
        "| layout | update dense s | update prefix s | update speedup | FLOP model | update / model | "
        "forward-only speedup | max rel grad diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    model = result["predicted_speedup"]
    for row in result["rows"]:
        m = row["median_s"]
        lines.append(
            f"| {row['layout']} | {m['dense']:.3f} | {m['prefix']:.3f} | {row['update_speedup']:.2f}x | {model:.2f}x | "
            f"{row['update_speedup'] / model:.2f} | {row['infer_speedup']:.2f}x | {row['max_rel_grad_diff']:.1e} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None, help="rewrite this page's block between the markers")
    args = parser.parse_args()
    from verl_prefix.backend.recipe_keys import between_markers

    with tempfile.TemporaryDirectory(prefix="verl_prefix_bench_") as tmp:
        model_dir = str(_cell().model.write(Path(tmp) / "model"))
        rows = [measure(layout, model_dir, args.reps) for layout in LAYOUTS]
        model = predicted(model_dir)
    result = {"cell": _cell().name, "rows": rows, "predicted_speedup": model, "command": " ".join(sys.argv)}
    print(table(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.table is not None:
        args.table.write_text(between_markers(args.table.read_text(), BEGIN, END, table(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
