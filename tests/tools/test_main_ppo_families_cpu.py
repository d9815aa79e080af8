"""verl's GRPO recipes for Qwen3.5 and GPT-OSS, their training-side overrides as the recipes set them, through verl's
own ``main_ppo`` on CPU: ``FAMILY=qwen3_5`` and ``FAMILY=gpt_oss`` of ``recipes/grpo_cpu_smoke.sh``, a tiny model of
the family and the ``hf`` rollout in place of vLLM/SGLang.

Per family, two launches side by side (each its own local Ray cluster, one actor rank), 2 steps of the smallest job
that forms groups (2 prompts x 4 samples, one mini-batch): the stock twin (``sync`` + ``fsdp2``) and the prefix run
(``prefix_sync`` + ``prefix_fsdp2``), on identical rollouts. Every step must reuse (in the update, the old and the
reference log-prob passes), fall back nowhere and match the stock twin's gradient norm to 1e-4 relative.

- ``qwen3_5``: ``examples/grpo_trainer/run_qwen3_5_2b_openr1_fsdp.sh`` of verl 0.9 (the family's FSDP recipe with
  the padded layout): gradient checkpointing, one row per micro-batch, KL loss ``low_var_kl`` at 0.02, entropy
  coefficient 0, chunked and checkpointed entropy, ``fsdp_size`` 8, ``reshard_after_forward``, parameter and optimizer
  offload with ``offload_policy`` (no-ops on CPU), no dynamic batch size, ``trainer.balance_batch=false``. The model
  is Qwen3.5's decoder (``qwen3_5_text``: a gated delta-net layer, then a gated full-attention one); the recipe's
  checkpoint is the vision-language ``qwen3_5`` on geo3k-shaped images, which ``TASK=vl`` serves for Qwen2.5-VL only
  (Qwen3.5's processor needs a video processor, and so torchvision, which a CPU install does not carry). Not run:
  the 27B/35B recipes' ``use_remove_padding=true``, which ``prefix_fsdp2`` refuses at initialisation for this
  decoder: verl patches Qwen3.5's delta-net forward to split a packed row per sequence only for the
  vision-language model type, so transformers' forward would carry recurrent state across the packed sequences
  (``backend/fsdp/refusals.recurrent_packed_error``).
- ``gpt_oss``: ``examples/grpo_trainer/run_gpt_oss_20b_fsdp.sh`` of verl 0.9: eager attention (the recipe saves its
  checkpoint for it; transformers has no sdpa for GPT-OSS's sinks), remove padding, gradient checkpointing, KL loss
  ``low_var_kl`` at 0.001, entropy coefficient 0, the reference policy's parameter offload (a no-op on CPU). The
  tiny GPT-OSS alternates a 16-token sliding-window layer with a full one (the prompts run 220-330 tokens: the
  window is crossed, asserted), has attention sinks and 4 experts, 2 per token. Not run: the recipe's
  ``model_dtype=bfloat16``: fp32 here, as the hf rollout samples (the twins are compared at 1e-4, which bf16
  rounding does not meet; bf16 is judged as error against fp32, ``docs/cpu.md``); its micro-batches of 32 rows,
  which the job's 8 rows do not divide (verl's stock engine asserts they do): one micro-batch of 8 here.

  The stock twin runs GPT-OSS padded (``use_remove_padding=false``), the prefix run the recipe's
  ``use_remove_padding=true``. verl's packed layout (one row of the micro-batch's sequences, position ids
  restarting, no attention mask) relies on transformers finding the sequence boundaries from the position ids,
  and transformers 5.10.4's ``GptOssModel.forward`` builds its causal and sliding-window masks without them
  (``models/gpt_oss/modeling_gpt_oss.py``: ``mask_kwargs`` has no ``position_ids``), so every packed sequence
  attends to the ones before it in the row. Measured here with the stock twin packed (2026-12-05): its old
  log-probs 7.8e-3 off the rollout's (``training/rollout_probs_diff_max``; the prefix run's 4e-8) and its gradient
  norm 0.46% off the prefix run's; a packed pair of plain HF forwards, logits 3.1 off the padded ones. The prefix
  engine runs every group padded inside (one sequence a row), so it computes what the rollout and the padded stock
  twin compute, which is what this test asserts.

Both recipes' batch sizes and ``rollout.n`` are the job's (a 2-core machine), and their strategy is the twin's.
Measured 2026-12-05 on the 2-vCPU VM (``-n 0``): 102 s for the Qwen3.5 pair, 111 s for GPT-OSS; gradient norms
equal to 7 digits on both steps (Qwen3.5 step 1: 6.892369 stock, 6.892370 prefix, 1.4e-7 relative).
"""

from __future__ import annotations

import pytest
from helpers.recipe_runs import (
    SMALL_JOB,
    assert_reuse_ran,
    assert_same_rollouts_and_update,
    metrics,
    run_dense_and_prefix,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

STEPS = 2
# the stock twin's launch only: GPT-OSS packed is not one sequence a row in transformers 5.10.4 (above)
STOCK_ARGS = {"qwen3_5": (), "gpt_oss": ("actor_rollout_ref.model.use_remove_padding=false",)}
# what each recipe's overrides must have set, read back from the config main_ppo prints (a key Hydra did not
# take would leave verl's default there)
RECIPE_KEYS = {
    "qwen3_5": ("'kl_loss_coef': 0.02", "'lr': 5e-07", "'offload_policy': True", "'balance_batch': False"),
    "gpt_oss": ("'attn_implementation': 'eager'", "'use_remove_padding': True", "'lr': 1e-06"),
}


@pytest.mark.parametrize("family", sorted(RECIPE_KEYS))
def test_family_recipe_reuses_every_step_and_matches_the_stock_twin(tmp_path_factory, family):
    env = {"FAMILY": family, "GPUS_PER_NODE": "1"}
    runs = run_dense_and_prefix(
        tmp_path_factory, family, steps=STEPS, env=env, args=SMALL_JOB, dense_args=STOCK_ARGS[family]
    )
    for mode, out in runs.items():
        log = (out / "recipe.log").read_text()
        for key in RECIPE_KEYS[family]:
            assert key in log or (mode == "dense" and "use_remove_padding" in key), (family, mode, key)
    dense = metrics(runs["dense"] / "metrics_first.jsonl")
    prefix = metrics(runs["prefix"] / "metrics_first.jsonl")
    assert sorted(dense) == sorted(prefix) == list(range(1, STEPS + 1)), (dense.keys(), prefix.keys())
    for step in dense:
        d, p = dense[step], prefix[step]
        assert_same_rollouts_and_update(d, p, step)
        assert_reuse_ran(p, step)
        assert p["actor/prefix/ref_log_prob/groups"] > 0, (step, p)
        assert p["actor/prefix/ref_log_prob/physical_tokens"] < p["actor/prefix/ref_log_prob/logical_tokens"], step
        assert p["actor/prefix/split_groups"] == 0.0, (step, p)
        if family == "gpt_oss":  # the sliding-window layers' suffixes saw a prefix cut to the window
            windowed = p["actor/prefix/phase_b_layers/concat_window"] + p["actor/prefix/phase_b_layers/merged_window"]
            assert windowed > 0, (step, p)
        print(f"{family} step {step}: grad norm {d['actor/grad_norm']:.7g} (stock) {p['actor/grad_norm']:.7g} (prefix)")
