"""Dormant-prefix policies at schedule level against plain HF: keep, recompute and offload (a CPU
stand-in store that really copies) give the dense gradients, with and without checkpointing and with
the MoE aux loss; the recompute check catches a wrong recompute; recompute holds less during phase B."""

from __future__ import annotations

import pytest
import torch
from helpers.layouts import make_layout, token_weights
from helpers.precision import promote_fp32_upcasts
from helpers.schedule_runs import train_reuse
from test_moe import compare as moe_compare
from test_moe import tiny_moe
from test_schedule_hf import TOLERANCE, dense_grads, tiny_model, weighted_loss, worst_relative

from verl_prefix.schedule import dormant as D
from verl_prefix.schedule import executor
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.prefix_kv import prefix_attention_mode
from verl_prefix.schedule.telemetry import PhaseMeter

CPU = torch.device("cpu")
LAYOUT = [(9, [4, 7, 1, 6, 3, 5, 2, 8]), (14, [5, 3, 6]), (4, [2, 4])]


class CountingStore(D.HostOffload):
    """``offload``'s store with CPU as both "device" and "host": the copies are real and counted."""

    instances: list[CountingStore] = []

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        CountingStore.instances.append(self)


def dormant(policy: str, stats: D.DormantStats | None = None, **kwargs) -> D.Dormant:
    return D.Dormant(policy, stats=stats, store_factory=CountingStore, **kwargs)


def run_policy(model, layout, weights, policy, *, rows=3, stats=None, check_recompute=True, **options):
    """``train_reuse`` with a fresh ``policy`` per group; ``options`` for ``train_group`` (meter, chunks...)."""
    return train_reuse(
        model,
        layout,
        weighted_loss(weights),
        rows=rows,
        calculate_entropy=True,
        dormant=lambda: dormant(policy, stats, check_recompute=check_recompute),
        **options,
    )


@pytest.mark.parametrize(
    "dtype, checkpointing",
    [(torch.float64, False), (torch.float32, False), (torch.float64, True)],
    ids=["fp64", "fp32", "fp64-grad-ckpt"],
)
@pytest.mark.parametrize("policy", ["keep", "recompute", "offload"])
def test_every_policy_matches_dense(policy, dtype, checkpointing):
    model = tiny_model("qwen3", "sdpa", dtype, tied=True, checkpointing=checkpointing)
    layout = make_layout(LAYOUT)
    weights = token_weights(layout, dtype)
    stats = D.DormantStats()
    CountingStore.instances.clear()
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        got, plan = run_policy(model, layout, weights, policy, stats=stats, meter=PhaseMeter(CPU))
        keep = run_policy(model, layout, weights, "keep")[0] if policy == "offload" else None
    assert len(plan.groups) == 3 and not plan.dense_rows  # reuse ran: three groups, no dense row
    assert worst_relative(got, want) < TOLERANCE[dtype]
    assert stats.metrics()[f"prefix/policy/{policy}"] == 3.0
    if policy == "offload":
        # the copies are exact; every group moved its saved tensors out and back
        assert all(torch.equal(got[n], keep[n]) for n in keep)
        assert len(CountingStore.instances) == 3
        assert all(s.offloaded_bytes > 0 and s.restored_bytes == s.offloaded_bytes for s in CountingStore.instances)
        assert stats.metrics()["prefix/offloaded_mib"] > 0
    if policy == "recompute":
        assert stats.recompute_max_diff == 0.0  # deterministic CPU kernels: bit-identical K/V


@pytest.mark.parametrize("policy", ["recompute", "offload"])
def test_policies_with_the_moe_aux_loss(policy):
    """The router-probability sums are a boundary leaf too: recompute re-derives them in phase C (their
    top-k counts must match phase A's exactly), offload moves the router graph with the rest."""
    layout = make_layout([(9, [4, 7, 1, 6]), (14, [5, 3, 6]), (3, [2, 4])])
    with promote_fp32_upcasts():
        for checkpointing in (False, True):
            stats = D.DormantStats()
            model = tiny_moe(torch.float64, checkpointing=checkpointing)
            grads, aux, _, got, _ = moe_compare(
                model, layout, 2, torch.float64, count=False, dormant=dormant(policy, stats)
            )
            assert grads < 1e-10 and aux < 1e-10, f"checkpointing={checkpointing}: grads {grads:.2e}, aux {aux:.2e}"
            assert stats.policies[policy] == 3
            assert all(got[n].norm() > 0 for n in got if n.endswith("mlp.gate.weight"))


def _shift_recomputed_positions(monkeypatch) -> None:
    """A wrong recompute: phase C's prefix forward (the only one under grad) runs one position later."""
    original = executor.prefix_forward

    def shifted(model, ids, positions, *args, **kwargs):
        if torch.is_grad_enabled():
            positions = positions + 1
        return original(model, ids, positions, *args, **kwargs)

    monkeypatch.setattr(executor, "prefix_forward", shifted)


def test_negative_control_recompute_at_shifted_positions(monkeypatch):
    model = tiny_model("llama", "sdpa", torch.float64)
    layout = make_layout(LAYOUT)
    weights = token_weights(layout, torch.float64)
    _shift_recomputed_positions(monkeypatch)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        with pytest.raises(RuntimeError, match="recomputed prefix K/V differ from phase A's"):
            run_policy(model, layout, weights, "recompute")
        # without the check the gradient is silently wrong: the check is what catches it
        got, _ = run_policy(model, layout, weights, "recompute", check_recompute=False)
    assert worst_relative(got, want) > 1e-3


def test_negative_control_recompute_without_phase_c(monkeypatch):
    model = tiny_model("llama", "sdpa", torch.float64)
    layout = make_layout(LAYOUT)
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        got, _ = run_policy(model, layout, weights, "recompute")
        assert worst_relative(got, want) < 1e-10
        monkeypatch.setattr(executor, "prefix_backward", lambda prefix, leaves, model=None: None)
        got, _ = run_policy(model, layout, weights, "recompute")
    assert worst_relative(got, want) > 1e-3


def test_offload_store_mechanics():
    """Pack copies non-parameters to "host" and counts them; unpack without a prefetch fetches on
    demand; parameters are never moved; CPU as the real device is refused (nothing to move to)."""
    store = D.HostOffload(CPU)
    weight = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with store.saving():
        y = (x.t().sin() * 2).sum(0) @ weight  # a transposed (strided) saved tensor too
    assert store.offloaded_bytes > 0 and store.restored_bytes == 0
    moved = store.offloaded_bytes
    y.sum().backward()
    assert store.restored_bytes == moved
    want = torch.autograd.grad(((x.detach().requires_grad_().t().sin() * 2).sum(0) @ weight).sum(), weight)
    assert torch.equal(weight.grad, want[0])
    with pytest.raises(ValueError, match="this run's device is the CPU"):
        D.default_store(CPU)


def test_recompute_holds_less_during_phase_b():
    """Bytes held for backward during phase B (deterministic counts): keep holds phase A's graph plus
    the micro-batch's; recompute and offload only the micro-batch's (which itself grows with P: its
    attention saves ``cat(prefix K/V, suffix K/V)`` per row). Small cell: P=256, G=4, S=4, one micro-batch."""
    model = tiny_model("qwen3", "sdpa", torch.float32)
    layout = make_layout([(257, [4, 4, 4, 4])])
    weights = token_weights(layout, torch.float32)
    held, phase_a = {}, {}
    for policy in ("keep", "recompute", "offload"):
        stats, meter = D.DormantStats(), PhaseMeter(CPU)
        run_policy(model, layout, weights, policy, rows=4, meter=meter, stats=stats)
        held[policy], phase_a[policy] = stats.held_in_b[policy], meter.saved_mib["A"] * 1024**2
        assert stats.metrics()[f"prefix/max_saved_for_backward_held_in_B_mib/{policy}"] == held[policy] / 1024**2
    assert phase_a["recompute"] == phase_a["offload"] == 0
    assert held["recompute"] == held["offload"] > 0
    assert held["keep"] - held["recompute"] == phase_a["keep"] > 0
    assert held["recompute"] < 0.5 * held["keep"], held


def saved_activation_bytes(model, prefix_len: int) -> int:
    """Bytes phase A saves for backward, parameter storages excluded (they are held anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with prefix_attention_mode(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        executor.prefix_forward(model, torch.arange(prefix_len) % 100, torch.arange(prefix_len), ScheduleOptions(CPU))
    return sum(seen.values())


def test_auto_choice_and_estimate():
    """``auto`` keeps what fits, offloads (accelerators) or recomputes (CPU) what does not; the
    model-shape estimate is within 25% of the counted phase-A saved activations of the tiny models."""
    assert D.choose_policy(10, 10, CPU) == ("keep", "fits_budget")
    assert D.choose_policy(11, 10, CPU) == ("recompute", "over_budget_cpu")
    assert D.choose_policy(11, 10, torch.device("cuda", 0)) == ("offload", "over_budget")
    cases = [("qwen3", "sdpa", False), ("llama", "sdpa", False), ("llama", "eager", False), ("qwen3", "sdpa", True)]
    for family, attn, ckpt in cases:
        model = tiny_model(family, attn, torch.float32, checkpointing=ckpt)
        for prefix_len in (64, 256):
            measured = saved_activation_bytes(model, prefix_len)
            estimate = D.estimate_prefix_graph_bytes(model, prefix_len)
            assert 0.8 < estimate / measured < 1.25, (family, attn, ckpt, prefix_len, estimate, measured)


def test_knob_validation():
    assert D.validate_policy("auto", 1 << 30) == "auto"
    with pytest.raises(ValueError, match="dormant_prefix='swap' is not supported"):
        D.validate_policy("swap")
    with pytest.raises(ValueError, match="dormant_prefix=auto needs dormant_prefix_budget_bytes"):
        D.validate_policy("auto")
    with pytest.raises(ValueError, match="must be a positive integer"):
        D.validate_policy("keep", 0)
    with pytest.raises(ValueError, match="one of"):
        D.Dormant("auto")
