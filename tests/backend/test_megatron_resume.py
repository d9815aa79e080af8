"""verl's resume on the Megatron engine on CPU: a checkpoint saved after a step loads into a fresh engine (what
``trainer.resume_mode=auto`` does in a new ``main_ppo`` launch), optimizer state included.

Without TransformerEngine or apex, megatron-core's distributed optimizer reads the iteration from torch Adam's
per-parameter state, which a fresh engine has none of, and the load raised (the platform's
``optimizer_fresh_state_dict`` entry); once it loaded, Adam's step came back as the template's (0) in one tensor all
parameters shared, which Adam then advanced once per parameter (``optimizer_state_load``'s step copy: the second step
ended 2.2e-2 off). Here one engine steps, saves, and steps again; a fresh engine loads that checkpoint (the weights at
the save, step 1) and takes the same second step: the weights after it equal the first engine's bit for bit. The
control: the same load with Adam's moments zeroed afterwards ends elsewhere. One rank, fp32, the distributed
optimizer, a tiny Qwen3, in a fresh process (the platform patches process-wide).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers.ranks import run_ranks

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 is an optional dependency (scripts/setup.sh)")
if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge 0.3.1 is an optional dependency (scripts/setup.sh)", allow_module_level=True)

SHAPE = dict(num_groups=2, group_size=2, prompt_lens=[7, 5], response_len_range=(3, 6), vocab_size=128)


def _resume(rank: int, model_dir: str, root: str) -> dict:
    import torch

    from verl_prefix.harness import verl_engine
    from verl_prefix.harness.grpo_batches import make_grpo_batch
    from verl_prefix.harness.megatron import build_megatron_engine, exported_weights, ppo_loss

    loss_fn, _ = ppo_loss(["use_kl_loss=True"])

    def batch(seed: int):  # a new one per step (a step may change the batch it is given)
        return make_grpo_batch(**SHAPE, seed=seed, use_kl=True)

    path = str(Path(root) / "global_step_1" / "actor")

    running = build_megatron_engine(model_dir, lr=1e-2)
    verl_engine.run_train_step(running, loss_fn, batch(3))
    running.save_checkpoint(path, global_step=1)
    saved = exported_weights(running)
    verl_engine.run_train_step(running, loss_fn, batch(4))
    want = exported_weights(running)

    def resumed(zero_moments: bool) -> dict:
        engine = build_megatron_engine(model_dir, lr=1e-2)
        engine.load_checkpoint(path)
        loaded = all(torch.equal(w, saved[n]) for n, w in exported_weights(engine).items())
        inner = engine.optimizer.chained_optimizers[0].optimizer
        steps = sorted({float(state["step"]) for state in inner.state.values()})
        if zero_moments:
            for state in inner.state.values():
                state["exp_avg"].zero_()
                state["exp_avg_sq"].zero_()
        verl_engine.run_train_step(engine, loss_fn, batch(4))
        got = exported_weights(engine)
        worst = max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items())
        exact = all(torch.equal(got[n], w) for n, w in want.items())
        return {"loaded": loaded, "steps": steps, "exact": exact, "worst": worst}

    return {"resumed": resumed(False), "moments_zeroed": resumed(True)}


def test_fresh_engine_resumes_optimizer_state(tiny_qwen3_dir, tmp_path):
    result = run_ranks(_resume, str(tiny_qwen3_dir), str(tmp_path / "checkpoints"), world=1)[0]
    assert result["resumed"]["loaded"], result  # the weights at the save
    assert result["resumed"]["steps"] == [1.0], result  # Adam's iteration, from the checkpoint
    assert result["resumed"]["exact"], result
    assert result["moments_zeroed"]["worst"] > 1e-4, result  # the comparison sees the optimizer state
