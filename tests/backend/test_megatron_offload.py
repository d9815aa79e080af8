"""``prefix_megatron`` with verl's ``param_offload`` and ``optimizer_offload`` (the distributed optimizer), TP=2 on
two gloo ranks, fp32, two steps at a learning rate that moves the weights.

verl moves the Megatron engine's state with ``to(device)`` around each pass (its engine context loads on entry and
offloads on exit); on the host the load and offload devices are both ``cpu``, so the CPU platform's ``offload``
entry gives the context its direction and runs verl's own offload and load functions: between passes the parameter
and gradient buffers hold no storage (checked), and each pass restores them from their host copies. verl's engine
with offload equals itself without, bit for bit (the stand-in moves exact copies); ``prefix_megatron`` with offload
equals verl's engine without it: every gradient of both steps (the second after an Adam step through the offloaded
optimizer state), the forward-only log-probs, reuse asserted on every pass.
"""

from __future__ import annotations

import pytest
from helpers.engine_batches import compare_steps, megatron_train_step, shared_system_batch
from helpers.megatron_stack import require_megatron_stack
from helpers.ranks import run_two_ranks
from helpers.reuse import assert_infer_matches, assert_reuse_ran

require_megatron_stack()

TOL = 1e-5  # fp32
STEPS = 2
OFFLOAD = dict(param_offload=True, optimizer_offload=True)


def _steps(engine, loss_fn, batch) -> list[dict]:
    from verl_prefix.backend.megatron.platform import offloaded
    from verl_prefix.harness import verl_engine

    out = []
    for _ in range(STEPS):
        step = megatron_train_step(engine, loss_fn, batch)
        infer = verl_engine.run_infer(engine, batch)
        step["released"] = offloaded(engine)  # between passes, as verl leaves it
        step["infer"] = {k: infer[k] for k in ("response_log_probs", "response_entropy", "metrics")}
        out.append(step)
    return out


def _body(rank: int, model_dir: str) -> dict:
    import torch

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.backend.megatron.platform import offloaded
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    loss_fn, _ = ppo_loss(["use_kl_loss=true", "ppo_micro_batch_size_per_gpu=4"])
    reuse = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2)
    from verl.utils import tensordict_utils as tu

    batch = shared_system_batch(0, False)
    tu.assign_non_tensor(batch, disable_auto_offload=False)  # verl's worker context: load on entry, offload on exit
    layout = dict(tensor_parallel_size=2, lr=1e-2)
    runs = {
        "stock": build_megatron_engine(model_dir, **layout),
        "stock_offload": build_megatron_engine(model_dir, **layout, **OFFLOAD),
        "prefix_offload": build_megatron_engine(
            model_dir, backend="prefix_megatron", prefix_reuse=reuse, **layout, **OFFLOAD
        ),
    }
    released_at_init = {name: offloaded(engine) for name, engine in runs.items()}
    # a forward-only engine (the reference policy's) with offload on: its chunks hold their own parameters, which
    # the host keeps in place; its log-probs stay the stock engine's over passes
    reference = build_megatron_engine(
        model_dir, backend="prefix_megatron", prefix_reuse=reuse, forward_only=True, **layout, **OFFLOAD
    )
    from verl_prefix.harness import verl_engine

    ref_passes = [verl_engine.run_infer(reference, batch)["response_log_probs"] for _ in range(2)]
    plain = build_megatron_engine(model_dir, forward_only=True, **layout)  # verl's, no offload
    want_ref = verl_engine.run_infer(plain, batch)["response_log_probs"]
    steps = {name: _steps(engine, loss_fn, batch) for name, engine in runs.items()}
    out: dict = {"released_at_init": released_at_init}
    out["reference"] = max((got.values() - want_ref.values()).abs().max().item() for got in ref_passes)
    for name in ("stock_offload", "prefix_offload"):
        out[name] = []
        for want, got in zip(steps["stock"], steps[name]):
            compared = compare_steps(want, got)
            compared["identical"] = all(torch.equal(want["grads"][n], got["grads"][n]) for n in want["grads"])
            compared["released"] = got["released"]
            compared["infer"] = (want["infer"], got["infer"])
            out[name].append(compared)
    return out


@pytest.fixture(scope="module")
def ranks(tiny_model) -> dict:
    return run_two_ranks(_body, str(tiny_model("qwen3")), timeout=900)


def test_offload_releases_the_buffers_between_passes(ranks):
    for rank, result in ranks.items():
        assert result["released_at_init"] == {"stock": False, "stock_offload": True, "prefix_offload": True}, rank
        for name in ("stock_offload", "prefix_offload"):
            assert all(step["released"] for step in result[name]), (rank, name)


def test_forward_only_engine_with_offload_keeps_its_parameters(ranks):
    for rank, result in ranks.items():
        assert result["reference"] < TOL, rank


def test_verls_engine_with_offload_is_itself_on_cpu(ranks):
    for rank, result in ranks.items():
        assert all(step["identical"] for step in result["stock_offload"]), rank


def test_prefix_engine_with_offload_matches_verls_engine(ranks):
    for rank, result in ranks.items():
        for index, step in enumerate(result["prefix_offload"]):
            assert step["grads"] > 10 and step["worst"] < TOL, (rank, index, step["name"], step["worst"])
            assert_reuse_ran(step["metrics"], groups=2)
            assert_infer_matches(*step["infer"], TOL, groups=2)
