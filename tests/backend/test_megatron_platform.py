"""verl's stock Megatron engine on CPU gloo through the platform layer (``backend.megatron.platform``), fp32:
TP=1 (one rank; Megatron-Bridge and mbridge loaders; THD and BSHD) and TP=2 (two ranks, both loaders) against
plain HF, DP=2 with the distributed optimizer (two ranks) against verl's FSDP2 engine on the same per-rank batches:
log-probs, entropies, loss, grad norm; the weights verl syncs to the rollout (``get_per_tensor_param``) equal the
checkpoint's. The gloo scatter trap: with the contiguous fix off, Megatron-Bridge loads wrong TP=2 shards
(log-probs far off). And the platform entry changes nothing for a CUDA device.

Every engine runs in fresh rank processes (the platform patches torch and megatron-core process-wide on CPU, which
must not leak into other test files of the same worker).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers.ranks import run_ranks, run_two_ranks

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 is an optional dependency (scripts/setup.sh)")
pytest.importorskip("mbridge", reason="mbridge 0.15.1 is an optional dependency (scripts/setup.sh)")
if importlib.util.find_spec("megatron.bridge") is None:  # importing it needs the platform's TransformerEngine stub
    pytest.skip("megatron-bridge 0.3.1 is an optional dependency (scripts/setup.sh)", allow_module_level=True)

VOCAB = 128
TOL = 1e-5  # fp32
SHAPE = dict(num_groups=2, group_size=2, prompt_lens=[7, 5], response_len_range=(3, 6), vocab_size=VOCAB)


def _batch(seed: int, **kwargs):
    from verl_prefix.harness.grpo_batches import make_grpo_batch

    return make_grpo_batch(**SHAPE, seed=seed, use_kl=True, **kwargs)


def _scored(log_probs) -> list[torch.Tensor]:
    """Per row, every position that scores a next token (the last scores none: engines leave anything there)."""
    return [row[:-1].detach() for row in log_probs.unbind()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _engine_facts(engine, batch, loss_fn, export: bool) -> dict:
    from verl_prefix.harness import verl_engine
    from verl_prefix.harness.megatron import exported_weights

    infer = verl_engine.run_infer(engine, batch)
    out = {"log_probs": _scored(infer["log_probs"]), "entropy": list(infer["entropy"].unbind())}
    if export:  # before the step: what the rollout receives from the checkpoint's weights
        out["export"] = exported_weights(engine)
    step = verl_engine.run_train_step(engine, loss_fn, batch)
    # verl reports the step's metrics on the model-parallel source rank only (TP rank 0 of the last stage)
    out.update(loss=step["loss"], grad_norm=step["grad_norm"], source=engine.is_mp_src_rank_with_outputs())
    return out


def _hf_facts(model_dir: str, batch, actor_config) -> dict:
    from transformers import AutoModelForCausalLM

    from verl_prefix.harness import verl_engine

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = verl_engine.hf_log_probs(hf, batch, calculate_entropy=True)
    loss = verl_engine.hf_ppo_loss(hf, actor_config, batch)
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in hf.parameters() if p.grad is not None))
    return {
        "log_probs": _scored(ref["log_probs"]),
        "entropy": [row.detach() for row in ref["entropy"].unbind()],
        "loss": float(loss),
        "grad_norm": float(grad_norm),
    }


def _assert_matches(got: dict, want: dict, what: str) -> None:
    assert _max_diff(got["log_probs"], want["log_probs"]) < TOL * 10, what
    assert _max_diff(got["entropy"], want["entropy"]) < TOL * 10, what
    if got.get("source", True):
        assert got["loss"] == pytest.approx(want["loss"], rel=TOL, abs=TOL), what
        assert float(got["grad_norm"]) == pytest.approx(want["grad_norm"], rel=TOL), what


def _assert_export_is_checkpoint(exported: dict, model_dir: str) -> None:
    from safetensors.torch import load_file

    checkpoint = load_file(str(Path(model_dir) / "model.safetensors"))
    assert sorted(exported) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(exported[name], tensor.float()), name


# --- bodies (module level: each rank unpickles them by name) ---


def _noop_on_cuda(rank: int) -> dict:
    import verl.utils.megatron_utils as megatron_utils
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine import EngineRegistry

    from verl_prefix.backend.megatron import platform

    def snapshot() -> dict:
        return {
            "current_device": torch.cuda.current_device,
            "module_cuda": torch.nn.Module.cuda,
            "stream": torch.cuda.Stream,
            "rng": mrandom.initialize_rng_tracker,
            "attention": DotProductAttention.forward,
            "config": McoreEngineConfig.__post_init__,
            "overrides": megatron_utils.mapping_string_to_attn_backend,
            "optimizer_state_dict": DistributedOptimizer.state_dict,
            "registry": sorted(EngineRegistry._engines["language_model"].get("megatron", {})),
            "bridge": "megatron.bridge" in __import__("sys").modules,
        }

    before = snapshot()
    applied = platform.ensure_megatron_platform(device="cuda")
    after_cuda = snapshot()
    platform.ensure_megatron_platform(device="cpu")  # the positive control: the snapshot sees the patches
    after_cpu = snapshot()
    changed = sorted(k for k in before if before[k] != after_cpu[k])
    return {
        "applied": applied,
        "same_on_cuda": before == after_cuda,
        "applied_after": platform.applied_patches(),
        "changed_on_cpu": changed,
        "snapshot_keys": sorted(before),
    }


def _tp1(rank: int, model_dir: str) -> dict:
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    loss_fn, actor_config = ppo_loss(["use_kl_loss=True"])
    batch = _batch(seed=1)
    out = {"hf": _hf_facts(model_dir, batch, actor_config)}
    for key, kwargs in (
        ("bridge_thd", dict()),
        ("bridge_bshd", dict(use_remove_padding=False)),
        ("mbridge_thd", dict(vanilla_mbridge=True)),
    ):
        engine = build_megatron_engine(model_dir, lr=0.0, **kwargs)
        out[key] = _engine_facts(engine, batch, loss_fn, export=key == "bridge_thd")
    return out


def _tp2(rank: int, model_dir: str) -> dict:
    from verl_prefix.backend.megatron.platform import contiguous_tp_scatter
    from verl_prefix.harness import verl_engine
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    loss_fn, actor_config = ppo_loss(["use_kl_loss=True"])
    batch = _batch(seed=2)  # TP ranks hold the same rows
    out = {"hf": _hf_facts(model_dir, batch, actor_config)}
    with contiguous_tp_scatter(False):  # the negative control: gloo scatters the views' raw storage
        broken = build_megatron_engine(model_dir, tensor_parallel_size=2, lr=0.0)
    out["unfixed_log_probs"] = _scored(verl_engine.run_infer(broken, batch)["log_probs"])
    engine = build_megatron_engine(model_dir, tensor_parallel_size=2, lr=0.0)
    out["tp2"] = _engine_facts(engine, batch, loss_fn, export=True)
    mbridge = build_megatron_engine(model_dir, tensor_parallel_size=2, lr=0.0, vanilla_mbridge=True)
    out["tp2_mbridge"] = _engine_facts(mbridge, batch, loss_fn, export=False)
    # sequence parallelism (verl's setting at TP > 1): megatron-core's torch norms built under it, their parameters
    # marked so finalize_model_grads sums their gradients over the TP ranks (``sequence_parallel_norm``)
    sequence_parallel = build_megatron_engine(model_dir, tensor_parallel_size=2, lr=0.0, sequence_parallel=True)
    out["tp2_sp_on"] = bool(sequence_parallel.tf_config.sequence_parallel)
    out["tp2_sp"] = _engine_facts(sequence_parallel, batch, loss_fn, export=False)
    unmarked = build_megatron_engine(model_dir, tensor_parallel_size=2, lr=0.0, sequence_parallel=True)
    for param in unmarked.module[0].parameters():  # the negative control: each rank's norm gradient of its slice
        if getattr(param, "sequence_parallel", False):
            param.sequence_parallel = False
    out["tp2_sp_unmarked"] = _engine_facts(unmarked, batch, loss_fn, export=False)
    return out


def _dp2(rank: int, model_dir: str) -> dict:
    from verl_prefix.harness import verl_engine
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    loss_fn, _ = ppo_loss(["use_kl_loss=True"])
    batch = _batch(seed=3 + rank, global_batch_size=8)  # each data-parallel rank its own rows
    megatron = build_megatron_engine(model_dir, lr=0.0, use_distributed_optimizer=True)
    assert megatron.get_data_parallel_size() == 2
    fsdp, _, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", lr=0.0, use_remove_padding=True)
    return {
        "megatron": _engine_facts(megatron, batch, loss_fn, export=True),
        "fsdp2": _engine_facts(fsdp, batch, loss_fn, export=False),
    }


# --- tests ---


def test_platform_entry_is_a_no_op_for_a_cuda_device():
    result = run_ranks(_noop_on_cuda, world=1)[0]
    assert result["applied"] == ()
    assert result["same_on_cuda"], "ensure_megatron_platform(device='cuda') patched something"
    from verl_prefix.backend.megatron.platform import PATCHES

    assert set(result["applied_after"]) == set(PATCHES), "every patch in the table is applied on CPU"
    # the positive control: on CPU the same snapshot sees every patched entry change, so it would see a CUDA one
    assert result["changed_on_cpu"] == result["snapshot_keys"]


def test_tp1_matches_hf_with_both_loaders_and_layouts(tiny_qwen3_dir):
    out = run_ranks(_tp1, str(tiny_qwen3_dir), world=1)[0]
    for key in ("bridge_thd", "bridge_bshd", "mbridge_thd"):
        _assert_matches(out[key], out["hf"], key)
    _assert_export_is_checkpoint(out["bridge_thd"]["export"], str(tiny_qwen3_dir))


def test_tp2_matches_hf_and_the_gloo_scatter_trap(tiny_qwen3_dir):
    results = run_two_ranks(_tp2, str(tiny_qwen3_dir))
    assert [results[rank]["tp2"]["source"] for rank in (0, 1)] == [True, False]
    for rank, out in results.items():
        _assert_matches(out["tp2"], out["hf"], f"TP=2 rank {rank}")
        _assert_matches(out["tp2_mbridge"], out["hf"], f"TP=2 mbridge rank {rank}")
        _assert_export_is_checkpoint(out["tp2"]["export"], str(tiny_qwen3_dir))
        # without contiguous pieces the row-parallel shards load scrambled: log-probs off by far more than rounding
        assert _max_diff(out["unfixed_log_probs"], out["hf"]["log_probs"]) > 0.1, "the scatter trap did not show"
        assert out["tp2_sp_on"], "sequence parallelism was turned off"
        _assert_matches(out["tp2_sp"], out["hf"], f"TP=2 with sequence parallelism rank {rank}")
        if out["tp2_sp_unmarked"]["source"]:  # the norms' gradients not summed over the TP ranks: off
            got, want = out["tp2_sp_unmarked"]["grad_norm"], out["hf"]["grad_norm"]
            assert abs(float(got) - want) > 10 * TOL * want, "unsummed norm gradients passed"


def test_dp2_distributed_optimizer_matches_fsdp2(tiny_qwen3_dir):
    results = run_two_ranks(_dp2, str(tiny_qwen3_dir))
    for rank, out in results.items():
        _assert_matches(out["megatron"], out["fsdp2"], f"DP=2 rank {rank}")
        _assert_export_is_checkpoint(out["megatron"]["export"], str(tiny_qwen3_dir))
    assert all(results[rank]["megatron"]["source"] for rank in (0, 1))  # each data-parallel rank reports
    assert results[0]["megatron"]["grad_norm"] == pytest.approx(results[1]["megatron"]["grad_norm"], rel=1e-12)
