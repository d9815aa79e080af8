"""Dormant-prefix policies at schedule level against plain HF: keep, recompute and offload (the CPU
stand-in store, which really copies) give the dense gradients, with and without checkpointing and with
the MoE aux loss; the recompute check catches a wrong recompute; recompute holds less during phase B.
Offload's residency claims, each with a negative control: (a) no parameter bytes move, (b) each storage
moves once (moved + left in place = the meter's phase-A bytes), (c) nothing of the graph is resident in
phase B and at most two layers' worth in phase C, (d) exact at fp64 1e-10. ``auto`` estimates in the
compute dtype and never picks offload where it would not lower the peak."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import offload as O
from helpers.layouts import make_layout, token_weights
from helpers.precision import promote_fp32_upcasts
from helpers.schedule_runs import train_reuse
from test_moe import compare as moe_compare
from test_moe import tiny_moe
from test_schedule_hf import CONFIGS, TOLERANCE, VOCAB, dense_grads, tiny_model, weighted_loss, worst_relative
from transformers import AutoModelForCausalLM

from verl_prefix.schedule import dormant as D
from verl_prefix.schedule import executor
from verl_prefix.schedule.kv.seam import prefix_attention_mode
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.telemetry import PhaseMeter

CPU = torch.device("cpu")
LAYOUT = [(9, [4, 7, 1, 6, 3, 5, 2, 8]), (14, [5, 3, 6]), (4, [2, 4])]


def dormant(policy: str, stats: D.DormantStats | None = None, store=O.RecordingStore, **kwargs) -> D.Dormant:
    return D.Dormant(policy, stats=stats, store_factory=store, **kwargs)


def run_policy(
    model, layout, weights, policy, *, rows=3, stats=None, check_recompute=True, store=O.RecordingStore, **options
):
    """``train_reuse`` with a fresh ``policy`` per group; ``options`` for ``train_group`` (meter, chunks...)."""
    return train_reuse(
        model,
        layout,
        weighted_loss(weights),
        rows=rows,
        calculate_entropy=True,
        dormant=lambda: dormant(policy, stats, store, check_recompute=check_recompute),
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
    O.RecordingStore.instances.clear()
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        got, plan = run_policy(model, layout, weights, policy, stats=stats, meter=PhaseMeter(CPU))
        keep = run_policy(model, layout, weights, "keep")[0] if policy == "offload" else None
    assert len(plan.groups) == 3 and not plan.dense_rows  # reuse ran: three groups, no dense row
    assert worst_relative(got, want) < TOLERANCE[dtype]
    assert stats.metrics()[f"prefix/policy/{policy}"] == 3.0
    if policy == "offload":
        # the copies are exact; every group moved its activations out and the ones backward needs back
        assert all(torch.equal(got[n], keep[n]) for n in keep)
        assert len(O.RecordingStore.instances) == 3
        for store in O.RecordingStore.instances:
            assert 0 < store.restored_bytes <= store.offloaded_bytes
            found = O.claims(store, model)
            assert found["parameter_bytes_moved"] == found["storages_moved_twice"] == found["resident_in_b"] == 0
        m = stats.metrics()
        assert m["prefix/offloaded_mib"] > 0 and m["prefix/max_offload_resident_mib/B"] == 0
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
    """Pack moves activations and leaves parameters (and views of them: ``x @ weight`` saves ``weight``'s
    storage) in place; a storage saved twice moves once and comes back as the view each save made; unpack
    without a prefetch restores on demand; CPU as the real device is refused (nothing to move to)."""
    store = O.RecordingStore(CPU)
    owner = torch.nn.Linear(3, 3, bias=False).double()  # the model whose parameters stay
    weight = owner.weight
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with store.saving(owner):
        h = x.t().sin() * 2  # sin saves x.t() (a strided view), mul saves nothing of h
        y = (h.exp() * h).sum(0) @ weight.t()  # h saved by exp's product and by the mul; weight.t() by mm
    found = O.claims(store, owner)
    assert store.parameter_bytes_moved == 0 and found["storages_moved_twice"] == 0
    assert O.storage_key(weight) in store.stayed and O.storage_key(x) not in store.stayed
    moved = store.offloaded_bytes
    assert store.restored_bytes == 0
    store.begin_phase_c()
    y.sum().backward()
    assert store.restored_bytes == moved and store.resident_bytes == 0  # everything released after backward
    x2 = x.detach().requires_grad_()
    h2 = x2.t().sin() * 2
    want = torch.autograd.grad(((h2.exp() * h2).sum(0) @ weight.t()).sum(), (x2, weight))
    assert torch.equal(x.grad, want[0]) and torch.equal(weight.grad, want[1])
    with pytest.raises(ValueError, match="this run's device is the CPU"):
        D.default_store(CPU)


def deep_model(dtype=torch.float64, layers=6, checkpointing=False):
    """A tiny Qwen3 with enough layers that one or two of them are a small share of the graph."""
    torch.manual_seed(0)
    config = CONFIGS["qwen3"](
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        attn_implementation="sdpa",
        initializer_range=0.2,
    )
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


RESIDENCY_LAYOUT = [(41, [4, 7, 1, 6])]


def run_offload(model, store, chunk=None):
    """Offload with ``store`` on one group (P=40, G=4, micro-batches of 2, ``chunk``-token chunks), against
    dense HF and against keep's metered phase A. Returns (worst relative error vs dense, the store, keep's
    phase-A saved bytes, the store's claims)."""
    layout = make_layout(RESIDENCY_LAYOUT)
    weights = token_weights(layout, torch.float64)
    O.RecordingStore.instances.clear()
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        got, plan = run_policy(model, layout, weights, "offload", rows=2, store=store, prefix_chunk_tokens=chunk)
        keep_meter = PhaseMeter(CPU)
        run_policy(model, layout, weights, "keep", rows=2, meter=keep_meter, prefix_chunk_tokens=chunk)
    assert len(plan.groups) == 1 and not plan.dense_rows  # reuse ran
    (ran,) = O.RecordingStore.instances
    return worst_relative(got, want), ran, round(keep_meter.saved_mib["A"] * 1024**2), O.claims(ran, model)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-ckpt"])
@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunks-of-8"])
def test_offload_residency(chunk, checkpointing):
    """(a) no parameter bytes move (by storage; the type oracle agrees); (b) each storage moves once, even
    with chunks, and what moved plus what was left in place (the K/V, the token ids) is exactly the bytes
    the meter counts for keep's phase A; (c) the store holds nothing in phase B and nothing it moved is kept
    alive there by anyone else; in phase C at most the layer backward runs through plus the one prefetched
    (and RoPE's cos/sin, which every layer saves), under half of what moved with 6 layers; (d) exact against
    dense HF at fp64 1e-10."""
    model = deep_model(checkpointing=checkpointing)
    error, store, keep_a, found = run_offload(model, O.RecordingStore, chunk)
    params = {O.storage_key(p) for p in model.parameters()}
    stayed = sum(n for key, n in store.stayed.items() if key not in params)
    assert found["parameter_bytes_moved"] == 0  # (a)
    assert found["storages_moved_twice"] == found["restored_twice"] == 0  # (b)
    assert store.offloaded_bytes + stayed == keep_a > 0
    assert found["resident_in_b"] == 0  # (c)
    assert 0 < found["resident_in_c"] <= found["bound_in_c"]
    assert found["shared"] < 0.1 * found["two_layers"]  # RoPE's cos/sin
    if not checkpointing:  # (under checkpointing phase A saves only each layer's input: a layer is already small)
        assert found["resident_in_c"] < 0.5 * store.offloaded_bytes
    assert error < 1e-10  # (d)


TWO_GROUPS = [(41, [4, 7, 1, 6]), (29, [3, 5, 2])]


def _pooled_offload(pool):
    """Offload over two groups in turn with every store leasing from ``pool`` (its CPU stand-in: pageable
    slabs, the same leasing). Returns (worst relative error vs dense, the stores)."""
    model = deep_model()
    layout = make_layout(TWO_GROUPS)
    weights = token_weights(layout, torch.float64)
    O.RecordingStore.instances.clear()
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        store = functools.partial(O.RecordingStore, pool=pool)
        got, plan = run_policy(model, layout, weights, "offload", rows=2, store=store)
    assert len(plan.groups) == 2 and not plan.dense_rows
    return worst_relative(got, want), list(O.RecordingStore.instances)


def test_offload_host_slabs_are_bounded_pooled_and_released():
    """Issue 27 item 3: the host memory offload copies into is leased from one pool, given back after each
    group's phase C and reused by the next, so it peaks at the largest group's offloaded bytes plus under a
    quarter of waste and one partly used slab (not the sum over groups, nor a power of two per storage), and
    ``release`` (the engine's, after each mini-batch) frees all of it. Exact against dense at fp64 1e-10."""
    pool = D.PinnedPool(pin=False, slab_bytes=2**16)
    error, stores = _pooled_offload(pool)
    assert error < 1e-10
    largest = max(s.offloaded_bytes for s in stores)
    assert len(stores) == 2 and sum(s.offloaded_bytes for s in stores) > largest
    assert largest <= pool.peak_bytes <= 1.25 * largest + pool.slab_bytes
    assert all(not s.lease.slabs for s in stores)  # every store gave its slabs back
    held = pool.held_bytes
    assert held == pool.peak_bytes and pool.release() == held and pool.held_bytes == 0
    # a slab a failed group drops without giving it back is unpinned and uncounted when it is freed
    lease = D.PinnedLease(pool)
    lease.take(100)
    assert pool.held_bytes == pool.slab_bytes
    del lease
    assert pool.held_bytes == 0
    # negative control: stores that keep their slabs hold every group's bytes at once
    kept = D.PinnedPool(pin=False, slab_bytes=2**16)
    hoard: list = []
    kept.give_back = hoard.extend
    _, stores = _pooled_offload(kept)
    assert kept.peak_bytes >= sum(s.offloaded_bytes for s in stores) > 1.25 * largest + kept.slab_bytes


def test_negative_control_parameters_by_type_only():
    """(a): a store that leaves only objects that *are* parameters moves ``weight.t()`` views: every weight
    phase A multiplies by is copied (still exact: the copies are faithful)."""
    model = deep_model()
    error, _, _, found = run_offload(model, O.TypeOnlyStore)
    assert found["parameter_bytes_moved"] > 0.5 * sum(p.numel() * 8 for n, p in model.named_parameters() if "proj" in n)
    assert error < 1e-10


def test_negative_control_no_dedupe():
    """(b): a store that copies a storage each time it is saved moves some storages twice and more bytes
    than keep's graph holds (with chunks: the earlier chunks' K/V leaves on top, once per chunk)."""
    model = deep_model()
    _, store, keep_a, found = run_offload(model, O.NoDedupeStore, chunk=8)
    assert found["storages_moved_twice"] > 0
    assert store.offloaded_bytes > keep_a


def test_negative_control_restore_all_at_once():
    """(c), phase C: restoring every layer at the first unpack holds the whole graph again."""
    _, store, _, found = run_offload(deep_model(), O.AllAtOnceStore)
    assert found["resident_in_c"] == found["restored"] > found["bound_in_c"]


def test_negative_control_keeps_the_sources():
    """(c), phase B: a store that copies but keeps the device tensors leaves the graph resident (all of
    it that backward later needs)."""
    _, _, _, found = run_offload(deep_model(), O.SourceKeepingStore)
    assert found["resident_in_b"] == found["restored"] > 0


def test_negative_control_offload_without_phase_c(monkeypatch):
    """(d): without phase C's backward offload still runs, and the prefix gradient is missing."""
    monkeypatch.setattr(executor, "prefix_backward", lambda prefix, leaves, model=None: None)
    error, store, _, _ = run_offload(deep_model(), O.RecordingStore)
    assert error > 1e-3 and store.restored_bytes == 0


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
    """``auto`` keeps what fits; over budget it recomputes on the CPU and offloads on an accelerator only
    where offload's phase-C residency (two layers) is below the whole graph, else recomputes; the
    model-shape estimate is within 25% of the counted phase-A saved activations of the tiny models, in fp32
    and in bf16 (HF's RMSNorm saves its input in fp32 there, which the estimate counts)."""
    six = D.GraphEstimate((10, 10, 10, 10, 10, 4))
    assert (six.total, six.offload_resident) == (54, 20)
    assert D.choose_policy(six, 54, CPU) == ("keep", "fits_budget")
    assert D.choose_policy(six, 53, CPU) == ("recompute", "over_budget_cpu")
    assert D.choose_policy(six, 53, torch.device("cuda", 0)) == ("offload", "over_budget")
    one = D.GraphEstimate((10,))  # offload would restore the one layer whole: no lower than keep
    assert one.offload_resident == one.total
    assert D.choose_policy(one, 9, torch.device("cuda", 0)) == ("recompute", "over_budget_offload_no_gain")
    cases = [("qwen3", "sdpa", False), ("llama", "sdpa", False), ("llama", "eager", False), ("qwen3", "sdpa", True)]
    for dtype in (torch.float32, torch.bfloat16):
        for family, attn, ckpt in cases:
            model = tiny_model(family, attn, dtype, checkpointing=ckpt)
            for prefix_len in (64, 256):
                measured = saved_activation_bytes(model, prefix_len)
                estimate = D.estimate_prefix_graph(model, prefix_len)
                assert estimate.total == D.estimate_prefix_graph_bytes(model, prefix_len)
                assert len(estimate.layer_bytes) == model.config.num_hidden_layers
                why = (dtype, family, attn, ckpt, prefix_len, estimate, measured)
                assert 0.8 < estimate.total / measured < 1.25, why


def test_auto_estimates_in_the_compute_dtype():
    """Under mixed precision the master weights are fp32 and the activations bf16 (FSDP2's param_dtype, verl's
    autocast): the estimate must use the compute dtype. Measured on the bf16 model, the fp32 master's own
    dtype overestimates by more than 1.5x; ``compute_dtype`` with the autocast dtype does not."""
    master = tiny_model("qwen3", "sdpa", torch.float32)
    measured = saved_activation_bytes(tiny_model("qwen3", "sdpa", torch.bfloat16), 256)
    assert D.compute_dtype(master) == torch.float32
    assert D.compute_dtype(master, torch.bfloat16) == torch.bfloat16
    assert D.compute_dtype(master, torch.float32) == torch.float32  # no autocast below fp32: the parameters'
    wrong = D.estimate_prefix_graph_bytes(master, 256)
    right = D.estimate_prefix_graph_bytes(master, 256, D.compute_dtype(master, torch.bfloat16))
    assert wrong > 1.5 * measured
    assert 0.8 < right / measured < 1.25


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
