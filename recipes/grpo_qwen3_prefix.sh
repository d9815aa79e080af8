#!/usr/bin/env bash
# GRPO on GSM8K with Qwen3 (or, TASK=vl, on Geometry3K images with Qwen2.5-VL / Qwen3-VL) and shared-prefix reuse,
# on one or more GPU nodes.
#
# Reads top to bottom: data and model paths, cluster shape, batch shape, then the stock verl entry
# point with configs/prefix_grpo.yaml (verl's ppo_trainer plus the prefix_sync trainer mode and the
# prefix_fsdp2 engine). Every verl option can still be overridden after "$@".
#
#   bash recipes/grpo_qwen3_prefix.sh trainer.total_epochs=1
#   TASK=vl bash recipes/grpo_qwen3_prefix.sh            # Geometry3K images on Qwen2.5-VL (docs/multimodal.md)
#   TASK=vl MODEL=Qwen/Qwen3-VL-8B-Instruct bash recipes/grpo_qwen3_prefix.sh
#
# Prerequisites on every node: verl 0.9.1 with its GPU stack (pip install -e '.[gpu]' from this repo,
# or verl's docker image plus `pip install .`), and the parquet files made by verl's
# examples/data_preprocess/gsm8k.py (TASK=text) or geo3k.py (TASK=vl; verl's data set then needs
# qwen_vl_utils, and its geo3k reward mathruler).
#
# Any verl trainer mode keeps groups whole with the prefix engine (TRAINER, below): sync (prefix_sync, the default),
# colocate_async, legacy (trainer.use_v1=false), or separate_async, where a standalone vLLM pool of ROLLOUT_GPUS (4)
# GPUs per node generates while the other GPUs train (partial rollouts; weights synced over NCCL every
# train_batch_size / ppo_mini_batch_size mini-batches, as verl requires).
#
#   TRAINER=separate_async ROLLOUT_GPUS=4 bash recipes/grpo_qwen3_prefix.sh
#
# Cluster shape from the environment: NNODES (1) and GPUS_PER_NODE (8). On several nodes, start Ray on each
# first and run this on the head (or submit it with `ray job submit`): docs/multinode.md.
set -euo pipefail
cd "$(dirname "$0")/.."

TASK="${TASK:-text}"
case "$TASK" in
  text) MODEL="${MODEL:-Qwen/Qwen3-8B}"; DATA="${DATA:-$HOME/data/gsm8k}"
    # 64 prompts x 16 samples per step; mini-batches of 16 prompts keep 2 whole groups per GPU slot.
    task=(data.max_prompt_length=2048 actor_rollout_ref.rollout.n=16) ;;
  # One image (a few hundred to ~1,000 visual tokens) plus the question: the visual tokens are the shared
  # prefix. vLLM takes the images from verl's agent loop; the engine encodes them once per group. G=8.
  vl) MODEL="${MODEL:-Qwen/Qwen2.5-VL-7B-Instruct}"; DATA="${DATA:-$HOME/data/geo3k}"
    task=(data.max_prompt_length=1024 data.image_key=images actor_rollout_ref.rollout.n=8
      actor_rollout_ref.rollout.enable_chunked_prefill=false
      actor_rollout_ref.actor.freeze_vision_tower="${FREEZE_VISION_TOWER:-false}") ;;
  *) echo "TASK must be text or vl, got $TASK" >&2; exit 2 ;;
esac
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
TRAINER="${TRAINER:-sync}"
TRAIN_GPUS="$GPUS_PER_NODE"
case "$TRAINER" in
  sync) trainer=() ;;  # prefix_sync, from configs/prefix_grpo.yaml
  colocate_async) trainer=(trainer.v1.trainer_mode=colocate_async) ;;
  legacy) trainer=(trainer.use_v1=false) ;;
  separate_async)
    ROLLOUT_GPUS="${ROLLOUT_GPUS:-4}"
    if (( ROLLOUT_GPUS < 1 || ROLLOUT_GPUS >= GPUS_PER_NODE )); then
      echo "ROLLOUT_GPUS=$ROLLOUT_GPUS must leave GPUs to train on (GPUS_PER_NODE=$GPUS_PER_NODE)" >&2; exit 2
    fi
    TRAIN_GPUS=$((GPUS_PER_NODE - ROLLOUT_GPUS))
    trainer=(trainer.v1.trainer_mode=separate_async actor_rollout_ref.hybrid_engine=false
      trainer.v1.separate_async.parameter_sync_step=4  # train_batch_size 64 / ppo_mini_batch_size 16
      actor_rollout_ref.rollout.nnodes="$NNODES" actor_rollout_ref.rollout.n_gpus_per_node="$ROLLOUT_GPUS"
      actor_rollout_ref.rollout.checkpoint_engine.backend=nccl) ;;
  *) echo "TRAINER must be sync, colocate_async, legacy or separate_async, got $TRAINER" >&2; exit 2 ;;
esac

python -m verl.trainer.main_ppo \
  --config-path="$PWD/configs" --config-name=prefix_grpo \
  data.train_files="$DATA/train.parquet" \
  data.val_files="$DATA/test.parquet" \
  data.train_batch_size=64 \
  data.max_response_length=2048 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=16 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.actor.use_kl_loss=true \
  actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
  trainer.logger='[console,wandb]' \
  trainer.project_name=verl_prefix \
  trainer.experiment_name="grpo_$(basename "$MODEL")_prefix" \
  trainer.nnodes="$NNODES" \
  trainer.n_gpus_per_node="$TRAIN_GPUS" \
  trainer.total_epochs=15 \
  "${task[@]}" \
  "${trainer[@]}" \
  "$@"
