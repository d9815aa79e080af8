"""``prefix_megatron`` under megatron-core's activation recompute, against verl's own Megatron engine, TP=2 on two
gloo ranks, fp32 (``megatron.recompute``).

The CPU platform adapts megatron-core's RNG save/restore around a recomputed forward (``recompute_rng``), so verl's
engine itself recomputes on CPU: its gradients with ``recompute_granularity`` full (uniform and block) and selective
equal its own without recompute, and the recompute ran (megatron-core's checkpoint functions counted). The prefix
engine with each recompute setting equals verl's engine without recompute, one-level, tree, chunked prefix, merged
phase B and ``dormant_prefix=recompute``, reuse asserted, every case recomputing phase B's layers. Negative controls:
phase B's recomputed layers attending to detached copies of the prefix K/V (their prefix gradient dropped) is off;
phase A through megatron-core's checkpoint (its K/V captured without a graph) stops at phase C.
"""

from __future__ import annotations

import pytest
from helpers.engine_batches import MEGATRON_CASES, compare_steps, megatron_cases, megatron_train_step
from helpers.engine_batches import shared_system_batch as batch_of
from helpers.megatron_stack import require_megatron_stack
from helpers.ranks import run_two_ranks
from helpers.reuse import assert_reuse_ran

require_megatron_stack()

TOL = 1e-5  # fp32
SETTINGS = {
    "full_uniform": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full_block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "layernorm", "mlp"]},
}
CASES = {"one_level": MEGATRON_CASES["one_level"], "tree": MEGATRON_CASES["tree"]}
ALL_CASES = MEGATRON_CASES


class Counted:
    """How many times megatron-core's recompute ran a function in backward (both of its checkpoint kinds)."""

    def __init__(self) -> None:
        from megatron.core.tensor_parallel import random as mrandom

        self.calls = 0
        stock_backward = mrandom.CheckpointFunction.backward
        stock_recompute = mrandom.CheckpointWithoutOutput._recompute

        def backward(ctx, *args):
            self.calls += 1
            return stock_backward(ctx, *args)

        def recompute(obj, grad):
            self.calls += 1
            return stock_recompute(obj, grad)

        mrandom.CheckpointFunction.backward = staticmethod(backward)
        mrandom.CheckpointWithoutOutput._recompute = recompute

    def during(self, run):
        before = self.calls
        result = run()
        return result, self.calls - before


def _prefix_grad_dropped():
    """Negative control: phase B's recomputed layers (the pass in backward, grad enabled) attend to detached copies
    of the prefix K/V, so their dK/dV never reach the leaves phase C seeds from."""
    import contextlib

    import torch

    from verl_prefix.schedule.kv.contexts import ServeContext

    @contextlib.contextmanager
    def control():
        stock = ServeContext.attend

        def attend(self, module, base, query, key, value, **kwargs):
            if not torch.is_grad_enabled():
                return stock(self, module, base, query, key, value, **kwargs)
            layer = module.layer_idx
            kept = self.prefix.keys[layer], self.prefix.values[layer]
            self.prefix.keys[layer], self.prefix.values[layer] = (t.detach() for t in kept)
            try:
                return stock(self, module, base, query, key, value, **kwargs)
            finally:
                self.prefix.keys[layer], self.prefix.values[layer] = kept

        ServeContext.attend = attend
        try:
            yield
        finally:
            ServeContext.attend = stock

    return control


def _phase_a_checkpointed():
    """Negative control: phase A's calls recompute like phase B's (megatron-core's checkpoint under no_grad)."""
    import contextlib

    from verl_prefix.backend.megatron import causal_lm

    @contextlib.contextmanager
    def control():
        saved = causal_lm.CaptureContext
        causal_lm.CaptureContext = type("NeverCapture", (), {})
        try:
            yield
        finally:
            causal_lm.CaptureContext = saved

    return control


def _body(rank: int, model_dir: str) -> dict:
    import dataclasses
    import functools

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    counted = Counted()
    loss_fn, _ = ppo_loss(["use_kl_loss=true", "ppo_micro_batch_size_per_gpu=4"])
    base = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2)
    local = {"attention_backend": "local"}
    stock = build_megatron_engine(model_dir, lr=0.0, tensor_parallel_size=2)
    batch = batch_of(0, False)
    want = megatron_train_step(stock, loss_fn, batch)
    out: dict = {}
    for name, setting in SETTINGS.items():
        over = {**local, **setting}
        recomputing = build_megatron_engine(model_dir, lr=0.0, tensor_parallel_size=2, override_transformer_config=over)
        got, calls = counted.during(functools.partial(megatron_train_step, recomputing, loss_fn, batch))
        out[name] = {"stock": {**compare_steps(want, got), "recomputes": calls}}
        prefix = build_megatron_engine(
            model_dir, backend="prefix_megatron", lr=0.0, tensor_parallel_size=2, prefix_reuse=base,
            override_transformer_config=over,
        )  # fmt: skip
        cases = ALL_CASES if name == "full_uniform" else CASES
        controls = {"prefix_grad_dropped": _prefix_grad_dropped()}
        for case, (knobs, dormant) in cases.items():
            own = controls if case == "one_level" else {}
            run = functools.partial(megatron_cases, stock, prefix, loss_fn, batch, base, {case: (knobs, dormant)}, own)
            result, calls = counted.during(run)
            out[name][case] = {**result[case], "recomputes": calls}
        prefix.reuse_config, prefix.dormant_prefix = dataclasses.replace(base), "keep"
        try:
            with _phase_a_checkpointed()():
                megatron_train_step(prefix, loss_fn, batch)
            out[name]["phase_a_checkpointed"] = None
        except RuntimeError as error:
            out[name]["phase_a_checkpointed"] = str(error)
    return out


@pytest.fixture(scope="module")
def ranks(tiny_model) -> dict:
    return run_two_ranks(_body, str(tiny_model("qwen3")), timeout=1200)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_verls_engine_recomputes_on_cpu_exactly(ranks, setting):
    for rank, result in ranks.items():
        r = result[setting]["stock"]
        assert r["recomputes"] > 0, (rank, setting)
        assert r["grads"] > 10 and r["worst"] < TOL, (rank, setting, r["name"], r["worst"])


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_reuse_under_recompute_matches_verls_engine(ranks, setting):
    for rank, result in ranks.items():
        for case in ALL_CASES if setting == "full_uniform" else CASES:
            r = result[setting][case]
            assert r["recomputes"] > 0, (rank, setting, case)  # phase B's layers recomputed in backward
            assert r["worst"] < TOL, (rank, setting, case, r["name"], r["worst"])
            assert_reuse_ran(r["metrics"], groups=2)
            want_infer, got_infer = r["infer"]
            assert got_infer["metrics"]  # the forward-only pass ran through the prefix engine too


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_recompute_controls_fail(ranks, setting):
    for rank, result in ranks.items():
        r = result[setting]["one_level"]
        assert r["prefix_grad_dropped"] > 1e-3, (rank, setting, "recomputed layers without their dK/dV passed")
        stopped = result[setting]["phase_a_checkpointed"]
        # the schedule's own check names it, or (a selective layer norm's output without a graph) autograd does
        assert stopped is not None and ("has no autograd graph" in stopped or "does not require grad" in stopped)
