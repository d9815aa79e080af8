"""One bench variant's first update in a fresh process, for its peak RSS (``--preset phase_b``'s
``fresh_process`` figures).

A peak read in the bench's own process would carry the other variants' earlier peaks, so each variant
gets its own: ``probe`` runs ``main`` in a fresh process (``measure.run_fresh``, as
``python -m verl_prefix.tools.bench.rss_probe REQUEST`` would) and reads back the JSON line it prints there.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path

import torch

from verl_prefix.tools.bench.presets import Cell, build_variant, cell_batch, cell_from_dict
from verl_prefix.tools.measure import peak_rss_mib, reset_peak_rss, rss_mib, run_fresh, select_platform, time_update


def probe(cell: Cell, variant: str, model_dir: Path, *, timeout_s: float = 3600.0) -> dict[str, float]:
    """One variant's first update in a fresh process: its RSS after building the engine and its peak RSS
    during that update (``VmHWM``, reset just before the update where Linux allows; otherwise the peak
    since the process started, build included)."""
    request = json.dumps(
        {
            "cell": dataclasses.asdict(cell),
            "variant": variant,
            "model_dir": str(model_dir),
            "threads": torch.get_num_threads(),
        }
    )
    code, stdout, stderr = run_fresh("verl_prefix.tools.bench.rss_probe", request, timeout_s=timeout_s)
    lines = stdout.strip().splitlines()
    if code != 0 or not lines:
        raise RuntimeError(f"rss probe for {cell.name} {variant} failed (exit {code}): {stderr[-2000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> None:
    """Child side of ``probe``: build one variant, run one update, print the RSS figures as JSON."""
    (request,) = sys.argv[1:] if argv is None else argv
    select_platform()
    spec = json.loads(request)
    cell = cell_from_dict(spec["cell"])
    torch.set_num_threads(spec["threads"])
    engine, loss_fn = build_variant(cell, spec["variant"], Path(spec["model_dir"]))
    batch = cell_batch(cell)
    gc.collect()
    before = rss_mib()
    reset = reset_peak_rss()
    seconds, _ = time_update(engine, loss_fn, batch)
    peak = peak_rss_mib()
    result = {"rss_before_update_mib": before, "peak_rss_mib": peak, "peak_reset_before_update": reset}
    print(json.dumps({**result, "update_s": seconds}), flush=True)


if __name__ == "__main__":
    main()
