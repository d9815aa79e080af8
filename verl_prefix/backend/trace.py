"""Record the batches an actor engine trains on, in a format ``verl_prefix.tools.replay`` reads back.

Replay's method: speed and exactness are judged on the very ``update_actor`` mini-batches a
real run produced (lengths, group sizes and advantages as they really are), not on one synthetic cell.

- **Trace**: a directory with ``manifest.json`` and one ``batch_NNNNNN.pt`` per ``engine.train_batch`` call:
  the TensorDict exactly as the engine received it (worker defaults included), the step's config (what
  ``build_verl_engine`` needs to rebuild an equivalent engine) and a reference to the model state.
  ``TraceWriter`` writes one, ``recording`` wraps a live engine's ``train_batch`` to fill it, and
  ``verl_prefix.tools.synthetic_trace`` makes one from chosen length distributions when no real run is at hand.
- **Replay** (``verl_prefix.tools.replay``): each batch runs through verl's stock ``fsdp2`` engine and through
  ``prefix_fsdp2``, both built from the same model directory and both stepping their optimizers, and
  reports per step the speed ratio, per-phase memory and how far the two runs' parameters drift apart, against the drift
  between two dense runs that differ only in their micro-batch partition (the noise floor).

Batch files hold plain data only (tensors, python scalars/strings/lists/dicts), so they load with
``torch.load(weights_only=True)``: a trace from elsewhere cannot run code when opened.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import io
import json
import os
import platform
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
    if type(obj).__module__.startswith("PIL.") and hasattr(obj, "save"):
        # a vision-language batch's chat messages hold the decoded images (verl's data set puts them there)
        buf = io.BytesIO()
        obj.save(buf, format="PNG")
        return {"__png__": buf.getvalue()}
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
        if obj.keys() == {"__png__"}:
            from PIL import Image

            return Image.open(io.BytesIO(obj["__png__"]))
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


def sequence_lengths(t: torch.Tensor) -> list[int]:
    """Each row's length in a (possibly nested) ``[rows, tokens]`` tensor."""
    if t.is_nested:
        return t.offsets().diff().tolist() if t.layout == torch.jagged else [int(x.shape[0]) for x in t.unbind()]
    return [int(t.shape[-1])] * int(t.shape[0])


def batch_groups(batch: TensorDict) -> list[tuple[int, list[int]]]:
    """``(prompt_len, response_lens)`` per uid group, in order of appearance: the FLOP model's input."""
    seq = sequence_lengths(batch["input_ids"])
    mask = batch["response_mask"]
    if mask.is_nested:
        resp = [int(r.sum()) for r in mask.unbind()]
    else:
        resp = [int(x) for x in mask.sum(-1).tolist()]
    groups: dict[str, tuple[int, list[int]]] = {}
    for uid, n, r in zip(_uids(batch), seq, resp):
        groups.setdefault(uid, (n - r, []))[1].append(r)
    return list(groups.values())


def max_token_id_of(batch: TensorDict) -> int | None:
    """The largest token id in the batch's ``input_ids`` (None without any): checked against a model's vocab."""
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
            tokens=int(sum(sequence_lengths(batch["input_ids"]))) if "input_ids" in batch.keys() else 0,
            config=config,
            model_ref=model_ref,
            max_token_id=max_token_id_of(batch),
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


def rank_trace_dir(root: str | os.PathLike) -> Path:
    """``root`` for a single process, ``root/rank<r>`` when several data-parallel ranks record at once."""
    import torch.distributed as dist

    root = Path(root)
    if dist.is_initialized() and dist.get_world_size() > 1:
        root = root / f"rank{dist.get_rank()}"
    return root


def record_train_batch(
    writer: TraceWriter,
    engine: Any,
    data: TensorDict,
    loss_function: Callable | None,
    config: dict[str, Any] | None = None,
) -> Path:
    """Record one ``engine.train_batch`` input, before the engine changes it, with its replay config.

    The step is the batch's ``global_steps`` when it carries one, else a running count.
    """
    cfg = config if config is not None else engine_replay_config(engine, loss_function)
    step = data.get("global_steps", None)
    step = getattr(step, "data", step)
    return writer.record(data, step=int(step) if isinstance(step, (int, np.integer)) else None, config=cfg)


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
    ``config`` defaults to ``engine_replay_config`` of the engine and the call's loss function. A run that
    should record from its first step sets ``record_trace_dir`` on the engine config instead.
    """
    if not isinstance(writer, TraceWriter):
        writer = TraceWriter(rank_trace_dir(writer), model_ref=model_ref, config=config)
    had_own = "train_batch" in vars(engine)
    original = engine.train_batch

    @functools.wraps(original)
    def train_batch(data: TensorDict, loss_function: Callable) -> Any:
        record_train_batch(writer, engine, data, loss_function, config)
        return original(data, loss_function)

    engine.train_batch = train_batch
    try:
        yield writer
    finally:
        if had_own:
            engine.train_batch = original
        else:
            del engine.train_batch
