"""The merged attention's prefix part backward, split into batch entries (``prefix_backward_splits``) or not: the
median time of phase B's merged attention backward for a Qwen3-8B-shaped group (32 query heads, 8 KV heads, head
size 128, G = 8 rows of 512 suffix tokens, bf16) at several prefix lengths, and the ratio. ``bench/gpu_check.sh``
runs it on the GPU; ``--tiny`` runs the same code on small CPU shapes (``tests/tools/test_merged_backward_bench.py``).

    python bench/merged_backward.py --out merged_backward.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager

import torch

from verl_prefix.schedule.attention import merged as MA


@contextmanager
def splits_fixed(splits: int | None):
    """``splits`` batch entries for every prefix backward (None: the module's own choice)."""
    chosen = MA.prefix_backward_splits
    if splits is not None:
        MA.prefix_backward_splits = lambda *args: splits
    try:
        yield
    finally:
        MA.prefix_backward_splits = chosen


def backward_seconds(shape: dict, device: torch.device, dtype: torch.dtype, splits: int | None, reps: int) -> float:
    rows, heads, kv_heads, dim, prefix, suffix = (shape[k] for k in ("rows", "heads", "kv_heads", "dim", "P", "S"))
    gen = torch.Generator(device=device).manual_seed(0)

    def t(*size, grad=True):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype).requires_grad_(grad)

    q, sk, sv = t(rows, heads, suffix, dim), t(rows, kv_heads, suffix, dim), t(rows, kv_heads, suffix, dim)
    pk, pv = t(1, kv_heads, prefix, dim).float(), t(1, kv_heads, prefix, dim).float()
    grad = t(rows, suffix, heads, dim, grad=False)
    times = []
    with splits_fixed(splits):
        for rep in range(reps + 2):  # two warm-up runs
            out = MA.merged_attention(q, pk, pv, sk, sv, scaling=dim**-0.5)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch.autograd.grad(out, (q, pk, pv, sk, sv), grad)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep >= 2:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="merged_backward.json")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="small shapes on CPU (checks the script runs)")
    args = parser.parse_args()
    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
        shapes = [dict(rows=2, heads=4, kv_heads=2, dim=8, P=p, S=16) for p in (16, 64)]
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        shapes = [dict(rows=8, heads=32, kv_heads=8, dim=128, P=p, S=512) for p in (512, 2048, 8192)]
    rows = []
    for shape in shapes:
        queries = shape["rows"] * shape["heads"] // shape["kv_heads"] * shape["S"]
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
        auto = MA.prefix_backward_splits(shape["kv_heads"], shape["P"], queries, sms)
        one = backward_seconds(shape, device, dtype, 1, args.reps)
        split = backward_seconds(shape, device, dtype, None if device.type == "cuda" else 2, args.reps)
        rows.append({**shape, "splits": auto, "unsplit_ms": one * 1e3, "split_ms": split * 1e3, "speedup": one / split})
        print(f"P={shape['P']:>5}  splits={auto:>2}  unsplit {one * 1e3:8.3f} ms  split {split * 1e3:8.3f} ms  "
              f"x{one / split:.2f}")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"device": str(device), "dtype": str(dtype), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
