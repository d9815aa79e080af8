"""Record the batches an actor engine trains on, and replay them through the dense and the prefix engine.

The paper's evaluation method: speed and exactness are judged on the very ``update_actor`` mini-batches a
real run produced (lengths, group sizes and advantages as they really are), not on one synthetic cell.

- **Trace**: a directory with ``manifest.json`` and one ``batch_NNNNNN.pt`` per ``engine.train_batch`` call:
  the TensorDict exactly as the engine received it (worker defaults included), the step's config (what
  ``build_verl_engine`` needs to rebuild an equivalent engine) and a reference to the model state.
  ``TraceWriter`` writes one, ``recording`` wraps a live engine's ``train_batch`` to fill it, and
  ``synthetic_trace`` makes one from chosen length distributions when no real run is at hand.
- **Replay**: ``replay`` runs each batch through verl's stock ``fsdp2`` engine and through ``prefix_fsdp2``,
  both built from the same model directory and both stepping their optimizers, and reports per step the
  speed ratio, per-phase memory and how far the two runs' parameters drift apart, against the drift
  between two dense runs that differ only in their micro-batch partition (the noise floor).

Batch files hold plain data only (tensors, python scalars/strings/lists/dicts), so they load with
``torch.load(weights_only=True)``: a trace from elsewhere cannot run code when opened.
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
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

FORMAT = "verl-prefix-trace"
VERSION = 1
MANIFEST = "manifest.json"
_BATCH_FILE = "batch_{:06d}.pt"

# ``build_verl_engine`` keyword arguments a trace config may carry; anything else in it is informational.
ENGINE_KWARGS = (
    "lr",
    "clip_grad",
    "micro_batch_size_per_gpu",
    "use_dynamic_bsz",
    "max_token_len_per_gpu",
    "loss_agg_mode",
    "policy_loss_mode",
    "use_kl_loss",
    "kl_loss_coef",
    "kl_loss_type",
    "entropy_coeff",
    "use_remove_padding",
    "gradient_checkpointing",
)


class TraceError(ValueError):
    """A missing, corrupt or unusable trace or model (a user mistake): one line, no traceback."""


# --------------------------------------------------------------------------------------------------------
# TensorDict <-> plain data


def _to_plain(obj: Any, where: str) -> Any:
    """A value ``torch.load(weights_only=True)`` can read back; numpy is tagged so it comes back as numpy."""
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype, torch.Size)):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, np.ndarray):
        items = [_to_plain(x, where) for x in obj.ravel().tolist()] if obj.dtype.kind == "O" else obj.tolist()
        return {"__ndarray__": items, "dtype": str(obj.dtype), "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {"__npscalar__": obj.item(), "dtype": str(obj.dtype)}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_plain(x, where) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    raise TraceError(f"cannot record {where}: {type(obj).__name__} is not plain data (tensor, number, str, list, dict)")


def _from_plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__ndarray__" in obj and obj.keys() == {"__ndarray__", "dtype", "shape"}:
            dtype = np.dtype(obj["dtype"])
            if dtype.kind == "O":
                flat = np.empty(len(obj["__ndarray__"]), dtype=object)
                flat[:] = [_from_plain(x) for x in obj["__ndarray__"]]
                return flat.reshape(obj["shape"])
            return np.array(obj["__ndarray__"], dtype=dtype).reshape(obj["shape"])
        if "__npscalar__" in obj and obj.keys() == {"__npscalar__", "dtype"}:
            return np.dtype(obj["dtype"]).type(obj["__npscalar__"])
        return {k: _from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_from_plain(x) for x in obj)
    return obj


def encode_tensordict(td: TensorDict, where: str = "batch") -> dict[str, Any]:
    """A TensorDict as a plain dict: jagged nested tensors as values + offsets, non-tensor data as python.

    Key order, dtypes, nested layouts and the NonTensorData / NonTensorStack distinction are all kept, so
    ``decode_tensordict`` rebuilds the very batch the engine saw.
    """
    fields: dict[str, Any] = {}
    for key in td.keys():
        value = td.get(key)
        name = f"{where}[{key!r}]"
        if isinstance(value, NonTensorStack):
            if len(td.batch_size) != 1:
                raise TraceError(f"cannot record {name}: non-tensor stacks need a 1-D batch")
            fields[key] = {"kind": "non_tensor_stack", "items": _to_plain(value.tolist(), name)}
        elif isinstance(value, NonTensorData):
            fields[key] = {"kind": "non_tensor_data", "value": _to_plain(value.data, name)}
        elif isinstance(value, TensorDict):
            fields[key] = {"kind": "tensordict", **encode_tensordict(value, name)}
        elif isinstance(value, torch.Tensor) and value.is_nested and value.layout == torch.jagged:
            lengths = value.lengths()
            fields[key] = {
                "kind": "nested_jagged",
                "values": value.values().detach().cpu().clone(),
                "offsets": value.offsets().detach().cpu().clone(),
                "lengths": None if lengths is None else lengths.detach().cpu().clone(),
                "ragged_idx": int(value._ragged_idx),
            }
        elif isinstance(value, torch.Tensor) and value.is_nested:
            fields[key] = {"kind": "nested_strided", "items": [t.detach().cpu().clone() for t in value.unbind()]}
        elif isinstance(value, torch.Tensor):
            fields[key] = {"kind": "tensor", "value": value.detach().cpu().clone()}
        else:
            raise TraceError(f"cannot record {name}: unsupported TensorDict entry {type(value).__name__}")
    return {"batch_size": list(td.batch_size), "fields": fields}


def decode_tensordict(payload: dict[str, Any]) -> TensorDict:
    """The TensorDict ``encode_tensordict`` saw (on CPU)."""
    td = TensorDict({}, batch_size=payload["batch_size"])
    for key, entry in payload["fields"].items():
        kind = entry["kind"]
        if kind == "tensor":
            td[key] = entry["value"]
        elif kind == "nested_jagged":
            td[key] = torch.nested.nested_tensor_from_jagged(
                entry["values"], entry["offsets"], lengths=entry["lengths"], jagged_dim=entry["ragged_idx"]
            )
        elif kind == "nested_strided":
            td[key] = torch.nested.nested_tensor(entry["items"], layout=torch.strided)
        elif kind == "non_tensor_stack":
            td[key] = NonTensorStack.from_list([NonTensorData(_from_plain(x)) for x in entry["items"]])
        elif kind == "non_tensor_data":
            td[key] = NonTensorData(_from_plain(entry["value"]))
        elif kind == "tensordict":
            td[key] = decode_tensordict(entry)
        else:
            raise TraceError(f"unknown field kind {kind!r} for {key!r}")
    return td


# --------------------------------------------------------------------------------------------------------
# Trace files


def _versions() -> dict[str, str]:
    from importlib import metadata

    import tensordict

    out = {"python": platform.python_version(), "torch": torch.__version__, "tensordict": tensordict.__version__}
    for dist in ("verl", "transformers", "verl-prefix"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _json_safe(obj: Any) -> Any:
    """Config values as JSON (OmegaConf containers, tuples and numpy scalars included)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if hasattr(obj, "items"):  # dict, DictConfig
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) or (hasattr(obj, "__iter__") and not isinstance(obj, (bytes, torch.Tensor))):
        return [_json_safe(x) for x in obj]
    return str(obj)


def _uids(batch: TensorDict) -> list[str]:
    value = batch.get("uid", None)
    if value is None:
        return [str(i) for i in range(len(batch))]
    items = value.tolist() if isinstance(value, NonTensorStack) else getattr(value, "data", value)
    if isinstance(items, np.ndarray):
        items = items.tolist()
    if not isinstance(items, list):
        items = [items] * len(batch)
    return [str(u) for u in items]


def _lengths(t: torch.Tensor) -> list[int]:
    if t.is_nested:
        return t.offsets().diff().tolist() if t.layout == torch.jagged else [int(x.shape[0]) for x in t.unbind()]
    return [int(t.shape[-1])] * int(t.shape[0])


def batch_groups(batch: TensorDict) -> list[tuple[int, list[int]]]:
    """``(prompt_len, response_lens)`` per uid group, in order of appearance: the FLOP model's input."""
    seq = _lengths(batch["input_ids"])
    mask = batch["response_mask"]
    if mask.is_nested:
        resp = [int(r.sum()) for r in mask.unbind()]
    else:
        resp = [int(x) for x in mask.sum(-1).tolist()]
    groups: dict[str, tuple[int, list[int]]] = {}
    for uid, n, r in zip(_uids(batch), seq, resp):
        groups.setdefault(uid, (n - r, []))[1].append(r)
    return list(groups.values())


def _max_token_id(batch: TensorDict) -> int | None:
    if "input_ids" not in batch.keys():
        return None
    ids = batch["input_ids"]
    flat = ids.values() if ids.is_nested and ids.layout == torch.jagged else ids
    return int(flat.max()) if flat.numel() else None


@dataclass(frozen=True)
class TraceStep:
    """One recorded ``train_batch`` call, as the manifest lists it."""

    index: int
    step: int
    file: str
    rows: int
    groups: int
    tokens: int
    config: dict[str, Any]
    model_ref: str | None
    max_token_id: int | None = None


@dataclass
class Trace:
    """A loaded trace: its manifest and a lazy view of its batches."""

    dir: Path
    manifest: dict[str, Any]
    steps: list[TraceStep]

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def model_ref(self) -> str | None:
        """The model state the batches were recorded against (replay's default model directory)."""
        return self.manifest.get("model_ref")

    @property
    def config(self) -> dict[str, Any]:
        """The trace-level config (each step also carries its own)."""
        return self.manifest.get("config") or {}

    def batch(self, i: int) -> TensorDict:
        """Batch ``i`` exactly as recorded (on CPU); a damaged file is a ``TraceError``."""
        entry = self.steps[i]
        path = self.dir / entry.file
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise TraceError(f"trace {self.dir}: {entry.file} is listed in the manifest but missing") from None
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
            raise TraceError(f"trace {self.dir}: cannot read {entry.file} ({type(exc).__name__})") from None
        if not isinstance(payload, dict) or payload.get("format") != FORMAT or "batch" not in payload:
            raise TraceError(f"trace {self.dir}: {entry.file} is not a {FORMAT} batch file")
        return decode_tensordict(payload["batch"])

    def __iter__(self) -> Iterator[tuple[TraceStep, TensorDict]]:
        for i, entry in enumerate(self.steps):
            yield entry, self.batch(i)


def load_trace(dir: str | os.PathLike) -> Trace:
    """Open a trace directory and validate its manifest; every problem is one ``TraceError`` line."""
    root = Path(dir)
    if not root.exists():
        raise TraceError(f"trace directory {root} does not exist")
    if not root.is_dir():
        raise TraceError(f"trace {root} is not a directory")
    path = root / MANIFEST
    if not path.is_file():
        ranks = sorted(p.name for p in root.glob("rank*") if (p / MANIFEST).is_file())
        hint = f" (per-rank traces found: {', '.join(ranks)}; pass one of them)" if ranks else ""
        raise TraceError(f"{root} is not a trace: no {MANIFEST}{hint}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"trace {root}: {MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TraceError(f"trace {root}: {MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise TraceError(f"trace {root}: format version {manifest.get('version')!r}, this package reads {VERSION}")
    try:
        steps = [TraceStep(**entry) for entry in manifest["steps"]]
    except (KeyError, TypeError) as exc:
        raise TraceError(f"trace {root}: malformed step list in {MANIFEST} ({exc})") from None
    if not steps:
        raise TraceError(f"trace {root} holds no batches")
    missing = [s.file for s in steps if not (root / s.file).is_file()]
    if missing:
        raise TraceError(f"trace {root}: {len(missing)} batch file(s) missing, first {missing[0]}")
    return Trace(dir=root, manifest=manifest, steps=steps)


class TraceWriter:
    """Writes a trace: one file per recorded batch plus a manifest rewritten (atomically) after each.

    A run that dies mid-way leaves a valid trace of the batches recorded so far. ``append=True`` continues
    an existing trace (a resumed run); otherwise an existing manifest is an error, so nothing is overwritten
    by accident. With several data-parallel ranks give each rank its own directory (``recording`` does).
    """

    def __init__(
        self,
        dir: str | os.PathLike,
        *,
        model_ref: str | None = None,
        config: dict[str, Any] | None = None,
        source: str = "recorded",
        append: bool = False,
    ) -> None:
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / MANIFEST
        if path.exists() and not append:
            raise TraceError(f"{self.dir} already holds a trace; choose a new directory or append")
        if path.exists():
            self.manifest = load_trace(self.dir).manifest
        else:
            self.manifest = {
                "format": FORMAT,
                "version": VERSION,
                "created": _now(),
                "updated": None,
                "source": source,
                "model_ref": model_ref,
                "config": _json_safe(config) if config is not None else None,
                "versions": _versions(),
                "steps": [],
            }

    @property
    def manifest_path(self) -> Path:
        """Where the manifest lives (rewritten after every record)."""
        return self.dir / MANIFEST

    def __len__(self) -> int:
        return len(self.manifest["steps"])

    def record(
        self,
        batch: TensorDict,
        *,
        step: int | None = None,
        config: dict[str, Any] | None = None,
        model_ref: str | None = None,
    ) -> Path:
        """Save one batch (before the engine mutates it) and list it in the manifest; returns its file.

        ``step`` is the trainer step it belongs to (several mini-batches may share one); ``config`` and
        ``model_ref`` default to the trace's own.
        """
        index = len(self)
        name = _BATCH_FILE.format(index)
        config = _json_safe(config) if config is not None else self.manifest.get("config") or {}
        model_ref = model_ref if model_ref is not None else self.manifest.get("model_ref")
        if self.manifest.get("config") is None:
            self.manifest["config"] = config
        if self.manifest.get("model_ref") is None:
            self.manifest["model_ref"] = model_ref
        step = index if step is None else int(step)
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "index": index,
            "step": step,
            "config": config,
            "model_ref": model_ref,
            "batch": encode_tensordict(batch),
        }
        path = self.dir / name
        tmp = path.with_suffix(".pt.tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)
        entry = TraceStep(
            index=index,
            step=step,
            file=name,
            rows=len(batch),
            groups=len(set(_uids(batch))),
            tokens=int(sum(_lengths(batch["input_ids"]))) if "input_ids" in batch.keys() else 0,
            config=config,
            model_ref=model_ref,
            max_token_id=_max_token_id(batch),
        )
        self.manifest["steps"].append(dataclasses.asdict(entry))
        self.manifest["updated"] = _now()
        tmp_manifest = self.manifest_path.with_suffix(".json.tmp")
        tmp_manifest.write_text(json.dumps(self.manifest, indent=2) + "\n")
        os.replace(tmp_manifest, self.manifest_path)
        return path


# --------------------------------------------------------------------------------------------------------
# Recording a live engine


def engine_replay_config(engine: Any, loss_function: Callable | None = None) -> dict[str, Any]:
    """What replay needs to rebuild an equivalent engine: micro-batching, optimizer, loss and reuse knobs.

    Read from the engine's configs and from the loss function verl's worker passes (``partial(ppo_loss,
    config=actor_config)``). Precision and attention kernel are deliberately left out: replay chooses them
    for the machine it runs on.
    """
    ec, oc, mc = engine.engine_config, engine.optimizer_config, engine.model_config
    config: dict[str, Any] = {
        "backend": getattr(ec, "strategy", None),
        "micro_batch_size_per_gpu": getattr(ec, "micro_batch_size_per_gpu", None),
        "use_dynamic_bsz": getattr(ec, "use_dynamic_bsz", False),
        "max_token_len_per_gpu": getattr(ec, "max_token_len_per_gpu", None),
        "lr": getattr(oc, "lr", None),
        "clip_grad": getattr(oc, "clip_grad", None),
        "use_remove_padding": bool(getattr(mc, "use_remove_padding", False)),
        "gradient_checkpointing": bool(getattr(mc, "enable_gradient_checkpointing", False)),
        "model_path": getattr(mc, "path", None),
    }
    optim = "actor_rollout_ref.actor.optim"
    overrides = []
    if getattr(oc, "weight_decay", None) is not None:
        overrides.append(f"{optim}.weight_decay={oc.weight_decay}")
    if getattr(oc, "betas", None) is not None:
        overrides.append(f"{optim}.betas=[{','.join(str(b) for b in oc.betas)}]")
    actor = getattr(loss_function, "keywords", {}).get("config") if loss_function is not None else None
    if actor is not None:
        policy = getattr(actor, "policy_loss", None)
        config.update(
            loss_agg_mode=getattr(actor, "loss_agg_mode", None),
            policy_loss_mode=getattr(policy, "loss_mode", None) if policy is not None else None,
            use_kl_loss=getattr(actor, "use_kl_loss", None),
            kl_loss_coef=getattr(actor, "kl_loss_coef", None),
            kl_loss_type=getattr(actor, "kl_loss_type", None),
            entropy_coeff=getattr(actor, "entropy_coeff", None),
        )
        for knob in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c"):
            if getattr(actor, knob, None) is not None:
                overrides.append(f"actor_rollout_ref.actor.{knob}={getattr(actor, knob)}")
    config["overrides"] = overrides
    reuse = getattr(engine, "reuse_config", None)
    if reuse is not None and dataclasses.is_dataclass(reuse):
        config["prefix_reuse"] = {f.name: getattr(reuse, f.name) for f in dataclasses.fields(reuse)}
    return _json_safe({k: v for k, v in config.items() if v is not None})


@contextmanager
def recording(
    engine: Any,
    writer: TraceWriter | str | os.PathLike,
    *,
    config: dict[str, Any] | None = None,
    model_ref: str | None = None,
) -> Iterator[TraceWriter]:
    """Record every batch ``engine.train_batch`` receives while the block runs (this instance only).

    ``writer`` may be a directory: with several data-parallel ranks each rank then writes ``DIR/rank<r>``.
    ``config`` defaults to ``engine_replay_config`` of the engine and the call's loss function; the step
    is the batch's ``global_steps`` when it carries one, else a running count.
    """
    import torch.distributed as dist

    if not isinstance(writer, TraceWriter):
        root = Path(writer)
        if dist.is_initialized() and dist.get_world_size() > 1:
            root = root / f"rank{dist.get_rank()}"
        writer = TraceWriter(root, model_ref=model_ref, config=config)
    had_own = "train_batch" in vars(engine)
    original = engine.train_batch

    @functools.wraps(original)
    def train_batch(data: TensorDict, loss_function: Callable) -> Any:
        cfg = config if config is not None else engine_replay_config(engine, loss_function)
        step = data.get("global_steps", None)
        step = getattr(step, "data", step)
        writer.record(data, step=int(step) if isinstance(step, (int, np.integer)) else None, config=cfg)
        return original(data, loss_function)

    engine.train_batch = train_batch
    try:
        yield writer
    finally:
        if had_own:
            engine.train_batch = original
        else:
            del engine.train_batch


# --------------------------------------------------------------------------------------------------------
# Synthetic traces


def _length_range(value: int | tuple[int, int] | list[int], name: str) -> tuple[int, int]:
    lo, hi = (value, value) if isinstance(value, int) else tuple(value)
    if not 1 <= lo <= hi:
        raise TraceError(f"{name} must be a length >= 1 or a range lo:hi with 1 <= lo <= hi, got {value}")
    return int(lo), int(hi)


def synthetic_trace(
    dir: str | os.PathLike,
    *,
    steps: int,
    groups: int,
    group_size: int,
    prefix_len: int | tuple[int, int],
    suffix_len: int | tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    micro_batch_size: int = 4,
    lr: float = 1e-5,
    model_ref: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a trace of ``steps`` GRPO mini-batches with chosen shapes, for replay without a real run.

    Each step has ``groups`` uid groups of ``group_size`` samples; a group's prompt length (the shared
    prefix) is drawn uniformly from ``prefix_len`` and each response length from ``suffix_len`` (an int or
    an inclusive ``(lo, hi)``). Batches come from ``testing.make_grpo_batch`` (GRPO advantages through
    verl's estimator), with the settings ``TrainingWorker`` injects, so they look like what an engine
    receives. ``overwrite`` replaces an existing trace in ``dir``.
    """
    from verl_prefix import testing as T

    for name, value in (("steps", steps), ("groups", groups), ("group_size", group_size)):
        if value < 1:
            raise TraceError(f"{name} must be >= 1, got {value}")
    p_lo, p_hi = _length_range(prefix_len, "prefix_len")
    s_range = _length_range(suffix_len, "suffix_len")
    if vocab_size <= len(T.SPECIAL_TOKENS):
        raise TraceError(f"vocab_size must exceed {len(T.SPECIAL_TOKENS)}, got {vocab_size}")
    root = Path(dir)
    if root.exists() and not root.is_dir():
        raise TraceError(f"{root} exists and is not a directory")
    if overwrite and (root / MANIFEST).exists():
        for old in list(root.glob("batch_*.pt")) + [root / MANIFEST]:
            old.unlink()
    config = {
        "micro_batch_size_per_gpu": micro_batch_size,
        "use_dynamic_bsz": False,
        "lr": lr,
        "synthetic": {
            "groups": groups,
            "group_size": group_size,
            "prefix_len": [p_lo, p_hi],
            "suffix_len": list(s_range),
            "vocab_size": vocab_size,
            "seed": seed,
        },
    }
    writer = TraceWriter(root, model_ref=model_ref, config=config, source="synthetic")
    rng = np.random.default_rng(seed)
    worker = dict(
        use_remove_padding=False,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=16384,
        micro_batch_size_per_gpu=micro_batch_size,
        use_fused_kernels=False,
    )
    for step in range(steps):
        batch = T.make_grpo_batch(
            num_groups=groups,
            group_size=group_size,
            prompt_lens=[int(x) for x in rng.integers(p_lo, p_hi + 1, size=groups)],
            response_len_range=s_range,
            vocab_size=vocab_size,
            seed=seed * 100_003 + step,
            worker_settings=worker,
        )
        writer.record(batch, step=step)
    return root


# --------------------------------------------------------------------------------------------------------
# Replay


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
            top = _max_token_id(trace.batch(i))
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
        longest = max(_lengths(batch["input_ids"]))
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


def prefix_memory_by_phase(metrics: dict[str, float], measured_update_peak: float | None = None) -> dict[str, Any]:
    """The prefix engine's per-phase memory metrics, regrouped by kind, plus its whole-update device peak.

    The engine resets the allocator's peak at every phase start, so a peak read around the whole update
    (``measured_update_peak``) only covers the time since the last phase began; the update's true peak is
    the larger of that and every phase's own peak.
    """
    out: dict[str, Any] = {"saved_for_backward_mib": {}, "peak_device_mib": {}, "rss_mib": {}}
    kinds = {
        "prefix/max_saved_for_backward_mib/": "saved_for_backward_mib",
        "prefix/max_peak_device_mib/": "peak_device_mib",
        "prefix/max_rss_mib/": "rss_mib",
    }
    for key, value in metrics.items():
        for head, kind in kinds.items():
            if key.startswith(head):
                out[kind][key[len(head) :]] = value
    if "prefix/max_saved_for_backward_held_mib" in metrics:
        out["saved_for_backward_held_mib"] = metrics["prefix/max_saved_for_backward_held_mib"]
    if measured_update_peak is not None:
        out["update_peak_device_mib"] = max([measured_update_peak, *out["peak_device_mib"].values()])
    return out


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
    another micro-batch partition. Both are cumulative over steps. ``model_dir`` defaults to the trace's
    ``model_ref`` when that is a directory here. Returns (and optionally writes) the JSON result.
    """
    from tqdm.auto import tqdm

    import verl_prefix
    from verl_prefix import testing as T
    from verl_prefix.bench import _time_update, machine_info, measure_update_memory
    from verl_prefix.flops import ModelShape, predicted_speedup

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
            T.build_verl_engine,
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
        p_initial = T.params_of(dense)
        identical = _distance(p_initial, T.params_of(prefix)) == 0.0
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
                t_dense, _ = _time_update(dense, dense_loss, batch)
                t_prefix, _ = _time_update(prefix, prefix_loss, batch)
                if rep >= (warmup if i == 0 else 0):
                    dense_s.append(t_dense)
                    prefix_s.append(t_prefix)
            gc.collect()
            with measure_update_memory(dense) as dense_mem:
                out_dense = T.run_train_step(dense, dense_loss, batch)
            with measure_update_memory(prefix, count_saved=False) as prefix_mem:
                out_prefix = T.run_train_step(prefix, prefix_loss, batch)
            p_dense, p_prefix = T.params_of(dense), T.params_of(prefix)
            update = _distance(p_dense, p_initial)
            drift = _distance(p_prefix, p_dense) / update if update > 0 else math.nan
            row_noise, variant, out_noise = math.nan, None, None
            if noisy is not None:
                noise_batch, variant = _noise_batch(batch)
                if noise_batch is not None:
                    out_noise = T.run_train_step(noisy[0], noisy[1], noise_batch)
                    row_noise = _distance(T.params_of(noisy[0]), p_dense) / update if update > 0 else math.nan
            del p_dense, p_prefix
            metrics = {k: v for k, v in out_prefix["reduced_metrics"].items() if k.startswith("prefix/")}
            groups = batch_groups(batch)
            ratios = [d / p for d, p in zip(dense_s, prefix_s)]
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
                "predicted_speedup": predicted_speedup(shape, groups),
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
                    if k.startswith("prefix/time_s/") and not k.endswith("/schedule")
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
            "date": _now(),
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
