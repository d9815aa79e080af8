"""prefix_megatron on a tiny Qwen3-MoE at expert parallelism 2 (two ranks, DP=2 x EP=2, the distributed optimizer)
against verl's Megatron engine on the same batch and weights, fp32, gloo.

With megatron-core's router aux loss on (``moe_router_load_balancing_type=aux_loss``): the engine adds megatron-core's
aux per logical micro-batch, each of its rows' prefixes counted once per row (``backend.megatron.moe``), with the
stock engine's ``1 / num_microbatches`` scale; the stock engine runs the same micro-batches (four rows, one group or
the four dense singletons each). One-level reuse, the tree, a chunked prefix, merged phase-B attention and
``dormant_prefix=recompute``: every parameter's ``main_grad`` (router and local experts included), grad norm, the
loss verl reports (the aux outside it, as verl's engine reports it), forward-only log-probs; reuse asserted.
Negative controls: phase C skipped, and the prefix's router statistics counted once per micro-batch, both fail.
With verl's default (no load-balancing loss) the update is exact too, and so it is with megatron-core's router z-loss
alone (counting the prefix once fails). Expert bias (DeepSeek-V3's aux-loss-free
balancing: sigmoid scores, ``moe_router_enable_expert_bias``, here beside the aux loss): the per-expert token counts
``finalize_model_grads`` moves the bias by, all-reduced, equal the stock engine's exactly, and so do the biases and
the update; counting the prefix once per group fails. Under sequence parallelism (TP=2 x EP=2 on two ranks, verl's
setting at TP > 1) the aux and z-loss are exact too, on rows whose lengths need no alignment padding (verl's engine
pads each row to a multiple of the TP size and its routers count that padding; reuse counts real tokens only); the
terms counted once per TP rank fail (expert bias under sequence parallelism, pipeline stages and recompute:
``test_megatron_pipeline.py``). And what the engine refuses in MoE routing, with the knob.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from helpers.engine_batches import (
    MEGATRON_CASES,
    compare_steps,
    inferred,
    megatron_cases,
    megatron_counted_step,
    megatron_train_step,
    phase_c_skipped,
    shared_system_batch,
)
from helpers.megatron_stack import require_megatron_stack
from helpers.ranks import run_two_ranks
from helpers.reuse import assert_infer_matches, assert_reuse_ran

require_megatron_stack()

TOL = 1e-5  # fp32
COEFF = 0.1  # large enough that the aux moves the router's gradient well past the tolerance
AUX = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": COEFF}
BIAS = {**AUX, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
Z = {"moe_router_load_balancing_type": "none", "moe_z_loss_coeff": COEFF}  # the router z-loss alone
Z_CASES = ("one_level", "tree", "chunked")
BIAS_CASES = ("one_level", "tree", "chunked")
CASES = MEGATRON_CASES


@contextlib.contextmanager
def _prefix_counted_once():
    """Negative control: a micro-batch's aux sees its rows' shared prefix once, not once per row."""
    from verl_prefix.schedule.models import moe

    saved = moe.logical_stats
    moe.logical_stats = lambda prefix, suffix, copies: saved(prefix, suffix, 1)
    try:
        yield
    finally:
        moe.logical_stats = saved


@contextlib.contextmanager
def _counts_prefix_once():
    """Negative control: the expert counts see a shared prefix once, not once per row below it."""
    from verl_prefix.backend.megatron.moe import ExpertCounts

    saved = ExpertCounts.weighted
    ExpertCounts.weighted = lambda self, weights: saved(self, torch.as_tensor(weights).clamp(max=1.0))
    try:
        yield
    finally:
        ExpertCounts.weighted = saved


def _pair(model_dir: str, routing: dict, base):
    from verl_prefix.harness.megatron import build_megatron_engine

    layout = dict(expert_model_parallel_size=2, override_transformer_config={"attention_backend": "local", **routing})
    stock = build_megatron_engine(model_dir, lr=0.0, **layout)
    prefix = build_megatron_engine(model_dir, backend="prefix_megatron", lr=0.0, prefix_reuse=base, **layout)
    return stock, prefix


def _body(rank: int, model_dir: str) -> dict:
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import verl_engine
    from verl_prefix.harness.megatron import ppo_loss

    loss_fn, _ = ppo_loss(["use_kl_loss=true", "ppo_micro_batch_size_per_gpu=4"])
    base = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=4)  # the stock engine's micro-batches
    stock, prefix = _pair(model_dir, AUX, base)
    assert prefix.routers is not None and len(prefix.routers.modules) == 2
    batch = shared_system_batch(stock.get_data_parallel_rank(), True)
    controls = {"no_phase_c": phase_c_skipped, "counted_once": _prefix_counted_once}
    out: dict = {"source": prefix.is_mp_src_rank_with_outputs()}
    out.update(megatron_cases(stock, prefix, loss_fn, batch, base, CASES, controls))
    want = megatron_train_step(stock, loss_fn, batch)
    # the aux's share of the router's gradient: the same step without it differs by far more than the tolerance
    plain_stock, plain_prefix = _pair(model_dir, {}, base)
    plain = megatron_train_step(plain_stock, loss_fn, batch)
    out["aux_effect"] = compare_steps(want, plain)["worst"]
    plain_got = megatron_train_step(plain_prefix, loss_fn, batch)
    infer = (inferred(verl_engine.run_infer(plain_stock, batch)), inferred(verl_engine.run_infer(plain_prefix, batch)))
    out["no_aux"] = {**compare_steps(plain, plain_got), "infer": infer}
    # the router z-loss (megatron-core's mean of logsumexp^2 per call), without the aux loss
    z_stock, z_prefix = _pair(model_dir, Z, base)
    assert z_prefix.routers is not None and z_prefix.routers.coeff == 0.0 and z_prefix.routers.z_coeff == COEFF
    z_controls = {"counted_once": _prefix_counted_once}
    z_cases = {f"z_{case}": CASES[case] for case in Z_CASES}
    out.update(megatron_cases(z_stock, z_prefix, loss_fn, batch, base, z_cases, z_controls, controlled=z_cases))
    out["z_effect"] = compare_steps(plain, megatron_train_step(z_stock, loss_fn, batch))["worst"]
    # expert bias beside the aux loss
    bias_stock, bias_prefix = _pair(model_dir, BIAS, base)
    assert bias_prefix.expert_counts is not None and len(bias_prefix.expert_counts.routers) == 2
    want = megatron_counted_step(bias_stock, loss_fn, batch)
    assert len(want["counts"]) == 1 and want["counts"][0].sum() > 0
    for case in BIAS_CASES:
        bias_prefix.reuse_config = dataclasses.replace(base, **CASES[case][0])
        got = megatron_counted_step(bias_prefix, loss_fn, batch)
        out[f"bias_{case}"] = {
            **compare_steps(want, got),
            "counts": (want["counts"][0], got["counts"][0]),
            "bias": (want["bias"], got["bias"]),
        }
        with _counts_prefix_once():
            once = megatron_counted_step(bias_prefix, loss_fn, batch)
        out[f"bias_{case}"]["once"] = (want["counts"][0] - once["counts"][0]).abs().sum().item()
    return out


@pytest.fixture(scope="module")
def ranks(tiny_model) -> dict:
    return run_two_ranks(_body, str(tiny_model("qwen3_moe")), timeout=900)


def _groups(rank: int) -> int:
    return 2 if rank == 0 else 1  # data-parallel rank 1: one group and four singletons


@pytest.mark.parametrize("case", list(CASES))
def test_aux_loss_update_matches_verl_megatron_engine(ranks, case):
    for rank, result in ranks.items():
        r = result[case]
        assert r["grads"] > 10 and r["worst"] < TOL, f"rank {rank}: {r['name']} off by {r['worst']:.2e}"
        if result["source"]:
            assert r["loss"][1] == pytest.approx(r["loss"][0], rel=TOL, abs=1e-7)
            assert r["grad_norm"][1] == pytest.approx(r["grad_norm"][0], rel=TOL)
        assert_reuse_ran(r["metrics"], groups=_groups(rank))
        assert r["metrics"]["moe_aux_loss"] > 0
        assert_infer_matches(*r["infer"], TOL, groups=_groups(rank))
        if case == "recompute":
            assert r["metrics"]["prefix/policy/recompute"] > 0


def test_aux_loss_matters_and_negative_controls_fail(ranks):
    for rank, result in ranks.items():
        assert result["aux_effect"] > 100 * TOL, f"rank {rank}: the aux loss changed no gradient"
        for case in ("one_level", "tree"):
            r = result[case]
            assert r["no_phase_c"] > 1e-2, f"rank {rank} {case}: skipping phase C changed nothing"
            assert r["counted_once"] > 100 * TOL, f"rank {rank} {case}: counting the prefix once passed"
            assert ".mlp.router." in r["counted_once_name"] or r["counted_once"] > 1e-3, r


def test_without_aux_loss_update_matches(ranks):
    """verl's default MoE routing (no load-balancing loss): nothing counted, the update exact all the same."""
    for rank, result in ranks.items():
        r = result["no_aux"]
        assert r["worst"] < TOL, (rank, r["name"], r["worst"])
        assert_reuse_ran(r["metrics"], groups=_groups(rank))
        assert "moe_aux_loss" not in r["metrics"]
        assert_infer_matches(*r["infer"], TOL, groups=_groups(rank))


@pytest.mark.parametrize("case", Z_CASES)
def test_router_z_loss_matches_verl_megatron_engine(ranks, case):
    """megatron-core's router z-loss (each layer's mean of logsumexp(logits)^2 over a call's tokens) per logical
    micro-batch: the prefix's sums counted once per row. Exact against verl's engine; the z-loss moves gradients
    well past the tolerance; counting the prefix once per micro-batch fails."""
    for rank, result in ranks.items():
        r = result[f"z_{case}"]
        assert r["grads"] > 10 and r["worst"] < TOL, f"rank {rank} {case}: {r['name']} off by {r['worst']:.2e}"
        if result["source"]:
            assert r["loss"][1] == pytest.approx(r["loss"][0], rel=TOL, abs=1e-7)  # reported without the z term
        assert_reuse_ran(r["metrics"], groups=_groups(rank))
        assert r["metrics"]["moe_z_loss"] > 0 and "moe_aux_loss" not in r["metrics"]
        assert_infer_matches(*r["infer"], TOL, groups=_groups(rank))
        assert r["counted_once"] > 100 * TOL, f"rank {rank} {case}: counting the prefix once passed"
        assert result["z_effect"] > 100 * TOL, f"rank {rank}: the z-loss changed no gradient"


@pytest.mark.parametrize("case", BIAS_CASES)
def test_expert_bias_counts_match_verl_megatron_engine(ranks, case):
    import torch

    for rank, result in ranks.items():
        r = result[f"bias_{case}"]
        want, got = r["counts"]
        assert torch.equal(got, want), f"rank {rank} {case}: expert counts {got.tolist()} vs {want.tolist()}"
        for w, g in zip(*r["bias"]):
            assert torch.equal(g, w), (rank, case)
        assert r["grads"] > 10 and r["worst"] < TOL, f"rank {rank}: {r['name']} off by {r['worst']:.2e}"
        assert_reuse_ran(r["metrics"], groups=_groups(rank))
        assert r["once"] > 0, f"rank {rank} {case}: counting the prefix once gave the same counts"


def _tf(**changes):
    plain = dict(
        num_moe_experts=4, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=None,
        moe_input_jitter_eps=None, moe_expert_capacity_factor=None, moe_router_enable_expert_bias=False,
        moe_router_force_load_balancing=False, sequence_parallel=False,
    )  # fmt: skip
    return SimpleNamespace(**{**plain, **changes})


@pytest.mark.parametrize(
    "change",
    [
        dict(moe_router_load_balancing_type="seq_aux_loss"),
        dict(moe_router_load_balancing_type=["aux_loss", "global_aux_loss"], moe_aux_loss_coeff=[0.01, 0.01]),
        dict(moe_input_jitter_eps=0.01),
        dict(moe_expert_capacity_factor=1.0),
        dict(moe_router_force_load_balancing=True),
    ],
)
def test_router_refusals_name_the_knob(change):
    from verl_prefix.backend.megatron.moe import router_refusal

    reason = router_refusal(_tf(**change))
    knob = next(iter(change))
    assert reason is not None and f"{knob}=" in reason and "override_transformer_config" in reason, reason
    assert "prefix_reuse.enable=false" in reason


def test_router_settings_served():
    from verl_prefix.backend.megatron.moe import aux_coefficient, replay_refusal, router_refusal

    assert router_refusal(_tf()) is None
    assert router_refusal(_tf(moe_router_enable_expert_bias=True)) is None  # counted per row
    assert router_refusal(_tf(sequence_parallel=True)) is None  # the aux over the gathered slices
    bias_sp = _tf(moe_router_enable_expert_bias=True, sequence_parallel=True, moe_router_load_balancing_type="none")
    assert router_refusal(bias_sp) is None  # each TP rank counts its own slice
    assert router_refusal(SimpleNamespace(num_moe_experts=None)) is None  # a dense model
    assert aux_coefficient(_tf()) == 0.01
    assert aux_coefficient(_tf(moe_router_load_balancing_type="none")) == 0.0
    assert replay_refusal(SimpleNamespace(router_replay=SimpleNamespace(mode="disabled"))) is None
    off = SimpleNamespace(router_replay=SimpleNamespace(mode="R3"), prefix_reuse={"enable": False})
    assert replay_refusal(off) is None  # reuse off: verl's own engine
    reason = replay_refusal(SimpleNamespace(router_replay=SimpleNamespace(mode="R3")))
    assert "router_replay.mode=disabled" in reason, reason


# -- sequence parallelism: TP=2 with megatron-core's sequence split (verl turns it on at TP > 1; MoE at TP > 1
# requires it), EP=2 over the same two ranks (expert TP 1) --

SP_LAYOUT = dict(
    tensor_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2, expert_tensor_parallel_size=1
)
SP_CASES = {k: CASES[k] for k in ("one_level", "tree", "chunked")}


@contextlib.contextmanager
def _every_rank_grads_every_slice():
    """Negative control: the gathered logits send each slice every TP rank's gradient of its copy of the aux (the
    gather's default backward, a reduce-scatter), so the aux counts TP times."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    from verl_prefix.backend.megatron import moe

    saved = moe.whole_sequence
    moe.whole_sequence = lambda logits, config: gather_from_sequence_parallel_region(logits)
    try:
        yield
    finally:
        moe.whole_sequence = saved


def _sp_body(rank: int, model_dir: str) -> dict:
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    loss_fn, _ = ppo_loss(["use_kl_loss=true", "ppo_micro_batch_size_per_gpu=4"])
    base = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=4)
    layout = dict(
        SP_LAYOUT, override_transformer_config={"attention_backend": "local", **AUX, "moe_z_loss_coeff": COEFF}
    )
    stock = build_megatron_engine(model_dir, lr=0.0, **layout)
    prefix = build_megatron_engine(model_dir, backend="prefix_megatron", lr=0.0, prefix_reuse=base, **layout)
    assert stock.tf_config.sequence_parallel and prefix.tf_config.sequence_parallel
    # verl pads every row to a multiple of the TP size under sequence parallelism and its routers count that
    # padding; rows already aligned leave it none, so the stock engine's aux is the logical one
    batch = shared_system_batch(0, False, aligned=2)
    controls = {"summed": _every_rank_grads_every_slice}
    return megatron_cases(stock, prefix, loss_fn, batch, base, SP_CASES, controls, controlled=("one_level",))


@pytest.fixture(scope="module")
def sp_ranks(tiny_model) -> dict:
    return run_two_ranks(_sp_body, str(tiny_model("qwen3_moe")), timeout=900)


@pytest.mark.parametrize("case", list(SP_CASES))
def test_aux_loss_under_sequence_parallelism_matches_verl_megatron_engine(sp_ranks, case):
    """The aux and z-loss of a call whose positions are split over the TP ranks: its router logits gathered, each
    rank the whole terms, each slice its own gradient; exact against verl's engine at TP=2 (sequence parallel) x EP=2.
    Negative control: each slice given every rank's gradient of the aux (the aux counted TP times) fails."""
    for rank, result in sp_ranks.items():
        r = result[case]
        assert r["grads"] > 10 and r["worst"] < TOL, f"rank {rank} {case}: {r['name']} off by {r['worst']:.2e}"
        assert_reuse_ran(r["metrics"], groups=2)
        assert r["metrics"]["moe_aux_loss"] > 0 and r["metrics"]["moe_z_loss"] > 0
        assert_infer_matches(*r["infer"], TOL, groups=2)
        if case == "one_level":
            assert r["summed"] > 100 * TOL, f"rank {rank}: the aux counted TP times passed"
