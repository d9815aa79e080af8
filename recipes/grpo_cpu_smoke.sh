#!/usr/bin/env bash
# The CPU twin of recipes/grpo_qwen3_prefix.sh: verl's own entry point (python -m verl.trainer.main_ppo) with
# configs/prefix_grpo.yaml plus the configs/cpu/smoke.yaml overlay, on a tiny model and GSM8K-shaped data
# that `verl-prefix smoke-data` writes. No GPU, no network.
#
#   bash recipes/grpo_cpu_smoke.sh                      # 3 steps: 2, a checkpoint, then resume for step 3
#   STEPS=2 SAVE_AT=1 bash recipes/grpo_cpu_smoke.sh    # what tests/tools/test_main_ppo_cpu.py runs
#   MODE=dense bash recipes/grpo_cpu_smoke.sh           # the dense twin: sync trainer, stock fsdp2
#   TASK=vl bash recipes/grpo_cpu_smoke.sh              # image prompts on a tiny Qwen2.5-VL (docs/multimodal.md)
#   TASK=agentic bash recipes/grpo_cpu_smoke.sh         # prompts behind one shared system message, prefix_reuse.tree
#                                                       # on (docs/trees.md); MODE=dense: the stock twin
#   ENGINE=torchtitan bash recipes/grpo_cpu_smoke.sh    # prefix_torchtitan at TP=2 on a tiny Qwen3 (docs/torchtitan.md);
#                                                       # MODE=dense: verl's own TorchTitan engine
#   ENGINE=megatron bash recipes/grpo_cpu_smoke.sh      # prefix_megatron at TP=2 on a tiny Qwen3 (docs/megatron.md);
#                                                       # MODE=dense: verl's own Megatron engine
#   FAMILY=qwen3_5 bash recipes/grpo_cpu_smoke.sh       # a tiny Qwen3.5 decoder (gated delta-net + full attention)
#                                                       # under verl's run_qwen3_5_2b_openr1_fsdp.sh training knobs
#   FAMILY=gpt_oss bash recipes/grpo_cpu_smoke.sh       # a tiny GPT-OSS (windows, sinks, experts; eager attention)
#                                                       # under verl's run_gpt_oss_20b_fsdp.sh training knobs
#
# Two launches of main_ppo: steps 1..SAVE_AT saving a checkpoint at SAVE_AT, then a resumed run to STEPS.
# Metrics go to the console and to $OUT/metrics_{first,resumed}.jsonl (verl's file logger).
# Env: OUT (outputs/grpo_cpu_smoke), STEPS (3), SAVE_AT (STEPS-1), MODE (prefix|dense), NNODES (1),
# GPUS_PER_NODE (actor ranks per node, 2), PYTHON (python), TASK (text|agentic|vl), ENGINE (fsdp2|torchtitan|megatron), TP
# (torchtitan's or megatron's tensor-parallel size, 2; the other ranks shard data), FAMILY (the text task's model under
# ENGINE=fsdp2: llama by default; qwen3_5 or gpt_oss add the training-side overrides of verl 0.9's FSDP GRPO recipe for
# that family, below). With RAY_ADDRESS set, main_ppo joins that cluster instead of starting one (docs/multinode.md).
# Extra arguments are passed to both launches (after the family's overrides: they win).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-$PWD/outputs/grpo_cpu_smoke}"
STEPS="${STEPS:-3}"
SAVE_AT="${SAVE_AT:-$((STEPS - 1))}"
MODE="${MODE:-prefix}"
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-2}"
PYTHON="${PYTHON:-python}"
TASK="${TASK:-text}"
ENGINE="${ENGINE:-fsdp2}"
TP="${TP:-2}"
FAMILY="${FAMILY:-}"

export VERL_PLATFORM=cpu HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

config=prefix_grpo
family=llama
case "$ENGINE/$MODE" in
  fsdp2/prefix) twin=(trainer.v1.trainer_mode=prefix_sync actor_rollout_ref.actor.strategy=prefix_fsdp2) ;;
  # the stock actor config again, without the prefix knobs it would refuse
  fsdp2/dense) twin=(trainer.v1.trainer_mode=sync actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor._target_=verl.workers.config.FSDPActorConfig actor_rollout_ref.ref._target_=verl.workers.config.FSDPActorConfig
    '~actor_rollout_ref.ref.prefix_reuse' '~actor_rollout_ref.actor.prefix_reuse'
    '~actor_rollout_ref.actor.dormant_prefix' '~actor_rollout_ref.actor.moe_aux_loss_coef'
    # Hydra cannot delete a key whose value is null: give it a value first
    actor_rollout_ref.actor.dormant_prefix_budget_bytes=0 '~actor_rollout_ref.actor.dormant_prefix_budget_bytes') ;;
  # verl's TorchTitan engine builds torchtitan's qwen3 (the smoke model's flavor is registered in each worker,
  # docs/torchtitan.md); fp32 parameters as the FSDP runs; packed rows (its padded path cannot feed flex
  # attention); the smoke overlay's FSDP block is not its config
  torchtitan/prefix | torchtitan/dense)
    config=prefix_grpo_torchtitan
    family=qwen3
    ranks=$((NNODES * GPUS_PER_NODE))
    if (( TP < 1 || ranks % TP )); then
      echo "TP=$TP must divide the $ranks actor ranks (NNODES x GPUS_PER_NODE)" >&2; exit 2
    fi
    titan=actor_rollout_ref.actor.torchtitan
    twin=("$titan.tensor_parallel_size=$TP" "$titan.data_parallel_shard_size=$((ranks / TP))"
      "$titan.data_parallel_size=$((ranks / TP))" "$titan.mixed_precision_param=float32"
      actor_rollout_ref.model.use_remove_padding=true
      '~actor_rollout_ref.actor.fsdp_config' '~actor_rollout_ref.ref.fsdp_config')
    if [[ "$MODE" == dense ]]; then  # verl's own TorchTitan engine and synchronous trainer
      # verl 0.9.1 cannot import its engine with torchtitan 0.3.0: the plugin's adapted one is opt-in, in this
      # process and (through the job's runtime env) in every Ray worker
      export VERL_PREFIX_STOCK_TORCHTITAN=1
      twin+=(trainer.v1.trainer_mode=sync actor_rollout_ref.actor.strategy=torchtitan "$titan.strategy=torchtitan"
        actor_rollout_ref.ref.strategy=torchtitan actor_rollout_ref.ref.torchtitan.strategy=torchtitan
        '++ray_kwargs.ray_init.runtime_env.env_vars.VERL_PREFIX_STOCK_TORCHTITAN="1"')  # a string: Ray's env_vars
    fi ;;
  # verl's Megatron engine (megatron-core, Megatron-Bridge's loader) through the CPU platform layer: fp32, the
  # local attention spec, sequence parallelism on at TP > 1 (verl's default), the distributed optimizer (the rollout's weight sync,
  # get_per_tensor_param, needs it); packed (THD) rows, verl's Megatron default; the smoke overlay's FSDP block
  # is not its config
  megatron/prefix | megatron/dense)
    config=prefix_grpo_megatron
    family=qwen3
    ranks=$((NNODES * GPUS_PER_NODE))
    if (( TP < 1 || ranks % TP )); then
      echo "TP=$TP must divide the $ranks actor ranks (NNODES x GPUS_PER_NODE)" >&2; exit 2
    fi
    mcore=actor_rollout_ref.actor.megatron  # the reference policy's parallelism and overrides follow the actor's
    # verl validates McoreEngineConfig (bf16/fp16 only) in the driver and each worker, before an engine applies the
    # platform; and it registers its Megatron engine for cuda/npu only: the plugin's CPU opt-in does both (float32
    # accepted; verl's engine for cpu through the platform layer), here and through the job's runtime env in every
    # Ray worker
    export VERL_PREFIX_MEGATRON_CPU=1
    twin=('++ray_kwargs.ray_init.runtime_env.env_vars.VERL_PREFIX_MEGATRON_CPU="1"'  # a string: Ray's env_vars
      "$mcore.tensor_model_parallel_size=$TP" "$mcore.use_distributed_optimizer=true"
      "$mcore.override_transformer_config.attention_backend=local"
      "$mcore.dtype=float32" actor_rollout_ref.ref.megatron.dtype=float32
      '~actor_rollout_ref.actor.fsdp_config' '~actor_rollout_ref.ref.fsdp_config')
    if [[ "$MODE" == dense ]]; then  # verl's own Megatron engine and synchronous trainer
      twin+=(trainer.v1.trainer_mode=sync actor_rollout_ref.actor.strategy=megatron actor_rollout_ref.ref.strategy=megatron
        actor_rollout_ref.actor.megatron._target_=verl.workers.config.McoreEngineConfig
        actor_rollout_ref.ref.megatron._target_=verl.workers.config.McoreEngineConfig
        '~actor_rollout_ref.ref.megatron.prefix_reuse' '~actor_rollout_ref.actor.megatron.prefix_reuse'
        '~actor_rollout_ref.actor.megatron.dormant_prefix'
        # Hydra cannot delete a key whose value is null: give it a value first
        actor_rollout_ref.actor.megatron.dormant_prefix_budget_bytes=0
        '~actor_rollout_ref.actor.megatron.dormant_prefix_budget_bytes')
    fi ;;
  */prefix | */dense) echo "ENGINE must be fsdp2, torchtitan or megatron, got $ENGINE" >&2; exit 2 ;;
  *) echo "MODE must be prefix or dense, got $MODE" >&2; exit 2 ;;
esac
if [[ "$ENGINE" == torchtitan && "$TASK" != text ]]; then
  echo "ENGINE=torchtitan runs TASK=text (torchtitan builds no vision tower here)" >&2; exit 2
fi
if [[ "$ENGINE" == megatron && "$TASK" != text ]]; then
  echo "ENGINE=megatron runs TASK=text (megatron-core builds no vision tower here)" >&2; exit 2
fi
case "$TASK" in
  text) task=() ;;
  # the tree computes the shared system message once per rank and mini-batch (trie nodes of 16 tokens and up)
  agentic) task=()
    if [[ "$MODE" == prefix ]]; then
      task=(actor_rollout_ref.actor.prefix_reuse.tree=true actor_rollout_ref.actor.prefix_reuse.min_shared_tokens=16)
    fi ;;
  # the tiny Qwen2.5-VL's image-only processor is remote code; the data set opens the PNGs itself (no
  # qwen_vl_utils on CPU); the reward is the same rule-plus-shaping kind as the text task's
  vl) task=(actor_rollout_ref.model.trust_remote_code=true data.trust_remote_code=true
    data.custom_cls.path=pkg://verl_prefix.tools.smoke.vl data.custom_cls.name=SmokeVLDataset
    reward.custom_reward_function.path=pkg://verl_prefix.tools.smoke.vl) ;;
  *) echo "TASK must be text, agentic or vl, got $TASK" >&2; exit 2 ;;
esac
# verl 0.9's FSDP GRPO recipe of a family, its training-side overrides (actor, reference, model) as the recipe sets
# them, but for: the strategy (fsdp2 in the recipe: the twin's choice here, fsdp2 or prefix_fsdp2), the job's size
# (train and mini-batch sizes, rollout.n: the smoke job's, or the test's), and bf16 (fp32 here, as the hf rollout
# samples: the twins compare gradient norms at 1e-4, which bf16 rounding, 1e-3, does not meet; docs/cpu.md). The
# offload knobs are passed as the recipe sets them and change nothing on CPU (the parameters live there already).
case "$FAMILY" in
  "" | llama) family_args=() ;;
  # examples/grpo_trainer/run_qwen3_5_2b_openr1_fsdp.sh (the padded layout: its 27B/35B twins' use_remove_padding=true
  # is refused beside reuse for a decoder whose delta-net layers verl does not patch, qwen3_5_text; docs/cpu.md)
  qwen3_5) family=qwen3_5
    family_args=(actor_rollout_ref.model.use_remove_padding=false actor_rollout_ref.model.enable_gradient_checkpointing=true
      actor_rollout_ref.actor.optim.lr=5e-7 actor_rollout_ref.actor.use_dynamic_bsz=false
      actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1
      actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1
      actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.entropy_coeff=0
      actor_rollout_ref.actor.kl_loss_coef=0.02 actor_rollout_ref.actor.kl_loss_type=low_var_kl
      actor_rollout_ref.actor.use_torch_compile=false actor_rollout_ref.actor.fsdp_config.fsdp_size=8
      actor_rollout_ref.actor.fsdp_config.reshard_after_forward=true actor_rollout_ref.actor.fsdp_config.entropy_checkpointing=true
      actor_rollout_ref.actor.entropy_from_logits_with_chunking=true actor_rollout_ref.actor.fsdp_config.offload_policy=true
      actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1
      actor_rollout_ref.actor.fsdp_config.param_offload=true actor_rollout_ref.actor.fsdp_config.optimizer_offload=true
      actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false actor_rollout_ref.ref.fsdp_config.param_offload=false
      actor_rollout_ref.ref.fsdp_config.reshard_after_forward=true actor_rollout_ref.ref.entropy_from_logits_with_chunking=true
      actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=1 actor_rollout_ref.ref.use_torch_compile=false
      actor_rollout_ref.ref.fsdp_config.offload_policy=false actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false
      trainer.balance_batch=false) ;;
  # examples/grpo_trainer/run_gpt_oss_20b_fsdp.sh, whose checkpoint is saved for eager attention (transformers has
  # no sdpa for GPT-OSS: its sinks; the hf rollout follows the actor's eager). Its micro-batches of 32 rows are the
  # job's size: verl asserts a pass's rows divide by it (the smoke job's 8 rows are one micro-batch, as 32 are of
  # the recipe's 160 per GPU a fifth). MODE=dense packs GPT-OSS wrongly in transformers 5.10.4 (its forward builds
  # masks without the position ids that mark packed sequences: each attends to the ones before it in the row); the
  # test runs that stock twin padded (tests/tools/test_main_ppo_families_cpu.py)
  gpt_oss) family=gpt_oss
    family_args=(actor_rollout_ref.model.override_config.attn_implementation=eager
      actor_rollout_ref.model.use_remove_padding=true actor_rollout_ref.model.enable_gradient_checkpointing=true
      actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.use_kl_loss=true
      actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
      actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.fsdp_config.param_offload=false
      actor_rollout_ref.actor.fsdp_config.optimizer_offload=false actor_rollout_ref.ref.fsdp_config.param_offload=true) ;;
  *) echo "FAMILY must be llama, qwen3_5 or gpt_oss, got $FAMILY" >&2; exit 2 ;;
esac
if [[ -n "$FAMILY" && "$FAMILY" != llama && ( "$ENGINE" != fsdp2 || "$TASK" != text ) ]]; then
  echo "FAMILY=$FAMILY runs ENGINE=fsdp2 TASK=text" >&2; exit 2
fi
cluster=()
if [[ -n "${RAY_ADDRESS:-}" ]]; then
  cluster=(ray_kwargs.ray_init.num_cpus=null)  # joining a cluster: its nodes declare their own CPUs
fi

"$PYTHON" -m verl_prefix.tools.cli smoke-data --task "$TASK" --family "$family" --out "$OUT/inputs"
rm -rf "$OUT/checkpoints"

main_ppo() {
  "$PYTHON" -m verl.trainer.main_ppo \
    --config-path="$PWD/configs" --config-name="$config" +cpu=smoke \
    actor_rollout_ref.model.path="$OUT/inputs/model" \
    data.train_files="$OUT/inputs/data/train.parquet" \
    data.val_files="$OUT/inputs/data/test.parquet" \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$GPUS_PER_NODE" \
    trainer.default_local_dir="$OUT/checkpoints" \
    trainer.logger='[console,file]' \
    trainer.experiment_name="grpo_cpu_smoke_${TASK}_${ENGINE}_${family}_$MODE" \
    "${twin[@]}" ${task[@]+"${task[@]}"} ${family_args[@]+"${family_args[@]}"} ${cluster[@]+"${cluster[@]}"} "$@"
}

# The job's runtime env carries these to its Ray workers, also on a cluster started elsewhere (where workers
# inherit the raylet's environment, not this shell's): verl's file logger runs in the TaskRunner actor.
job_env() { echo "++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH=$OUT/$1"; }

start=$SECONDS
main_ppo "$(job_env metrics_first.jsonl)" \
  trainer.total_training_steps="$SAVE_AT" trainer.save_freq="$SAVE_AT" trainer.resume_mode=disable "$@"
if (( STEPS > SAVE_AT )); then
  main_ppo "$(job_env metrics_resumed.jsonl)" \
    trainer.total_training_steps="$STEPS" trainer.save_freq=-1 trainer.resume_mode=auto "$@"
fi
echo "grpo_cpu_smoke ($TASK, $ENGINE, $family, $MODE): $STEPS steps in $((SECONDS - start)) s; metrics in $OUT/metrics_*.jsonl"
