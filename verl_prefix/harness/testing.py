"""Test and benchmark harness around verl's own engine, usable on CPU in a single process.

Everything here goes through verl's real code paths: the model directory is loaded by
``HFModelConfig``, the engine is built from verl's composed Hydra config exactly as
``ActorRolloutRefWorker.init_model`` + ``TrainingWorker`` build it, and the train/infer helpers do what
``TrainingWorker.train_batch`` / ``infer_batch`` do around ``engine.train_batch`` / ``engine.infer_batch``.
A reuse engine and verl's stock engine can therefore be compared on identical inputs.
"""

from __future__ import annotations

import functools
import json
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tensordict import NonTensorData, TensorDict

SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "deepseek_v3",
    "gemma4_text",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    "gemma3_text",
    "gpt_oss",
)
_MOE_FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_5_moe_text", "qwen3_next")
# hybrids whose gated delta-net layers are sized like the attention ones (``layer_types`` via ``extra_config``)
_DELTA_NET_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


def _family_config(family: str, head_dim: int, hidden_size: int, vocab_size: int, experts: tuple[int, int]) -> dict:
    """Config fields a family needs to be tiny (beyond the common ones): DeepSeek-V3's MLA (query/key heads of
    ``head_dim``, half of it RoPE, value heads of ``head_dim // 2``, one KV head per query head) and MoE after
    one dense layer; Gemma-4's per-layer inputs and global heads shrunk (its defaults build 200M parameters)
    and a window longer than any test sequence."""
    if family == "deepseek_v3":
        return dict(
            qk_rope_head_dim=head_dim // 2,
            qk_nope_head_dim=head_dim // 2,
            v_head_dim=head_dim // 2,
            kv_lora_rank=hidden_size // 2,
            q_lora_rank=None,
            n_routed_experts=experts[0],
            num_experts_per_tok=experts[1],
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            n_shared_experts=1,
            moe_intermediate_size=hidden_size // 2,
        )
    if family == "gemma4_text":
        return dict(
            head_dim=head_dim,
            global_head_dim=2 * head_dim,
            vocab_size_per_layer_input=vocab_size,
            hidden_size_per_layer_input=8,
            sliding_window=4096,
        )
    return {}


def write_tiny_model(
    dir: str | os.PathLike,
    family: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 128,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.1,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    seed: int = 0,
    experts_implementation: str | None = None,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write a random-init HF causal LM plus a local tokenizer, loadable with no network.

    A large-ish ``initializer_range`` keeps next-token distributions away from uniform so that
    log-prob and gradient comparisons are not trivially satisfied. Dropout is always 0.
    ``experts_implementation`` (MoE only) is written into ``config.json``: transformers defaults to
    ``grouped_mm``, which has no fp64 kernel; ``"eager"`` loads everywhere. ``extra_config`` is passed
    to the config last (a sliding window, ``rope_parameters``...), so it wins. ``gemma3_text`` (sliding and
    full layers) and ``gpt_oss`` (alternating sliding layers, attention sinks, MoE) get their defaults' large
    windows and head dims scaled down to the tiny model: a window of 16, ``head_dim = hidden / heads``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in _FAMILIES:
        raise ValueError(f"family must be one of {_FAMILIES}, got {family!r}")
    out = write_tokenizer(dir, vocab_size)

    head_dim = hidden_size // num_heads
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        attention_dropout=0.0,
        initializer_range=initializer_range,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    if family in ("qwen3", "qwen3_moe", "gemma3_text", "gpt_oss", *_DELTA_NET_FAMILIES):
        kwargs["head_dim"] = head_dim
    if family in _DELTA_NET_FAMILIES:
        kwargs.update(
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            linear_num_key_heads=num_kv_heads,
            linear_num_value_heads=num_heads,
        )
    if family in ("qwen3_5_moe_text", "qwen3_next"):  # every layer sparse, with a shared expert
        kwargs.update(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=intermediate_size or hidden_size // 2,
            shared_expert_intermediate_size=intermediate_size or hidden_size // 2,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    if family == "gemma3_text":
        kwargs.update(query_pre_attn_scalar=head_dim, sliding_window=16)
    if family == "gpt_oss":
        kwargs.update(num_local_experts=num_experts, num_experts_per_tok=num_experts_per_tok, sliding_window=16)
    if family == "qwen3_moe":
        kwargs.update(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=intermediate_size or hidden_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    if family == "mistral":
        kwargs["sliding_window"] = None  # Mistral's config defaults to a 4096 window; tests choose their own
    if family == "deepseek_v3":
        kwargs["num_key_value_heads"] = num_heads  # MLA: a K/V head per query head
    kwargs.update(_family_config(family, head_dim, hidden_size, vocab_size, (num_experts, num_experts_per_tok)))
    kwargs.update(extra_config or {})
    config = AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    # verl reads "architectures" from config.json; make sure it is there.
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("architectures"), f"config.json for {family} has no architectures"
    if experts_implementation is not None:
        if family not in _MOE_FAMILIES:
            raise ValueError("experts_implementation applies to mixture-of-experts families only")
        cfg["experts_implementation"] = experts_implementation
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_tokenizer(dir: str | os.PathLike, vocab_size: int) -> Path:
    """A local word-level tokenizer of ``vocab_size`` ids (``SPECIAL_TOKENS`` first) in ``dir``; returns ``dir``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError("vocab_size must leave room for ordinary tokens")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out)
    return out


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


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _pad_right(rows: list[torch.Tensor], width: int, value: float) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def make_grpo_batch(
    *,
    num_groups: int,
    group_size: int,
    prompt_lens: list[int] | int,
    response_len_range: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    pad_token_id: int = PAD_ID,
    use_kl: bool = False,
    layout: Literal["v1", "legacy"] = "v1",
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    global_batch_size: int | None = None,
    worker_settings: dict[str, Any] | None = None,
    shared_system: int = 0,
    response_stems: tuple[int, ...] = (),
) -> TensorDict:
    """A per-rank GRPO actor-update mini-batch, as ``TrainingWorker.train_batch`` receives it.

    ``layout="v1"`` is the default trainer (``trainer.use_v1``, TransferQueue): every per-sample
    field (prompts, responses, masks, log-probs, advantages) is nested-jagged. ``layout="legacy"``
    is ``RayPPOTrainer`` (DataProto): ``prompts`` left-padded, ``responses``/masks/log-probs
    right-padded, dense ``attention_mask``, put through verl's ``left_right_2_no_padding``.
    Samples of a group are contiguous, share a ``uid`` and identical prompt tokens. The engine
    settings the worker injects (``micro_batch_size_per_gpu``...) are left to ``run_train_step``
    unless given in ``worker_settings``. ``shared_system``: every prompt starts with one block of that many
    tokens (a system prompt shared across groups, what ``prefix_reuse.tree`` computes once), before its own
    ``prompt_lens`` tokens. ``response_stems``: tree rollouts, each group's responses branching inside the
    response (what ``prefix_reuse.tree`` computes once, loss included): level ``k`` has ``2**k`` stems of
    ``response_stems[k]`` tokens (level 0 one stem for the whole group), row ``i`` taking stem
    ``i * 2**k // group_size`` of each level, then its own ``response_len_range`` tokens.
    """
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    lo, hi = response_len_range
    if not 1 <= lo <= hi:
        raise ValueError(f"response_len_range must satisfy 1 <= lo <= hi, got {response_len_range}")
    p_lens = [prompt_lens] * num_groups if isinstance(prompt_lens, int) else list(prompt_lens)
    if len(p_lens) != num_groups or min(p_lens) < 1:
        raise ValueError("prompt_lens must be one positive length per group")
    g = torch.Generator().manual_seed(seed)
    first = len(SPECIAL_TOKENS)

    def rand_tokens(n: int) -> torch.Tensor:
        return torch.randint(first, vocab_size, (n,), generator=g, dtype=torch.int64)

    prompts, responses, uids = [], [], []
    system = rand_tokens(shared_system) if shared_system else None  # drawn only when asked: seeds stay put
    for gi in range(num_groups):
        prompt = rand_tokens(p_lens[gi]) if system is None else torch.cat([system, rand_tokens(p_lens[gi])])
        stems = [[rand_tokens(n) for _ in range(2**k)] for k, n in enumerate(response_stems)]
        for row in range(group_size):
            r_len = int(torch.randint(lo, hi + 1, (1,), generator=g))
            prompts.append(prompt.clone())
            stem = [level[row * len(level) // group_size] for level in stems]
            responses.append(torch.cat([*stem, rand_tokens(r_len)]))
            uids.append(f"uid-{seed}-{gi}")
    bsz = len(prompts)
    r_lens = [len(r) for r in responses]
    r_max = max(r_lens)
    response_mask = _pad_right([torch.ones(n, dtype=torch.int64) for n in r_lens], r_max, 0)

    # GRPO advantages through verl's own estimator: outcome score on the last response token.
    scores = torch.randn(bsz, generator=g)
    token_rewards = torch.zeros(bsz, r_max)
    token_rewards[torch.arange(bsz), torch.tensor(r_lens) - 1] = scores
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards=token_rewards, response_mask=response_mask, index=np.array(uids, dtype=object)
    )
    # Old / reference log-probs near a near-uniform policy's, so PPO ratios straddle the clip range.
    base_lp = -float(np.log(vocab_size))
    old_lp = (base_lp + 0.3 * torch.randn(bsz, r_max, generator=g)) * response_mask
    ref_lp = (base_lp + 0.3 * torch.randn(bsz, r_max, generator=g)) * response_mask

    per_sample = {"advantages": advantages, "old_log_probs": old_lp}
    if use_kl:
        per_sample["ref_log_prob"] = ref_lp

    if layout == "v1":
        # TransferQueue hands every non-scalar per-sample field back as a jagged nested tensor,
        # whether or not the lengths differ (storage managers' as_nested_tensor).
        ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
        mask_rows = [response_mask[i, :n] for i, n in enumerate(r_lens)]
        tensors = {
            "prompts": _nested(prompts),
            "responses": _nested(responses),
            "response_mask": _nested(mask_rows),
            "loss_mask": _nested(mask_rows),
            "input_ids": _nested(ids),
            "position_ids": _nested([torch.arange(len(x), dtype=torch.int64) for x in ids]),
            **{k: _nested([v[i, :n] for i, n in enumerate(r_lens)]) for k, v in per_sample.items()},
        }
        batch = tu.get_tensordict(tensor_dict={**tensors, "uid": np.array(uids, dtype=object)})
    elif layout == "legacy":
        p_max = max(len(p) for p in prompts)
        left = [torch.cat([torch.full((p_max - len(p),), pad_token_id), p]) for p in prompts]
        prompts_pad = torch.stack(left)
        responses_pad = _pad_right(responses, r_max, pad_token_id)
        prompt_mask = (prompts_pad != pad_token_id).long()
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)
        tensors = {
            "prompts": prompts_pad,
            "responses": responses_pad,
            "input_ids": torch.cat([prompts_pad, responses_pad], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            **per_sample,
        }
        batch = tu.get_tensordict(tensor_dict={**tensors, "uid": np.array(uids, dtype=object)})
        batch = left_right_2_no_padding(batch)
    else:
        raise ValueError(f"layout must be 'v1' or 'legacy', got {layout!r}")

    # What the trainer's _update_actor and the worker's train_mini_batch attach to the mini-batch.
    global_token_num = [len(p) + n for p, n in zip(prompts, r_lens)]
    tu.assign_non_tensor(
        batch,
        temperature=temperature,
        calculate_entropy=calculate_entropy,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=global_batch_size or bsz,
        global_token_num=NonTensorData(global_token_num),
        update_lr_scheduler=True,
        disable_auto_offload=True,
        **(worker_settings or {}),
    )
    return batch


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
    """Full (unsharded) copies of every parameter gradient, by parameter name; None grads are skipped."""
    return {n: _full(p.grad) for part in _model_parts(engine) for n, p in part.named_parameters() if p.grad is not None}


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
    result: dict[str, Any] = {"loss": float(sum(output["loss"])), "metrics": output["metrics"]}
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
    out = {"log_probs": _nested(lps)}
    if calculate_entropy:
        out["entropy"] = _nested(ents)
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
