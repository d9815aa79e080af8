"""``prefix_megatron`` at pipeline parallelism 2 (two stages on two gloo ranks, fp32) with reuse off trains and infers
as verl's own Megatron engine does: the refusal of PP under reuse tells users to switch reuse off, and that advice
must run. verl's Megatron engine returns ``{}`` on every stage but the last; the driver passes that through
(it raised ``KeyError: 'metrics'`` on stage 0). Every parameter's gradient on each stage, the last stage's loss,
grad norm and log-probs equal verl's engine's on the same batch; the first stage reports nothing, as verl's."""

from __future__ import annotations

import importlib.util

import pytest
from helpers.engine_batches import megatron_train_step, shared_system_batch
from helpers.ranks import run_two_ranks

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 is an optional dependency (scripts/setup.sh)")
if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge 0.3.1 is an optional dependency (scripts/setup.sh)", allow_module_level=True)


def _body(rank: int, model_dir: str) -> dict:
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import verl_engine
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    loss_fn, _ = ppo_loss(["ppo_micro_batch_size_per_gpu=4"])
    stock = build_megatron_engine(model_dir, lr=0.0, pipeline_model_parallel_size=2)
    off = build_megatron_engine(
        model_dir, backend="prefix_megatron", lr=0.0, pipeline_model_parallel_size=2,
        prefix_reuse=PrefixReuseConfig(enable=False),
    )  # fmt: skip
    batch = shared_system_batch(0, False)
    want, got = megatron_train_step(stock, loss_fn, batch), megatron_train_step(off, loss_fn, batch)
    infer_want, infer_got = verl_engine.run_infer(stock, batch), verl_engine.run_infer(off, batch)
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items() if g.norm() > 0)
    log_probs = None
    if infer_want["log_probs"] is not None:
        log_probs = (infer_got["log_probs"].values() - infer_want["log_probs"].values()).abs().max().item()
    refused = None
    try:
        build_megatron_engine(model_dir, backend="prefix_megatron", lr=0.0, pipeline_model_parallel_size=2)
    except ValueError as error:
        refused = str(error)
    return {
        "last_stage": off.is_mp_src_rank_with_outputs(),
        "grads": (len(want["grads"]), sorted(got["grads"]) == sorted(want["grads"]), worst),
        "loss": (want["loss"], got["loss"]),
        "grad_norm": (want["grad_norm"], got["grad_norm"]),
        "log_probs": log_probs,
        "refused": refused,
    }


def test_pipeline_stages_with_reuse_off_train_as_verls_engine(tiny_model):
    results = run_two_ranks(_body, str(tiny_model("qwen3")), timeout=600)
    assert [results[r]["last_stage"] for r in (0, 1)] == [False, True]
    for rank, result in results.items():
        count, same_names, worst = result["grads"]
        assert count > 0 and same_names and worst < 1e-6, (rank, result["grads"])
        refused = result["refused"]
        assert "pipeline_model_parallel_size=2" in refused and "prefix_reuse.enable=false" in refused
    first, last = results[0], results[1]
    assert first["loss"] == (None, None) and first["log_probs"] is None  # verl's engine: nothing before the last
    assert last["loss"][0] == pytest.approx(last["loss"][1], rel=1e-6, abs=1e-9)
    assert last["grad_norm"][0] > 0 and last["grad_norm"][1] == pytest.approx(last["grad_norm"][0], rel=1e-6)
    assert last["log_probs"] < 1e-6
