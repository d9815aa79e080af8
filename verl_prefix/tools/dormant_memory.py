"""Memory of the dormant-prefix policies on one bench cell, one fresh process per policy.

``python -m verl_prefix.tools.dormant_memory`` runs, for each policy, a child process that builds the
29M-parameter bench model (``bench.MODEL_29M``, fp32, random init, no checkpointing), trains one GRPO
group (prefix 2048, G=8 suffixes of 128, micro-batches of 4) through the schedule on CPU, and reports
the bytes held for backward during phase B (``prefix/max_saved_for_backward_held_in_B_mib/<policy>``)
and the process's peak RSS above its RSS once the model is loaded. Byte counts are deterministic;
RSS depends on the allocator.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from typing import Any

import psutil
import torch

from verl_prefix.schedule import dormant as D
from verl_prefix.schedule.executor import train_group
from verl_prefix.schedule.grouping import RowLayout, plan_batch
from verl_prefix.schedule.telemetry import PhaseMeter
from verl_prefix.schedule.ulysses import Ulysses
from verl_prefix.tools.bench import MODEL_29M

_MIB = 1024.0**2


def _model(spec: Any = MODEL_29M) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        spec.family,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().train()


def measure(
    policy: str, prefix_len: int, suffix_len: int, group_size: int, rows: int, ulysses: Ulysses | None = None
) -> dict[str, float]:
    """One group through A/B/C under ``policy`` in this process; the figures of ``main``. With ``ulysses``
    this rank runs its sequence-parallel share (``verl_prefix.tools.sp_memory``)."""
    torch.set_num_threads(1)
    model = _model()
    loaded_rss = psutil.Process().memory_info().rss
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, MODEL_29M.vocab_size, (prefix_len + 1,), generator=gen)
    ids = [
        torch.cat([prompt, torch.randint(0, MODEL_29M.vocab_size, (suffix_len,), generator=gen)])
        for _ in range(group_size)
    ]
    layout = RowLayout(
        ids,
        [torch.arange(len(r)) for r in ids],
        [prefix_len + 1] * group_size,
        [suffix_len] * group_size,
        ["g"] * group_size,
    )
    plan = plan_batch(layout, max_rows=rows, max_tokens=None, min_prefix_len=1, min_group_size=1)
    stats, meter = D.DormantStats(), PhaseMeter(torch.device("cpu"))
    train_group(
        model,
        layout,
        plan.groups[0],
        torch.ones(group_size),
        lambda rows, log_probs, entropy: sum(lp.sum() for lp in log_probs),
        calculate_entropy=False,
        device=torch.device("cpu"),
        meter=meter,
        dormant=D.Dormant(policy, stats=stats),
        ulysses=ulysses,
    )
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "held_in_B_mib": stats.held_in_b[policy] / _MIB,
        "phase_A_saved_mib": meter.saved_mib["A"],
        "peak_held_mib": meter.peak_held_saved_mib,  # over A, B and C (recompute's phase-C graph too)
        "params_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / _MIB,
        "peak_rss_above_model_mib": (peak_rss - loaded_rss) / _MIB,
        "time_s": sum(meter.seconds.values()),
    }


def main(argv: list[str] | None = None) -> None:
    """Each policy in a fresh process (peak RSS is per process); prints a Markdown table and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="keep,recompute")
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--suffix", type=int, default=128)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cell = (args.prefix, args.suffix, args.group, args.rows)
    if args.child:
        print(json.dumps(measure(args.child, *cell)))
        return
    results = {}
    for policy in args.policies.split(","):
        command = [sys.executable, "-m", "verl_prefix.tools.dormant_memory", "--child", policy]
        command += ["--prefix", str(args.prefix), "--suffix", str(args.suffix)]
        command += ["--group", str(args.group), "--rows", str(args.rows)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[policy] = json.loads(out.strip().splitlines()[-1])
    header = (
        "policy",
        "held for backward in B",
        "phase A saved",
        "peak held (A/B/C)",
        "parameters",
        "peak RSS above model",
        "time (s)",
    )
    print("| " + " | ".join(header) + " |")
    print("|---|---|---|---|---|---|---|")
    for policy, r in results.items():
        keys = (
            "held_in_B_mib",
            "phase_A_saved_mib",
            "peak_held_mib",
            "params_mib",
            "peak_rss_above_model_mib",
            "time_s",
        )
        print(f"| {policy} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
