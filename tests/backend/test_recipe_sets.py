"""The training-side settings of verl's FSDP GRPO example recipes (``examples/grpo_trainer``), each set through the
engine pair: verl's ``fsdp2`` against ``prefix_fsdp2`` on the same batch, fp32, tiny Qwen3. Reuse must run on the
update and the old-log-prob pass, nothing may fall back, and the update must match the stock twin (gradient norm
and every gradient within 1e-5 relative).

This is the engine-level check: each recipe end to end through ``main_ppo`` (Ray, rollout, reward) takes minutes
per recipe on the CPUs these tests run on, too slow for CI; ``tests/tools/test_main_ppo_cpu.py`` covers the
trainer path once, and ``tests/tools/test_main_ppo_families_cpu.py`` the Qwen3.5 and GPT-OSS recipes' overrides
on tiny models of their families.
"""

from __future__ import annotations

import pytest
import torch
from helpers.engine_pairs import worst_relative
from helpers.reuse import assert_reuse_ran

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import grpo_batches, verl_engine

VOCAB = 128
A, M = "actor_rollout_ref.actor", "actor_rollout_ref.model"

# recipe -> (build_verl_engine keyword arguments, Hydra overrides); both engines get both
RECIPES: dict[str, tuple[dict, tuple[str, ...]]] = {
    # run_qwen3-8b.sh and most FSDP recipes: checkpointing, dynamic bsz, KL loss low_var_kl
    "gsm8k": (
        {"gradient_checkpointing": True, "use_dynamic_bsz": True, "max_token_len_per_gpu": 40, "use_kl_loss": True},
        (f"{A}.kl_loss_type=low_var_kl", f"{A}.kl_loss_coef=0.001", f"{A}.entropy_coeff=0"),
    ),
    "entropy_chunking": (
        {"entropy_coeff": 0.01},
        (
            f"{A}.entropy_from_logits_with_chunking=true",
            f"{A}.entropy_from_logits_chunk_size=16",
            f"{A}.entropy_checkpointing=true",
        ),
    ),
    # Dr.GRPO: seq-mean-token-sum-norm with verl's documented constant, no KL
    "dr_grpo": ({"loss_agg_mode": "seq-mean-token-sum-norm"}, (f"{A}.loss_scale_factor=16",)),
    "gspo": (
        {"policy_loss_mode": "gspo", "loss_agg_mode": "seq-mean-token-mean"},
        (f"{A}.clip_ratio_low=0.0003", f"{A}.clip_ratio_high=0.0004"),
    ),
    "dapo": ({"loss_agg_mode": "token-mean"}, (f"{A}.clip_ratio_low=0.2", f"{A}.clip_ratio_high=0.28")),
    "fused_kernels": ({}, (f"{M}.use_fused_kernels=true",)),
    "lora": ({}, (f"{M}.lora_rank=8", f"{M}.lora_alpha=16")),
    "tiled_mlp": ({}, (f"{M}.tiled_mlp.enabled=true", f"{M}.tiled_mlp.num_shards=2")),
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_sets_match_the_stock_engine(tiny_model, recipe, monkeypatch):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM

    # verl patches its fused forward onto the model class for the whole process: put HF's back afterwards
    monkeypatch.setattr(Qwen3ForCausalLM, "forward", Qwen3ForCausalLM.forward)
    kwargs, overrides = RECIPES[recipe]
    # verl's fused forward reads an untied LM head FSDP2 holds sharded (the stock engine fails): tie it there
    model_dir = tiny_model("qwen3", tie_word_embeddings=recipe == "fused_kernels")
    build = dict(dtype="float32", micro_batch_size_per_gpu=2, overrides=overrides, **kwargs)
    torch.manual_seed(0)  # LoRA's A matrices start random: the same draw for both engines
    stock, s_loss, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **build)
    torch.manual_seed(0)
    prefix, p_loss, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **build)
    assert worst_relative(verl_engine.params_of(prefix), verl_engine.params_of(stock)) == 0.0
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    batch = grpo_batches.make_grpo_batch(
        num_groups=3,
        group_size=4,
        prompt_lens=[9, 5, 12],
        response_len_range=(1, 7),
        vocab_size=VOCAB,
        seed=3,
        use_kl=True,
        calculate_entropy=True,
    )
    want = verl_engine.run_train_step(stock, s_loss, batch, capture_grads=True)
    got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
    infer = verl_engine.run_infer(prefix, batch)
    for metrics in (got["metrics"], infer["metrics"]):
        assert_reuse_ran(metrics, groups=3)
        fell = {
            k: v for k, v in verl_engine.reduce_step_metrics(metrics).items() if k.startswith("prefix/fallback_") and v
        }
        assert not fell, fell
    assert want["grads"] and got["grads"].keys() == want["grads"].keys()
    assert worst_relative(got["grads"], want["grads"]) < 1e-5
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
