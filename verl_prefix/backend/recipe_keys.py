"""What every training-side key of verl's ``ppo_trainer.yaml`` does to reuse, and the compatibility matrix.

One source of truth, so the docs cannot drift from what runs: ``tests/backend/test_recipe_keys.py`` walks verl's
generated YAML under ``actor_rollout_ref.{actor,ref,model}`` and fails on a key ``KEYS`` does not classify (a new
verl key), builds engines for the keys classified ``served`` or ``dense`` and checks the claim; ``render`` writes
``docs/compatibility.md`` (``verl-prefix compat --write``) from ``MATRIX`` and a tally of ``KEYS``, and a test checks
the committed page and that every test a cell cites exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KeyStatus = Literal["no_effect", "served", "dense", "refused", "gpu_check", "selector"]
CellStatus = Literal["reuses", "dense", "refused", "gpu_check", "absent", "untested"]

E = "tests/backend/test_engine_exactness.py"
R = "tests/backend/test_recipe_keys.py"
RS = "tests/backend/test_recipe_sets.py"
FB = "tests/backend/test_fallbacks_and_bad_input.py"


@dataclass(frozen=True)
class KeyEffect:
    """One key's effect on reuse: ``status``, why, the test backing it, and for ``dense`` the fallback reason
    (its warning names the key, ``fallbacks.REASON_HINTS``)."""

    status: KeyStatus
    why: str
    test: str = ""
    reason: str = ""


def _fx(status: KeyStatus, why: str, test: str = "", reason: str = "") -> KeyEffect:
    return KeyEffect(status, why, test, reason)


_LOSS = _fx("served", "the loss runs on reuse's log-probs, as on the stock engine's", f"{E}::test_every_policy_loss")
_AGG = _fx("served", "loss aggregation over the mini-batch's global counts", f"{E}::test_every_loss_agg_mode")
_BATCHING = _fx("served", "micro-batch sizes and token budgets; phase B plans its own", f"{R}::test_served_keys_reuse")
_REF_BATCHING = _fx(
    "served", "forward-only micro-batch sizes and token budgets", f"{E}::test_infer_batch_matches_stock"
)
_KL = _fx("served", "the KL term runs on reuse's log-probs; every type verl accepts", f"{R}::test_loss_keys_reuse")
_FSDP = _fx("served", "FSDP2 sharding and prefetch: the same collectives on every path", f"{R}::test_served_keys_reuse")
_ENTROPY = _fx(
    "served",
    "the engine's entropy function follows verl's config",
    f"{E}::test_entropy_variants_follow_the_engine_config",
)
_ULYSSES = _fx(
    "served", "Ulysses sequence parallelism (needs remove padding)", "tests/backend/test_ulysses_engine.py::"
    "test_ulysses_reuse_matches_the_engine_without_sequence_parallelism"
)  # fmt: skip
_OFFLOAD = _fx("gpu_check", "parameter/optimizer offload between steps; verl skips it on CPU")
_QAT = _fx("gpu_check", "verl's quantisation-aware training needs its triton fake-quant kernels")
_COMPILE = _fx(
    "served",
    "torch.compile of verl's entropy function, which reuse calls too (inductor on CPU, the e2e tier)",
    "tests/backend/test_torch_compile_engine.py::test_compiled_entropy_function_reuses_and_matches_the_stock_engine",
)
_NONE = _fx("no_effect", "outside the update's maths (paths, seeds of the data loader, logging)")
_PAD = _fx("served", "verl's bucketed padding of packed rows", f"{R}::test_served_keys_reuse")
_DTYPE = _fx(
    "served", "parameter/compute dtype (fp32 and fp64 tested; bf16 on GPU)", f"{E}::test_update_matches_stock_engine"
)


def _engine_keys(role: str) -> dict[str, KeyEffect]:
    """The ``fsdp_config`` keys actor and ref share."""
    f = f"{role}.fsdp_config"
    return {
        f"{f}._target_": _fx("no_effect", "the engine config class; PrefixFSDPEngineConfig adds the reuse knobs"),
        f"{f}.wrap_policy.min_num_params": _FSDP,
        f"{f}.param_offload": _OFFLOAD,
        f"{f}.optimizer_offload": _OFFLOAD,
        f"{f}.offload_policy": _OFFLOAD,
        f"{f}.reshard_after_forward": _FSDP,
        f"{f}.fsdp_size": _FSDP,
        f"{f}.forward_prefetch": _FSDP,
        f"{f}.model_dtype": _DTYPE,
        f"{f}.dtype": _DTYPE,
        f"{f}.use_orig_params": _FSDP,
        f"{f}.seed": _FSDP,
        f"{f}.full_determinism": _FSDP,
        f"{f}.ulysses_sequence_parallel_size": _ULYSSES,
        f"{f}.entropy_from_logits_with_chunking": _ENTROPY,
        f"{f}.entropy_from_logits_chunk_size": _ENTROPY,
        f"{f}.entropy_checkpointing": _ENTROPY,
        f"{f}.use_torch_compile": _COMPILE,
        f"{f}.use_no_sync_for_gradient_accumulation": _FSDP,
        f"{f}.pad_to_length": _PAD,
        f"{f}.pad_to_length_bucket": _PAD,
        f"{f}.forward_only": _fx("no_effect", "verl sets it per role: the ref engine is forward-only"),
        f"{f}.strategy": _fx("selector", "mapped from actor.strategy by the worker"),
        f"{f}.qat.*": _QAT,
        f"{f}.turbo_config.*": _fx("no_effect", "read by verl's VeOmni engine only"),
        f"{role}.profiler.*": _fx("no_effect", "profiling"),
    }


KEYS: dict[str, KeyEffect] = {
    **_engine_keys("actor"),
    **_engine_keys("ref"),
    # -- actor -------------------------------------------------------------------------------------------
    "actor._target_": _fx("no_effect", "the actor config class; PrefixFSDPActorConfig adds the reuse knobs"),
    "actor.rollout_n": _NONE,
    "actor.strategy": _fx(
        "selector", "prefix_fsdp2 / prefix_torchtitan / prefix_megatron select reuse; fsdp, fsdp2 are verl's own"
    ),
    "actor.ppo_mini_batch_size": _BATCHING,
    "actor.ppo_micro_batch_size": _fx(
        "served",
        "verl's deprecated global form of ppo_micro_batch_size_per_gpu; any micro-batch split is exact",
        f"{E}::test_every_suffix_partition",
    ),
    "actor.ppo_micro_batch_size_per_gpu": _BATCHING,
    "actor.use_dynamic_bsz": _fx(
        "served", "token-budget micro-batches", f"{E}::test_dynamic_batch_size_and_gradient_checkpointing"
    ),
    "actor.ppo_max_token_len_per_gpu": _BATCHING,
    "actor.clip_ratio": _LOSS,
    "actor.clip_ratio_low": _LOSS,
    "actor.clip_ratio_high": _LOSS,
    "actor.clip_ratio_c": _LOSS,
    "actor.tau_pos": _LOSS,
    "actor.tau_neg": _LOSS,
    "actor.policy_loss._target_": _NONE,
    "actor.policy_loss.loss_mode": _LOSS,
    "actor.policy_loss.clip_cov_ratio": _LOSS,
    "actor.policy_loss.clip_cov_lb": _LOSS,
    "actor.policy_loss.clip_cov_ub": _LOSS,
    "actor.policy_loss.kl_cov_ratio": _LOSS,
    "actor.policy_loss.ppo_kl_coef": _LOSS,
    "actor.policy_loss.dro_beta": _LOSS,
    "actor.loss_agg_mode": _AGG,
    "actor.loss_scale_factor": _AGG,
    "actor.entropy_coeff": _fx("served", "entropy bonus", f"{E}::test_update_matches_stock_engine"),
    "actor.calculate_entropy": _fx("served", "entropy in the update", f"{E}::test_update_matches_stock_engine"),
    "actor.calculate_sum_pi_squared": _fx(
        "dense",
        "sum(pi^2) over the vocabulary per token is not computed by reuse",
        f"{FB}::test_sum_pi_squared_runs_dense_and_is_counted",
        "sum_pi_squared",
    ),
    "actor.use_kl_loss": _fx(
        "served", "KL loss on ref log-probs (the ref reuses too)", f"{E}::test_update_matches_stock_engine"
    ),
    "actor.kl_loss_coef": _KL,
    "actor.kl_loss_type": _KL,
    "actor.use_prefix_grouper": _fx(
        "served",
        "verl's flag, which its FSDP engine ignores; the prefix engine reuses either way",
        f"{R}::test_served_keys_reuse",
    ),
    "actor.use_torch_compile": _COMPILE,
    "actor.ppo_epochs": _fx("no_effect", "each epoch is another update through the same engine"),
    "actor.shuffle": _fx(
        "served",
        "the prefix balancer keeps shuffled groups whole",
        "tests/backend/test_trainer_balance.py::test_shuffled_groups_land_whole_on_one_rank",
    ),
    "actor.data_loader_seed": _NONE,
    "actor.checkpoint.*": _fx("no_effect", "checkpoint contents; FSDP2 checkpoints as with strategy=fsdp2"),
    "actor.use_fused_kernels": _fx(
        "served",
        "verl's fused log-probs and entropy inside the LM head's call",
        "tests/backend/test_fused_kernels_engine.py::test_tied_embeddings_match_the_stock_engine_with_fused_kernels",
    ),
    "actor.qat.*": _QAT,
    "actor.grad_clip": _fx("no_effect", "clipping after the schedule's gradients"),
    "actor.ulysses_sequence_parallel_size": _ULYSSES,
    "actor.entropy_from_logits_with_chunking": _ENTROPY,
    "actor.entropy_from_logits_chunk_size": _ENTROPY,
    "actor.entropy_checkpointing": _ENTROPY,
    "actor.pad_to_length": _PAD,
    "actor.use_remove_padding": _fx(
        "served",
        "packed dense rows; groups pad inside",
        f"{FB}::test_remove_padding_dense_rows_match_the_padded_stock_engine",
    ),
    "actor.freeze_vision_tower": _fx(
        "served",
        "a frozen vision tower",
        "tests/backend/test_multimodal_engine.py::test_freeze_vision_tower_flag_is_honoured",
    ),
    "actor.optim.*": _fx("no_effect", "the optimizer steps on the schedule's gradients"),
    # -- ref (forward-only) ---------------------------------------------------------------------------------
    "ref._target_": _fx("no_effect", "the ref config class; PrefixFSDPActorConfig adds the reuse knobs"),
    "ref.rollout_n": _NONE,
    "ref.strategy": _fx("selector", "follows actor.strategy, so ref log-probs reuse too"),
    "ref.use_torch_compile": _COMPILE,
    "ref.log_prob_micro_batch_size": _REF_BATCHING,
    "ref.log_prob_micro_batch_size_per_gpu": _REF_BATCHING,
    "ref.log_prob_use_dynamic_bsz": _REF_BATCHING,
    "ref.log_prob_max_token_len_per_gpu": _REF_BATCHING,
    "ref.ulysses_sequence_parallel_size": _ULYSSES,
    "ref.entropy_from_logits_with_chunking": _ENTROPY,
    "ref.entropy_from_logits_chunk_size": _ENTROPY,
    "ref.entropy_checkpointing": _ENTROPY,
    "ref.pad_to_length": _PAD,
    # -- model ------------------------------------------------------------------------------------------------
    "model._target_": _NONE,
    "model.path": _NONE,
    "model.hf_config_path": _NONE,
    "model.tokenizer_path": _NONE,
    "model.use_shm": _NONE,
    "model.trust_remote_code": _NONE,
    "model.custom_chat_template": _NONE,
    "model.external_lib": _NONE,
    "model.enable_gradient_checkpointing": _fx(
        "served", "verl's non-reentrant checkpointing", f"{E}::test_dynamic_batch_size_and_gradient_checkpointing"
    ),
    "model.enable_activation_offload": _fx(
        "dense",
        "verl's offload handler wraps each layer in a reentrant checkpoint; forward-only passes still reuse",
        "tests/backend/test_silent_wrongness.py::test_verl_activation_offload_runs_dense_and_matches_stock",
        "activation_offload",
    ),
    "model.use_remove_padding": _fx(
        "served",
        "packed dense rows; groups pad inside",
        f"{FB}::test_remove_padding_dense_rows_match_the_padded_stock_engine",
    ),
    "model.lora_rank": _fx(
        "served", "LoRA adapters (PEFT) train under reuse", f"{RS}::test_recipe_sets_match_the_stock_engine"
    ),
    "model.lora_alpha": _fx("served", "LoRA scaling", f"{RS}::test_recipe_sets_match_the_stock_engine"),
    "model.target_modules": _fx("served", "LoRA targets", f"{RS}::test_recipe_sets_match_the_stock_engine"),
    "model.exclude_modules": _fx("served", "LoRA exclusions", f"{RS}::test_recipe_sets_match_the_stock_engine"),
    "model.lora_adapter_path": _fx("no_effect", "where LoRA weights start; the update is LoRA's"),
    "model.use_liger": _fx("gpu_check", "liger-kernel's patched HF modules (triton); not installed on the CPU image"),
    "model.use_fused_kernels": _fx(
        "served",
        "verl's fused log-probs and entropy inside the LM head's call",
        "tests/backend/test_fused_kernels_engine.py::test_tied_embeddings_match_the_stock_engine_with_fused_kernels",
    ),
    "model.fused_kernel_options.impl_backend": _fx(
        "served",
        "torch (tested); triton and liger are GPU kernels behind the same call",
        "tests/backend/test_fused_kernels_engine.py::test_tied_embeddings_match_the_stock_engine_with_fused_kernels",
    ),
    "model.tiled_mlp.enabled": _fx(
        "served", "verl's tiled MLP (per token)", f"{RS}::test_recipe_sets_match_the_stock_engine"
    ),
    "model.tiled_mlp.num_shards": _fx("served", "tiles of the MLP", f"{RS}::test_recipe_sets_match_the_stock_engine"),
    "model.mtp.*": _fx("no_effect", "multi-token prediction: read by verl's Megatron engine only"),
    "model.lora.*": _fx("no_effect", "Megatron's LoRA block; the FSDP engine reads only lora.merge (weight sync)"),
}


# -- verl's Megatron engine config (``actor_rollout_ref.{actor,ref}.megatron``, ``model_engine=megatron``) ------------

ME_ = "tests/backend/test_megatron_engine.py"
_MEGA_EXACT = f"{ME_}::test_update_and_log_probs_match_verl_megatron_engine"
_MEGA_REFUSED = f"{ME_}::test_refusals_name_the_knob"
_MEGA_PP = "tests/backend/test_megatron_pipeline.py::test_pipeline_stages_reuse_exactly"
_MEGA_SELECT = "tests/backend/test_selection.py::test_one_line_builds_the_prefix_engine_for_actor_and_ref"
_MEGA_MOE = "tests/backend/test_megatron_moe.py::test_aux_loss_update_matches_verl_megatron_engine"
_MEGA_RECOMPUTE = "tests/backend/test_megatron_recompute.py::test_reuse_under_recompute_matches_verls_engine"
_MEGA_OFFLOAD = "tests/backend/test_megatron_offload.py::test_prefix_engine_with_offload_matches_verls_engine"
_MEGA_CKPT = f"{ME_}::test_weight_export_and_checkpoint_round_trip"
_MEGA_DIST_CKPT = _fx("no_effect", "verl's checkpoint format and its load path, outside the update's maths")


def _megatron_keys(role: str) -> dict[str, KeyEffect]:
    """The ``megatron`` engine-config keys actor and ref share, as ``prefix_megatron`` treats them."""
    m = f"{role}.megatron"
    served_pp = _fx(
        "served",
        "every stage runs the schedule on its own layers, activations and gradients crossing by point-to-point "
        "sends; expert bias served, the MoE aux loss under PP refused",
        _MEGA_PP,
    )
    served_vpp = _fx(
        "served",
        "several model chunks per rank: a call runs them in order, relayed around the ring of ranks; every "
        "micro-batch backpropagated right after its forward",
        _MEGA_PP,
    )
    return {
        f"{m}._target_": _fx(
            "selector", "the engine config class; the plugin swaps in PrefixMcoreEngineConfig", _MEGA_SELECT
        ),
        f"{m}.strategy": _fx("selector", "set from actor.strategy by the plugin in every worker", _MEGA_SELECT),
        f"{m}.param_offload": _fx(
            "served", "verl's offload between passes (real on CPU via the platform)", _MEGA_OFFLOAD
        ),
        f"{m}.optimizer_offload": _fx("served", "the distributed optimizer's state between passes", _MEGA_OFFLOAD),
        f"{m}.tensor_model_parallel_size": _fx("served", "TP=2 on gloo; dK/dV stay with the heads' rank", _MEGA_EXACT),
        f"{m}.expert_model_parallel_size": _fx(
            "served", "EP=2; the aux loss and expert bias counted per row", _MEGA_MOE
        ),
        f"{m}.expert_tensor_parallel_size": _fx(
            "served",
            "megatron-core's expert TP (follows TP by default; 1 beside TP=2 tested)",
            "tests/backend/test_megatron_moe.py::test_aux_loss_under_sequence_parallelism_matches_verl_megatron_engine",
        ),
        f"{m}.pipeline_model_parallel_size": served_pp,
        f"{m}.virtual_pipeline_model_parallel_size": served_vpp,
        f"{m}.context_parallel_size": _fx(
            "refused", "CP's ring exchange of the prefix K/V is not built", _MEGA_REFUSED
        ),
        f"{m}.dynamic_context_parallel": _fx("refused", "see context_parallel_size", _MEGA_REFUSED),
        f"{m}.max_seqlen_per_dp_cp_rank": _fx("no_effect", "read by dynamic context parallelism only (refused)"),
        f"{m}.sequence_parallel": _fx(
            "served",
            "each schedule call padded to a multiple of TP; on CPU too (the platform's sequence_parallel_norm), MoE "
            "aux and expert counts per slice; bf16 SP: GPU check",
            "tests/backend/test_megatron_pipeline.py::test_pipeline_stages_with_data_or_tensor_parallelism",
        ),
        f"{m}.use_distributed_optimizer": _fx("served", "DP=2 with the distributed optimizer", _MEGA_EXACT),
        f"{m}.use_dist_checkpointing": _MEGA_DIST_CKPT,
        f"{m}.dist_checkpointing_path": _MEGA_DIST_CKPT,
        f"{m}.dist_checkpointing_prefix": _MEGA_DIST_CKPT,
        f"{m}.dist_ckpt_optim_fully_reshardable": _MEGA_DIST_CKPT,
        f"{m}.distrib_optim_fully_reshardable_mem_efficient": _MEGA_DIST_CKPT,
        f"{m}.entropy_from_logits_with_chunking": _fx(
            "served", "verl's entropy function on the schedule's logits", _MEGA_EXACT
        ),
        f"{m}.entropy_from_logits_chunk_size": _fx(
            "served", "verl's entropy function on the schedule's logits", _MEGA_EXACT
        ),
        f"{m}.seed": _fx("no_effect", "megatron-core's RNG seeds; dropout must be 0 under reuse (refused otherwise)"),
        f"{m}.override_transformer_config.recompute_granularity": _fx(
            "served",
            "full and selective; phase A's checkpoints run straight, phase B's re-enter the call",
            _MEGA_RECOMPUTE,
        ),
        f"{m}.override_transformer_config.recompute_modules": _fx(
            "served", "selective recompute's modules", _MEGA_RECOMPUTE
        ),
        f"{m}.override_transformer_config.recompute_method": _fx("served", "uniform and block", _MEGA_RECOMPUTE),
        f"{m}.override_transformer_config.recompute_num_layers": _fx(
            "served", "layers per checkpoint", _MEGA_RECOMPUTE
        ),
        f"{m}.override_transformer_config.attention_backend": _fx(
            "served",
            "the schedule hooks every backend's core attention (local on CPU; flash/TE: GPU check)",
            _MEGA_EXACT,
        ),
        f"{m}.override_transformer_config.*": _fx(
            "refused",
            "any other megatron-core setting is checked on the built model at initialisation (dropout, windows, "
            "sinks, sparse attention, MoE routing that depends on a call's tokens): refused naming it",
            f"{ME_}::test_built_model_refusals",
        ),
        f"{m}.use_mbridge": _fx("served", "Megatron-Bridge's loader (verl's default)", _MEGA_EXACT),
        f"{m}.vanilla_mbridge": _fx(
            "served", "verl's deprecated mbridge loader", f"{ME_}::test_selected_through_verl_config"
        ),
        f"{m}.use_remove_padding": _fx(
            "served", "packed (THD) dense rows; the schedule's calls are [b, s]", _MEGA_EXACT
        ),
        f"{m}.pad_bshd_to_minibatch_max": _fx("no_effect", "verl's padded layout for its own dense rows"),
        f"{m}.pad_to_length": _fx("no_effect", "verl's padding of its own dense rows"),
        f"{m}.pad_to_length_bucket": _fx("no_effect", "verl's padding of its own dense rows"),
        f"{m}.use_megatron_fsdp": _fx("refused", "megatron-core's FSDP is not run under reuse", _MEGA_REFUSED),
        f"{m}.forward_only": _fx("no_effect", "verl sets it per role: the ref engine is forward-only"),
        f"{m}.dtype": _fx("served", "fp32 on CPU (bf16 on GPU: GPU check)", _MEGA_EXACT),
        f"{m}.router_replay.*": _fx(
            "refused",
            "router replay (R2/R3) replays routes per token of the stock layout",
            "tests/backend/test_megatron_moe.py::test_router_refusals_name_the_knob",
        ),  # fmt: skip
        f"{m}.qat.*": _QAT,
    }


MEGATRON_KEYS: dict[str, KeyEffect] = {
    **_megatron_keys("actor"),
    **{k: v for k, v in _megatron_keys("ref").items() if ".override_transformer_config." not in k},
    "ref.megatron.override_transformer_config": _fx(
        "no_effect", "verl's ref config interpolates the actor's overrides: the actor's keys above decide"
    ),
}


def classify_megatron(path: str) -> KeyEffect | None:
    """``MEGATRON_KEYS``'s entry for ``path`` (relative to ``actor_rollout_ref``), as ``classify`` reads ``KEYS``."""
    return _classified(MEGATRON_KEYS, path)


def classify(path: str) -> KeyEffect | None:
    """The entry for ``path`` (relative to ``actor_rollout_ref``): exact, else the longest ``prefix.*`` above it."""
    return _classified(KEYS, path)


def _classified(table: dict[str, KeyEffect], path: str) -> KeyEffect | None:
    if path in table:
        return table[path]
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        hit = table.get(".".join(parts[:cut]) + ".*")
        if hit is not None:
            return hit
    return None


# -- the compatibility matrix --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One (feature, engine) cell: what a run gets, a few words, and the tests that back it."""

    status: CellStatus
    note: str
    tests: tuple[str, ...] = ()


ENGINES = ("prefix_fsdp2", "prefix_torchtitan", "prefix_megatron")
TB = "tests/backend/test_trainer_balance.py"
TT = "tests/backend/test_titan_engine.py"
_TITAN_REFUSALS = f"{TT}::test_refusals_at_config_time"
TS = "tests/backend/test_titan_schedule.py"
ME = "tests/backend/test_megatron_engine.py"
MM = "tests/backend/test_megatron_moe.py"
_MEGATRON_REFUSALS = f"{ME}::test_refusals_name_the_knob"

MATRIX: tuple[tuple[str, dict[str, Cell]], ...] = (
    (
        "trainer `sync`, `colocate_async`, `separate_async`",
        {
            e: Cell(
                "reuses",
                "groups kept whole per rank",
                (f"{TB}::test_every_v1_trainer_mode_keeps_groups_whole_for_a_prefix_engine",),
            )
            for e in ENGINES
        },
    ),
    (
        "trainer `use_v1=false`",
        {
            e: Cell(
                "reuses",
                "groups kept whole per rank",
                (f"{TB}::test_legacy_trainer_keeps_groups_whole_for_a_prefix_engine",),
            )
            for e in ENGINES
        },
    ),
    (
        "fused kernels (`use_fused_kernels`)",
        {
            "prefix_fsdp2": Cell(
                "reuses",
                "torch backend tested, text and vision-language (images in the prefix); triton/liger on GPU",
                (
                    "tests/backend/test_fused_kernels_engine.py::test_tied_embeddings_match_the_stock_engine_with_fused_kernels",
                    "tests/backend/test_fused_kernels_vl_engine.py::test_images_in_the_prefix_with_fused_kernels_match_the_stock_engine",
                ),
            ),
            "prefix_torchtitan": Cell("absent", "verl's TorchTitan engine has none"),
            "prefix_megatron": Cell(
                "reuses",
                "reused rows from the logits, dense rows verl's fused kernels (GPU)",
                ("tests/backend/test_megatron_fused.py::test_fused_kernels_setting_reuses_and_matches",),
            ),
        },
    ),
    (
        "remove padding",
        {
            "prefix_fsdp2": Cell(
                "reuses", "", (f"{FB}::test_remove_padding_dense_rows_match_the_padded_stock_engine",)
            ),
            "prefix_torchtitan": Cell("reuses", "`false` is refused", (_TITAN_REFUSALS,)),
            "prefix_megatron": Cell(
                "reuses", "`true` (THD) tested", (f"{ME}::test_update_and_log_probs_match_verl_megatron_engine",)
            ),
        },
    ),
    (
        "dynamic bsz",
        {
            "prefix_fsdp2": Cell("reuses", "", (f"{E}::test_dynamic_batch_size_and_gradient_checkpointing",)),
            "prefix_torchtitan": Cell(
                "reuses",
                "suffix micro-batches by verl's token budget (PP too)",
                (
                    f"{TS}::test_dynamic_batch_size_plans_suffix_micro_batches_by_token_budget",
                    f"{TS}::test_pipeline_stages_plan_by_dynamic_batch_size",
                ),
            ),
            "prefix_megatron": Cell(
                "reuses",
                "suffix micro-batches by verl's token budget",
                (f"{ME}::test_dynamic_batch_size_matches_verl_megatron_engine",),
            ),
        },
    ),
    (
        "Ulysses / context parallel",
        {
            "prefix_fsdp2": Cell(
                "reuses",
                "Ulysses 2/4/8",
                (
                    "tests/backend/test_ulysses_engine.py::test_ulysses_reuse_matches_the_engine_without_sequence_parallelism",
                ),
            ),
            "prefix_torchtitan": Cell("refused", "`context_parallel_size > 1`", (_TITAN_REFUSALS,)),
            "prefix_megatron": Cell("refused", "`context_parallel_size > 1`", (_MEGATRON_REFUSALS,)),
        },
    ),
    (
        "gradient checkpointing",
        {
            "prefix_fsdp2": Cell(
                "reuses", "non-reentrant (verl's)", (f"{E}::test_dynamic_batch_size_and_gradient_checkpointing",)
            ),
            "prefix_torchtitan": Cell("refused", "`activation_checkpoint` other than `none`", (_TITAN_REFUSALS,)),
            "prefix_megatron": Cell(
                "reuses",
                "`recompute_granularity` full (uniform, block) or selective, expert bias too; with the MoE aux loss "
                "or fp8: refused",
                ("tests/backend/test_megatron_recompute.py::test_reuse_under_recompute_matches_verls_engine",),
            ),
        },
    ),
    (
        "activation offload",
        {
            "prefix_fsdp2": Cell(
                "dense",
                "`activation_offload` (training; forward-only reuses)",
                ("tests/backend/test_silent_wrongness.py::test_verl_activation_offload_runs_dense_and_matches_stock",),
            ),
            "prefix_torchtitan": Cell("absent", "not a TorchTitan setting"),
            "prefix_megatron": Cell("absent", "not a Megatron engine setting"),
        },
    ),
    (
        "param / optimizer offload",
        {
            "prefix_fsdp2": Cell("gpu_check", "between steps; a no-op on CPU"),
            "prefix_torchtitan": Cell("refused", "not verified between phases A and C", (_TITAN_REFUSALS,)),
            "prefix_megatron": Cell(
                "reuses",
                "verl's offload between passes, run for real on CPU by the platform",
                ("tests/backend/test_megatron_offload.py::test_prefix_engine_with_offload_matches_verls_engine",),
            ),
        },
    ),
    (
        "LoRA (`lora_rank`)",
        {
            "prefix_fsdp2": Cell("reuses", "", (f"{RS}::test_recipe_sets_match_the_stock_engine",)),
            "prefix_torchtitan": Cell("absent", "verl's TorchTitan engine has none"),
            "prefix_megatron": Cell("refused", "Megatron-Bridge's LoRA not run under reuse yet", (_MEGATRON_REFUSALS,)),
        },
    ),
    (
        "VLM (Qwen2/2.5/3-VL, Qwen3.5)",
        {
            "prefix_fsdp2": Cell(
                "reuses",
                "images in the prefix; refused under Ulysses",
                (
                    "tests/backend/test_multimodal_engine.py::test_update_matches_stock_engine_fp64",
                    "tests/backend/test_multimodal_engine.py::test_what_reuse_does_not_serve_yet_is_refused_with_a_reason",
                ),
            ),
            "prefix_torchtitan": Cell(
                "refused",
                "model types qwen2/qwen3 (MoE) only",
                (f"{TT}::test_model_types_outside_the_allowlist_are_refused_at_build",),
            ),
            "prefix_megatron": Cell(
                "refused", "model types qwen2/qwen3/llama/qwen3_moe/deepseek_v3 only", (_MEGATRON_REFUSALS,)
            ),
        },
    ),
    (
        "MoE (expert parallelism, router load balancing)",
        {
            "prefix_fsdp2": Cell(
                "reuses",
                "HF's aux loss (`moe_aux_loss_coef`) with each prefix counted per row",
                ("tests/schedule/test_moe.py::test_aux_matches_hf_dense_for_every_partition",),
            ),
            "prefix_torchtitan": Cell(
                "reuses",
                "EP, TP x EP; the expert-bias token counts per row",
                (f"{TS}::test_moe_schedule_knob_matches_verl_torchtitan_engine",),
            ),
            "prefix_megatron": Cell(
                "reuses",
                "EP, TP x EP with sequence parallelism; megatron-core's aux loss, z-loss and expert-bias counts "
                "per row; token dropping refused",
                (
                    f"{MM}::test_aux_loss_update_matches_verl_megatron_engine",
                    f"{MM}::test_expert_bias_counts_match_verl_megatron_engine",
                    f"{MM}::test_aux_loss_under_sequence_parallelism_matches_verl_megatron_engine",
                    f"{MM}::test_router_z_loss_matches_verl_megatron_engine",
                    f"{MM}::test_router_refusals_name_the_knob",
                ),
            ),
        },
    ),
    (
        "tree (`prefix_reuse.tree`)",
        {
            "prefix_fsdp2": Cell(
                "reuses", "", ("tests/backend/test_tree_engine.py::test_tree_update_and_log_probs_match_stock_engine",)
            ),
            "prefix_torchtitan": Cell(
                "reuses",
                "TP, FSDP, PP; dense and MoE flavors (EP, TP x EP)",
                (
                    f"{TS}::test_schedule_knob_matches_verl_torchtitan_engine",
                    f"{TS}::test_moe_schedule_knob_matches_verl_torchtitan_engine",
                    f"{TS}::test_pipeline_stages_run_the_one_schedule",
                ),
            ),
            "prefix_megatron": Cell(
                "reuses",
                "TP, DP, EP, PP",
                (
                    f"{ME}::test_update_and_log_probs_match_verl_megatron_engine",
                    f"{MM}::test_aux_loss_update_matches_verl_megatron_engine",
                    "tests/backend/test_megatron_pipeline.py::test_pipeline_stages_reuse_exactly",
                ),
            ),
        },
    ),
)

_SHOWN = {
    "reuses": "reuses",
    "dense": "dense",
    "refused": "refused at start-up",
    "gpu_check": "GPU check",
    "absent": "n/a",
    "untested": "not tested",
}
_KEY_SHOWN = {
    "no_effect": "no effect on reuse",
    "served": "served (reuse runs)",
    "dense": "dense with a reason",
    "refused": "refused at start-up",
    "gpu_check": "GPU check (not run on CPU)",
    "selector": "selects the engine",
}


def _cell(cell: Cell) -> str:
    head = _SHOWN[cell.status]
    return f"{head}: {cell.note}" if cell.note else head


def matrix_table() -> str:
    """The matrix as a markdown table, one row per feature."""
    lines = ["| feature | " + " | ".join(f"`{e}`" for e in ENGINES) + " |", "|---|" + "---|" * len(ENGINES)]
    lines += [f"| {name} | " + " | ".join(_cell(cells[e]) for e in ENGINES) + " |" for name, cells in MATRIX]
    return "\n".join(lines)


def render() -> str:
    """``docs/compatibility.md``: the matrix, then every classified key of verl's YAML by what it does."""
    out = [
        "# Compatibility",
        "",
        "<!-- generated by `verl-prefix compat --write docs/compatibility.md` from verl_prefix/backend/recipe_keys.py;"
        " the tests check every cell and every key -->",
        "",
        "What each engine does with verl's training features. `reuses`: reuse runs (tested against the stock "
        "engine); `dense`: those samples run the stock dense path, counted as `prefix/fallback_<reason>` with one "
        "warning; `refused at start-up`: the engine stops before training, naming the setting; `GPU check`: not "
        "runnable on CPU, not checked yet; `n/a`: the engine has no such setting.",
        "",
        matrix_table(),
        "",
        "## Every key of verl's `ppo_trainer.yaml`",
        "",
        "Every key under `actor_rollout_ref.actor`, `.ref` and `.model` (paths below are under `actor_rollout_ref.`), "
        "as `prefix_fsdp2` treats it, with the test behind the claim; `.*` covers a block. A key whose value turns "
        "reuse off is `dense`: its samples are counted as `prefix/fallback_<reason>` and the warning names the key. "
        "`served` keys were set away from verl's defaults on an engine that reused; ref keys run the actor's code "
        "forward-only.",
        "",
        "| key | effect | why | test |",
        "|---|---|---|---|",
    ]
    out += _key_rows(KEYS)
    out += [
        "",
        "## verl's Megatron engine config",
        "",
        "`model_engine=megatron`: every key of `_generated_ppo_megatron_trainer.yaml` under "
        "`actor_rollout_ref.{actor,ref}.megatron`, as `prefix_megatron` treats it (`actor.strategy=prefix_megatron` "
        "alone selects it; the other actor, ref and model keys are the table above's). Refusals are raised when the "
        "engine is built, naming the key and `+actor_rollout_ref.actor.megatron.prefix_reuse.enable=false` for "
        "verl's own engine.",
        "",
        "| key | effect | why | test |",
        "|---|---|---|---|",
        *_key_rows(MEGATRON_KEYS),
    ]
    return "\n".join(out) + "\n"


def _key_rows(table: dict[str, KeyEffect]) -> list[str]:
    rows = []
    for path, effect in table.items():
        status = _KEY_SHOWN[effect.status] + (f": `{effect.reason}`" if effect.reason else "")
        test = f"`{effect.test.split('::')[-1]}`" if effect.test else ""
        rows.append(f"| `{path}` | {status} | {effect.why} | {test} |")
    return rows


def readme_block() -> str:
    """The compact README version: engines by a few features, and the link."""
    keep = ("fused kernels", "dynamic bsz", "Ulysses", "LoRA", "tree")
    rows = [(n, c) for n, c in MATRIX if n.startswith(keep)]
    lines = ["| | " + " | ".join(f"`{e}`" for e in ENGINES) + " |", "|---|" + "---|" * len(ENGINES)]
    lines += [f"| {n.split(' (')[0]} | " + " | ".join(_SHOWN[c[e].status] for e in ENGINES) + " |" for n, c in rows]
    return "\n".join(lines)


README_BEGIN, README_END = "<!-- compatibility:begin -->", "<!-- compatibility:end -->"


def with_readme_block(readme: str) -> str:
    """``readme`` with ``readme_block()`` between its compatibility markers; ValueError without them."""
    return between_markers(readme, README_BEGIN, README_END, readme_block(), "the README")


def between_markers(page: str, begin: str, end: str, block: str, what: str = "the page") -> str:
    """``page`` with ``block`` between its ``begin`` and ``end`` markers (a generated table); ValueError without
    them."""
    start, stop = page.find(begin), page.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"{what} has no {begin} ... {end} block")
    return page[: start + len(begin)] + "\n" + block + "\n" + page[stop:]
