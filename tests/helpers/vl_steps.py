"""One update of a vision-language engine on the stock engine's terms, and the gradient comparison, shared by
the one-level and the tree multimodal engine tests."""

from __future__ import annotations

from contextlib import nullcontext

from helpers.delta_rule import fp64_delta_net
from helpers.precision import fp64_throughout
from verl_prefix.harness import verl_engine
from verl_prefix.schedule.models.multimodal import text_only_call


def step(engine_and_loss, batch, precision=fp64_throughout) -> dict:
    """One update with captured grads. ``text_only_call`` lets verl's placeholder vision pass of a text-only
    micro-batch run under transformers 5 (the stock engine needs it as much as ours). In fp64 Qwen3.5's gated
    delta-nets run the delta rule token by token in fp64 (``fp64_delta_net``; transformers' chunked kernel
    computes in fp32 whatever the dtype), a no-op for the other families."""
    engine, loss_fn, _ = engine_and_loss
    delta_rule = fp64_delta_net(engine.module) if precision is fp64_throughout else nullcontext()
    with precision(), delta_rule, text_only_call(engine.module):
        return verl_engine.run_train_step(engine, loss_fn, batch, capture_grads=True)


def worst(got: dict, want: dict) -> float:
    """The worst parameter's relative gradient error (the same parameters on both sides)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max(((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)).item() for n in want)
