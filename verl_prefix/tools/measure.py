"""The measuring primitives every tool shares: the platform choice, the machine a figure came from, the
time of one update and its memory (peak RSS and its reset, the device allocator's peak, bytes saved for
backward).

The benches, the capacity search and its probes, replay and the CLI all measure through these, so that a
"peak RSS" or an "update time" means the same thing in every result file. Below every command in the
tools layer: it imports only the harness's ``verl_engine`` (the settings verl's worker adds to a batch).
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing.context
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from verl_prefix.harness import verl_engine
from verl_prefix.schedule.telemetry import SavedBytes

_MIB = 1024.0**2


# what a fresh measuring process needs imported; its forkserver imports them once per parent process
FRESH_PRELOAD = ("torch", "torch.distributed", "verl_prefix")


def fresh_process_context() -> multiprocessing.context.BaseContext:
    """A multiprocessing context for processes that measure from a clean start (their own peak RSS, no
    state of this process). On CPU they fork from a forkserver that imported ``FRESH_PRELOAD`` once:
    ``spawn`` pays those imports in every process (seconds each on 2 cores). With CUDA they spawn, since
    importing verl has already asked the driver for devices and CUDA does not survive a fork after that."""
    if torch.cuda.is_available():
        return torch.multiprocessing.get_context("spawn")
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(FRESH_PRELOAD))
    return ctx


def run_fresh(module: str, request: str, *, timeout_s: float | None = None) -> tuple[int | None, str, str]:
    """``module.main([request])`` in a fresh process (``fresh_process_context``) with ``probe_env()``'s
    environment, as ``python -m module request`` would run it: its exit code (``None`` when it ran past
    ``timeout_s`` and was killed), its stdout and its stderr (file descriptors 1 and 2, so C-level output
    and a child that ends itself with ``os._exit`` after a flushed print are captured too)."""
    ctx = fresh_process_context()
    with tempfile.TemporaryDirectory(prefix="verl_prefix_fresh_") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = ctx.Process(target=_fresh_main, args=(module, request, probe_env(), str(out), str(err)))
        proc.start()
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
            return None, _read(out), _read(err)
        return proc.exitcode, _read(out), _read(err)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _fresh_main(module: str, request: str, env: dict[str, str], out: str, err: str) -> None:
    os.environ.clear()  # the caller's environment now, not the forkserver's from when it started
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    importlib.import_module(module).main([request])
    sys.stdout.flush()


def select_platform() -> None:
    """Without CUDA, put verl on its CPU platform before any verl engine code runs.

    Every process that builds an engine calls it first: the CLI, and each fresh probe process (which
    inherits the environment but not the parent's registered platform)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VERL_PLATFORM", "cpu")
        os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from verl_prefix.backend.platform_cpu import cpu_platform_requested, ensure_cpu_platform

    if cpu_platform_requested():
        ensure_cpu_platform()  # the package may have been imported before the variable was set


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


def timestamp() -> str:
    """Now, with the local offset, to the second: every result file's ``date``."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def probe_env() -> dict[str, str]:
    """The environment of a fresh measuring process: this package first on ``PYTHONPATH`` (the child must
    import the same code as the parent), and no ``torch.distributed`` rendezvous variables (the parent's
    process group owns ``MASTER_PORT``; the child picks its own)."""
    package_root = str(Path(__file__).resolve().parents[2])
    dist_keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in dist_keys}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    return env


def _sync() -> None:
    from verl.utils.device import get_torch_device

    get_torch_device().synchronize()


def _train_data(engine: Any, batch: Any) -> Any:
    """The mini-batch as ``TrainingWorker.train_batch`` hands it to the engine (worker defaults added)."""
    from verl.utils import tensordict_utils as tu

    data = batch.copy()
    for key, val in verl_engine.worker_defaults(engine, infer=False).items():
        if key not in data.keys():
            tu.assign_non_tensor(data, **{key: val})
    tu.maybe_fix_3d_position_ids(data)
    return data


def _infer_data(engine: Any, batch: Any) -> Any:
    """The batch as the actor's ``compute_log_prob`` hands it to the engine (old log-probs, with entropy)."""
    from verl.utils import tensordict_utils as tu

    data = batch.copy()
    tu.assign_non_tensor(
        data, calculate_entropy=True, compute_loss=False, **verl_engine.worker_defaults(engine, infer=True)
    )
    tu.maybe_fix_3d_position_ids(data)
    return data


def time_update(engine: Any, loss_fn: Callable, batch: Any, *, capture_grads: bool = False) -> tuple[float, dict]:
    """Seconds for one update's zero_grad + forward/backward, no optimizer step (weights stay identical,
    so every rep measures the same work).

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
            output["grads"] = verl_engine.grads_of(engine)
    return elapsed, output


def time_infer(engine: Any, batch: Any) -> float:
    """Seconds for one forward-only log-prob pass over the batch."""
    data = _infer_data(engine, batch)
    with engine.eval_mode(disable_auto_offload=True):
        _sync()
        start = time.perf_counter()
        with torch.no_grad():
            engine.forward_backward_batch(data, None, forward_only=True)
        _sync()
        return time.perf_counter() - start


def device_module() -> Any | None:
    """``torch.cuda`` or ``torch.npu`` where one is available (their allocators report peaks), else None."""
    if torch.cuda.is_available():
        return torch.cuda
    if hasattr(torch, "npu") and torch.npu.is_available():  # pragma: no cover - NPU machines only
        return torch.npu
    return None


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
    module = device_module()
    had_own = "forward_step" in vars(engine)
    if count_saved:
        original = engine.forward_step
        stats["saved_for_backward_held_mib"] = 0.0

        def forward_step(*args: Any, **kwargs: Any) -> Any:
            # the module: what checkpointed layers recompute counts too (torchtitan's list of parts: none)
            counter = SavedBytes(engine.module if isinstance(engine.module, torch.nn.Module) else None)
            with counter.counting():
                out = original(*args, **kwargs)
            held = counter.total / _MIB
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
            stats["peak_device_mib"] = module.max_memory_allocated() / _MIB
        if count_saved:
            if had_own:
                engine.forward_step = original
            else:
                del engine.forward_step


def prefix_memory_by_phase(metrics: dict[str, float], measured_update_peak: float | None = None) -> dict[str, Any]:
    """The prefix engine's per-phase memory metrics, regrouped by kind, plus its whole-update device peak.

    The engine resets the allocator's peak at every phase start but keeps the lifetime peak readable, so a
    peak read around the whole update (``measured_update_peak``) covers it; the larger of that and every
    phase's own peak is the update's peak either way. Replay writes this, and the report reads bench
    results through it, so both show the same figures.
    """
    out: dict[str, Any] = {"saved_for_backward_mib": {}, "peak_device_mib": {}, "rss_mib": {}}
    kinds = {
        "prefix/max_saved_for_backward_mib/": "saved_for_backward_mib",
        "prefix/max_peak_device_mib/": "peak_device_mib",
        "prefix/max_rss_mib/": "rss_mib",
    }
    for key, value in metrics.items():
        for head, kind in kinds.items():
            phase = key[len(head) :]
            # every rank reports every phase; one that did not run (no time) has no memory to show
            if key.startswith(head) and metrics.get(f"prefix/time_s/{phase}", 1.0) > 0:
                out[kind][phase] = value
    if "prefix/max_saved_for_backward_held_mib" in metrics:
        out["saved_for_backward_held_mib"] = metrics["prefix/max_saved_for_backward_held_mib"]
    if measured_update_peak is not None:
        out["update_peak_device_mib"] = max([measured_update_peak, *out["peak_device_mib"].values()])
    return out


def rss_mib() -> float:
    """This process's resident set size now (MiB): the baseline a peak is taken above."""
    import psutil

    return psutil.Process().memory_info().rss / _MIB


def reset_peak_rss() -> bool:
    """Start the process's RSS high-water mark (``VmHWM``) afresh at the current RSS (Linux ``clear_refs``
    5), so that the peak read later is the update's own. False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """The RSS high-water mark of this process image: ``VmHWM`` (not ``ru_maxrss``, which a child started
    by fork + exec inherits from its parent's RSS at the fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1]) / 1024.0  # kB
    raise RuntimeError("no VmHWM in /proc/self/status: peak RSS needs Linux")


__all__ = [
    "device_module",
    "machine_info",
    "measure_update_memory",
    "peak_rss_mib",
    "prefix_memory_by_phase",
    "probe_env",
    "reset_peak_rss",
    "rss_mib",
    "select_platform",
    "time_infer",
    "time_update",
    "timestamp",
]
