"""verl's own engines built and stepped in this process, usable on CPU: the harness of tests and benchmarks.

Everything here goes through verl's real code paths: the model directory is loaded by
``HFModelConfig``, the engine is built from verl's composed Hydra config exactly as
``ActorRolloutRefWorker.init_model`` + ``TrainingWorker`` build it, and the train/infer helpers do what
``TrainingWorker.train_batch`` / ``infer_batch`` do around ``engine.train_batch`` / ``engine.infer_batch``.
A reuse engine and verl's stock engine can therefore be compared on identical inputs.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import TensorDict


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: a fresh process group's ``MASTER_PORT`` (ranks, probes, tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_group() -> None:
    """A world-size-1 process group, as verl's engines need ``torch.distributed``; idempotent. gloo on CPU;
    with CUDA, NCCL for CUDA tensors (what verl's engines all-reduce there) and gloo for CPU ones."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, val in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, val)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, rank=0, world_size=1)


def _allow_fp64_precision() -> None:
    """verl's ``PrecisionType.to_dtype`` knows fp16/bf16/fp32 only; teach it fp64 for exactness tests."""
    from verl.utils.torch_dtypes import PrecisionType

    if getattr(PrecisionType.to_dtype, "_verl_prefix_fp64", False):
        return
    original = PrecisionType.to_dtype

    def to_dtype(precision: Any) -> torch.dtype:
        if precision in ("fp64", "float64", "64", 64, torch.float64):
            return torch.float64
        return original(precision)

    to_dtype._verl_prefix_fp64 = True  # type: ignore[attr-defined]
    PrecisionType.to_dtype = staticmethod(to_dtype)


def compose_ppo_config(overrides: Sequence[str] = ()) -> Any:
    """verl's ``ppo_trainer`` Hydra config, composed as ``verl.trainer.main_ppo`` does."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def build_verl_engine(
    model_dir: str | os.PathLike,
    *,
    backend: str = "fsdp2",
    dtype: Literal["float32", "float64"] = "float32",
    attn_implementation: Literal["sdpa", "eager"] = "sdpa",
    use_remove_padding: bool = False,
    gradient_checkpointing: bool = False,
    lr: float = 1e-3,
    micro_batch_size_per_gpu: int = 4,
    infer_micro_batch_size_per_gpu: int | None = None,
    use_dynamic_bsz: bool = False,
    max_token_len_per_gpu: int = 16384,
    loss_agg_mode: str = "token-mean",
    policy_loss_mode: str = "vanilla",
    use_kl_loss: bool = False,
    kl_loss_coef: float = 0.001,
    kl_loss_type: str = "low_var_kl",
    entropy_coeff: float = 0.0,
    clip_grad: float = 1.0,
    overrides: Sequence[str] = (),
) -> tuple[Any, Callable, Any]:
    """Build ``(engine, loss_fn, actor_config)`` the way verl's actor worker does, in this process.

    Config comes from verl's own ``ppo_trainer.yaml`` plus Hydra ``overrides`` (applied last, so
    they win). Mixed precision is pinned to ``dtype`` (verl's default is bf16, which CPU must
    avoid). ``backend`` becomes ``actor.strategy``, which is what the worker hands to
    ``EngineRegistry.new``.
    """
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import ActorConfig, HFModelConfig, TrainingWorkerConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
    prec = "fp32" if dtype == "float32" else "fp64"
    if prec == "fp64":
        _allow_fp64_precision()
    init_single_process_group()

    a, r, m = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model"
    infer_mbs = infer_micro_batch_size_per_gpu or micro_batch_size_per_gpu
    base = [
        f"{m}.path='{Path(model_dir).resolve()}'",
        f"+{m}.override_config.attn_implementation={attn_implementation}",
        f"{m}.use_remove_padding={use_remove_padding}",
        f"{m}.enable_gradient_checkpointing={gradient_checkpointing}",
        f"{a}.strategy={backend}",
        f"{a}.ppo_micro_batch_size_per_gpu={micro_batch_size_per_gpu}",
        f"{a}.use_dynamic_bsz={use_dynamic_bsz}",
        f"{a}.ppo_max_token_len_per_gpu={max_token_len_per_gpu}",
        f"{a}.loss_agg_mode={loss_agg_mode}",
        f"{a}.policy_loss.loss_mode={policy_loss_mode}",
        f"{a}.use_kl_loss={use_kl_loss}",
        f"{a}.kl_loss_coef={kl_loss_coef}",
        f"{a}.kl_loss_type={kl_loss_type}",
        f"{a}.entropy_coeff={entropy_coeff}",
        f"{a}.use_torch_compile=false",
        f"{a}.optim.lr={lr}",
        f"{a}.optim.clip_grad={clip_grad}",
        f"{a}.fsdp_config.model_dtype={prec}",
        f"+{a}.fsdp_config.mixed_precision={{param_dtype:{prec},reduce_dtype:{prec},buffer_dtype:{prec}}}",
        # torch.compile of the entropy kernel needs an inductor C++ build: minutes on a small CPU.
        f"{a}.fsdp_config.use_torch_compile=false",
        f"{r}.log_prob_micro_batch_size_per_gpu={infer_mbs}",
        f"{r}.log_prob_use_dynamic_bsz={use_dynamic_bsz}",
        f"{r}.log_prob_max_token_len_per_gpu={max_token_len_per_gpu}",
    ]
    cfg = compose_ppo_config([*base, *overrides]).actor_rollout_ref

    # --- ActorRolloutRefWorker.init_model, actor branch ---
    model_config: HFModelConfig = omega_conf_to_dataclass(cfg.model)
    actor_config: ActorConfig = omega_conf_to_dataclass(cfg.actor)
    actor_config.model_config = model_config
    training_config = TrainingWorkerConfig(
        model_type=actor_config.model_config.get("model_type", "language_model"),
        model_config=actor_config.model_config,
        engine_config=actor_config.engine,
        optimizer_config=actor_config.optim,
        checkpoint_config=actor_config.checkpoint,
        profiler_config=None,
    )
    assert cfg.actor.use_dynamic_bsz == cfg.rollout.log_prob_use_dynamic_bsz
    engine_config = training_config.engine_config
    engine_config.use_dynamic_bsz = cfg.actor.use_dynamic_bsz
    engine_config.infer_max_token_len_per_gpu = cfg.rollout.log_prob_max_token_len_per_gpu
    engine_config.infer_micro_batch_size_per_gpu = cfg.rollout.log_prob_micro_batch_size_per_gpu
    engine_config.max_token_len_per_gpu = cfg.actor.ppo_max_token_len_per_gpu
    engine_config.micro_batch_size_per_gpu = cfg.actor.ppo_micro_batch_size_per_gpu
    engine_config.use_remove_padding = model_config.get("use_remove_padding", False)
    loss_fn = functools.partial(ppo_loss, config=actor_config)

    # --- TrainingWorker.__init__ + reset() ---
    engine_config.use_remove_padding = model_config.get("use_remove_padding", False)
    engine_config.use_fused_kernels = model_config.get("use_fused_kernels", False)
    model_config.model_type = training_config.model_type
    engine = EngineRegistry.new(
        model_type=training_config.model_type,
        backend=engine_config.strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=training_config.optimizer_config,
        checkpoint_config=training_config.checkpoint_config,
    )
    engine.initialize()
    return engine, loss_fn, actor_config


def worker_defaults(engine: Any, *, infer: bool) -> dict[str, Any]:
    """The engine settings ``TrainingWorker.train_batch`` / ``infer_batch`` add when absent."""
    ec = engine.engine_config
    return dict(
        use_remove_padding=engine.model_config.get("use_remove_padding", False),
        use_dynamic_bsz=ec.use_dynamic_bsz,
        max_token_len_per_gpu=ec.infer_max_token_len_per_gpu if infer else ec.max_token_len_per_gpu,
        micro_batch_size_per_gpu=ec.infer_micro_batch_size_per_gpu if infer else ec.micro_batch_size_per_gpu,
        use_fused_kernels=ec.use_fused_kernels,
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def _model_parts(engine: Any) -> list[torch.nn.Module]:
    """The engine's model: one module (FSDP engines) or torchtitan's list of model parts."""
    return list(engine.module) if isinstance(engine.module, list) else [engine.module]


def grads_of(engine: Any) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of every parameter gradient, by parameter name; None grads are skipped. Under
    megatron-core's DDP the gradient accumulates in ``main_grad`` (``param.grad`` stays None): that one, this
    rank's TP shard (whole on one rank)."""
    grads = {}
    for part in _model_parts(engine):
        for name, param in part.named_parameters():
            grad = param.grad if param.grad is not None else getattr(param, "main_grad", None)
            if grad is not None:
                grads[name] = _full(grad)
    return grads


def params_of(engine: Any) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of every parameter, by name."""
    return {n: _full(p) for part in _model_parts(engine) for n, p in part.named_parameters()}


def reduce_step_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """One float per metric, as the worker (``Metric.aggregate_dp``) and trainer (``reduce_metrics``) do."""
    from verl.utils.metric import Metric
    from verl.utils.metric.utils import reduce_metrics

    flat = {}
    for key, val in metrics.items():
        vals = val if isinstance(val, list) else [val]
        flat[key] = Metric.aggregate_dp(vals) if isinstance(vals[0], Metric) else vals
    return {k: float(v) for k, v in reduce_metrics(flat).items()}


def new_language_model_engine(
    backend: str, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any = None
) -> Any:
    """An initialised verl engine from its registry, as verl's worker builds one (``model_type`` language_model;
    verl's default checkpoint config unless given)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.engine import EngineRegistry

    model_config.model_type = "language_model"
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=backend,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=checkpoint_config if checkpoint_config is not None else CheckpointConfig(),
    )
    engine.initialize()
    return engine


def run_train_step(engine: Any, loss_fn: Callable, batch: TensorDict, *, capture_grads: bool = False) -> dict:
    """One actor update on one mini-batch, as ``TrainingWorker.train_batch`` runs it.

    Returns ``loss`` (sum of micro-batch losses: each is already a share of the mini-batch total),
    ``grad_norm`` (pre-clip), ``lr`` when the scheduler stepped, the engine's raw per-micro-batch
    ``metrics`` and ``reduced_metrics`` (one float each, reduced as verl does for one DP rank), and
    with ``capture_grads`` the full gradients taken just before the optimizer step.
    """
    from verl.utils import tensordict_utils as tu

    data = batch.copy()
    for key, val in worker_defaults(engine, infer=False).items():
        if key not in data.keys():
            tu.assign_non_tensor(data, **{key: val})
    grads: dict[str, torch.Tensor] = {}
    if capture_grads:
        step = engine.optimizer_step

        def step_with_capture() -> float:
            grads.update(grads_of(engine))
            return step()

        engine.optimizer_step = step_with_capture
    try:
        disable = tu.get(data, key="disable_auto_offload", default=False)
        with engine.train_mode(disable_auto_offload=disable):
            output = engine.train_batch(data, loss_function=loss_fn)
    finally:
        if capture_grads:
            del engine.optimizer_step
    if "loss" not in output:  # a pipeline stage before the last: verl's Megatron engine returns {} there
        result: dict[str, Any] = {"loss": None, "metrics": {}, "grad_norm": None, "reduced_metrics": {}}
    else:
        result = {"loss": float(sum(output["loss"])), "metrics": output["metrics"]}
        result["grad_norm"] = output["metrics"].pop("grad_norm", None)
        result["reduced_metrics"] = reduce_step_metrics(output["metrics"])
    if tu.get(data, key="update_lr_scheduler", default=False):
        result["lr"] = engine.lr_scheduler_step()
    if capture_grads:
        result["grads"] = grads
    return result


def run_infer(engine: Any, batch: TensorDict, calculate_entropy: bool = True) -> dict:
    """Forward-only log-probs as the actor's ``compute_log_prob`` runs them (no loss).

    ``log_probs``/``entropy`` are what the worker returns: nested, one value per token of
    prompt+response, position t scoring token t+1. ``response_log_probs``/``response_entropy``
    are what the trainer stores as ``old_log_probs``/``entropy``: nested per response under the v1
    layout (``response_from_nested``), right-padded under the legacy one (``no_padding_2_padding``).
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding, response_from_nested

    data = batch.copy()
    tu.assign_non_tensor(
        data, calculate_entropy=calculate_entropy, compute_loss=False, **worker_defaults(engine, infer=True)
    )
    disable = tu.get(data, key="disable_auto_offload", default=False)
    with engine.eval_mode(disable_auto_offload=disable):
        output = engine.infer_batch(data, loss_function=None)
    if "model_output" not in output:  # a pipeline stage before the last (verl's Megatron engine returns {})
        return {k: None for k in ("log_probs", "entropy", "response_log_probs", "response_entropy")} | {"metrics": {}}
    model_output = output["model_output"]
    log_probs, entropy = model_output["log_probs"], model_output.get("entropy")

    def response_part(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        mask = batch["response_mask"]
        return response_from_nested(t, mask) if mask.is_nested else no_padding_2_padding(t, batch)

    return {
        "log_probs": log_probs,
        "entropy": entropy,
        "response_log_probs": response_part(log_probs),
        "response_entropy": response_part(entropy),
        "metrics": output["metrics"],
    }


def hf_log_probs(model: torch.nn.Module, batch: TensorDict, *, calculate_entropy: bool = False) -> dict:
    """Plain-HF reference for the engine's ``model_output``: one unpadded forward per sample.

    Returns nested full-sequence ``log_probs`` (position t scores token t+1; the last position is
    0) and optionally ``entropy``, with the autograd graph kept so a loss can be backpropagated.
    """
    temperature = float(batch["temperature"]) if "temperature" in batch.keys() else 1.0
    lps, ents = [], []
    for ids, pos in zip(batch["input_ids"].unbind(), batch["position_ids"].unbind()):
        logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0] / temperature
        logp = torch.log_softmax(logits, dim=-1)
        nxt = torch.gather(logp[:-1], 1, ids[1:, None])[:, 0]
        lps.append(torch.cat([nxt, nxt.new_zeros(1)]))
        if calculate_entropy:
            ents.append(-(logp.exp() * logp).sum(-1))
    out = {"log_probs": torch.nested.as_nested_tensor(lps, layout=torch.jagged)}
    if calculate_entropy:
        out["entropy"] = torch.nested.as_nested_tensor(ents, layout=torch.jagged)
    return out


def hf_ppo_loss(model: torch.nn.Module, actor_config: Any, batch: TensorDict) -> torch.Tensor:
    """verl's ``ppo_loss`` on plain-HF log-probs of the whole mini-batch, normalised as one rank does."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    data = batch.copy()
    tu.assign_non_tensor(data, batch_num_tokens=int(data["loss_mask"].sum()), dp_size=1)
    calc_entropy = bool(tu.get(data, key="calculate_entropy", default=False))
    loss, _ = ppo_loss(actor_config, hf_log_probs(model, data, calculate_entropy=calc_entropy), data)
    return loss
