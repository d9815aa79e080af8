"""prefix_megatron on two GPUs (NCCL), what only a GPU runs: TP=2 with sequence parallelism (verl's default at
TP > 1; the CPU platform turns it off because the local spec's norms refuse it), bf16 (verl's Megatron engine
asserts bf16/fp16 on a GPU), TransformerEngine's attention where it is installed (megatron-core's local one
otherwise): against verl's own Megatron engine on the same batch and weights. bf16 runs of two engines differ by
rounding in different reduction orders, so the bound is a gross-error one (the bench's bf16 tolerance), with the
negative control (phase C skipped) required to be far off it. ``bench/gpu_check.sh`` runs this file; the CPU
reference of the same computation (the padding sequence parallelism needs, at fp32) is
``test_megatron_engine.py::test_calls_padded_for_sequence_parallelism_are_exact``.

Also on two GPUs: pipeline stages (PP=2) with megatron-core's full recompute and verl's offload, selective recompute
under sequence parallelism, a tiny Qwen3-MoE at EP=2 with megatron-core's aux loss and expert bias (sigmoid scores),
TransformerEngine's grouped experts where installed (CPU reference: ``test_megatron_moe.py``), the same MoE at TP=2
with sequence parallelism and verl's default routing (no load-balancing loss), DeepSeek-V3's MLA at TP=2 with
sequence parallelism (CPU reference: ``test_megatron_mla.py``), and verl's fused kernels on (its Triton linear
cross-entropy for dense rows, logits for reused ones; CPU reference: ``test_megatron_fused.py``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers.ranks import run_ranks
from helpers.reuse import assert_reuse_ran

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs (bench/gpu_check.sh runs it on a GPU machine)", allow_module_level=True)
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is an optional dependency (scripts/setup.sh)", allow_module_level=True)

BF16_TOL = 0.5  # verl_prefix.tools.bench.tables.GRAD_TOLERANCE["bfloat16"]: a gross-error bound


SP = dict(tensor_parallel_size=2, sequence_parallel=True)
LAYOUTS = {
    # family, engine settings, extra transformer-config overrides, model extra config
    "tp2_sp": ("qwen3", SP, {}, None),
    "moe_ep2_aux_bias": (
        "qwen3_moe",
        dict(expert_model_parallel_size=2),
        {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01,
         "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
        None,
    ),
    "moe_tp2_sp": ("qwen3_moe", SP, {}, None),
    "fused_tp2_sp": ("qwen3", {**SP, "use_fused_kernels": True}, {}, None),  # both engines on verl's fused kernels
    "mla_tp2_sp": (
        "deepseek_v3", SP, {"moe_router_enable_expert_bias": False},
        {"first_k_dense_replace": 2, "q_lora_rank": 16},
    ),
    # pipeline stages with megatron-core's full recompute and verl's offload (CPU reference: test_megatron_pipeline.py,
    # test_megatron_recompute.py, test_megatron_offload.py), and selective recompute under sequence parallelism
    "pp2_recompute_offload": (
        "qwen3", dict(pipeline_model_parallel_size=2, param_offload=True, optimizer_offload=True),
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, None,
    ),
    "tp2_sp_selective_recompute": (
        "qwen3", SP, {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}, None,
    ),
    # virtual pipeline stages (two chunks per rank; CPU reference: test_megatron_pipeline.py pp2_vpp2), and MoE under
    # sequence parallelism with the aux loss, the z-loss and expert bias (CPU reference: test_megatron_moe.py,
    # the pp2_tp2_ep2_moe layout)
    "pp2_vpp2": ("qwen3", dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), {},
                 {"num_hidden_layers": 4}),
    "moe_tp2_sp_aux_z_bias": (
        "qwen3_moe", {**SP, "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
        {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001,
         "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
        None,
    ),
}  # fmt: skip


def _body(rank: int, model_dir: str, name: str) -> dict:
    from helpers.engine_batches import compare_steps, megatron_train_step, phase_c_skipped, shared_system_batch

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    _, settings, overrides, _ = LAYOUTS[name]
    loss_fn, _ = ppo_loss(["use_kl_loss=true", "entropy_coeff=0.01", "ppo_micro_batch_size_per_gpu=4"])
    gpu = dict(dtype="bfloat16", override_transformer_config={"attention_backend": "auto", **overrides}, **settings)
    stock = build_megatron_engine(model_dir, lr=0.0, **gpu)
    reuse = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=4)
    prefix = build_megatron_engine(model_dir, backend="prefix_megatron", lr=0.0, prefix_reuse=reuse, **gpu)
    if settings.get("sequence_parallel"):
        assert prefix.causal_lm.sequence_multiple == 2  # sequence parallelism: the schedule pads its calls
    batch = shared_system_batch(stock.get_data_parallel_rank(), data_parallel=stock.get_data_parallel_size() > 1)
    if settings.get("param_offload"):  # verl's worker context loads on entry and offloads on exit
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(batch, disable_auto_offload=False)
    want = megatron_train_step(stock, loss_fn, batch)
    out = {"reuse": compare_steps(want, megatron_train_step(prefix, loss_fn, batch))}
    with phase_c_skipped():
        out["no_phase_c"] = compare_steps(want, megatron_train_step(prefix, loss_fn, batch))["worst"]
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_on_two_gpus_matches_verl_megatron_engine(tmp_path, name):
    from verl_prefix.harness.tiny_models import write_tiny_model

    family, settings, _, extra = LAYOUTS[name]
    model_dir = write_tiny_model(tmp_path / family, family, extra_config=extra)
    ranks = run_ranks(_body, str(model_dir), name, world=2, cuda=True, timeout=900)
    for rank, result in ranks.items():
        r = result["reuse"]
        assert r["worst"] < BF16_TOL, (rank, r["name"], r["worst"])
        assert result["no_phase_c"] > 2 * r["worst"], (rank, result["no_phase_c"], r["worst"])
        groups = (
            1
            if "tensor_parallel_size" not in settings and "pipeline_model_parallel_size" not in settings and rank
            else 2
        )
        assert_reuse_ran(r["metrics"], groups=groups)
