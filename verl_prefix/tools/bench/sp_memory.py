"""Per-rank memory of one GRPO group under Ulysses sequence parallelism, against one rank without it.

``python -m verl_prefix.tools.bench.sp_memory`` trains one group of the 29M-parameter bench model (fp32, CPU,
no checkpointing, ``keep`` policy; prefix 4096, G=8 suffixes of 128, micro-batches of 4 by default)
through the schedule once on a single process and once on ``--sp`` gloo ranks (fresh processes each,
forked from ``measure.fresh_process_context``'s server),
and reports per rank the bytes held for backward during phase B (phase A's graph plus the micro-batch's
own) and the peak RSS above the loaded model (``verl_prefix.tools.bench.dormant_memory.measure``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from verl_prefix.tools.bench.dormant_memory import measure
from verl_prefix.tools.measure import fresh_process_context


def _rank(rank: int, world: int, port: int, cell: tuple[int, int, int, int], results: Any) -> None:
    from verl_prefix.schedule.ulysses import Ulysses

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = measure("keep", *cell, ulysses=Ulysses(dist.group.WORLD) if world > 1 else None)
    finally:
        dist.destroy_process_group()


def run(world: int, cell: tuple[int, int, int, int]) -> list[dict[str, float]]:
    """The figures of every rank of a ``world``-rank sequence-parallel group (1: no sequence parallelism)."""
    from verl_prefix.harness.verl_engine import free_port

    ctx = fresh_process_context()
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, cell, results)) for r in range(world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        failed = [r for r, proc in enumerate(procs) if proc.exitcode != 0 or r not in results]
        if failed:
            raise RuntimeError(f"sequence-parallel memory run failed on ranks {failed}")
        return [dict(results[r]) for r in range(world)]


def compare(sp: int, cell: tuple[int, int, int, int]) -> dict[str, Any]:
    """SP=1 and SP=``sp`` on the same cell; ``ratio`` is the largest rank's phase-B held bytes over SP=1's."""
    single = run(1, cell)[0]
    ranks = run(sp, cell)
    worst = max(r["held_in_B_mib"] for r in ranks)
    return {"cell": cell, "sp1": single, f"sp{sp}": ranks, "ratio_held_in_B": worst / single["held_in_B_mib"]}


def main(argv: list[str] | None = None) -> None:
    """Prints a Markdown table and the JSON behind it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--suffix", type=int, default=128)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = compare(args.sp, (args.prefix, args.suffix, args.group, args.rows))
    header = ("run", "rank", "held for backward in B (MiB)", "peak held A/B/C (MiB)", "peak RSS above model (MiB)")
    print("| " + " | ".join((*header, "time (s)")) + " |")
    print("|---|---|---|---|---|---|")
    rows = [("SP=1", 0, result["sp1"])] + [(f"SP={args.sp}", r, x) for r, x in enumerate(result[f"sp{args.sp}"])]
    for name, rank, r in rows:
        print(
            f"| {name} | {rank} | {r['held_in_B_mib']:.1f} | {r['peak_held_mib']:.1f} | "
            f"{r['peak_rss_above_model_mib']:.1f} | {r['time_s']:.1f} |"
        )
    print(f"\nper-rank phase-B held bytes, SP={args.sp} / SP=1: {result['ratio_held_in_B']:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
