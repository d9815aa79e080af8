"""Replay a trace through verl's stock ``fsdp2`` engine and ``prefix_fsdp2``: per step the speed ratio,
per-phase memory and the parameter drift between the runs, against a noise floor from a second dense run
with a different micro-batch partition. The trace format lives in ``verl_prefix.backend.trace``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from verl_prefix.backend.trace import (
    ENGINE_KWARGS,
    Trace,
    TraceError,
    batch_groups,
    load_trace,
    max_token_id_of,
    sequence_lengths,
)
from verl_prefix.harness import verl_engine
from verl_prefix.tools.flops import ModelShape, predicted_speedup
from verl_prefix.tools.measure import (
    machine_info,
    measure_update_memory,
    prefix_memory_by_phase,
    time_update,
    timestamp,
)
from verl_prefix.tools.tree_flops import tree_model


def _check_model_dir(model_dir: Path, trace: Trace, count: int) -> Any:
    """The model's HF config, after checking it can embed every token id the replayed batches hold."""
    from transformers import AutoConfig

    if not model_dir.exists():
        raise TraceError(f"model directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise TraceError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a broken config
        raise TraceError(f"cannot load the model config in {model_dir}: {str(exc).splitlines()[0]}") from None
    vocab = hf_config.get_text_config().vocab_size
    for i in range(count):
        top = trace.steps[i].max_token_id
        if top is None:
            top = max_token_id_of(trace.batch(i))
        if top is not None and top >= vocab:
            raise TraceError(
                f"model {model_dir} has vocab_size {vocab} but trace batch {i} holds token id {top}: wrong model?"
            )
    return hf_config


def _resolve_model(trace: Trace, model_dir: str | os.PathLike | None) -> Path:
    if model_dir is not None:
        return Path(model_dir)
    ref = trace.model_ref
    if ref:
        for candidate in (trace.dir / ref, Path(ref)):  # relative to the trace first (synthetic traces)
            if candidate.is_dir():
                return candidate
    raise TraceError(f"trace {trace.dir} names no model directory that exists here (model_ref={ref!r}); pass one")


def _noise_batch(batch: TensorDict) -> tuple[TensorDict | None, str | None]:
    """The same batch with a different dense micro-batch partition: its drift from dense is rounding only."""
    from verl.utils import tensordict_utils as tu

    data = batch.copy()
    rows = len(batch)
    if tu.get(data, key="use_dynamic_bsz", default=False):
        budget = int(tu.get(data, key="max_token_len_per_gpu", default=0))
        longest = max(sequence_lengths(batch["input_ids"]))
        new = max(longest, budget // 2)
        if new == budget:
            new = 2 * budget
        tu.assign_non_tensor(data, max_token_len_per_gpu=new)
        return data, f"max_token_len_per_gpu {budget} -> {new}"
    mbs = int(tu.get(data, key="micro_batch_size_per_gpu", default=1))
    if rows < 2:
        return None, None
    new = mbs // 2 if mbs > 1 else 2
    if min(new, rows) == min(mbs, rows):  # both cover the whole batch in one micro-batch
        new = max(1, rows // 2)
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=new)
    return data, f"micro_batch_size_per_gpu {mbs} -> {new}"


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Global L2 distance between two parameter sets (float64 accumulation)."""
    total = 0.0
    for name, x in a.items():
        total += float(torch.linalg.vector_norm(x.double() - b[name].double())) ** 2
    return math.sqrt(total)


def replay(
    trace_dir: str | os.PathLike,
    model_dir: str | os.PathLike | None = None,
    *,
    steps: int | None = None,
    reps: int = 2,
    warmup: int = 1,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    threads: int | None = None,
    noise: bool = True,
    out_json: str | os.PathLike | None = None,
    command: str | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Replay a trace through verl's ``fsdp2`` and ``prefix_fsdp2`` (plus a second dense engine for noise).

    Per step: ``reps`` interleaved forward-backward passes of each engine on the step's batch *without* an
    optimizer step (so every rep does the same work; ``warmup`` more on the first step are discarded), timed;
    then one real update per engine (zero_grad, forward-backward, optimizer step, LR scheduler, as
    ``TrainingWorker.train_batch`` runs it), after which the parameters are compared:
    ``drift = ||p_prefix - p_dense|| / ||p_dense - p_initial||`` against
    ``noise_floor = ||p_dense2 - p_dense|| / ||p_dense - p_initial||``, where dense2 runs the same batch with
    another micro-batch partition. Both are cumulative over steps. A trace recorded with ``prefix_reuse.tree``
    replays the tree; its ``predicted_speedup`` is then the FLOP model of that trie (``tree_flops``; ``tree``
    holds the trie's size and the one-level model beside it). ``model_dir`` defaults to the trace's
    ``model_ref`` when that is a directory here. Returns (and optionally writes) the JSON result.
    """
    from tqdm.auto import tqdm

    import verl_prefix

    if reps < 1:
        raise TraceError(f"reps must be >= 1, got {reps}")
    if warmup < 0:
        raise TraceError(f"warmup must be >= 0, got {warmup}")
    if dtype not in ("float32", "float64"):
        raise TraceError(f"dtype must be float32 or float64, got {dtype!r}")
    if steps is not None and steps < 1:
        raise TraceError(f"steps must be >= 1, got {steps}")
    if threads is not None and threads < 1:
        raise TraceError(f"threads must be >= 1, got {threads}")
    trace = load_trace(trace_dir)
    count = len(trace) if steps is None else min(steps, len(trace))
    model_path = _resolve_model(trace, model_dir)
    hf_config = _check_model_dir(model_path, trace, count)
    shape = ModelShape.from_config(hf_config.get_text_config())
    emit = log or (lambda _msg: None)

    previous_threads = torch.get_num_threads()
    if threads is None and not torch.cuda.is_available():
        threads = 1  # see docs/benchmarks.md: more threads on a shared VM make times swing 100x
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    try:
        config = trace.steps[0].config or trace.config
        kwargs = {k: config[k] for k in ENGINE_KWARGS if k in config}
        overrides = tuple(config.get("overrides", ()))
        build = functools.partial(
            verl_engine.build_verl_engine,
            model_path,
            dtype=dtype,
            attn_implementation=attn_implementation,
            overrides=overrides,
            **kwargs,
        )
        dense, dense_loss, _ = build(backend="fsdp2")
        prefix, prefix_loss, _ = build(backend="prefix_fsdp2")
        prefix.reuse_config = verl_prefix.PrefixReuseConfig(**config.get("prefix_reuse", {}))
        noisy = build(backend="fsdp2")[:2] if noise else None
        p_initial = verl_engine.params_of(dense)
        identical = _distance(p_initial, verl_engine.params_of(prefix)) == 0.0
        params = sum(p.numel() for p in p_initial.values())

        rows_out: list[dict[str, Any]] = []
        bar = tqdm(range(count), desc="replay", unit="step", disable=not progress)
        if progress and log is not None:
            emit = functools.partial(tqdm.write, file=sys.stdout)
        for i in bar:
            entry, batch = trace.steps[i], trace.batch(i)
            dense_s, prefix_s = [], []
            for rep in range((warmup if i == 0 else 0) + reps):
                gc.collect()  # outside the timed regions
                t_dense, _ = time_update(dense, dense_loss, batch)
                t_prefix, _ = time_update(prefix, prefix_loss, batch)
                if rep >= (warmup if i == 0 else 0):
                    dense_s.append(t_dense)
                    prefix_s.append(t_prefix)
            gc.collect()
            with measure_update_memory(dense) as dense_mem:
                out_dense = verl_engine.run_train_step(dense, dense_loss, batch)
            with measure_update_memory(prefix, count_saved=False) as prefix_mem:
                out_prefix = verl_engine.run_train_step(prefix, prefix_loss, batch)
            p_dense, p_prefix = verl_engine.params_of(dense), verl_engine.params_of(prefix)
            update = _distance(p_dense, p_initial)
            drift = _distance(p_prefix, p_dense) / update if update > 0 else math.nan
            row_noise, variant, out_noise = math.nan, None, None
            if noisy is not None:
                noise_batch, variant = _noise_batch(batch)
                if noise_batch is not None:
                    out_noise = verl_engine.run_train_step(noisy[0], noisy[1], noise_batch)
                    row_noise = _distance(verl_engine.params_of(noisy[0]), p_dense) / update if update > 0 else math.nan
            del p_dense, p_prefix
            metrics = {k: v for k, v in out_prefix["reduced_metrics"].items() if k.startswith("prefix/")}
            groups = batch_groups(batch)
            ratios = [d / p for d, p in zip(dense_s, prefix_s)]
            predicted, tree = predicted_speedup(shape, groups), None
            if prefix.reuse_config.tree:  # the FLOP model of the trie the prefix engine ran
                model = tree_model(batch, prefix.reuse_config)
                tree = {"nodes": len(model.nodes), "depth": model.depth, **model.speedups(shape)}
                predicted = tree["tree"]
            prefix_memory = prefix_memory_by_phase(metrics, prefix_mem.get("peak_device_mib"))
            row = {
                "index": i,
                "step": entry.step,
                "rows": len(batch),
                "groups": len(groups),
                "tokens": entry.tokens,
                "group_size_mean": statistics.mean(len(r) for _, r in groups),
                "prompt_len_mean": statistics.mean(p for p, _ in groups),
                "response_len_mean": statistics.mean(x for _, r in groups for x in r),
                "predicted_speedup": predicted,
                "tree": tree,
                "dense_s": dense_s,
                "prefix_s": prefix_s,
                "dense_median_s": statistics.median(dense_s),
                "prefix_median_s": statistics.median(prefix_s),
                "ratio_median": statistics.median(ratios),
                "ratio_of_medians": statistics.median(dense_s) / statistics.median(prefix_s),
                "loss_dense": out_dense["loss"],
                "loss_prefix": out_prefix["loss"],
                "loss_noise": out_noise["loss"] if out_noise else None,
                "grad_norm_dense": out_dense["grad_norm"],
                "grad_norm_prefix": out_prefix["grad_norm"],
                "update_norm": update,
                "drift": drift,
                "noise_floor": row_noise,
                "drift_over_noise": drift / row_noise if row_noise and row_noise > 0 else math.nan,
                "noise_variant": variant,
                "memory": {"dense": dense_mem, "prefix": prefix_memory},
                "prefix_time_s": {
                    k.split("/")[-1]: v
                    for k, v in metrics.items()
                    if k.startswith("prefix/time_s/") and not k.endswith("/schedule") and v > 0
                },
                "prefix_metrics": metrics,
            }
            rows_out.append(row)
            bar.set_postfix_str(f"x{row['ratio_median']:.2f} drift {drift:.1e} noise {row_noise:.1e}")
            emit(
                f"  step {i}: dense {row['dense_median_s']:.3f}s prefix {row['prefix_median_s']:.3f}s "
                f"(x{row['ratio_median']:.2f}, FLOP model x{row['predicted_speedup']:.2f}) | drift {drift:.2e} "
                f"noise floor {row_noise:.2e}"
            )
        result: dict[str, Any] = {
            "kind": "replay",
            "date": timestamp(),
            "command": command or shlex.join(sys.argv),
            "machine": machine_info(),
            "trace": {
                "dir": str(trace.dir),
                "source": trace.manifest.get("source"),
                "model_ref": trace.model_ref,
                "batches": len(trace),
                "created": trace.manifest.get("created"),
                "versions": trace.manifest.get("versions"),
            },
            "model": {"dir": str(model_path), "params": int(params), **dataclasses.asdict(shape)},
            "dtype": dtype,
            "attn_implementation": attn_implementation,
            "reps": reps,
            "warmup": warmup,
            "engine_kwargs": kwargs,
            "overrides": list(overrides),
            "initial_params_identical": identical,
            "steps": rows_out,
            "summary": _summary(rows_out),
        }
    finally:
        torch.set_num_threads(previous_threads)
    result["wall_s"] = time.perf_counter() - started
    if out_json is not None:
        path = Path(out_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def finite(key: str) -> list[float]:
        return [r[key] for r in rows if r[key] is not None and math.isfinite(r[key])]

    drift, noise = finite("drift"), finite("noise_floor")
    return {
        "steps": len(rows),
        "ratio_median": statistics.median(r["ratio_median"] for r in rows),
        "predicted_speedup_median": statistics.median(r["predicted_speedup"] for r in rows),
        "max_drift": max(drift) if drift else math.nan,
        "max_noise_floor": max(noise) if noise else math.nan,
        "final_drift": rows[-1]["drift"],
        "final_noise_floor": rows[-1]["noise_floor"],
    }


REPLAY_HEADER = (
    "| step | rows | groups | prompt mean | response mean | dense (s) | prefix (s) | speedup | FLOP model "
    "| drift | noise floor | saved held dense (MiB) | saved held prefix (MiB) |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def replay_table(result: dict[str, Any]) -> str:
    """A replay result as a markdown table, one row per step (what the CLI prints and docs embed)."""
    lines = [REPLAY_HEADER]
    for r in result["steps"]:
        held_d = r["memory"]["dense"].get("saved_for_backward_held_mib", math.nan)
        held_p = r["memory"]["prefix"].get("saved_for_backward_held_mib", math.nan)
        lines.append(
            f"| {r['index']} | {r['rows']} | {r['groups']} | {r['prompt_len_mean']:.0f} | "
            f"{r['response_len_mean']:.0f} | {r['dense_median_s']:.3f} | {r['prefix_median_s']:.3f} | "
            f"{r['ratio_median']:.2f}x | {r['predicted_speedup']:.2f}x | {r['drift']:.1e} | "
            f"{r['noise_floor']:.1e} | {held_d:.1f} | {held_p:.1f} |"
        )
    return "\n".join(lines)
