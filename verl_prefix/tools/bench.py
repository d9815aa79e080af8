"""Dense ``fsdp2`` vs ``prefix_fsdp2`` on identical GRPO batches: time, FLOP prediction and gradient agreement.

Both engines are verl's real engines built from one model directory, so they hold the same weights, and
they see the same batch interleaved rep by rep, so machine noise hits both alike. The optimizer never
steps: weights stay identical and every rep measures the same work. Medians and ratios are reported
because shared machines are noisy.

The caller must have chosen verl's platform (``VERL_PLATFORM=cpu`` without CUDA) before verl is
imported; ``verl_prefix.tools.cli`` does that.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_prefix.schedule.telemetry import SavedBytes
from verl_prefix.tools import testing as T
from verl_prefix.tools.flops import ModelShape, predicted_speedup

WARMUP = 1


class BenchError(ValueError):
    """A user mistake or an unmet requirement (no CUDA for the gpu preset): one line, no traceback."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a random-init Qwen3-style model, as ``testing.write_tiny_model`` takes it."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    family: str = "qwen3"
    num_experts: int = 0  # > 0 with family "qwen3_moe": intermediate_size is each expert's
    num_experts_per_tok: int = 0

    def write(self, directory: Path) -> Path:
        """A random-init model of this shape, with a local tokenizer."""
        kwargs = dataclasses.asdict(self)
        family = kwargs.pop("family")
        if not self.num_experts:
            kwargs.pop("num_experts")
            kwargs.pop("num_experts_per_tok")
        return T.write_tiny_model(directory, family, **kwargs)


@dataclass(frozen=True)
class Cell:
    """One measured configuration: a model, a dtype and one GRPO mini-batch shape."""

    name: str
    model: ModelSpec
    num_groups: int
    group_size: int
    prompt_len: int
    response_len_range: tuple[int, int]
    micro_batch_size: int = 4
    dtype: str = "float32"
    min_prefix_len: int = 32
    overrides: tuple[str, ...] = ()
    # Non-empty: a phase-B attention cell (``measure_variants``) timing these engines side by side, any of
    # ``ALL_VARIANTS``: "fsdp2" (the stock engine), "merged"/"concat"/"merged_varlen" (``prefix_fsdp2`` with
    # that ``prefix_reuse.phase_b_attention``). Empty: the classic dense vs prefix cell (``measure_cell``).
    variants: tuple[str, ...] = ()
    dense_micro_batch_size: int | None = None  # the stock engine's rows per micro-batch, if not micro_batch_size
    max_reps: int | None = None  # at most this many timed reps for this cell (the slow ones)
    time_forward_only: bool = False  # variant cells: also time the forward-only log-prob pass


@dataclass(frozen=True)
class Preset:
    """A named set of cells with its default reps and torch thread count."""

    cells: tuple[Cell, ...]
    reps: int
    needs_cuda: bool = False
    # CPU presets pin 1 torch thread: on the shared 2-vCPU dev VM, 2 threads made the same update take
    # 0.7 s to 80 s from rep to rep (OpenMP barriers wait on preempted vCPUs); 1 thread was steady.
    threads: int | None = None
    description: str = ""
    # variant cells: each variant's first update also runs once in a fresh process, for its peak RSS
    fresh_rss: bool = False
    # a capacity preset (``verl_prefix.tools.capacity.CapacitySpec``): a search instead of timed cells
    capacity: Any = None


SMOKE_MODEL = ModelSpec(
    hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384, vocab_size=1024
)
# ~29.6M parameters (untied embeddings), the model DESIGN.md's CPU measurements use.
MODEL_29M = ModelSpec(
    hidden_size=512,
    num_layers=6,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=1792,
    vocab_size=8192,
    max_position_embeddings=16384,  # the gpu preset's 12K-token sequences
)
# bf16 on GPU: fp32 master weights, bf16 compute, fp32 gradient reduction (verl's usual mixed precision).
_BF16 = (
    "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:bf16,reduce_dtype:fp32,buffer_dtype:fp32}",
)


# A Qwen3-MoE-style model of the smoke model's size: 8 experts, top-2 (router aux loss off, so the stock
# fsdp2 engine is the reference; tests/schedule/test_moe.py covers the aux loss).
SMOKE_MOE_MODEL = ModelSpec(
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=192,
    vocab_size=1024,
    family="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
)


# Qwen3-1.7B's shape (28 layers, GQA 16/8, vocab 151936): the largest Qwen3 whose full fine-tune (fp32
# master weights and Adam states, about 27 GB) leaves one H200 room for 16 x 12K-token sequences.
MODEL_GPU = ModelSpec(
    hidden_size=2048,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=6144,
    vocab_size=151936,
    max_position_embeddings=16384,
)
_GPU = (*_BF16, "actor_rollout_ref.model.enable_gradient_checkpointing=true")


VARIANTS = ("fsdp2", "merged", "concat")
# the gpu preset also runs merged_varlen (flash-attn's varlen kernels; skipped where flash_attn does not import)
GPU_VARIANTS = (*VARIANTS, "merged_varlen")
ALL_VARIANTS = GPU_VARIANTS
PHASE_B_ATTENTIONS = ("merged", "concat", "merged_varlen")  # the prefix_fsdp2 variants


def unavailable_variant(variant: str, cuda: bool | None = None) -> str | None:
    """Why a variant cannot run on this machine (then the cell skips it, saying so), or None."""
    from verl_prefix.schedule.varlen_attention import flash_attn_varlen

    cuda = torch.cuda.is_available() if cuda is None else cuda
    if variant == "merged_varlen" and cuda and flash_attn_varlen() is None:
        return "flash_attn does not import (merged_varlen needs flash-attn's varlen kernels on CUDA)"
    return None


# The capacity presets' models: the 29M and smoke models' shapes with positions long enough for the grids.
CAPACITY_MODEL = dataclasses.replace(MODEL_29M, max_position_embeddings=65536)
CAPACITY_SMOKE_MODEL = dataclasses.replace(SMOKE_MODEL, max_position_embeddings=65536)
# The gpu preset's offload cell: prefix_fsdp2 with dormant_prefix=offload (set on the engine config).
_OFFLOAD = (
    "actor_rollout_ref.actor.fsdp_config._target_=verl_prefix.config.PrefixFSDPEngineConfig",
    "+actor_rollout_ref.actor.fsdp_config.dormant_prefix=offload",
)


def _capacity_spec(kind: str) -> Any:
    from verl_prefix.tools.capacity import CapacitySpec

    if kind == "gpu":  # the gpu preset's model and precision; budget 40 GiB above the loaded model, G=16, suffix 2048
        return CapacitySpec(
            model=MODEL_GPU,
            group_size=16,
            suffix_len=2048,
            budget_mib=40 * 1024,
            # few probes: each loads the 1.7B model in a fresh process (a lent GPU has minutes, not hours)
            grid=(4096, 8192, 16384, 32768, 65536),
            engines=("fsdp2:1", "keep", "recompute:4096"),
            micro_batch_size=2,
            overrides=_GPU,
            timeout_s=600.0,
        )
    if kind == "cpu":  # issue 11's setting: the 29M model, G=8, suffix 128, 2 GiB above the loaded model
        return CapacitySpec(
            model=CAPACITY_MODEL,
            group_size=8,
            suffix_len=128,
            budget_mib=2048.0,
            grid=(1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768),
            # the stock engine's memory grows with its rows per micro-batch: 1 is its best, 2 shows the slope
            engines=("fsdp2:1", "fsdp2:2", "keep", "recompute", "recompute:1024", "recompute:512"),
            micro_batch_size=4,
            timeout_s=3600.0,
            repeats=3,
        )
    # the same search in minutes: the 1M smoke model, G=8, suffix 128, 256 MiB
    return CapacitySpec(
        model=CAPACITY_SMOKE_MODEL,
        group_size=8,
        suffix_len=128,
        budget_mib=256.0,
        grid=(512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384),
        engines=("fsdp2:1", "fsdp2:2", "fsdp2:4", "keep", "recompute", "recompute:1024"),
        micro_batch_size=4,
    )


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
    }


def _phase_b_cells() -> tuple[Cell, ...]:
    """Issue 14: merged vs concat phase-B attention beside the stock engine, one G=8 group, suffix 128.

    The stock engine runs 2 rows per micro-batch in every cell (its work does not depend on the prefix
    engine's suffix micro-batch; it saves 1.6 GB for backward per 2-row micro-batch at prefix 2048, so 8
    rows would hold about 6.5 GB on a shared 23 GB VM) and only at prefix 2048: at 8192 it would save about
    6 GB per 2-row micro-batch and take several times the 2048 update's 50 s per rep."""
    cells = []
    for prefix in (2048, 8192):
        for rows in (2, 8):
            cells.append(
                Cell(
                    f"P{prefix}/S128/G8/mb{rows}",
                    MODEL_29M,
                    1,
                    8,
                    prefix,
                    (128, 128),
                    micro_batch_size=rows,
                    variants=VARIANTS if prefix <= 2048 else VARIANTS[1:],
                    dense_micro_batch_size=2,
                    max_reps=None,  # 3 timed reps everywhere: two reps that disagree settle no ratio
                )
            )
    return tuple(cells)


def _cpu_cells() -> tuple[Cell, ...]:
    pairs = [(2048, 128), (1024, 256), (512, 512), (256, 1024)]
    cells = [Cell(f"P{p}/S{s}/G8", MODEL_29M, 1, 8, p, (s, s)) for p, s in pairs]
    cells += [Cell(f"P1024/S256/G{g}", MODEL_29M, 1, g, 1024, (256, 256)) for g in (4, 16)]
    cells += [Cell("MoE P1024/S256/G8", SMOKE_MOE_MODEL, 1, 8, 1024, (256, 256))]
    return tuple(cells)


PRESETS: dict[str, Preset] = {
    "smoke": Preset(
        cells=(Cell("P512/S32-64/G8", SMOKE_MODEL, 2, 8, 512, (32, 64)),),
        reps=5,
        threads=1,
        description="1M-param Qwen3-style model, fp32, one 2x8 GRPO mini-batch; about 25 s on 2 cores",
    ),
    "moe": Preset(
        cells=(Cell("MoE P512/S32-64/G8", SMOKE_MOE_MODEL, 2, 8, 512, (32, 64)),),
        reps=5,
        threads=1,
        description="Qwen3-MoE-style model (8 experts, top-2), fp32, one 2x8 GRPO mini-batch",
    ),
    "cpu": Preset(
        cells=_cpu_cells(),
        reps=3,
        threads=1,
        description="29M-param Qwen3-style model, fp32, one group per cell; slow (about half an hour on 2 cores)",
    ),
    "phase_b": Preset(
        cells=_phase_b_cells(),
        reps=3,
        threads=1,
        fresh_rss=True,
        description="29M-param model, fp32: stock fsdp2 vs prefix_fsdp2 with phase_b_attention merged and concat, "
        "prefix 2048/8192, suffix 128, G=8, suffix micro-batches of 2 and 8 rows; slow",
    ),
    "phase_b_smoke": Preset(
        cells=(Cell("P512/S32/G8/mb4", SMOKE_MODEL, 1, 8, 512, (32, 32), variants=VARIANTS),),
        reps=3,
        threads=1,
        description="1M-param model, fp32: the phase_b variants on one small group; about a minute "
        "(also bench/gpu_check.sh's CPU dry run)",
    ),
    "gpu": Preset(
        cells=tuple(
            # 2 rows per micro-batch: the dense engine's fp32 log-softmax over 2 x 12K tokens x 152K vocab
            # is already 15 GB, plus its backward, next to both engines' weights and gradients
            Cell(
                f"P{p}/S{s}/G16",
                MODEL_GPU,
                1,
                16,
                p,
                (s, s),
                micro_batch_size=2,
                dtype="bfloat16",
                overrides=_GPU,
                variants=GPU_VARIANTS,  # phase B's merged, concat and merged_varlen attention side by side
                time_forward_only=True,
            )
            for p, s in ((10240, 2048), (2048, 10240))
        ),
        reps=5,
        needs_cuda=True,
        description="1.7B-param Qwen3-style model, bf16 mixed precision, gradient checkpointing, G=16, 12K tokens; "
        "stock fsdp2 vs prefix_fsdp2 with merged, concat and merged_varlen phase-B attention",
    ),
    "gpu_offload": Preset(
        cells=(
            Cell(
                "P10240/S2048/G16 offload",
                MODEL_GPU,
                1,
                16,
                10240,
                (2048, 2048),
                micro_batch_size=2,
                dtype="bfloat16",
                overrides=_GPU + _OFFLOAD,
                variants=("fsdp2", "merged"),
            ),
        ),
        reps=3,
        needs_cuda=True,
        description="the gpu preset's 10K/2K cell with dormant_prefix=offload (saved tensors in pinned host memory)",
    ),
    "capacity": Preset(
        cells=(),
        reps=1,
        threads=1,
        capacity=_capacity_spec("cpu"),
        description="longest prefix whose update fits 2 GiB above the loaded 29M model (G=8, suffix 128), "
        "stock fsdp2 at micro-batches 1/2 vs keep/recompute/recompute with 1024- and 512-token chunks; fresh "
        "processes (3 per grid point), each stopped once over the budget; about 40 minutes on 2 cores with --jobs 2",
    ),
    "capacity_smoke": Preset(
        cells=(),
        reps=1,
        threads=1,
        capacity=_capacity_spec("smoke"),
        description="the capacity search on the 1M smoke model at 256 MiB (stock at micro-batches 1/2/4); "
        "about 8 minutes on 2 cores",
    ),
    "gpu_capacity": Preset(
        cells=(),
        reps=1,
        needs_cuda=True,
        capacity=_capacity_spec("gpu"),
        description="capacity on the gpu preset's 1.7B model: 40 GiB above the loaded model enforced with "
        "set_per_process_memory_fraction (real OOM boundary), G=16, suffix 2048",
    ),
}


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


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: timings mean nothing without it."""
    import transformers
    import verl

    cpu_model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "node": platform.node(),
        "platform": platform.platform(),
        "processor": cpu_model or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "verl": getattr(verl, "__version__", "unknown"),
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def _sync() -> None:
    from verl.utils.device import get_torch_device

    get_torch_device().synchronize()


def _train_data(engine: Any, batch: Any) -> Any:
    """The mini-batch as ``TrainingWorker.train_batch`` hands it to the engine (worker defaults added)."""
    from verl.utils import tensordict_utils as tu

    data = batch.copy()
    for key, val in T._worker_defaults(engine, infer=False).items():
        if key not in data.keys():
            tu.assign_non_tensor(data, **{key: val})
    tu.maybe_fix_3d_position_ids(data)
    return data


def _infer_data(engine: Any, batch: Any) -> Any:
    """The batch as the actor's ``compute_log_prob`` hands it to the engine (old log-probs, with entropy)."""
    from verl.utils import tensordict_utils as tu

    data = batch.copy()
    tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False, **T._worker_defaults(engine, infer=True))
    tu.maybe_fix_3d_position_ids(data)
    return data


def _time_update(engine: Any, loss_fn: Callable, batch: Any, *, capture_grads: bool = False) -> tuple[float, dict]:
    """Seconds for one update's zero_grad + forward/backward, no optimizer step (weights stay identical).

    With ``capture_grads`` the output also holds ``grads``, copied inside the train context because
    leaving it zeroes them.
    """
    data = _train_data(engine, batch)
    with engine.train_mode(disable_auto_offload=True):
        _sync()
        start = time.perf_counter()
        engine.optimizer_zero_grad()
        output = engine.forward_backward_batch(data, loss_fn)
        _sync()
        elapsed = time.perf_counter() - start
        if capture_grads:
            output["grads"] = T.grads_of(engine)
    return elapsed, output


@contextmanager
def measure_update_memory(engine: Any, *, count_saved: bool = True) -> Iterator[dict[str, float]]:
    """Memory of one update (dense or prefix), comparable with the prefix engine's ``prefix/max_*`` metrics.

    With ``count_saved``, ``saved_for_backward_held_mib`` is the largest number of bytes one micro-batch
    saves for backward: the stock engine frees them at each micro-batch's backward, so that is what it holds
    at once (the prefix engine's counterpart is ``prefix/max_saved_for_backward_held_mib``). On CUDA/NPU,
    ``peak_device_mib`` is the allocator's peak over the block, reset at its start (verl never resets it);
    the prefix engine's per-phase resets keep that reading whole (``telemetry`` keeps the lifetime peak
    readable). The dict is filled when the block exits.
    """
    stats: dict[str, float] = {}
    module = None
    if torch.cuda.is_available():
        module = torch.cuda
    elif hasattr(torch, "npu") and torch.npu.is_available():  # pragma: no cover - NPU machines only
        module = torch.npu
    had_own = "forward_step" in vars(engine)
    if count_saved:
        original = engine.forward_step
        stats["saved_for_backward_held_mib"] = 0.0

        def forward_step(*args: Any, **kwargs: Any) -> Any:
            counter = SavedBytes(engine.module)  # the module: what checkpointed layers recompute counts too
            with counter.counting():
                out = original(*args, **kwargs)
            held = counter.total / 1024.0**2
            stats["saved_for_backward_held_mib"] = max(stats["saved_for_backward_held_mib"], held)
            return out

        engine.forward_step = forward_step
    if module is not None:
        module.synchronize()
        module.reset_peak_memory_stats()
    try:
        yield stats
    finally:
        if module is not None:
            module.synchronize()
            stats["peak_device_mib"] = module.max_memory_allocated() / 1024.0**2
        if count_saved:
            if had_own:
                engine.forward_step = original
            else:
                del engine.forward_step


def _time_infer(engine: Any, batch: Any) -> float:
    """Seconds for one forward-only log-prob pass over the batch."""
    data = _infer_data(engine, batch)
    with engine.eval_mode(disable_auto_offload=True):
        _sync()
        start = time.perf_counter()
        with torch.no_grad():
            engine.forward_backward_batch(data, None, forward_only=True)
        _sync()
        return time.perf_counter() - start


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
    return T.reduce_step_metrics({k: v for k, v in output["metrics"].items() if k.startswith("prefix/")})


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

    batch = T.make_grpo_batch(
        num_groups=cell.num_groups,
        group_size=cell.group_size,
        prompt_lens=cell.prompt_len,
        response_len_range=cell.response_len_range,
        vocab_size=cell.model.vocab_size,
        seed=0,
    )
    dtype = "float32" if cell.dtype in ("float32", "bfloat16") else cell.dtype
    engines = {}
    for backend in ("fsdp2", "prefix_fsdp2"):
        engines[backend] = T.build_verl_engine(
            model_dir,
            backend=backend,
            dtype=dtype,
            micro_batch_size_per_gpu=cell.micro_batch_size,
            overrides=cell.overrides,
        )
    dense, dense_loss, _ = engines["fsdp2"]
    prefix, prefix_loss, _ = engines["prefix_fsdp2"]
    prefix.reuse_config = verl_prefix.PrefixReuseConfig(
        min_prefix_len=cell.min_prefix_len, suffix_micro_batch_size=cell.micro_batch_size
    )

    train, infer = _Timings(), _Timings()
    grad_diff, grad_param, reuse = math.nan, "", {}
    memory: dict[str, dict[str, float]] = {}
    for rep in range(WARMUP + reps):
        gc.collect()  # outside the timed regions: a collection mid-rep would land on one engine only
        if rep == 0:
            with measure_update_memory(dense) as memory["dense"]:
                t_dense, out_dense = _time_update(dense, dense_loss, batch, capture_grads=True)
            with measure_update_memory(prefix, count_saved=False) as memory["prefix"]:
                t_prefix, out_prefix = _time_update(prefix, prefix_loss, batch, capture_grads=True)
        else:
            t_dense, out_dense = _time_update(dense, dense_loss, batch)
            t_prefix, out_prefix = _time_update(prefix, prefix_loss, batch)
        if rep == 0:
            grad_diff, grad_param = max_rel_grad_diff(out_dense["grads"], out_prefix["grads"])
            reuse = _prefix_metrics(out_prefix)
        del out_dense, out_prefix
        i_dense = _time_infer(dense, batch)
        i_prefix = _time_infer(prefix, batch)
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
    params = sum(p.numel() for p in T.params_of(dense).values())
    del engines, dense, prefix
    gc.collect()
    return {
        **_cell_header(cell, params, response_lens),
        "reps": reps,
        "warmup": WARMUP,
        **train.summary(""),
        **infer.summary("infer_"),
        "predicted_speedup": predicted_speedup(ModelShape.from_config(hf_config), groups),
        "max_rel_grad_diff": grad_diff,
        "max_rel_grad_diff_param": grad_param,
        "prefix_metrics": reuse,
        "memory": memory,
    }


def cell_reps(cell: Cell, reps: int) -> int:
    """The timed reps this cell runs: the run's, capped by the cell's ``max_reps``."""
    return min(reps, cell.max_reps) if cell.max_reps else reps


def _cell_batch(cell: Cell) -> Any:
    return T.make_grpo_batch(
        num_groups=cell.num_groups,
        group_size=cell.group_size,
        prompt_lens=cell.prompt_len,
        response_len_range=cell.response_len_range,
        vocab_size=cell.model.vocab_size,
        seed=0,
    )


def _build_variant(cell: Cell, variant: str, model_dir: Path) -> tuple[Any, Callable]:
    """``(engine, loss_fn)`` for one variant: the stock engine, or ``prefix_fsdp2`` with that phase-B attention."""
    import verl_prefix

    if variant not in ALL_VARIANTS:
        raise BenchError(f"cell {cell.name!r}: unknown variant {variant!r}; choose from {', '.join(ALL_VARIANTS)}")
    dtype = "float32" if cell.dtype in ("float32", "bfloat16") else cell.dtype
    stock = variant == "fsdp2"
    rows = cell.dense_micro_batch_size if stock and cell.dense_micro_batch_size else cell.micro_batch_size
    engine, loss_fn, _ = T.build_verl_engine(
        model_dir,
        backend="fsdp2" if stock else "prefix_fsdp2",
        dtype=dtype,
        micro_batch_size_per_gpu=rows,
        overrides=cell.overrides,
    )
    if not stock:
        engine.reuse_config = verl_prefix.PrefixReuseConfig(
            min_prefix_len=cell.min_prefix_len, suffix_micro_batch_size=cell.micro_batch_size, phase_b_attention=variant
        )
    return engine, loss_fn


@contextmanager
def count_attention_saved() -> Iterator[list[int]]:
    """Bytes phase B's attention calls save for backward, one total per suffix micro-batch (all layers).

    Wraps ``ServeContext.attend`` (one context per micro-batch) with a saved-tensors hook that counts each
    storage once (parameters excluded) and hands every tensor on to the hook outside (the engine's own
    ``prefix/max_saved_for_backward_mib/B`` counter), so both counts stay whole. Recomputes in backward
    (gradient checkpointing) are not counted. The list is filled as micro-batches run."""
    import weakref

    from verl_prefix.schedule.prefix_kv import ServeContext

    original = ServeContext.attend
    totals: list[int] = []
    index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    seen: dict[int, set[int]] = {}

    def attend(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() != -1 or not torch.is_grad_enabled():
            return original(self, *args, **kwargs)  # a checkpoint's recompute, or forward-only
        if self not in index:
            index[self] = len(totals)
            totals.append(0)
            seen[index[self]] = set()
        slot = index[self]
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = top if top is not None else (lambda t: t, lambda t: t)

        def pack(tensor: torch.Tensor) -> Any:
            if not isinstance(tensor, torch.nn.Parameter) and not isinstance(tensor._base, torch.nn.Parameter):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen[slot]:
                    seen[slot].add(storage.data_ptr())
                    totals[slot] += storage.nbytes()
            return outer_pack(tensor)

        with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack):
            return original(self, *args, **kwargs)

    ServeContext.attend = attend
    try:
        yield totals
    finally:
        ServeContext.attend = original


def attention_kv_bytes(
    model: ModelSpec,
    variant: str,
    *,
    prefix_len: int,
    suffix_len: int,
    rows: int,
    repeat_suffix: bool = False,
    suffix_tokens: int | None = None,
) -> dict[str, int]:
    """K/V bytes one phase-B micro-batch hands its attention kernels, all layers, in fp32, from the shapes.

    ``concat``: every row gets ``cat(prefix, suffix)`` with K/V heads repeated to the query heads (what
    ``sdpa_lower_right`` passes sdpa and sdpa saves). ``merged``: the one ``[1, kv_heads, P, d]`` prefix
    plus the suffix rows' K/V, repeated to the query heads only with ``repeat_suffix`` (CUDA: see
    ``merged_attention.native_gqa``; the CPU kernel takes them as they are). ``merged_varlen``: the one
    prefix plus only the real suffix tokens (``suffix_tokens``, default ``rows x suffix_len``) at KV heads
    (no pads, no repeat). Also returned: one prefix copy and the suffix rows' K/V at KV heads, the issue's
    yardstick."""
    head_dim = model.hidden_size // model.num_heads
    unit = 2 * model.num_layers * head_dim * 4  # K and V, every layer, fp32
    one_prefix = unit * model.num_kv_heads * prefix_len
    suffix_rows = unit * rows * model.num_kv_heads * suffix_len
    if variant == "concat":
        held = unit * rows * model.num_heads * (prefix_len + suffix_len)
    elif variant == "merged":
        held = one_prefix + unit * rows * (model.num_heads if repeat_suffix else model.num_kv_heads) * suffix_len
    elif variant == "merged_varlen":
        tokens = rows * suffix_len if suffix_tokens is None else suffix_tokens
        held = one_prefix + unit * model.num_kv_heads * tokens
    else:
        raise ValueError(f"phase-B attention variant must be one of {PHASE_B_ATTENTIONS}, got {variant!r}")
    return {"held": held, "one_prefix_copy": one_prefix, "suffix_rows": suffix_rows}


def _largest_micro_batch_tokens(response_lens: list[int], cell: Cell) -> int:
    """Real suffix tokens (``response + 1`` a row, as ``attention_kv_bytes``'s ``suffix_len``) of the
    fullest micro-batch a group can form: what ``merged_varlen`` packs at most."""
    rows = min(cell.micro_batch_size, cell.group_size)
    groups = [response_lens[g : g + cell.group_size] for g in range(0, len(response_lens), cell.group_size)]
    return max(sum(sorted(lens)[-rows:]) + rows for lens in groups)


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
    runs each variant's first update in a fresh process for its peak RSS (``rss_probe``)."""
    from transformers import AutoConfig

    reps = cell_reps(cell, reps)
    skipped = {v: why for v in cell.variants if (why := unavailable_variant(v)) is not None}
    for v, why in skipped.items():
        log(f"  {cell.name}: skipping variant {v}: {why}")
    variants = tuple(v for v in cell.variants if v not in skipped)
    batch = _cell_batch(cell)
    engines = {v: _build_variant(cell, v, model_dir) for v in variants}
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
                    t, out = _time_update(engine, loss_fn, batch, capture_grads=True)
                info[v]["memory"] = memory
            elif rep == 0:
                with measure_update_memory(engine, count_saved=False) as memory, count_attention_saved() as attn:
                    t, out = _time_update(engine, loss_fn, batch, capture_grads=True)
                info[v].update(memory=memory, attention_saved_mib=[b / 1024.0**2 for b in attn])
                info[v]["prefix_metrics"] = _prefix_metrics(out)
            else:
                t, out = _time_update(engine, loss_fn, batch)
            if rep == 0:
                grads[v] = out["grads"]
            del out
            line.append(f"{v} {t:.3f}s")
            if rep >= WARMUP:
                times[v].append(t)
            if cell.time_forward_only:
                i = _time_infer(engine, batch)
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
            grads.clear()
        if tick is not None:
            tick()

    params = sum(p.numel() for p in T.params_of(engines[variants[0]][0]).values())
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
            entry["attention_kv_mib"] = {
                k: b / 1024.0**2
                for k, b in attention_kv_bytes(
                    cell.model,
                    v,
                    prefix_len=min(prompt_lens) - 1,  # the shared prefix: the prompt minus its last token
                    suffix_len=max(response_lens) + 1,
                    rows=min(cell.micro_batch_size, cell.group_size),
                    repeat_suffix=torch.cuda.is_available(),  # the engines run on CUDA when there is one
                    suffix_tokens=_largest_micro_batch_tokens(response_lens, cell),
                ).items()
            }
        if fresh_rss:
            entry["fresh_process"] = rss_probe(cell, v, model_dir)
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
        result["predicted_speedup"] = predicted_speedup(ModelShape.from_config(hf_config), groups)
    return result


def rss_probe(cell: Cell, variant: str, model_dir: Path, *, timeout_s: float = 3600.0) -> dict[str, float]:
    """One variant's first update in a fresh process: its RSS after building the engine and its peak RSS
    during that update (``VmHWM``, reset just before the update where Linux allows; otherwise the peak
    since the process started, build included). A peak in a shared process would carry the other
    variants' earlier peaks, so each variant gets its own process."""
    import subprocess

    package_root = str(Path(__file__).resolve().parents[2])
    # the parent's process group owns MASTER_PORT: the child picks its own
    dist_keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in dist_keys}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    request = json.dumps(
        {
            "cell": dataclasses.asdict(cell),
            "variant": variant,
            "model_dir": str(model_dir),
            "threads": torch.get_num_threads(),
        }
    )
    code = "import sys; from verl_prefix.tools.bench import _rss_probe_main; _rss_probe_main(sys.argv[1])"
    proc = subprocess.run(
        [sys.executable, "-c", code, request], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"rss probe for {cell.name} {variant} failed (exit {proc.returncode}): {proc.stderr[-2000:]}"
        )
    return json.loads(lines[-1])


def _rss_probe_main(request: str) -> None:
    """Child side of ``rss_probe``: build one variant, run one update, print the RSS figures as JSON."""
    import psutil

    from verl_prefix.tools.cli import _select_platform

    _select_platform()
    spec = json.loads(request)
    raw = spec["cell"]
    cell = Cell(
        **{
            **raw,
            "model": ModelSpec(**raw["model"]),
            "response_len_range": tuple(raw["response_len_range"]),
            "overrides": tuple(raw["overrides"]),
            "variants": tuple(raw["variants"]),
        }
    )
    torch.set_num_threads(spec["threads"])
    engine, loss_fn = _build_variant(cell, spec["variant"], Path(spec["model_dir"]))
    batch = _cell_batch(cell)
    gc.collect()
    before = psutil.Process().memory_info().rss / 1024.0**2
    reset = _reset_peak_rss()
    seconds, _ = _time_update(engine, loss_fn, batch)
    peak = _peak_rss_mib()
    result = {"rss_before_update_mib": before, "peak_rss_mib": peak, "peak_reset_before_update": reset}
    print(json.dumps({**result, "update_s": seconds}), flush=True)


def _reset_peak_rss() -> bool:
    """Start the process's RSS high-water mark (``VmHWM``) afresh at the current RSS (Linux ``clear_refs``
    5), so that the peak read later is the update's own. False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_mib() -> float:
    """The RSS high-water mark of this process image: ``VmHWM`` (not ``ru_maxrss``, which a child started
    by fork + exec inherits from its parent's RSS at the fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1]) / 1024.0  # kB
    raise RuntimeError("no VmHWM in /proc/self/status: peak RSS needs Linux")


def resolve_preset(
    preset: str | Preset,
    reps: int | None = None,
    threads: int | None = None,
    cells: Sequence[str] | None = None,
) -> tuple[Preset, int]:
    """Validate a request before anything slow or any file is touched: ``(preset, reps)`` or ``BenchError``.

    ``cells`` keeps only the named cells, in the preset's order (a lent GPU's minutes go to the headline).
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise BenchError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        name, preset = preset, PRESETS[preset]
    else:
        name = "custom"
    reps = preset.reps if reps is None else reps
    if reps < 1:
        raise BenchError(f"reps must be >= 1, got {reps}")
    if threads is not None and threads < 1:
        raise BenchError(f"threads must be >= 1, got {threads}")
    if cells:
        names = [c.name for c in preset.cells]
        unknown = [c for c in cells if c not in names]
        if unknown:
            raise BenchError(f"preset {name!r} has no cell {unknown[0]!r}; its cells: {', '.join(names)}")
        preset = dataclasses.replace(preset, cells=tuple(c for c in preset.cells if c.name in cells))
    if preset.needs_cuda and not torch.cuda.is_available():
        raise BenchError(f"preset {name!r} needs a CUDA GPU (torch.cuda.is_available() is False)")
    return preset, reps


# verl's use_torch_compile, on for both engines (in verl 0.9.1's FSDP engine it compiles the entropy kernel)
COMPILE_OVERRIDES = (
    "actor_rollout_ref.actor.use_torch_compile=true",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=true",
)


def compiled(cells: tuple[Cell, ...]) -> tuple[Cell, ...]:
    """The same cells with ``use_torch_compile`` on for both engines (the conservative comparison)."""
    return tuple(
        dataclasses.replace(c, name=f"{c.name} compile", overrides=c.overrides + COMPILE_OVERRIDES) for c in cells
    )


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
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
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
    """A capacity preset: ``verl_prefix.tools.capacity.run_capacity`` with the bench's result header, the
    JSON rewritten after each engine's search (``complete`` false until the last)."""
    from verl_prefix.tools.capacity import run_capacity

    started = time.perf_counter()
    previous = torch.get_num_threads()
    threads = spec.threads if threads is None else threads
    if threads is not None:
        torch.set_num_threads(threads)  # each probe child takes the parent's thread count
    saving = threading.Lock()
    try:
        header = {  # read after set_num_threads: machine_info's torch_threads is the probes' count
            "preset": name,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
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


TABLE_HEADER = (
    "| cell | params | dense update (s) | prefix update (s) | speedup median | speedup of medians "
    "| FLOP model | forward-only speedup | max rel grad diff |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def markdown_table(result: dict) -> str:
    """The result as a markdown table, one row per cell (what the CLI prints and docs embed); a result of
    variant cells gets ``variants_table``, a capacity result ``capacity.capacity_table``."""
    if "capacity" in result:
        from verl_prefix.tools.capacity import capacity_table

        return capacity_table(result["capacity"])
    if any("variants" in c for c in result["cells"]):
        return variants_table(result)
    rows = [TABLE_HEADER]
    for c in result["cells"]:
        rows.append(
            f"| {c['cell']} | {c['model']['params'] / 1e6:.2f}M | {c['dense_median_s']:.3f} | "
            f"{c['prefix_median_s']:.3f} | {c['ratio_median']:.2f}x | {c['ratio_of_medians']:.2f}x | "
            f"{c['predicted_speedup']:.2f}x | {c['infer_ratio_median']:.2f}x | {c['max_rel_grad_diff']:.1e} |"
        )
    return "\n".join(rows)


VARIANTS_HEADER = (
    "| cell | variant | reps | update median (s) | speedup vs stock | time / concat | saved for backward, "
    "B per micro-batch (MiB) | held (MiB) | attention saved per micro-batch (MiB) | attention K/V inputs (MiB) "
    "| peak RSS, fresh process (MiB) | phase-B micro-batches merged/concat | max rel grad diff |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def variants_table(result: dict) -> str:
    """Variant cells as a markdown table, one row per cell and variant. Speedups are medians of per-rep
    ratios (stock / variant), and the stock row shows the FLOP model's prediction for reuse; "time / concat"
    is the median of per-rep merged / concat times (below 1: merged faster). Attention K/V inputs: what
    the shapes say a micro-batch hands its kernels (``attention_kv_bytes``); "attention saved": measured
    (``count_attention_saved``)."""
    rows = [VARIANTS_HEADER]
    for c in result["cells"]:
        if "variants" not in c:
            continue
        for name, v in c["variants"].items():
            counts = v.get("phase_b_micro_batches")
            ran = "-" if counts is None else f"{counts['merged']:g}/{counts['concat']:g}"
            if counts is not None and counts.get("merged_varlen"):
                ran += f" (varlen {counts['merged_varlen']:g})"
            attention = max(v["attention_saved_mib"]) if v.get("attention_saved_mib") else None
            rss = v.get("fresh_process", {}).get("peak_rss_mib")
            ratio = c.get(f"{name}_over_concat_time_median") if name in ("merged", "merged_varlen") else None
            speedup = _fmt(v.get("speedup_vs_stock_median"), ".2f", "x")
            if name == "fsdp2" and "predicted_speedup" in c:
                speedup = f"FLOP model {c['predicted_speedup']:.2f}x"
            rows.append(
                f"| {c['cell']} | {name} | {c['reps']} | {v['update_median_s']:.3f} | "
                f"{speedup} | {_fmt(ratio, '.3f')} | "
                f"{_fmt(v['saved_for_backward_per_micro_batch_mib'], '.1f')} | "
                f"{_fmt(v['saved_for_backward_held_mib'], '.1f')} | {_fmt(attention, '.1f')} | "
                f"{_fmt(v.get('attention_kv_mib', {}).get('held'), '.1f')} | {_fmt(rss, '.0f')} | "
                f"{ran} | "
                f"{_fmt(v.get('max_rel_grad_diff'), '.1e')} |"
            )
    return "\n".join(rows)
