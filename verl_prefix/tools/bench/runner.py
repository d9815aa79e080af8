"""Dense ``fsdp2`` vs ``prefix_fsdp2`` on identical GRPO batches: time, FLOP prediction and gradient agreement.

Both engines are verl's real engines built from one model directory, so they hold the same weights, and
they see the same batch interleaved rep by rep, so machine noise hits both alike. The optimizer never
steps: weights stay identical and every rep measures the same work. Medians and ratios are reported
because shared machines are noisy. ``run_bench`` runs a preset (``bench_presets``) and writes the result
JSON that ``bench_tables`` renders.

The caller must have chosen verl's platform (``VERL_PLATFORM=cpu`` without CUDA) before verl is
imported; ``verl_prefix.tools.cli`` does that (``measure.select_platform``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_prefix.harness import verl_engine
from verl_prefix.tools.bench import rss_probe
from verl_prefix.tools.bench.attention import (
    attention_kv_bytes,
    count_attention_saved,
    largest_micro_batch_tokens,
    suffix_repeated_on_cuda,
)
from verl_prefix.tools.bench.capacity import run_capacity
from verl_prefix.tools.bench.presets import (
    PHASE_B_ATTENTIONS,
    TREE_VARIANTS,
    Cell,
    ModelSpec,
    Preset,
    build_variant,
    cell_batch,
    cell_reps,
    compiled,
    resolve_preset,
    unavailable_variant,
)
from verl_prefix.tools.bench.tables import grad_check
from verl_prefix.tools.flops import ModelShape, predicted_speedup, vision_encoder_flops
from verl_prefix.tools.measure import machine_info, measure_update_memory, time_infer, time_update, timestamp
from verl_prefix.tools.tree_flops import tree_model

WARMUP = 1


@dataclass
class _Timings:
    dense: list[float] = field(default_factory=list)
    prefix: list[float] = field(default_factory=list)

    def summary(self, prefix: str) -> dict[str, Any]:
        ratios = [d / p for d, p in zip(self.dense, self.prefix)]
        dense_med, prefix_med = statistics.median(self.dense), statistics.median(self.prefix)
        return {
            f"{prefix}dense_s": self.dense,
            f"{prefix}prefix_s": self.prefix,
            f"{prefix}dense_median_s": dense_med,
            f"{prefix}prefix_median_s": prefix_med,
            f"{prefix}ratio_median": statistics.median(ratios),
            f"{prefix}ratio_of_medians": dense_med / prefix_med,
        }


def _cell_header(cell: Cell, params: int, response_lens: list[int]) -> dict[str, Any]:
    """What every result row says about its cell: the model, the batch shape and the micro-batching."""
    return {
        "cell": cell.name,
        "model": {**dataclasses.asdict(cell.model), "params": int(params)},
        "dtype": cell.dtype,
        "num_groups": cell.num_groups,
        "group_size": cell.group_size,
        "prompt_len": cell.prompt_len,
        "response_lens": response_lens,
        "micro_batch_size": cell.micro_batch_size,
        "engine": cell.engine,
    }


def max_rel_grad_diff(dense: dict[str, torch.Tensor], prefix: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest ``||g_p - g_d|| / ||g_d||`` over parameters: the reuse schedule must not change gradients.

    A NaN anywhere is the result (NaN, that parameter): a comparison ``rel > worst`` alone skips NaNs and
    would report 0.0 for gradients that are all NaN."""
    if not dense:
        raise RuntimeError("no parameter gradients captured")
    if dense.keys() != prefix.keys():
        missing = sorted(set(dense) ^ set(prefix))
        raise RuntimeError(f"engines disagree on which parameters have gradients: {missing[:5]}")
    worst, worst_name = 0.0, ""
    for name, gd in dense.items():
        gd64, gp64 = gd.double(), prefix[name].double()
        num = float(torch.linalg.vector_norm(gp64 - gd64))
        den = float(torch.linalg.vector_norm(gd64))
        rel = num / den if den > 0 else (0.0 if num == 0 else math.inf)
        if math.isnan(rel):
            return math.nan, name
        if rel > worst or not worst_name:
            worst, worst_name = rel, name
    return worst, worst_name


def _prefix_metrics(output: dict) -> dict[str, float]:
    """The engine's ``prefix/*`` counters for one mini-batch (reuse factor, fallbacks)."""
    return verl_engine.reduce_step_metrics({k: v for k, v in output["metrics"].items() if k.startswith("prefix/")})


def measure_cell(
    cell: Cell,
    model_dir: Path,
    *,
    reps: int,
    log: Callable[[str], None] = print,
    tick: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Build both engines from ``model_dir``, run ``WARMUP + reps`` interleaved reps, summarise one cell.

    Memory is measured in the warm-up rep (rep 0), whose times are discarded, so the counting hooks cost
    no timed work. ``tick`` is called after every rep (a progress bar).
    """
    from transformers import AutoConfig

    import verl_prefix

    batch = cell_batch(cell)
    reuse = verl_prefix.PrefixReuseConfig(
        min_prefix_len=cell.min_prefix_len, suffix_micro_batch_size=cell.micro_batch_size
    )
    if cell.system_len:  # an agentic batch: the prefix engine runs the tree (every prompt opens with one block)
        reuse = dataclasses.replace(reuse, tree=True, min_shared_tokens=cell.min_prefix_len)
    if cell.engine == "fsdp2":
        engines = _fsdp_engines(cell, model_dir)
    else:
        engines = {"torchtitan": _titan_engines, "megatron": _megatron_engines}[cell.engine](cell, model_dir, reuse)
    dense, dense_loss = engines["dense"]
    prefix, prefix_loss = engines["prefix"]
    prefix.reuse_config = reuse

    train, infer = _Timings(), _Timings()
    grad_diff, grad_param, reuse = math.nan, "", {}
    memory: dict[str, dict[str, float]] = {}
    for rep in range(WARMUP + reps):
        gc.collect()  # outside the timed regions: a collection mid-rep would land on one engine only
        if rep == 0:
            with measure_update_memory(dense) as memory["dense"]:
                t_dense, out_dense = time_update(dense, dense_loss, batch, capture_grads=True)
            with measure_update_memory(prefix, count_saved=False) as memory["prefix"]:
                t_prefix, out_prefix = time_update(prefix, prefix_loss, batch, capture_grads=True)
        else:
            t_dense, out_dense = time_update(dense, dense_loss, batch)
            t_prefix, out_prefix = time_update(prefix, prefix_loss, batch)
        if rep == 0:
            grad_diff, grad_param = max_rel_grad_diff(out_dense["grads"], out_prefix["grads"])
            reuse = _prefix_metrics(out_prefix)
        del out_dense, out_prefix
        i_dense = time_infer(dense, batch)
        i_prefix = time_infer(prefix, batch)
        tag = "warm-up" if rep < WARMUP else f"rep {rep - WARMUP + 1}/{reps}"
        log(
            f"  {cell.name} {tag}: update dense {t_dense:.3f}s prefix {t_prefix:.3f}s | "
            f"forward-only dense {i_dense:.3f}s prefix {i_prefix:.3f}s"
        )
        if rep >= WARMUP:
            train.dense.append(t_dense)
            train.prefix.append(t_prefix)
            infer.dense.append(i_dense)
            infer.prefix.append(i_prefix)
        if tick is not None:
            tick()

    hf_config = AutoConfig.from_pretrained(model_dir)
    prompt_lens = [int(p.numel()) for p in batch["prompts"].unbind()]
    response_lens = [int(r.numel()) for r in batch["responses"].unbind()]
    groups = [
        (prompt_lens[g * cell.group_size], response_lens[g * cell.group_size : (g + 1) * cell.group_size])
        for g in range(cell.num_groups)
    ]
    params = sum(p.numel() for p in verl_engine.params_of(dense).values())
    del engines, dense, prefix
    gc.collect()
    return {
        **_cell_header(cell, params, response_lens),
        "reps": reps,
        "warmup": WARMUP,
        **train.summary(""),
        **infer.summary("infer_"),
        "predicted_speedup": predicted_speedup(
            ModelShape.from_config(hf_config), groups, encoder_flops(cell, hf_config)
        ),
        "max_rel_grad_diff": grad_diff,
        "max_rel_grad_diff_param": grad_param,
        **grad_check(grad_diff, cell.dtype),
        "prefix_metrics": reuse,
        "memory": memory,
    }


def _fsdp_engines(cell: Cell, model_dir: Path) -> dict[str, tuple[Any, Callable]]:
    """Stock ``fsdp2`` ("dense") and ``prefix_fsdp2`` ("prefix") from one model directory."""
    dtype = "float32" if cell.dtype in ("float32", "bfloat16") else cell.dtype
    engines = {}
    for key, backend in (("dense", "fsdp2"), ("prefix", "prefix_fsdp2")):
        engine, loss_fn, _ = verl_engine.build_verl_engine(
            model_dir, backend=backend, dtype=dtype, micro_batch_size_per_gpu=cell.micro_batch_size,
            overrides=cell.overrides,
        )  # fmt: skip
        engines[key] = (engine, loss_fn)
    return engines


def _titan_engines(cell: Cell, model_dir: Path, reuse: Any) -> dict[str, tuple[Any, Callable]]:
    """verl's TorchTitan engine ("dense") and ``prefix_torchtitan`` ("prefix") on this one rank, with verl's PPO
    loss; fp32 parameters (bf16 ones for a bfloat16 cell, torchtitan's default)."""
    from verl_prefix.harness import titan as TT

    verl_engine.init_single_process_group()
    param = "bfloat16" if cell.dtype == "bfloat16" else "float32"
    loss_fn = TT.ppo_loss_fn()
    engines = {}
    for key, backend in (("dense", "torchtitan"), ("prefix", "prefix_torchtitan")):
        engine = TT.build_titan_engine(
            model_dir, backend=backend, micro_batch_size_per_gpu=cell.micro_batch_size, lr=0.0,
            prefix_reuse=reuse if backend == "prefix_torchtitan" else None,
            # torchtitan sizes its RoPE table by its training seq_len (2048 unless set)
            engine_overrides={"mixed_precision_param": param, "max_seq_len": cell.model.max_position_embeddings},
        )  # fmt: skip
        engines[key] = (engine, loss_fn)
    return engines


def _megatron_engines(cell: Cell, model_dir: Path, reuse: Any) -> dict[str, tuple[Any, Callable]]:
    """verl's Megatron engine ("dense") and ``prefix_megatron`` ("prefix") on this one rank (TP=1, megatron-core's
    local attention; the CPU platform applied where there is no GPU), fp32, with verl's PPO loss."""
    from verl_prefix.harness import megatron as MG

    verl_engine.init_single_process_group()
    loss_fn, _ = MG.ppo_loss([f"ppo_micro_batch_size_per_gpu={cell.micro_batch_size}"])
    engines = {}
    for key, backend in (("dense", "megatron"), ("prefix", "prefix_megatron")):
        extra = {"prefix_reuse": reuse} if backend == "prefix_megatron" else {}
        rows = cell.dense_micro_batch_size if key == "dense" and cell.dense_micro_batch_size else cell.micro_batch_size
        engine = MG.build_megatron_engine(model_dir, backend=backend, lr=0.0, micro_batch_size_per_gpu=rows, **extra)
        engines[key] = (engine, loss_fn)
    return engines


def encoder_flops(cell: Cell, hf_config: Any) -> list[float] | None:
    """A vision-language cell's vision encoder FLOPs per group (its one image), for the FLOP model; else None."""
    if cell.image is None:
        return None
    return [vision_encoder_flops(hf_config.vision_config, [(1, *cell.image)])] * cell.num_groups


def _median_ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(num, den))


def measure_variants(
    cell: Cell,
    model_dir: Path,
    *,
    reps: int,
    log: Callable[[str], None] = print,
    tick: Callable[[], None] | None = None,
    fresh_rss: bool = False,
) -> dict[str, Any]:
    """Time ``cell.variants`` on one batch in one interleaved run: each rep runs every variant once, the
    order rotating rep by rep, so machine noise and the position in a rep hit all of them alike.

    The warm-up rep (times discarded) measures memory and captures gradients; every variant is checked
    against the stock engine (against concat where the stock engine does not run). ``fresh_rss`` also
    runs each variant's first update in a fresh process for its peak RSS (``rss_probe.probe``)."""
    from transformers import AutoConfig

    reps = cell_reps(cell, reps)
    skipped = {v: why for v in cell.variants if (why := unavailable_variant(v)) is not None}
    for v, why in skipped.items():
        log(f"  {cell.name}: skipping variant {v}: {why}")
    variants = tuple(v for v in cell.variants if v not in skipped)
    batch = cell_batch(cell)
    engines = {v: build_variant(cell, v, model_dir) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    infer: dict[str, list[float]] = {v: [] for v in variants}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    info: dict[str, dict[str, Any]] = {v: {} for v in variants}
    for rep in range(WARMUP + reps):
        gc.collect()  # outside the timed regions
        order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
        line = []
        for v in order:
            engine, loss_fn = engines[v]
            if rep == 0 and v == "fsdp2":
                with measure_update_memory(engine) as memory:
                    t, out = time_update(engine, loss_fn, batch, capture_grads=True)
                info[v]["memory"] = memory
            elif rep == 0:
                with measure_update_memory(engine, count_saved=False) as memory, count_attention_saved() as attn:
                    t, out = time_update(engine, loss_fn, batch, capture_grads=True)
                info[v].update(memory=memory, attention_saved_mib=[b / 1024.0**2 for b in attn])
                info[v]["prefix_metrics"] = _prefix_metrics(out)
            else:
                t, out = time_update(engine, loss_fn, batch)
            if rep == 0:
                grads[v] = out["grads"]
            del out
            line.append(f"{v} {t:.3f}s")
            if rep >= WARMUP:
                times[v].append(t)
            if cell.time_forward_only:
                i = time_infer(engine, batch)
                line[-1] += f" (forward-only {i:.3f}s)"
                if rep >= WARMUP:
                    infer[v].append(i)
        tag = "warm-up" if rep < WARMUP else f"rep {rep - WARMUP + 1}/{reps}"
        log(f"  {cell.name} {tag}: update " + " | ".join(line))
        if rep == 0:
            reference = "fsdp2" if "fsdp2" in grads else "concat"
            for v in variants:
                if v != reference and reference in grads:
                    info[v]["max_rel_grad_diff"], info[v]["max_rel_grad_diff_param"] = max_rel_grad_diff(
                        grads[reference], grads[v]
                    )
                    info[v]["max_rel_grad_diff_vs"] = reference  # the P8192 cells have no stock engine
                    info[v].update(grad_check(info[v]["max_rel_grad_diff"], cell.dtype))
            grads.clear()
        if tick is not None:
            tick()

    params = sum(p.numel() for p in verl_engine.params_of(engines[variants[0]][0]).values())
    del engines
    gc.collect()
    response_lens = [int(r.numel()) for r in batch["responses"].unbind()]
    prompt_lens = [int(p.numel()) for p in batch["prompts"].unbind()]
    summary: dict[str, Any] = {}
    for v in variants:
        entry: dict[str, Any] = {"update_s": times[v], "update_median_s": statistics.median(times[v]), **info[v]}
        if "fsdp2" in variants and v != "fsdp2":
            entry["speedup_vs_stock_median"] = _median_ratio(times["fsdp2"], times[v])
            entry["speedup_vs_stock_of_medians"] = statistics.median(times["fsdp2"]) / entry["update_median_s"]
        if cell.time_forward_only:
            entry["infer_s"] = infer[v]
            entry["infer_median_s"] = statistics.median(infer[v])
            if "fsdp2" in variants and v != "fsdp2":
                entry["infer_speedup_vs_stock_median"] = _median_ratio(infer["fsdp2"], infer[v])
        if v == "fsdp2":
            entry["saved_for_backward_per_micro_batch_mib"] = info[v]["memory"]["saved_for_backward_held_mib"]
            entry["saved_for_backward_held_mib"] = info[v]["memory"]["saved_for_backward_held_mib"]
        else:
            metrics = info[v]["prefix_metrics"]
            entry["saved_for_backward_per_micro_batch_mib"] = metrics.get("prefix/max_saved_for_backward_mib/B")
            entry["saved_for_backward_held_mib"] = metrics.get("prefix/max_saved_for_backward_held_mib")
            entry["phase_b_micro_batches"] = {
                a: metrics.get(f"prefix/phase_b_attention/{a}", 0.0) for a in PHASE_B_ATTENTIONS
            }
        if v in PHASE_B_ATTENTIONS:
            entry["attention_kv_mib"] = {
                k: b / 1024.0**2
                for k, b in attention_kv_bytes(
                    cell.model,
                    v,
                    prefix_len=min(prompt_lens) - 1,  # the shared prefix: the prompt minus its last token
                    suffix_len=max(response_lens) + 1,
                    rows=min(cell.micro_batch_size, cell.group_size),
                    repeat_suffix=suffix_repeated_on_cuda(cell.model),
                    suffix_tokens=largest_micro_batch_tokens(response_lens, cell),
                ).items()
            }
        if fresh_rss:
            entry["fresh_process"] = rss_probe.probe(cell, v, model_dir)
        summary[v] = entry
    result: dict[str, Any] = {
        **_cell_header(cell, params, response_lens),
        "stock_micro_batch_size": cell.dense_micro_batch_size or cell.micro_batch_size,
        "reps": reps,
        "warmup": WARMUP,
        "variant_order": "rotated by one each rep",
        "variants": summary,
    }
    if skipped:
        result["skipped_variants"] = skipped
    if {"merged_varlen", "concat"} <= set(variants):
        result["merged_varlen_over_concat_time_median"] = _median_ratio(times["merged_varlen"], times["concat"])
    if {"merged", "concat"} <= set(variants):
        result["merged_over_concat_time_median"] = _median_ratio(times["merged"], times["concat"])
        result["merged_over_concat_time_of_medians"] = (
            summary["merged"]["update_median_s"] / summary["concat"]["update_median_s"]
        )
    if "fsdp2" in variants:
        hf_config = AutoConfig.from_pretrained(model_dir)
        groups = [
            (prompt_lens[g * cell.group_size], response_lens[g * cell.group_size : (g + 1) * cell.group_size])
            for g in range(cell.num_groups)
        ]
        shape = ModelShape.from_config(hf_config)
        result["predicted_speedup"] = predicted_speedup(shape, groups, encoder_flops(cell, hf_config))
        if set(TREE_VARIANTS) <= set(variants):
            result.update(_tree_figures(cell, batch, shape, times, summary))
    return result


def _tree_figures(
    cell: Cell, batch: Any, shape: ModelShape, times: dict[str, list[float]], summary: dict[str, Any]
) -> dict[str, Any]:
    """A tree cell's FLOP model beside its measurements: each engine's speedup over stock, and the tree's over
    one-level reuse, measured (medians of per-rep ratios) and modelled (``tree_flops``, the engine's trie)."""
    import verl_prefix

    reuse = verl_prefix.PrefixReuseConfig(min_prefix_len=cell.min_prefix_len, tree=True)
    model = tree_model(batch, reuse)
    predicted = model.speedups(shape)
    measured = {
        "one_level": summary["one_level"]["speedup_vs_stock_median"],
        "tree": summary["tree"]["speedup_vs_stock_median"],
        "tree_over_one_level": _median_ratio(times["one_level"], times["tree"]),
    }
    return {
        "tree": {"nodes": len(model.nodes), "depth": model.depth},
        "predicted": predicted,
        "measured": measured,
        "measured_over_predicted": {k: measured[k] / predicted[k] for k in measured},
    }


def run_bench(
    preset: str | Preset,
    *,
    reps: int | None = None,
    out_json: Path | None = None,
    threads: int | None = None,
    command: str | None = None,
    log: Callable[[str], None] = print,
    progress: bool = False,
    compile: bool = False,
    cells: Sequence[str] | None = None,
    fresh_rss: bool | None = None,
    jobs: int = 1,
) -> dict:
    """Run a preset's cells (a name, or a ``Preset`` such as a test's minuscule one); optionally save JSON,
    rewritten after every cell so a run cut short keeps what it measured (``complete`` says which).

    ``threads`` (default: the preset's) sets ``torch.set_num_threads`` for the run and is restored after.
    ``progress`` shows a tqdm bar over all reps on stderr (runs take minutes to hours). ``compile`` runs
    both engines with verl's ``use_torch_compile``. ``fresh_rss`` (default: the preset's) measures each
    variant cell's peak RSS in a fresh process per variant. ``jobs``: a capacity preset's engines searched
    at once (one probe process each).
    """
    spec, reps = resolve_preset(preset, reps, threads, cells)
    if spec.capacity is not None:
        name = preset if isinstance(preset, str) else "custom"
        return _run_capacity(name, spec, out_json, command, log, threads, jobs=jobs)
    if compile:
        spec = dataclasses.replace(spec, cells=compiled(spec.cells))
    name = preset if isinstance(preset, str) else "custom"
    threads = spec.threads if threads is None else threads
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run_cells(
            name,
            spec.cells,
            reps=reps,
            out_json=out_json,
            command=command,
            log=log,
            progress=progress,
            fresh_rss=spec.fresh_rss if fresh_rss is None else fresh_rss,
        )
    finally:
        torch.set_num_threads(previous_threads)


def _run_cells(
    preset: str,
    cells: tuple[Cell, ...],
    *,
    reps: int,
    out_json: Path | None,
    command: str | None,
    log: Callable[[str], None],
    progress: bool = False,
    fresh_rss: bool = False,
) -> dict:
    from tqdm.auto import tqdm

    started = time.perf_counter()
    result: dict[str, Any] = {
        "preset": preset,
        "date": timestamp(),
        "command": command or shlex.join(sys.argv),
        "machine": machine_info(),
        "cells": [],
    }
    models: dict[ModelSpec, Path] = {}
    total = sum(WARMUP + cell_reps(c, reps) for c in cells)
    bar = tqdm(total=total, desc="bench", unit="rep", disable=not progress)
    if progress:
        log = functools.partial(tqdm.write, file=sys.stdout)  # keep the bar below the log lines
    with bar, tempfile.TemporaryDirectory(prefix="verl_prefix_bench_") as tmp:
        for cell in cells:
            if cell.model not in models:
                models[cell.model] = cell.model.write(Path(tmp) / f"model{len(models)}")
            bar.set_postfix_str(cell.name)
            if cell.variants:
                measured = measure_variants(
                    cell, models[cell.model], reps=reps, log=log, tick=bar.update, fresh_rss=fresh_rss
                )
            else:
                measured = measure_cell(cell, models[cell.model], reps=reps, log=log, tick=bar.update)
            result["cells"].append(measured)
            result["complete"] = len(result["cells"]) == len(cells)
            result["wall_s"] = time.perf_counter() - started
            _save(result, out_json)
    return result


def _run_capacity(
    name: str,
    spec: Preset,
    out_json: Path | None,
    command: str | None,
    log: Callable,
    threads: int | None,
    jobs: int = 1,
) -> dict:
    """A capacity preset: ``verl_prefix.tools.bench.capacity.run_capacity`` with the bench's result header, the
    JSON rewritten after each engine's search (``complete`` false until the last)."""
    started = time.perf_counter()
    previous = torch.get_num_threads()
    threads = spec.threads if threads is None else threads
    if threads is not None:
        torch.set_num_threads(threads)  # each probe child takes the parent's thread count
    saving = threading.Lock()
    try:
        header = {  # read after set_num_threads: machine_info's torch_threads is the probes' count
            "preset": name,
            "date": timestamp(),
            "command": command or shlex.join(sys.argv),
            "machine": {**machine_info(), "capacity_jobs": jobs},
        }

        def save(capacity: dict[str, Any]) -> None:
            with saving:
                partial = {**header, "capacity": capacity, "complete": capacity["complete"]}
                _save({**partial, "wall_s": time.perf_counter() - started}, out_json)

        capacity = run_capacity(spec.capacity, log=log, jobs=jobs, on_engine_done=save)
    finally:
        torch.set_num_threads(previous)
    result = {**header, "capacity": capacity, "wall_s": time.perf_counter() - started, "complete": True}
    _save(result, out_json)
    return result


def _save(result: dict, out_json: Path | None) -> None:
    if out_json is None:
        return
    out_json = Path(out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    partial = out_json.with_name(out_json.name + ".tmp")  # never a half-written result file
    partial.write_text(json.dumps(result, indent=2) + "\n")
    partial.replace(out_json)
