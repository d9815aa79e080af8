#!/usr/bin/env bash
# GRPO where prefix reuse pays, on verl's Megatron engine: Qwen3-8B (dense) answers HotpotQA questions from long
# retrieval-augmented prompts (3-4K tokens, recipes/hotpotqa_long_context.py) with short answers, on one node of
# 8 GPUs, with actor_rollout_ref.actor.strategy=prefix_megatron (docs/megatron.md) and vLLM rollouts.
#
# The same task and batch shape as recipes/grpo_qwen3_rag_prefix.sh (prefix_fsdp2), through
# configs/prefix_grpo_megatron.yaml (verl's ppo_trainer with model_engine=megatron, the prefix_sync trainer mode,
# prefix_megatron for the actor and the reference policy). Megatron layout: tensor parallelism TP (4) with
# sequence parallelism, data parallelism over the remaining GPUs with the distributed optimizer. What prefix_megatron
# refuses at start-up is left at verl's defaults: no pipeline, context or expert parallelism, no param/optimizer
# offload, no fused kernels, no activation recompute (override_transformer_config.recompute_granularity stays null),
# so every layer's activations are kept: TP=4 (2 data-parallel ranks) leaves room for them on 80 GB GPUs.
#
#   python recipes/hotpotqa_long_context.py --out ~/data/hotpotqa_long    # once; needs `datasets` and the hub
#   bash recipes/grpo_qwen3_megatron_prefix.sh trainer.total_epochs=1
#   TP=2 TREE=true bash recipes/grpo_qwen3_megatron_prefix.sh    # 4 data-parallel ranks; a token trie across groups
#
# Prerequisites on every node: verl 0.9.1 with its GPU stack and its Megatron stack (megatron-core,
# Megatron-Bridge, TransformerEngine: verl's Megatron docker image), plus this package (`pip install .`).
# Env: MODEL (Qwen/Qwen3-8B), DATA (~/data/hotpotqa_long), NNODES (1), GPUS_PER_NODE (8), TP (4: must divide the
# GPUs), PROMPT_LEN (6144: longer prompts are filtered out), TREE (false), MAX_CONNECTIONS (1: the workers'
# CUDA_DEVICE_MAX_CONNECTIONS, which verl sets itself for a Megatron actor on Ampere/Hopper only; empty leaves it
# to verl, for Blackwell). Every verl option can still be overridden after "$@".
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL="${MODEL:-Qwen/Qwen3-8B}"
DATA="${DATA:-$HOME/data/hotpotqa_long}"
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
TP="${TP:-4}"
PROMPT_LEN="${PROMPT_LEN:-6144}"
TREE="${TREE:-false}"
MAX_CONNECTIONS="${MAX_CONNECTIONS-1}"

if (( (NNODES * GPUS_PER_NODE) % TP != 0 )); then
  echo "TP=$TP must divide the $((NNODES * GPUS_PER_NODE)) GPUs (NNODES x GPUS_PER_NODE)" >&2
  exit 2
fi
env_vars=()
if [[ -n "$MAX_CONNECTIONS" ]]; then  # a string: Ray's env_vars
  env_vars=("++ray_kwargs.ray_init.runtime_env.env_vars.CUDA_DEVICE_MAX_CONNECTIONS=\"$MAX_CONNECTIONS\"")
fi

# 64 prompts x 8 samples per step; dynamic batch size packs each micro-batch to a token budget, and the suffix
# budget counts each row's suffix plus the prefix it attends to. The reference policy takes the actor's Megatron
# layout and reuse knobs through the YAML.
python -m verl.trainer.main_ppo \
  --config-path="$PWD/configs" --config-name=prefix_grpo_megatron \
  data.train_files="$DATA/train.parquet" \
  data.val_files="$DATA/test.parquet" \
  data.train_batch_size=64 \
  data.max_prompt_length="$PROMPT_LEN" \
  data.max_response_length=512 \
  data.filter_overlong_prompts=true \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.use_remove_padding=true \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=16 \
  actor_rollout_ref.actor.use_dynamic_bsz=true \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  actor_rollout_ref.actor.use_kl_loss=true \
  actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$TP" \
  actor_rollout_ref.actor.megatron.sequence_parallel=true \
  actor_rollout_ref.actor.megatron.use_distributed_optimizer=true \
  ++actor_rollout_ref.actor.megatron.prefix_reuse.tree="$TREE" \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true \
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 \
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true \
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768 \
  trainer.logger='[console,wandb]' \
  trainer.project_name=verl_prefix \
  trainer.experiment_name="grpo_$(basename "$MODEL")_megatron_prefix" \
  trainer.nnodes="$NNODES" \
  trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  trainer.total_epochs=3 \
  "${env_vars[@]}" \
  "$@"
