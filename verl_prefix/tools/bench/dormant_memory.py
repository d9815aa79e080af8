"""Memory of the dormant-prefix policies on one bench cell, one fresh process per policy.

``python -m verl_prefix.tools.bench.dormant_memory`` runs, for each policy, a child process that builds the
29M-parameter bench model (``bench_presets.MODEL_29M``, fp32, random init, no checkpointing), trains one GRPO
group (prefix 2048, G=8 suffixes of 128, micro-batches of 4) through the schedule on CPU, and reports
the bytes held for backward during phase B (``prefix/max_saved_for_backward_held_in_B_mib/<policy>``),
the dormant graph's bytes resident on the device per phase (``resident_{A,B,C}_mib``: keep holds phase A's
saved bytes through A, B and C; recompute none in A and B and its rebuilt graph, one chunk's with chunks, in
C; offload what its store holds, from the store's own bookkeeping) and the process's peak RSS above its RSS
once the model is loaded. Byte counts are deterministic; RSS depends on the allocator.

``offload`` runs with the CPU stand-in store (``HostOffload`` on the CPU: the same scheduling, synchronous
copies within the CPU), so its residency figures are the policy's own while its RSS holds the "host" copies
too. A policy written ``recompute:512`` (or ``keep:512``, ``offload:512``) also runs the prefix in chunks of
512 tokens (``prefix_reuse.prefix_chunk_tokens``); ``--model smoke`` uses the 1M-parameter bench model instead.
"""

from __future__ import annotations

import argparse
import json
import resource
from typing import Any

import psutil
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from verl_prefix.schedule import dormant as D
from verl_prefix.schedule.executor import train_group
from verl_prefix.schedule.grouping import RowLayout, plan_batch
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.telemetry import PhaseMeter
from verl_prefix.schedule.ulysses import Ulysses
from verl_prefix.tools.bench.presets import MODEL_29M, SMOKE_MODEL, ModelSpec
from verl_prefix.tools.measure import fresh_process_context

_MIB = 1024.0**2
MODELS = {"29m": MODEL_29M, "smoke": SMOKE_MODEL}


class LiveSaved:
    """The most bytes autograd holds saved for backward at once (storages still alive; parameters
    excluded): a true high-water mark, unlike the per-phase sums of ``PhaseMeter`` (which add up every
    chunk rebuilt in phase C). Runs as the only saved-tensor hook, i.e. without a meter and without
    checkpointing (an inner hook would hide the saves from it, DESIGN.md trap 17)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._params:
            self._live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
            for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
                del self._live[key]
            self.peak = max(self.peak, sum(n for _, n in self._live.values()))
        return tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


def parse_policy(spec: str) -> tuple[str, int | None]:
    """``"recompute:512"`` -> ``("recompute", 512)``; ``"keep"`` -> ``("keep", None)``."""
    policy, _, chunk = spec.partition(":")
    if policy not in D.POLICIES:
        raise ValueError(f"policy {policy!r}: choose one of {D.POLICIES} (offload runs the CPU stand-in store)")
    return policy, (int(chunk) if chunk else None)


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
    policy: str,
    prefix_len: int,
    suffix_len: int,
    group_size: int,
    rows: int,
    chunk_tokens: int | None = None,
    spec: ModelSpec = MODEL_29M,
    ulysses: Ulysses | None = None,
) -> dict[str, float]:
    """One group through A/B/C under ``policy`` (prefix in chunks of ``chunk_tokens`` if set) in this
    process; the figures of ``main``. With ``ulysses`` this rank runs its sequence-parallel share
    (``verl_prefix.tools.bench.sp_memory``)."""
    torch.set_num_threads(1)
    model = _model(spec)
    loaded_rss = psutil.Process().memory_info().rss
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, spec.vocab_size, (prefix_len + 1,), generator=gen)
    ids = [
        torch.cat([prompt, torch.randint(0, spec.vocab_size, (suffix_len,), generator=gen)]) for _ in range(group_size)
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
    stores: list[D.HostOffload] = []

    def stand_in(device: torch.device) -> D.HostOffload:
        stores.append(D.HostOffload(device))  # on the CPU: the stand-in (synchronous copies, same scheduling)
        return stores[-1]

    def run(meter: PhaseMeter | None, stats: D.DormantStats | None) -> None:
        options = ScheduleOptions(
            device=torch.device("cpu"), meter=meter, prefix_chunk_tokens=chunk_tokens, ulysses=ulysses
        )
        train_group(
            model,
            layout,
            plan.groups[0],
            lambda rows, log_probs, entropy: sum(lp.sum() for lp in log_probs),
            options,
            D.Dormant(policy, stats=stats, store_factory=stand_in),
        )

    run(meter, stats)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux; this run only
    if policy == "keep":
        resident = (meter.saved_mib["A"],) * 3
    elif policy == "recompute":
        resident = (0.0, 0.0, meter.saved_mib["C"])
    else:
        store = stores[0]
        peaks = store.peak_resident
        resident = (peaks["A"] / _MIB, (peaks["B"] + store.unfreed_in_b) / _MIB, peaks["C"] / _MIB)
    live = LiveSaved(model)
    with live.hooks():  # a second, unmetered run: the live high-water mark of saved tensors
        run(None, None)
    return {
        "held_in_B_mib": stats.held_in_b[policy] / _MIB,
        "phase_A_saved_mib": meter.saved_mib["A"],
        "peak_held_mib": meter.peak_held_saved_mib,  # per-phase sums: phase C adds up every rebuilt chunk
        "peak_live_saved_mib": live.peak / _MIB,  # the true high-water mark of saved tensors over A/B/C
        # the dormant graph on the device per phase (offload: not seen by the live count, its store's hooks
        # are innermost)
        "resident_A_mib": resident[0],
        "resident_B_mib": resident[1],
        "resident_C_mib": resident[2],
        "offloaded_mib": stats.offloaded_bytes / _MIB,
        "restored_mib": stats.restored_bytes / _MIB,
        "params_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / _MIB,
        "peak_rss_above_model_mib": (peak_rss - loaded_rss) / _MIB,
        "time_s": sum(meter.seconds.values()),
    }


def _child(spec: str, cell: tuple[int, int, int, int], model: str, results: Any) -> None:
    policy, chunk = parse_policy(spec)
    results[spec] = measure(policy, *cell, chunk_tokens=chunk, spec=MODELS[model])


def main(argv: list[str] | None = None) -> None:
    """Each policy in a fresh process (peak RSS is per process); prints a Markdown table and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="keep,recompute")
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--suffix", type=int, default=128)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--model", choices=sorted(MODELS), default="29m")
    args = parser.parse_args(argv)
    cell = (args.prefix, args.suffix, args.group, args.rows)
    specs = args.policies.split(",")
    for spec in specs:
        parse_policy(spec)  # a typo fails before any child runs
    results = {}
    ctx = fresh_process_context()
    with ctx.Manager() as manager:
        shared = manager.dict()
        for policy in specs:
            child = ctx.Process(target=_child, args=(policy, cell, args.model, shared))
            child.start()
            child.join()
            if child.exitcode != 0 or policy not in shared:
                raise RuntimeError(f"the {policy} child failed (exit code {child.exitcode})")
            results[policy] = dict(shared[policy])
    header = (
        "policy",
        "held for backward in B",
        "phase A saved",
        "peak held (A/B/C)",
        "peak live saved",
        "resident in A",
        "resident in B",
        "resident in C",
        "parameters",
        "peak RSS above model",
        "time (s)",
    )
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for policy, r in results.items():
        keys = (
            "held_in_B_mib",
            "phase_A_saved_mib",
            "peak_held_mib",
            "peak_live_saved_mib",
            "resident_A_mib",
            "resident_B_mib",
            "resident_C_mib",
            "params_mib",
            "peak_rss_above_model_mib",
            "time_s",
        )
        print(f"| {policy} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
