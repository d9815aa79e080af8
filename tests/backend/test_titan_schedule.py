"""prefix_torchtitan through the one schedule (``schedule.executor`` / ``schedule.tree.schedule`` behind
``titan.causal_lm``): what prefix_fsdp2 serves beyond one-level reuse, against verl's own TorchTitan engine (no
reuse) on the same batch, fp32, two gloo ranks at TP=2 and at FSDP=2, four at TP=2 x FSDP=2 (the data-parallel
ranks hold different groups: lockstep fillers): the token trie (``prefix_reuse.tree``), a chunked prefix
(``prefix_chunk_tokens``), merged phase-B attention (torch's flash attention for CPU), ``dormant_prefix=recompute``
and verl's dynamic batch size (suffix micro-batches by its token budget). Each asserts reuse ran; phase C skipped
fails. MoE flavors (a tiny qwen3_moe, torchtitan's load balancing on) at EP=2 x FSDP=2 and at TP=2 x EP=2: the same
knobs, and the tokens per expert torchtitan's bias hook reads and the bias it moves equal dense's exactly (the
schedule's routing weights, ``ScheduleOptions.count_routing``); counting the prefix once per node instead of once
per row below it fails.

One prefix engine per layout, its knobs switched between steps (lr 0: every step sees the same weights).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from helpers.engine_batches import phase_c_skipped, shared_system_batch
from helpers.ranks import run_ranks, run_two_ranks
from helpers.reuse import assert_infer_matches, assert_reuse_ran, reduced

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is an optional dependency (scripts/setup.sh installs it)")
pytest.importorskip("triton", reason="torchtitan 0.3.0's model stack imports triton (scripts/setup.sh installs it)")

TOL = 1e-5  # fp32
BUDGET = 40  # verl's max_token_len_per_gpu under dynamic batch size: two suffix rows of a 12-token prompt
MOE = dict(hidden_size=32, num_experts=4, num_experts_per_tok=2, intermediate_size=32)
# case -> (prefix_reuse knobs, dormant_prefix); every case also runs forward-only
CASES = {
    "tree": (dict(tree=True, min_shared_tokens=4), "keep"),
    "chunked": (dict(prefix_chunk_tokens=4), "keep"),
    "merged": (dict(phase_b_attention="merged"), "keep"),
    "recompute": (dict(), "recompute"),
    "tree_recompute": (dict(tree=True, min_shared_tokens=4), "recompute"),
}


def _loss_fn(calls: list | None = None):
    """verl's PPO loss with the KL loss and the entropy bonus on; ``calls`` collects each call's rows' prompt and
    response lengths (one call per micro-batch)."""
    import functools

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    from verl_prefix.harness import verl_engine

    a = "actor_rollout_ref.actor"
    knobs = ["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=4", "use_kl_loss=true", "entropy_coeff=0.01"]
    actor = verl_engine.compose_ppo_config([f"{a}.{k}" for k in knobs]).actor_rollout_ref.actor
    loss = functools.partial(ppo_loss, config=omega_conf_to_dataclass(actor))
    if calls is None:
        return loss

    def counted(model_output, data, dp_group=None):
        lengths = data["input_ids"].offsets().diff().tolist()
        responses = data["responses"].offsets().diff().tolist()
        calls.append([(n - r, r) for n, r in zip(lengths, responses)])
        return loss(model_output=model_output, data=data, dp_group=dp_group)

    return counted


def _grads_error(want: dict, got: dict) -> tuple[float, str]:
    errors = {n: ((got[n] - g).norm() / g.norm()).item() for n, g in want.items() if g.norm() > 0}
    name = max(errors, key=errors.get)
    return errors[name], name


def _summary(want: dict, got: dict) -> dict:
    """What the main process asserts on: the worst gradient error, the loss pair, reuse metrics."""
    worst, name = _grads_error(want["grads"], got["grads"])
    return {"worst": worst, "name": name, "loss": (want["loss"], got["loss"]), "metrics": reduced(got["metrics"])}


EP = dict(engine_overrides=dict(expert_parallel_size=2))
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "fsdp2": dict(data_parallel_shard_size=2),
    "tp2_fsdp2": dict(tensor_parallel_size=2, data_parallel_shard_size=2),  # four ranks; TP innermost
    "ep2": dict(data_parallel_shard_size=2, **EP),  # MoE: the experts over the two data-parallel ranks
    "tp2_ep2": dict(tensor_parallel_size=2, **EP),  # MoE: EP over the TP ranks, every sequence split over TP
}
MOE_LAYOUTS = ("ep2", "tp2_ep2")


def _train(engine, loss_fn, batch, moe: bool) -> dict:
    from helpers.titan_moe import counted_train_step

    from verl_prefix.harness import verl_engine

    if moe:  # the routing counts torchtitan's bias pre-hook reads, and the bias it moved
        return counted_train_step(engine, loss_fn, batch, capture_grads=True)
    return verl_engine.run_train_step(engine, loss_fn, batch, capture_grads=True)


@contextlib.contextmanager
def _prefix_counted_once():
    """Negative control: each node's tokens counted once (as one dense row) instead of once per row below it."""
    from verl_prefix.backend.titan import moe as titan_moe

    weighted = titan_moe.ExpertCounts.weighted
    titan_moe.ExpertCounts.weighted = lambda self, w: weighted(self, torch.as_tensor(w).clamp(max=1.0))
    try:
        yield
    finally:
        titan_moe.ExpertCounts.weighted = weighted


def _layout_body(rank: int, model_dir: str, name: str) -> dict:
    from verl.utils import tensordict_utils as tu

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import titan as TT
    from verl_prefix.harness import verl_engine

    layout, moe = LAYOUTS[name], name in MOE_LAYOUTS
    fsdp = "data_parallel_shard_size" in layout
    dp_rank = rank // layout.get("tensor_parallel_size", 1)  # the TP peers of a data-parallel rank share its batch
    loss_fn = _loss_fn()
    base = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2)
    stock = TT.build_titan_engine(model_dir, backend="torchtitan", lr=0.0, **layout)
    prefix = TT.build_titan_engine(model_dir, backend="prefix_torchtitan", lr=0.0, prefix_reuse=base, **layout)
    assert prefix.causal_lm is not None and prefix.causal_lm.scores
    assert bool(prefix.expert_counts) == moe
    batch = shared_system_batch(dp_rank, fsdp, even=name == "tp2_ep2")
    want = _train(stock, loss_fn, batch, moe)
    want_infer = verl_engine.run_infer(stock, batch)
    out: dict = {}
    for case, (knobs, dormant) in CASES.items():
        prefix.reuse_config = dataclasses.replace(base, **knobs)
        prefix.dormant_prefix = dormant
        got = _train(prefix, loss_fn, batch, moe)
        got_infer = verl_engine.run_infer(prefix, batch)
        out[case] = {**_summary(want, got), "infer": (_infer(want_infer), _infer(got_infer))}
        if moe:
            out[case]["routed"] = (want["routed"], got["routed"])
            out[case]["bias"] = (want["bias"], got["bias"])
        if case in ("tree", "chunked"):  # negative control: phase C skipped
            with phase_c_skipped():
                out[case]["no_phase_c"] = _summary(
                    want, verl_engine.run_train_step(prefix, loss_fn, batch, capture_grads=True)
                )
        if moe and case in ("tree", "chunked"):  # negative control: the routing counted once per node
            with _prefix_counted_once():
                out[case]["counted_once"] = _train(prefix, loss_fn, batch, moe)["routed"]
    prefix.reuse_config, prefix.dormant_prefix = base, "keep"
    if name == "tp2":  # dynamic batch size: suffix micro-batches by verl's token budget, not micro_batch_size_per_gpu
        dynamic = batch.copy()
        tu.assign_non_tensor(dynamic, use_dynamic_bsz=True, max_token_len_per_gpu=BUDGET)
        prefix.reuse_config = dataclasses.replace(base, suffix_micro_batch_size=None)
        calls: list = []
        got = verl_engine.run_train_step(prefix, _loss_fn(calls), dynamic, capture_grads=True)
        fixed_calls: list = []
        verl_engine.run_train_step(prefix, _loss_fn(fixed_calls), batch)  # micro_batch_size_per_gpu (4): one per group
        want_dynamic = verl_engine.run_train_step(stock, loss_fn, dynamic, capture_grads=True)
        out["dynamic"] = {**_summary(want_dynamic, got), "calls": calls, "fixed_calls": fixed_calls}
        out["dynamic"]["vs_fixed"] = _summary(want, got)["worst"]
    return out


def _infer(result: dict) -> dict:
    return {k: result[k] for k in ("response_log_probs", "response_entropy", "metrics")}


# under pipeline parallelism: what each stage runs of the one schedule (recompute is refused there, see below)
PP_CASES = {
    "one_level": dict(),
    "tree": dict(tree=True, min_shared_tokens=4),
    "chunked": dict(prefix_chunk_tokens=4),
    "merged": dict(phase_b_attention="merged"),
    "tree_chunked_merged": dict(tree=True, min_shared_tokens=4, prefix_chunk_tokens=4, phase_b_attention="merged"),
}


def _pp_body(rank: int, model_dir: str) -> dict:
    """prefix_torchtitan at pipeline_parallel_size=2 (rank 0: embeddings + layer 0, rank 1: layer 1 + norm + LM
    head) through the one schedule, each case against verl's engine at TP=2 (no pipeline: verl has no pipelined
    step) on the same rows; phase C not crossing the stages (the next stage's gradient dropped) for the tree and a
    chunked prefix; verl's dynamic batch size."""
    from helpers.engine_batches import titan_phase_c_not_crossing
    from helpers.tree_batches import shared_loss_batch
    from verl.utils import tensordict_utils as tu

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import titan as TT
    from verl_prefix.harness import verl_engine

    loss_fn = _loss_fn()
    base = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2)
    stock = TT.build_titan_engine(model_dir, backend="torchtitan", lr=0.0, tensor_parallel_size=2)
    batch = shared_system_batch(0, False)
    want = _train(stock, loss_fn, batch, False)
    want_infer = verl_engine.run_infer(stock, batch)
    dynamic = batch.copy()
    tu.assign_non_tensor(dynamic, use_dynamic_bsz=True, max_token_len_per_gpu=BUDGET)
    want_dynamic = verl_engine.run_train_step(stock, loss_fn, dynamic, capture_grads=True)
    shared = shared_loss_batch()
    want_shared, want_shared_infer = _train(stock, loss_fn, shared, False), verl_engine.run_infer(stock, shared)
    del stock
    pp = dict(engine_overrides=dict(pipeline_parallel_size=2))
    prefix = TT.build_titan_engine(model_dir, backend="prefix_torchtitan", lr=0.0, prefix_reuse=base, **pp)
    assert not prefix.causal_lm.scores if rank == 0 else prefix.causal_lm.scores
    out: dict = {"stage": (prefix.link.stage, prefix.link.num_stages)}
    for case, knobs in PP_CASES.items():
        prefix.reuse_config = dataclasses.replace(base, **knobs)
        got = _train(prefix, loss_fn, batch, False)
        got_infer = verl_engine.run_infer(prefix, batch)
        out[case] = {**_stage_summary(want, got), "infer": (_infer(want_infer), _infer(got_infer))}
        if case in ("tree", "chunked"):
            with titan_phase_c_not_crossing():
                crossing = verl_engine.run_train_step(prefix, loss_fn, batch, capture_grads=True)
            out[case]["not_crossing"] = _stage_summary(want, crossing)
    prefix.reuse_config = dataclasses.replace(base, suffix_micro_batch_size=None)
    calls: list = []
    got = verl_engine.run_train_step(prefix, _loss_fn(calls), dynamic, capture_grads=True)
    out["dynamic"] = {**_stage_summary(want_dynamic, got), "calls": calls}
    # loss on shared tokens: tree rollouts and per-turn samples, the trie's loss-carrying nodes scored on the last
    # stage (their LM head there), reached on stage 0 through the node's output
    shared = shared_loss_batch()
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=2, min_group_size=1, tree=True, min_shared_tokens=2)
    got, got_infer = _train(prefix, loss_fn, shared, False), verl_engine.run_infer(prefix, shared)
    out["shared_loss"] = {**_stage_summary(want_shared, got), "infer": (_infer(want_shared_infer), _infer(got_infer))}
    return out


def _stage_summary(want: dict, got: dict) -> dict:
    """A pipeline stage's result: the worst error of its own parameters' gradients (against the same parameters of
    the whole model), which parameters it holds, the loss pair (the last stage's, on every stage), reuse metrics."""
    worst, name = _grads_error({n: want["grads"][n] for n in got["grads"]}, got["grads"])
    return {
        "worst": worst,
        "name": name,
        "params": (sorted(got["grads"]), sorted(want["grads"])),
        "loss": (want["loss"], got["loss"]),
        "metrics": reduced(got["metrics"]),
    }


def _body(rank: int, model_dir: str, moe_dir: str) -> dict:
    return {
        "pp2": _pp_body(rank, model_dir),
        "tp2": _layout_body(rank, model_dir, "tp2"),
        "fsdp2": _layout_body(rank, model_dir, "fsdp2"),
        "ep2": _layout_body(rank, moe_dir, "ep2"),
        "tp2_ep2": _layout_body(rank, moe_dir, "tp2_ep2"),
    }


@pytest.fixture(scope="module")
def ranks(tiny_model, tmp_path_factory) -> dict:
    from verl_prefix.harness.tiny_models import write_tiny_model

    extra = {"verl_prefix_load_balance_coeff": 1e-3}  # torchtitan's load balancing on (harness.titan)
    moe = write_tiny_model(tmp_path_factory.mktemp("tiny_titan_schedule_moe"), "qwen3_moe", **MOE, extra_config=extra)
    return run_two_ranks(_body, str(tiny_model("qwen3")), str(moe))


def _tp_fsdp_body(rank: int, model_dir: str) -> dict:
    return {"tp2_fsdp2": _layout_body(rank, model_dir, "tp2_fsdp2")}


@pytest.fixture(scope="module")
def ranks_tp_fsdp(tiny_model) -> dict:
    return run_ranks(_tp_fsdp_body, str(tiny_model("qwen3")), world=4, timeout=900)


def _assert_exact(r: dict, groups: int) -> None:
    assert r["worst"] < TOL, f"{r['name']} off by {r['worst']:.2e}"
    assert r["loss"][1] == pytest.approx(r["loss"][0], rel=TOL, abs=1e-7)
    assert_reuse_ran(r["metrics"], groups=groups)
    want_infer, got_infer = r["infer"]
    assert_infer_matches(want_infer, got_infer, TOL, groups=groups)


@pytest.mark.parametrize("layout", ["tp2", "fsdp2"])
@pytest.mark.parametrize("case", list(CASES))
def test_schedule_knob_matches_verl_torchtitan_engine(ranks, layout, case):
    _assert_case(ranks, layout, case)


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_moe_schedule_knob_matches_verl_torchtitan_engine(ranks, layout, case):
    """MoE flavors through the one schedule: gradients, log-probs, and torchtitan's expert-load counts and bias
    exactly as dense (prefix tokens once per row below each node, every row's last token routed, padding and
    fillers uncounted); counting each node's tokens once instead fails (tree and chunked)."""
    _assert_case(ranks, layout, case)
    for result in ranks.values():
        r = result[layout][case]
        want, got = r["routed"]
        assert len(want) == 2 and all(w.sum() > 0 for w in want)
        assert all(torch.equal(w, g) for w, g in zip(want, got)), (layout, case, want, got)
        want_bias, got_bias = r["bias"]
        assert len(want_bias) == 2 and all(b.abs().sum() > 0 for b in want_bias)
        assert all(torch.equal(w, g) for w, g in zip(want_bias, got_bias)), (layout, case)
        if "counted_once" in r:
            assert any(not torch.equal(w, g) for w, g in zip(want, r["counted_once"])), (layout, case)


@pytest.mark.parametrize("case", list(CASES))
def test_schedule_knob_at_tp2_by_fsdp2_matches_verl_torchtitan_engine(ranks_tp_fsdp, case):
    """TP=2 x FSDP=2 on four ranks: each data-parallel rank's TP pair shares its batch, the two pairs hold
    different groups (lockstep fillers across FSDP, TP collectives inside each pair)."""
    _assert_case(ranks_tp_fsdp, "tp2_fsdp2", case)


def _assert_case(ranks: dict, layout: str, case: str) -> None:
    for rank, result in ranks.items():
        r = result[layout][case]
        dp_rank = rank // LAYOUTS[layout].get("tensor_parallel_size", 1)
        groups = 2 if "data_parallel_shard_size" not in LAYOUTS[layout] or dp_rank == 0 else 1
        _assert_exact(r, groups)
        m = r["metrics"]
        if case.startswith("tree"):
            assert m["prefix/tree_saved_tokens"] > 0 and m["prefix/tree_nodes"] >= groups
        if case == "chunked":
            assert m["prefix/chunked_groups"] > 0 and m["prefix/prefix_chunks"] > m["prefix/chunked_groups"]
        if case == "merged":
            assert m["prefix/phase_b_attention/merged"] > 0 and m["prefix/phase_b_attention/concat"] == 0
        if case.endswith("recompute"):
            assert m["prefix/policy/recompute"] > 0
        if "no_phase_c" in r:  # negative control
            assert r["no_phase_c"]["worst"] > 1e-2, f"{layout}/{case}: skipping phase C changed nothing"


def test_dynamic_batch_size_plans_suffix_micro_batches_by_token_budget(ranks):
    for rank, result in ranks.items():
        r = result["tp2"]["dynamic"]
        assert r["worst"] < TOL and r["vs_fixed"] < TOL, (rank, r["name"], r["worst"])
        assert_reuse_ran(r["metrics"], groups=2)
        # one loss call per suffix micro-batch: each within the budget (rows x (prefix + longest suffix)), unless a
        # single row; more of them than verl's micro_batch_size_per_gpu (4) gives, which is one per group
        assert len(r["fixed_calls"]) == 2
        assert len(r["calls"]) > len(r["fixed_calls"])
        for rows in r["calls"]:
            cost = len(rows) * max(p - 1 + s for p, s in rows)
            assert len(rows) == 1 or cost <= BUDGET, rows


@pytest.mark.parametrize("case", list(PP_CASES))
def test_pipeline_stages_run_the_one_schedule(ranks, case):
    """PP=2 through the one schedule: each stage's gradients (its own parameters; together every parameter once)
    within 1e-5 of verl's engine without a pipeline, the loss and forward-only log-probs and entropies (the last
    stage's, on every stage), reuse asserted on both stages; the tree and a chunked prefix with phase C not
    crossing the stages are wrong on stage 0 (its K/V reach the loss through stage 1's layers only)."""
    held = []
    for rank in (0, 1):
        assert ranks[rank]["pp2"]["stage"] == (rank, 2)
        r = ranks[rank]["pp2"][case]
        got_params, all_params = r["params"]
        held.append(set(got_params))
        _assert_exact(r, groups=2)
        m = r["metrics"]
        if case.startswith("tree"):
            assert m["prefix/tree_saved_tokens"] > 0 and m["prefix/tree_nodes"] >= 2
        if case == "chunked":
            assert m["prefix/chunked_groups"] > 0 and m["prefix/prefix_chunks"] > m["prefix/chunked_groups"]
        if case == "tree_chunked_merged":  # the trie's long nodes ran as chains of chunks
            assert m["prefix/tree_node_chunks"] > 0
        if "merged" in case:
            assert m["prefix/phase_b_attention/merged"] > 0 and m["prefix/phase_b_attention/concat"] == 0
        if "not_crossing" in r:
            worst = r["not_crossing"]["worst"]
            assert worst > 1e-2 if rank == 0 else worst < TOL, (case, rank, worst)
    assert not held[0] & held[1] and held[0] | held[1] == set(all_params) and len(all_params) > 10


def test_pipeline_stages_serve_loss_on_shared_tokens(ranks):
    """The trie's loss-carrying nodes (tree rollouts sharing response stems, per-turn samples) at PP=2: the last
    stage scores them, stage 0's gradients reach them through each node's output; exact on both stages."""
    for rank in (0, 1):
        r = ranks[rank]["pp2"]["shared_loss"]
        _assert_exact(r, groups=4)
        m = r["metrics"]
        assert m["prefix/tree_loss_nodes"] >= 4 and m["prefix/tree_shared_loss_tokens"] > 0, m


def test_pipeline_stages_plan_by_dynamic_batch_size(ranks):
    """Under verl's dynamic batch size the suffix micro-batches follow its token budget at PP=2 too (the loss runs
    on the last stage: one call per micro-batch there, none on stage 0)."""
    for rank in (0, 1):
        r = ranks[rank]["pp2"]["dynamic"]
        assert r["worst"] < TOL, (rank, r["name"], r["worst"])
        assert_reuse_ran(r["metrics"], groups=2)
    assert ranks[0]["pp2"]["dynamic"]["calls"] == []
    calls = ranks[1]["pp2"]["dynamic"]["calls"]
    assert len(calls) > 2
    for rows in calls:
        assert len(rows) == 1 or len(rows) * max(p - 1 + s for p, s in rows) <= BUDGET, rows


def test_config_refusals_under_pipeline_parallelism():
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.backend.titan.config import PrefixTorchtitanEngineConfig, refusal

    def config(**kwargs):
        reuse = kwargs.pop("reuse", {})
        return PrefixTorchtitanEngineConfig(prefix_reuse=PrefixReuseConfig(**reuse), **kwargs)

    for knobs in (dict(reuse=dict(tree=True)), dict(reuse=dict(prefix_chunk_tokens=8)),
                  dict(reuse=dict(phase_b_attention="merged")), dict(dormant_prefix="offload")):  # fmt: skip
        assert refusal(config(**knobs)) is None
        assert refusal(config(pipeline_parallel_size=2, **knobs)) is None  # the one schedule on every stage
    # recompute runs phase A again in phase C, crossing the stages again out of order: refused with PP only
    for policy in ("recompute", "auto"):
        budget = dict(dormant_prefix_budget_bytes=1 << 20) if policy == "auto" else {}
        assert refusal(config(dormant_prefix=policy, **budget)) is None
        message = refusal(config(pipeline_parallel_size=2, dormant_prefix=policy, **budget))
        assert "dormant_prefix=" + policy in message and "pipeline_parallel_size" in message, message
    assert refusal(config(pipeline_parallel_size=2)) is None
    with pytest.raises(ValueError):
        config(dormant_prefix="sometimes")
    torch.manual_seed(0)


def test_schedule_call_without_routing_weights_is_refused():
    """With MoE layers a training call of the schedule's model outside ``count_routing`` would let torchtitan
    count the expert load physically (the prefix once per group): refused, not counted."""
    from types import SimpleNamespace

    from transformers import Qwen3Config

    from verl_prefix.backend.titan.causal_lm import TitanCausalLM

    model = torch.nn.Linear(2, 2)  # in training mode, as the actor's model is in a training step
    counts = SimpleNamespace(weights=None)
    lm = TitanCausalLM(model, hooks=None, hf_config=Qwen3Config(), counts=counts)
    with pytest.raises(RuntimeError, match="without routing weights"):
        lm(torch.zeros(1, 3, dtype=torch.long), prefix_ctx=object())
