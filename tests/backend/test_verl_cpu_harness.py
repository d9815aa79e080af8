"""verl's stock FSDP2 engine on CPU, checked against a plain-HF recomputation of the same loss."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl_prefix.harness import grpo_batches, tiny_models, verl_engine

VOCAB = 128


def _batch(layout="v1", **kw):
    args = dict(
        num_groups=2,
        group_size=4,
        prompt_lens=[5, 7],
        response_len_range=(1, 6),
        vocab_size=VOCAB,
        seed=1,
        use_kl=True,
        calculate_entropy=True,
        layout=layout,
    )
    args.update(kw)
    return grpo_batches.make_grpo_batch(**args)


def _hf_model(model_dir, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def stock(tiny_qwen3_dir):
    # 8 samples in micro-batches of 2: gradient accumulation over 4 calls, each group split in two.
    return verl_engine.build_verl_engine(
        tiny_qwen3_dir,
        backend="fsdp2",
        micro_batch_size_per_gpu=2,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
    )


def test_cpu_platform_is_active():
    from verl.utils.device import get_device_id, get_device_name, get_nccl_backend, get_torch_device
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from verl_prefix.backend.platform_cpu import ensure_cpu_platform

    ensure_cpu_platform()  # idempotent
    assert (get_device_name(), get_device_id(), get_nccl_backend()) == ("cpu", "cpu", "gloo")
    dev = get_torch_device()
    dev.synchronize()
    dev.empty_cache()
    assert dev.max_memory_allocated() == 0 and dev.mem_get_info()[1] > 0
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead


def test_batch_layout():
    b = _batch()
    assert b.batch_size[0] == 8
    for key in ("prompts", "responses", "response_mask", "loss_mask", "input_ids", "position_ids"):
        assert b[key].is_nested, key
    assert list(b["uid"]) == ["uid-1-0"] * 4 + ["uid-1-1"] * 4
    prompts = b["prompts"].unbind()
    assert all(torch.equal(prompts[0], p) for p in prompts[:4])
    adv = b["advantages"].to_padded_tensor(0.0)[:, 0].reshape(2, 4)
    assert torch.allclose(adv.mean(1), torch.zeros(2), atol=1e-5) and adv.abs().sum() > 0

    legacy = _batch("legacy")
    assert not legacy["prompts"].is_nested and legacy["input_ids"].is_nested
    assert legacy["prompts"][:, 0].eq(tiny_models.PAD_ID).any()  # left-padded
    assert torch.equal(legacy["input_ids"].values(), b["input_ids"].values())


def test_infer_matches_hf(stock, tiny_qwen3_dir):
    engine, _, _ = stock
    batch = _batch()
    out = verl_engine.run_infer(engine, batch, calculate_entropy=True)
    with torch.no_grad():
        ref = verl_engine.hf_log_probs(_hf_model(tiny_qwen3_dir), batch, calculate_entropy=True)
    mask = batch["response_mask"]
    from verl.workers.utils.padding import response_from_nested

    for key, got in (("log_probs", out["response_log_probs"]), ("entropy", out["response_entropy"])):
        want = response_from_nested(ref[key], mask)
        torch.testing.assert_close(got.values(), want.values(), rtol=1e-5, atol=1e-5)

    # The legacy (padded) layout yields the same numbers, right-padded.
    legacy = verl_engine.run_infer(engine, _batch("legacy"), calculate_entropy=False)["response_log_probs"]
    torch.testing.assert_close(legacy, out["response_log_probs"].to_padded_tensor(0.0), rtol=1e-5, atol=1e-5)


def test_train_batch_matches_hf_loss_and_grads(stock, tiny_qwen3_dir):
    engine, loss_fn, actor_config = stock
    batch = _batch()
    before = verl_engine.params_of(engine)
    model = _hf_model(tiny_qwen3_dir)
    hf_params = dict(model.named_parameters())
    for name, p in before.items():  # the engine starts from the checkpoint the reference loads
        torch.testing.assert_close(p, hf_params[name].detach(), rtol=0, atol=0)

    res = verl_engine.run_train_step(engine, loss_fn, batch, capture_grads=True)
    grads = res["grads"]
    assert set(grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        assert g.abs().sum() > 0, name
    assert res["grad_norm"] > 0
    assert res["lr"] == pytest.approx(engine.optimizer_config.lr)  # constant schedule, no warm-up

    ref_loss = verl_engine.hf_ppo_loss(model, actor_config, batch)
    ref_loss.backward()
    assert abs(res["loss"] - ref_loss.item()) < 1e-6
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)

    after = verl_engine.params_of(engine)
    assert any(not torch.equal(before[n], after[n]) for n in before), "optimizer step changed nothing"


def test_fp64_engine(tiny_qwen3_dir):
    engine, loss_fn, _ = verl_engine.build_verl_engine(tiny_qwen3_dir, dtype="float64", micro_batch_size_per_gpu=8)
    assert {p.dtype for p in engine.module.parameters()} == {torch.float64}
    res = verl_engine.run_train_step(engine, loss_fn, _batch(use_kl=False), capture_grads=True)
    assert {g.dtype for g in res["grads"].values()} == {torch.float64}
    assert all(torch.isfinite(g).all() for g in res["grads"].values())
