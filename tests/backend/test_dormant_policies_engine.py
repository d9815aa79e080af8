"""Dormant-prefix policies through the engine against verl's stock fsdp2 engine: every policy in fp64
and fp32, with gradient checkpointing, with the MoE aux loss, and on two ranks with different group
structures (recompute adds prefix forwards, so ranks must agree on it per group slot). Offload under
FSDP2 moves none of the unsharded parameters (a store that skips only ``nn.Parameter`` objects does);
``auto`` estimates in the engine's compute dtype and never picks offload where it would not lower the peak."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from helpers import offload as O
from helpers.precision import promote_fp32_upcasts
from helpers.ranks import run_two_ranks

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import grpo_batches, verl_engine
from verl_prefix.schedule import dormant as D

VOCAB = 128
TOL = {"float64": 1e-10, "float32": 1e-5}
BUDGET_TINY = 1  # nothing fits: auto recomputes (CPU)
BUDGET_HUGE = 1 << 40  # everything fits: auto keeps


def grpo_batch(seed: int = 3):
    return grpo_batches.make_grpo_batch(
        num_groups=3,
        group_size=4,
        prompt_lens=[9, 5, 12],
        response_len_range=(1, 7),
        vocab_size=VOCAB,
        seed=seed,
        calculate_entropy=True,
    )


@functools.cache
def stock_step(model_dir, dtype: str) -> dict:
    """verl's stock fsdp2 on ``grpo_batch()``, one update: built and run once per model and dtype in a test
    process, since every policy (and chunk size) compares its gradients with the same reference."""
    stock, s_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="fsdp2", dtype=dtype, micro_batch_size_per_gpu=2
    )
    with promote_fp32_upcasts():
        return verl_engine.run_train_step(stock, s_loss, grpo_batch(), capture_grads=True)


def set_policy(engine, policy: str, budget: int | None = None, store=O.RecordingStore) -> None:
    """What the engine config's ``dormant_prefix`` knobs set; ``offload`` gets the CPU stand-in store
    (the engine refuses offload on a CPU device otherwise)."""
    engine.dormant_prefix = D.validate_policy(policy, budget)
    engine.dormant_prefix_budget_bytes = budget
    engine.offload_store_factory = store


def worst_relative(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)).item() for n in want)


def check_reuse_ran(metrics: dict, policy: str, groups: float) -> None:
    assert metrics["prefix/groups"] == groups > 0
    assert metrics["prefix/physical_tokens"] < metrics["prefix/logical_tokens"]
    assert metrics[f"prefix/policy/{policy}"] == groups
    assert not [k for k in metrics if k.startswith("prefix/policy/") and k != f"prefix/policy/{policy}"]


CASES = [  # (policy, budget, the policy that runs)
    ("keep", None, "keep"),
    ("recompute", None, "recompute"),
    ("offload", None, "offload"),
    ("auto", BUDGET_TINY, "recompute"),
    ("auto", BUDGET_HUGE, "keep"),
]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("policy, budget, runs", CASES, ids=[f"{p}-{r}" for p, _, r in CASES])
def test_every_policy_matches_stock_fsdp2(tiny_model, policy, budget, runs, dtype):
    model_dir = tiny_model("qwen3")
    batch = grpo_batch()
    want = stock_step(model_dir, dtype)
    prefix, p_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="prefix_fsdp2", dtype=dtype, micro_batch_size_per_gpu=2
    )
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    set_policy(prefix, policy, budget)
    with promote_fp32_upcasts():
        got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
    assert worst_relative(got["grads"], want["grads"]) < TOL[dtype]
    m = got["reduced_metrics"]
    check_reuse_ran(m, runs, 3.0)
    reason = "configured" if policy != "auto" else ("fits_budget" if runs == "keep" else "over_budget_cpu")
    assert m[f"prefix/policy_reason/{reason}"] == 3.0
    held = m[f"prefix/max_saved_for_backward_held_in_B_mib/{runs}"]
    assert held > 0
    if runs == "recompute":
        assert m["prefix/max_recompute_kv_diff"] == 0.0
        assert m["prefix/max_saved_for_backward_mib/A"] == 0.0  # phase A kept no graph
    if runs == "offload":
        assert m["prefix/offloaded_mib"] >= m["prefix/offload_restored_mib"] > 0
        assert m["prefix/max_offload_resident_mib/B"] == 0
        assert 0 < m["prefix/max_offload_resident_mib/C"] < m["prefix/offload_restored_mib"]


@pytest.mark.parametrize("policy", ["recompute", "offload"])
def test_policies_with_checkpointing_and_moe_aux(tiny_model, policy):
    """Gradient checkpointing and the MoE router aux loss (its probability-sum leaf) together, fp64,
    against ``keep`` on the same batch and partition (``tests/schedule/test_moe.py`` holds keep to the
    dense aux path; the aux is a per-micro-batch mean, so only equal partitions compare)."""
    model_dir = tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, experts_implementation="eager")
    batch = grpo_batch()
    results = {}
    for name in ("keep", policy):
        engine, loss_fn, _ = verl_engine.build_verl_engine(
            model_dir, backend="prefix_fsdp2", dtype="float64", micro_batch_size_per_gpu=2, gradient_checkpointing=True
        )
        engine.reuse_config = PrefixReuseConfig(min_prefix_len=2)
        engine.moe_aux_loss_coef = 0.5
        set_policy(engine, name)
        with promote_fp32_upcasts():
            results[name] = verl_engine.run_train_step(engine, loss_fn, batch, capture_grads=True)
    for name, result in results.items():
        check_reuse_ran(result["reduced_metrics"], name, 3.0)
        assert result["reduced_metrics"]["moe_aux_loss"] > 0
    assert worst_relative(results[policy]["grads"], results["keep"]["grads"]) < 1e-10
    gates = [n for n in results[policy]["grads"] if n.endswith("mlp.gate.weight")]
    assert gates and all(results[policy]["grads"][n].norm() > 0 for n in gates)


def _offload_through_fsdp2(model_dir, store):
    """One fp64 update of ``prefix_fsdp2`` (FSDP2 on gloo, CPU) with ``store`` as offload's store, and the
    stock engine's; returns (worst relative gradient difference, reduced metrics, the stores, the module)."""
    batch = grpo_batch()
    want = stock_step(model_dir, "float64")
    prefix, p_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="prefix_fsdp2", dtype="float64", micro_batch_size_per_gpu=2
    )
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2)
    set_policy(prefix, "offload", store=store)
    O.RecordingStore.instances.clear()
    with promote_fp32_upcasts():
        got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
    return (
        worst_relative(got["grads"], want["grads"]),
        got["reduced_metrics"],
        list(O.RecordingStore.instances),
        prefix.module,
    )


def test_offload_under_fsdp2_moves_activations_only(tiny_model):
    """Through the engine, FSDP2 unshards each layer's weights into ``nn.Parameter``s that ``linear`` saves as
    ``weight.t()`` views: none of their bytes move (by storage; the type oracle agrees), no storage moves
    twice, nothing stays on the device in phase B, phase C holds at most two layers (plus RoPE's cos/sin)
    of a 4-layer graph, and the update matches the stock engine at fp64 1e-10 with reuse running."""
    error, m, stores, module = _offload_through_fsdp2(tiny_model("qwen3", num_layers=4), O.RecordingStore)
    check_reuse_ran(m, "offload", 3.0)
    assert error < 1e-10
    assert len(stores) == 3
    for store in stores:
        found = O.claims(store, module)
        assert found["parameter_bytes_moved"] == found["storages_moved_twice"] == found["resident_in_b"] == 0
        assert 0 < found["resident_in_c"] <= found["bound_in_c"] < found["restored"]


def test_negative_control_offload_by_type_copies_fsdp2_weights(tiny_model):
    """The old rule (leave only objects that *are* ``nn.Parameter``) copies FSDP2's unsharded weights for
    every group: more parameter bytes move than the activations of these short prefixes."""
    error, m, stores, module = _offload_through_fsdp2(tiny_model("qwen3", num_layers=4), O.TypeOnlyStore)
    check_reuse_ran(m, "offload", 3.0)
    assert error < 1e-10  # faithful copies: the waste is silent
    for store in stores:
        assert store.parameter_bytes_moved > 0.5 * store.offloaded_bytes


def test_auto_picks_by_the_compute_dtype_and_the_peak(tiny_model):
    """``group_policies`` on an accelerator device (a mock: no collective runs on one process): a budget
    between the bf16 and the fp32 estimate keeps under bf16 autocast and not without it; over budget a
    4-layer model offloads (two layers in phase C are below the whole graph) and a 1-layer model recomputes
    (offload would restore its one layer whole: no lower peak than keep)."""
    from helpers.layouts import make_layout
    from transformers import AutoModelForCausalLM

    from verl_prefix.backend.distributed import dormant_agreement as backend_dormant
    from verl_prefix.schedule.grouping import plan_batch

    cuda = torch.device("cuda", 0)
    plan = plan_batch(make_layout([(257, [4, 4])]), max_rows=2, max_tokens=None, min_prefix_len=1, min_group_size=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3", num_layers=4))  # fp32 master weights
    fp32 = D.estimate_prefix_graph_bytes(model, 256, torch.float32)
    bf16 = D.estimate_prefix_graph_bytes(model, 256, torch.bfloat16)
    assert bf16 < 0.7 * fp32
    budget = (bf16 + fp32) // 2
    agree = backend_dormant.group_policies
    assert agree("auto", budget, model, plan, cuda, autocast_dtype=torch.bfloat16) == [("keep", "fits_budget")]
    assert agree("auto", budget, model, plan, cuda) == [("offload", "over_budget")]
    assert agree("auto", budget, model, plan, cuda, autocast_dtype=torch.float32) == [("offload", "over_budget")]
    one = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3", num_layers=1))
    assert agree("auto", BUDGET_TINY, one, plan, cuda) == [("recompute", "over_budget_offload_no_gain")]


def test_offload_is_refused_on_a_cpu_run(tiny_model):
    with pytest.raises(ValueError, match="this run's device is the CPU"):
        verl_engine.build_verl_engine(
            tiny_model("qwen3"),
            backend="prefix_fsdp2",
            overrides=[
                "actor_rollout_ref.actor.fsdp_config._target_=verl_prefix.config.PrefixFSDPEngineConfig",
                "+actor_rollout_ref.actor.fsdp_config.dormant_prefix=offload",
            ],
        )


def rank_batch(rank: int):
    from verl.utils import tensordict_utils as tu

    if rank == 0:  # two groups of four, one with a long prefix
        return grpo_batches.make_grpo_batch(
            num_groups=2, group_size=4, prompt_lens=[40, 5], response_len_range=(1, 6), vocab_size=VOCAB, seed=11
        )
    # one group of four plus four singletons with a short prompt: one reuse group and two dense chunks
    group = grpo_batches.make_grpo_batch(
        num_groups=1, group_size=4, prompt_lens=12, response_len_range=(1, 6), vocab_size=VOCAB, seed=12
    )
    singles = grpo_batches.make_grpo_batch(
        num_groups=4, group_size=1, prompt_lens=3, response_len_range=(2, 4), vocab_size=VOCAB, seed=13
    )
    return tu.concat_tensordict([group, singles])


def _rank_body(rank: int, model_dir: str, policy: str, budget: int | None) -> dict:
    kwargs = dict(dtype="float64", micro_batch_size_per_gpu=2, gradient_checkpointing=True)
    batch = rank_batch(rank)
    dense, d_loss, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs)
    prefix, p_loss, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **kwargs)
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=4)
    set_policy(prefix, policy, budget)
    with promote_fp32_upcasts():
        want = verl_engine.run_train_step(dense, d_loss, batch, capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
    return {"worst": worst, "metrics": got["reduced_metrics"]}


def test_two_ranks_recompute_and_auto(tiny_model):
    """recompute on both ranks (rank 1 fills rank 0's second group slot with a recomputing filler), then
    auto with a budget only rank 0's long-prefix group exceeds: rank 1 recomputes that slot's filler too."""
    model_dir = str(tiny_model("qwen3"))
    results = run_two_ranks(_rank_body, model_dir, "recompute", None)
    for rank in range(2):
        assert results[rank]["worst"] < 1e-10, rank
    assert results[0]["metrics"]["prefix/policy/recompute"] == 2.0
    assert results[1]["metrics"]["prefix/policy/recompute"] == 1.0
    # the estimate of a 39-token prefix exceeds it, the 11- and 4-token prefixes fit (checkpointing: H per layer)
    budget = 20 * 2 * 64 * 8  # 20 prefix tokens: 2 layers x hidden 64 x fp64 each
    results = run_two_ranks(_rank_body, model_dir, "auto", budget)
    for rank in range(2):
        assert results[rank]["worst"] < 1e-10, rank
    m0, m1 = results[0]["metrics"], results[1]["metrics"]
    assert m0["prefix/policy/recompute"] == 1.0 and m0["prefix/policy/keep"] == 1.0
    assert m0["prefix/policy_reason/over_budget_cpu"] == 1.0
    # rank 1's only group (slot 0) is recomputed because rank 0's slot-0 group is over budget
    assert m1["prefix/policy/recompute"] == 1.0 and m1["prefix/policy_reason/peer_recompute"] == 1.0


def test_auto_says_what_its_budget_bounds(tiny_model, monkeypatch, caplog):
    """Over budget, auto's log line says the budget bounds phase B only: phase C still holds the graph
    whole unless the prefix is chunked (the capacity table shows why that matters)."""
    from helpers.layouts import make_layout
    from transformers import AutoModelForCausalLM

    from verl_prefix.backend.distributed import dormant_agreement as backend_dormant
    from verl_prefix.schedule.grouping import plan_batch

    monkeypatch.setattr(backend_dormant, "LOGGED_REASONS", set())
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3"))
    plan = plan_batch(make_layout([(33, [4, 4])]), max_rows=2, max_tokens=None, min_prefix_len=1, min_group_size=1)
    cpu = torch.device("cpu")
    caplog.set_level(logging.WARNING, logger=backend_dormant.__name__)
    assert backend_dormant.group_policies("auto", BUDGET_HUGE, model, plan, cpu) == [("keep", "fits_budget")]
    assert "phase C" not in caplog.text
    assert backend_dormant.group_policies("auto", BUDGET_TINY, model, plan, cpu) == [("recompute", "over_budget_cpu")]
    assert "recompute keeps it out of phase B; phase C still holds it whole unless prefix_chunk_tokens" in caplog.text


pytestmark = pytest.mark.timeout(900)
