"""The child side of a capacity probe: ``python -m verl_prefix.tools.bench.capacity_probe REQUEST`` builds one
engine, runs one update on one GRPO group and prints whether it fit the budget, as one JSON line.

``capacity.probe`` starts it, one fresh process per probe (see ``capacity`` for what the figures mean):
a peak read in a long-lived process would carry every earlier probe's peak.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from verl_prefix.harness import grpo_batches, verl_engine
from verl_prefix.tools.bench.capacity import parse_engine
from verl_prefix.tools.measure import peak_rss_mib, reset_peak_rss, rss_mib, select_platform, time_update

_MIB = 1024.0**2
WATCH_INTERVAL_S = 0.02


def main(argv: list[str] | None = None) -> None:
    """Build, measure one update, print JSON."""
    import verl_prefix
    from verl_prefix.schedule.dormant import HostOffload

    (request,) = sys.argv[1:] if argv is None else argv
    select_platform()
    req = json.loads(request)
    spec = req["spec"]
    torch.set_num_threads(req["threads"])
    what = parse_engine(req["engine"])
    rows = what["rows"] if what["stock"] else spec["micro_batch_size"]
    engine, loss_fn, _ = verl_engine.build_verl_engine(
        Path(req["model_dir"]),
        backend="fsdp2" if what["stock"] else "prefix_fsdp2",
        dtype=spec["dtype"],
        micro_batch_size_per_gpu=rows,
        overrides=tuple(spec["overrides"]),
    )
    if not what["stock"]:
        engine.reuse_config = verl_prefix.PrefixReuseConfig(
            min_prefix_len=1, suffix_micro_batch_size=rows, prefix_chunk_tokens=what["chunk"]
        )
        engine.dormant_prefix = what["policy"]
        if what["policy"] == "offload" and not torch.cuda.is_available():
            engine.offload_store_factory = HostOffload  # CPU stand-in: the host copies stay in RSS

    def group(prefix_len: int) -> Any:
        return grpo_batches.make_grpo_batch(
            num_groups=1,
            group_size=spec["group_size"],
            prompt_lens=prefix_len + 1,
            response_len_range=(spec["suffix_len"], spec["suffix_len"]),
            vocab_size=req["vocab"],
            seed=0,
        )

    # a warm-up update on a 64-token prefix first: one-time costs (kernel code pages, thread pools, lazy
    # initialisation) would otherwise count as the probe's memory
    time_update(engine, loss_fn, group(64))
    batch = group(req["prefix_len"])
    gc.collect()
    budget = spec["budget_mib"] * _MIB
    result: dict[str, Any] = {"device": "cuda" if torch.cuda.is_available() else "cpu"}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        built = torch.cuda.memory_allocated()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (built + budget) / total))
        torch.cuda.reset_peak_memory_stats()
        try:
            seconds, _ = time_update(engine, loss_fn, batch)
            result.update(fits=True, update_s=seconds)
        except torch.OutOfMemoryError:
            result.update(fits=False, oom=True)
        result["peak_above_mib"] = (torch.cuda.max_memory_allocated() - built) / _MIB
    else:
        before_mib = rss_mib()
        result["peak_reset_before_update"] = reset_peak_rss()
        stop_when_over_budget(before_mib, spec["budget_mib"], result)
        seconds, _ = time_update(engine, loss_fn, batch)
        result["peak_above_mib"] = peak_rss_mib() - before_mib
        result.update(fits=result["peak_above_mib"] <= spec["budget_mib"], update_s=seconds)
    print(json.dumps(result), flush=True)


def stop_when_over_budget(before_mib: float, budget_mib: float, result: dict[str, Any]) -> None:
    """CPU's stand-in for the GPU's OOM: a daemon thread watches the high-water mark and, once it passes the
    budget, reports the probe as over and ends the process. An over-budget probe then costs seconds instead
    of a whole long update, and never holds more than the budget plus one poll's growth (so a long search
    cannot run the machine out of memory)."""

    def watch() -> None:
        while True:
            above = peak_rss_mib() - before_mib
            if above > budget_mib:
                report = {**result, "peak_above_mib": above, "fits": False, "stopped_over_budget": True}
                print(json.dumps(report), flush=True)
                os._exit(0)
            time.sleep(WATCH_INTERVAL_S)

    threading.Thread(target=watch, name="capacity-budget-watch", daemon=True).start()


if __name__ == "__main__":
    main()
