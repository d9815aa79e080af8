#!/usr/bin/env bash
# GRPO where prefix reuse pays: long retrieval-augmented prompts, short answers. Qwen3 answers HotpotQA
# questions from a block of about 30 documents (3-4K tokens: the question's ten HotpotQA paragraphs plus
# distractors from other questions); the reward is verl's HotpotQA exact match. G=8 samples of each prompt
# share those thousands of tokens, which the prefix_fsdp2 engine computes once per group.
#
# recipes/grpo_qwen3_prefix.sh (GSM8K: prompts of ~100-200 tokens, responses up to 2K) is the smoke recipe;
# at that shape reuse barely pays (docs/benchmarks.md). This one is the shape it is built for.
#
#   python recipes/hotpotqa_long_context.py --out ~/data/hotpotqa_long    # once; needs `datasets` and the hub
#   bash recipes/grpo_qwen3_rag_prefix.sh trainer.total_epochs=1
#   TREE=true bash recipes/grpo_qwen3_rag_prefix.sh    # also share tokens across groups (docs/trees.md)
#
# Prerequisites on every node: verl 0.9.1 with its GPU stack (pip install -e '.[gpu]' from this repo, or
# verl's docker image plus `pip install .`). Env: MODEL (Qwen/Qwen3-8B), DATA (~/data/hotpotqa_long),
# NNODES (1), GPUS_PER_NODE (8), PROMPT_LEN (6144: longer prompts are filtered out), TREE (false).
# Every verl option can still be overridden after "$@".
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL="${MODEL:-Qwen/Qwen3-8B}"
DATA="${DATA:-$HOME/data/hotpotqa_long}"
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
PROMPT_LEN="${PROMPT_LEN:-6144}"
TREE="${TREE:-false}"

# 64 prompts x 8 samples per step; dynamic batch size packs each micro-batch to a token budget, and the
# suffix budget counts each row's suffix plus the prefix it attends to.
python -m verl.trainer.main_ppo \
  --config-path="$PWD/configs" --config-name=prefix_grpo \
  data.train_files="$DATA/train.parquet" \
  data.val_files="$DATA/test.parquet" \
  data.train_batch_size=64 \
  data.max_prompt_length="$PROMPT_LEN" \
  data.max_response_length=512 \
  data.filter_overlong_prompts=true \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.model.use_remove_padding=true \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=16 \
  actor_rollout_ref.actor.use_dynamic_bsz=true \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  actor_rollout_ref.actor.use_kl_loss=true \
  actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.prefix_reuse.tree="$TREE" \
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
  trainer.experiment_name="grpo_$(basename "$MODEL")_rag_prefix" \
  trainer.nnodes="$NNODES" \
  trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  trainer.total_epochs=3 \
  "$@"
