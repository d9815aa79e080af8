"""prefix_torchtitan against verl's own TorchTitan engine (no reuse), fp32: on two gloo ranks TP=2, FSDP=2,
EP=2 (a tiny qwen3_moe) and PP=2 (against the stock engine at PP=1), on four TP=2 x FSDP=2 with EP=2: log-probs,
entropies, per-parameter gradients, loss and grad norm, and with MoE the expert load counts and bias
torchtitan's load balancing uses; reuse ran; skipping phase C, counting the prefix's routing once per group,
weighing a TP rank's tokens as another's, or a phase C that does not cross pipeline stages, fails. Plus what the
engine refuses before it builds anything: a flavor that is not the checkpoint's, pipeline combinations, CP and
other settings.

One set of ranks per world size for every engine-level fact (two engines per case, lr 0 so every step sees the
same weights).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.engine_batches import phase_c_skipped
from helpers.ranks import run_ranks, run_two_ranks
from helpers.reuse import assert_infer_matches, assert_reuse_ran, reduced
from helpers.titan_moe import counted_train_step

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is an optional dependency (scripts/setup.sh installs it)")
pytest.importorskip("triton", reason="torchtitan 0.3.0's model stack imports triton (scripts/setup.sh installs it)")

VOCAB = 128
TOL = 1e-5  # fp32
# a tiny qwen3_moe checkpoint (4 experts, top 2) whose torchtitan flavor differs from the dense one's dimensions
MOE = dict(hidden_size=32, num_experts=4, num_experts_per_tok=2, intermediate_size=32)


def _rank_batch(rank: int, fsdp: bool):
    from verl.utils import tensordict_utils as tu

    from verl_prefix.harness import grpo_batches

    shape = dict(num_groups=2, group_size=4, prompt_lens=[12, 9], response_len_range=(2, 7))
    if not fsdp:  # TP ranks hold the same rows
        return grpo_batches.make_grpo_batch(**shape, vocab_size=VOCAB, seed=7, use_kl=True)
    if rank == 0:
        return grpo_batches.make_grpo_batch(**shape, vocab_size=VOCAB, seed=8, use_kl=True, global_batch_size=16)
    # data-parallel rank 1: one group and four singletons (dense): the ranks' schedules differ (lockstep fillers)
    group = grpo_batches.make_grpo_batch(
        num_groups=1, group_size=4, prompt_lens=10, response_len_range=(2, 6), vocab_size=VOCAB, seed=9, use_kl=True,
        global_batch_size=16,
    )  # fmt: skip
    singles = grpo_batches.make_grpo_batch(
        num_groups=4, group_size=1, prompt_lens=6, response_len_range=(2, 4), vocab_size=VOCAB, seed=10, use_kl=True,
        global_batch_size=16,
    )  # fmt: skip
    return tu.concat_tensordict([group, singles])


def _tp_ep_batch(dp_rank: int):
    """Two groups of four per data-parallel rank. verl's own engine packs a micro-batch (four rows) into one
    sequence, which under TP x EP torchtitan's MoE splits over the TP ranks: the reference needs an even
    packed length, so the first seed whose micro-batches have one is taken (prefix_torchtitan pads its own)."""
    from verl_prefix.harness import grpo_batches

    for seed in range(100 * dp_rank, 100 * dp_rank + 100):
        batch = grpo_batches.make_grpo_batch(
            num_groups=2, group_size=4, prompt_lens=[12 - dp_rank, 9], response_len_range=(2, 7), vocab_size=VOCAB,
            seed=seed, use_kl=True, global_batch_size=16,
        )  # fmt: skip
        lengths = batch["input_ids"].offsets().diff()
        if all(int(lengths[i : i + 4].sum()) % 2 == 0 for i in range(0, len(batch), 4)):
            return batch
    raise AssertionError("no batch with even micro-batches")


def _compare(rank: int, model_dir: str, loss_fn, fsdp: bool, negative: bool, ep: bool = False, tp_ep: int = 0) -> dict:
    """Stock and prefix engines on this layout (lr 0: every step sees the same weights). ``tp_ep``: TP=2 with
    EP=2 and FSDP=``tp_ep`` (the MoE's tokens split over the TP ranks, its experts over EP, which torchtitan
    takes from FSDP x TP)."""
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.backend.titan import moe as titan_moe
    from verl_prefix.harness import titan as TT
    from verl_prefix.harness import verl_engine

    layout = dict(data_parallel_shard_size=2) if fsdp else dict(tensor_parallel_size=2)
    if tp_ep:
        layout = dict(data_parallel_shard_size=tp_ep, tensor_parallel_size=2)
    if ep or tp_ep:  # the experts split over two ranks (all-to-all dispatch)
        layout["engine_overrides"] = dict(expert_parallel_size=2)
    # two suffix micro-batches per group: the prefix leaves accumulate dK/dV across them
    reuse = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2)
    stock = TT.build_titan_engine(model_dir, backend="torchtitan", lr=0.0, **layout)
    batch = _tp_ep_batch(stock.get_data_parallel_rank()) if tp_ep else _rank_batch(rank, fsdp)
    prefix = TT.build_titan_engine(model_dir, backend="prefix_torchtitan", lr=0.0, prefix_reuse=reuse, **layout)
    out = {"want_infer": verl_engine.run_infer(stock, batch), "got_infer": verl_engine.run_infer(prefix, batch)}
    if not (fsdp or ep or tp_ep):  # what the rollout receives (every rank iterates: the gather is a collective)
        out["synced"] = {name: tensor.detach().clone() for name, tensor in prefix.get_per_tensor_param()[0]}
        # no data parallelism: each rank's data-parallel group is itself (verl's worker gathers metrics over it)
        out["dp_groups"] = [torch.distributed.get_world_size(e.get_data_parallel_group()) for e in (stock, prefix)]
    for key, engine in (("want", stock), ("got", prefix)):  # with the routing counts torchtitan's bias hook reads
        out[key] = counted_train_step(engine, loss_fn, batch, capture_grads=True)
    if ep and negative:  # negative control: the prefix's routing counted once per group instead of once per row
        weighted = titan_moe.ExpertCounts.weighted
        titan_moe.ExpertCounts.weighted = lambda self, w: weighted(self, torch.as_tensor(w).clamp(max=1.0))
        try:
            out["once_per_group"] = counted_train_step(prefix, loss_fn, batch)["routed"]
        finally:
            titan_moe.ExpertCounts.weighted = weighted
    if tp_ep and negative:  # negative control: every TP rank weighs its slice of the tokens as if the first
        shard_like = titan_moe.shard_like
        titan_moe.shard_like = lambda weights, ids: weights[:, : ids.to_local().shape[1]]
        try:
            out["unsliced_weights"] = counted_train_step(prefix, loss_fn, batch)["routed"]
        finally:
            titan_moe.shard_like = shard_like
        out["odd_dense_refused"] = _odd_dense_refusal(prefix, loss_fn, batch, stock.get_data_parallel_rank())
    if negative:  # negative control: the one schedule's phase C skipped
        with phase_c_skipped():
            out["no_phase_c"] = verl_engine.run_train_step(prefix, loss_fn, batch, capture_grads=True)
    if not (fsdp or ep or tp_ep):  # last: it zeroes the weights before restoring them
        out["checkpoint"] = _checkpoint_round_trip(prefix, Path(model_dir).parent / "titan_tp2_checkpoint")
    for key in ("want_infer", "got_infer"):
        out[key] = {k: out[key][k] for k in ("response_log_probs", "response_entropy", "metrics")}
    return out


def _checkpoint_round_trip(engine, root: Path) -> dict:
    """verl's ``save_checkpoint`` at step 3 (torchtitan's interval alone would skip it), the weights zeroed, then
    verl's ``load_checkpoint``: what torchtitan wrote, and whether every parameter came back."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    path = str(root / "global_step_3" / "actor")
    interval = engine.checkpointer.interval
    engine.save_checkpoint(path, global_step=3)
    params = dict(engine.module[0].named_parameters())
    before = {n: local(p.detach()).clone() for n, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    engine.load_checkpoint(path)
    restored = sorted(n for n, p in params.items() if torch.equal(local(p.detach()), before[n]))
    return {"interval": interval, "written": (root / "global_step_3" / "step-3").is_dir(), "restored": restored,
            "params": sorted(params)}  # fmt: skip


def _odd_dense_refusal(prefix, loss_fn, batch, dp_rank: int) -> str:
    """Data-parallel rank 0 adds a singleton row of 9 tokens (a dense chunk torchtitan's MoE cannot split over
    TP=2): every rank refuses together, before a collective, instead of hanging or failing in DTensor."""
    from verl.utils import tensordict_utils as tu

    from verl_prefix.harness import grpo_batches, verl_engine

    if dp_rank == 0:
        single = grpo_batches.make_grpo_batch(
            num_groups=1, group_size=1, prompt_lens=6, response_len_range=(3, 3), vocab_size=VOCAB, seed=5,
            use_kl=True, global_batch_size=16,
        )  # fmt: skip
        batch = tu.concat_tensordict([batch, single])
    try:
        verl_engine.run_train_step(prefix, loss_fn, batch)
    except ValueError as error:
        return str(error)
    return "ran"


def _pipeline(rank: int, model_dir: str, loss_fn) -> dict:
    """prefix_torchtitan at pipeline_parallel_size=2 (rank 0: embeddings + layer 0, rank 1: layer 1 + norm + LM
    head) on the TP=2 case's batch, compared with that case's stock engine (PP=1). Also: a phase C that does not
    cross stages (negative control), a mini-batch with one group dense (its prefix is under ``min_prefix_len``)
    and one reusing, and reuse off (every row dense, pipelined by the engine: verl's own has no pipelined step)
    in verl's dynamic-batch-size micro-batches."""
    import dataclasses

    from helpers.engine_batches import titan_phase_c_not_crossing
    from verl.utils import tensordict_utils as tu

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import titan as TT
    from verl_prefix.harness import verl_engine

    batch = _rank_batch(rank, fsdp=False)
    reuse = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2)
    build = dict(backend="prefix_torchtitan", lr=0.0, prefix_reuse=reuse)
    engine = TT.build_titan_engine(model_dir, **build, engine_overrides=dict(pipeline_parallel_size=2))
    link = engine.link
    out = {"stage": (link.stage, link.num_stages, engine.is_mp_src_rank_with_outputs())}
    # what the rollout receives: every stage's weights on every rank (both iterate: the broadcasts are collective)
    out["synced"] = {name: tensor.detach().clone() for name, tensor in engine.get_per_tensor_param()[0]}
    out["got_infer"] = verl_engine.run_infer(engine, batch)
    out["got_infer"] = {k: out["got_infer"][k] for k in ("response_log_probs", "response_entropy", "metrics")}
    out["got"] = verl_engine.run_train_step(engine, loss_fn, batch, capture_grads=True)
    # negative control: each stage's phase C seeded by its own leaves only, never by the next stage's gradient
    with titan_phase_c_not_crossing():
        out["not_crossing"] = verl_engine.run_train_step(engine, loss_fn, batch, capture_grads=True)
    # reuse off under verl's dynamic batch size: its token-budget micro-batches, pipelined (rows reordered, restored)
    dynamic = batch.copy()
    tu.assign_non_tensor(dynamic, use_dynamic_bsz=True, max_token_len_per_gpu=48)
    for key, config, rows in (("mixed", dict(min_prefix_len=10), batch), ("dense", dict(enable=False), dynamic)):
        engine.reuse_config = dataclasses.replace(reuse, **config)
        out[key] = verl_engine.run_train_step(engine, loss_fn, rows, capture_grads=True)
    # stages handed different rows (verl hands a pipeline's ranks the same ones): both refuse, neither hangs
    try:
        verl_engine.run_train_step(engine, loss_fn, batch if rank == 0 else _rank_batch(rank, fsdp=True))
        out["different_rows"] = "ran"
    except ValueError as error:
        out["different_rows"] = str(error)
    out["checkpoint"] = _checkpoint_round_trip(engine, Path(model_dir).parent / "titan_pp2_checkpoint")  # last
    return out


def _refused_moe_tp(moe_dir: str) -> str:
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import titan as TT

    try:
        reuse = PrefixReuseConfig()
        TT.build_titan_engine(moe_dir, backend="prefix_torchtitan", tensor_parallel_size=2, prefix_reuse=reuse)
    except ValueError as error:
        return str(error)
    return "built"


def _loss_fn():
    """verl's PPO loss with the KL loss and the entropy bonus on."""
    import functools

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    from verl_prefix.harness import verl_engine

    a = "actor_rollout_ref.actor"
    knobs = ["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=4", "use_kl_loss=true", "entropy_coeff=0.01"]
    actor = verl_engine.compose_ppo_config([f"{a}.{k}" for k in knobs]).actor_rollout_ref.actor
    return functools.partial(ppo_loss, config=omega_conf_to_dataclass(actor))


def _body(rank: int, model_dir: str, moe_dir: str, moe_off_dir: str) -> dict:
    loss_fn = _loss_fn()
    return {
        # TP=2 x EP=2 on two ranks (EP over the TP ranks), torchtitan's load balancing off; on at four ranks
        "tp2_ep2_aux_off": _compare(rank, moe_off_dir, loss_fn, fsdp=True, negative=False, tp_ep=1),
        "moe_tp2_refused": _refused_moe_tp(moe_dir),
        "ep2": _compare(rank, moe_dir, loss_fn, fsdp=True, negative=True, ep=True),
        "ep2_aux_off": _compare(rank, moe_off_dir, loss_fn, fsdp=True, negative=False, ep=True),
        "tp2": _compare(rank, model_dir, loss_fn, fsdp=False, negative=True),
        "fsdp2": _compare(rank, model_dir, loss_fn, fsdp=True, negative=False),
        "pp2": _pipeline(rank, model_dir, loss_fn),
    }


def _body_tp_ep(rank: int, moe_dir: str) -> dict:
    return {"aux_on": _compare(rank, moe_dir, _loss_fn(), fsdp=True, negative=True, tp_ep=2)}


def _worst(want: dict, got: dict) -> tuple[float, str]:
    errors = {n: ((got[n] - g).norm() / g.norm()).item() for n, g in want.items()}
    name = max(errors, key=errors.get)
    return errors[name], name


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> tuple[str, str]:
    """A tiny qwen3_moe with torchtitan's load balancing on, and one without (torchtitan counts, moves no bias);
    their flavors share a name and each replaces the other when its engines are built."""
    from verl_prefix.harness.tiny_models import write_tiny_model

    extra = {"verl_prefix_load_balance_coeff": 1e-3}  # torchtitan's load balancing on (harness.titan)
    moe = write_tiny_model(tmp_path_factory.mktemp("tiny_titan_moe"), "qwen3_moe", **MOE, extra_config=extra)
    moe_off = write_tiny_model(tmp_path_factory.mktemp("tiny_titan_moe_off"), "qwen3_moe", **MOE, seed=1)
    return str(moe), str(moe_off)


@pytest.fixture(scope="module")
def ranks(tiny_model, moe_dirs) -> dict:
    return run_two_ranks(_body, str(tiny_model("qwen3")), *moe_dirs)


@pytest.fixture(scope="module")
def ranks_tp_ep(moe_dirs) -> dict:
    """Four gloo ranks: TP=2 x FSDP=2, EP=2."""
    return run_ranks(_body_tp_ep, moe_dirs[0], world=4, timeout=600)


def _assert_matches(r: dict, rank: int, groups: int, grad_norm: bool) -> None:
    assert_infer_matches(r["want_infer"], r["got_infer"], TOL, groups=groups)
    want, got = r["want"], r["got"]
    assert set(got["grads"]) == set(want["grads"]) and len(want["grads"]) > 10
    worst, name = _worst(want["grads"], got["grads"])
    assert worst < TOL, f"rank {rank}: {name} off by {worst:.2e}"
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL, abs=1e-7)
    if grad_norm:
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)
    assert_reuse_ran(got["metrics"], groups=groups)


def test_tp2_matches_verl_torchtitan_engine(ranks):
    """Phase A's K/V are each rank's head shard at inner_attention; dK/dV accumulate on that shard."""
    for rank in range(2):
        _assert_matches(ranks[rank]["tp2"], rank, groups=2, grad_norm=rank == 0)  # verl reports it on rank 0


def _stage_grads(ranks: dict, key: str) -> list[dict]:
    """Each pipeline stage's gradients: its own parameters only, together every parameter of the model once."""
    want = ranks[0]["tp2"]["want"]["grads"]
    stages = [ranks[rank]["pp2"][key]["grads"] for rank in range(2)]
    assert all(stages) and not set(stages[0]) & set(stages[1]), key
    assert set(stages[0]) | set(stages[1]) == set(want) and len(want) > 10, key
    return stages


def test_pp2_matches_verl_torchtitan_engine(ranks):
    """PP=2 against verl's engine at PP=1 (no reuse): both stages' gradients, loss and grad norm (on the last
    stage, where verl reads them; the clip norm spans the stages), and forward-only log-probs and entropies (the
    last stage's, on every stage); reuse ran. With one group dense (``min_prefix_len``) or every row dense (reuse
    off), dense rows cross the stages as pipeline micro-batches, with verl's own inputs, outputs and loss."""
    assert [ranks[r]["pp2"]["stage"] for r in range(2)] == [(0, 2, False), (1, 2, True)]
    want = ranks[0]["tp2"]["want"]
    for key, groups in (("got", 2), ("mixed", 1), ("dense", 0)):
        for rank, grads in enumerate(_stage_grads(ranks, key)):
            worst, name = _worst({n: want["grads"][n] for n in grads}, grads)
            assert worst < TOL, f"{key}, stage {rank}: {name} off by {worst:.2e}"
            got = ranks[rank]["pp2"][key]
            assert got["loss"] == pytest.approx(want["loss"], rel=TOL, abs=1e-7), (key, rank)
            if groups:
                assert_reuse_ran(got["metrics"], groups=groups)
            else:
                assert reduced(got["metrics"])["prefix/fallback_disabled"] == 8.0
        assert ranks[1]["pp2"][key]["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL), key
        assert ranks[0]["pp2"][key]["grad_norm"] is None  # verl reports it on the last stage only
    assert reduced(ranks[0]["pp2"]["mixed"]["metrics"])["prefix/fallback_short_prefix"] == 4.0
    # reuse off under dynamic batch size: verl's token budget made 4 micro-batches (2 of 4 rows without it)
    assert len(ranks[1]["pp2"]["dense"]["metrics"]["kl_coef"]) == 4
    for rank in range(2):
        assert_infer_matches(ranks[rank]["tp2"]["want_infer"], ranks[rank]["pp2"]["got_infer"], TOL, groups=2)


def test_pp2_stages_with_different_rows_refuse_together(ranks):
    """Stages handed different rows would send activations of other shapes or wait on each other forever: the
    engine compares the rows' hash across the stages first, and every stage raises the same error."""
    for rank in range(2):
        assert "pipeline stages hold different rows" in ranks[rank]["pp2"]["different_rows"], rank


def test_pp2_phase_c_not_crossing_stages_is_wrong(ranks):
    """Negative control: stage 0's phase C without stage 1's gradient of its phase-A input misses what every
    suffix backpropagated into stage 1's prefix K/V; stage 1's own gradients stay right."""
    want = ranks[0]["tp2"]["want"]["grads"]
    first, last = _stage_grads(ranks, "not_crossing")
    assert _worst({n: want[n] for n in first}, first)[0] > 1e-2
    assert _worst({n: want[n] for n in last}, last)[0] < TOL


def test_tp2_without_phase_c_is_wrong(ranks):
    """Negative control: the same comparison fails when the prefix gets no gradient from the suffixes."""
    for rank in range(2):
        r = ranks[rank]["tp2"]
        worst, _ = _worst(r["want"]["grads"], r["no_phase_c"]["grads"])
        assert worst > 1e-2


def test_tp2_weight_sync_is_the_checkpoint_in_fp32(ranks, tiny_model):
    """The weights a rollout receives from a TP=2 engine (verl's ``get_per_tensor_param``: shards gathered, HF
    names from torchtitan's state-dict adapter), and from a PP=2 one (every stage's on every rank), before any
    step, are the checkpoint's, exactly and in fp32 (verl casts them to bf16; ``titan.platform`` keeps an fp32
    engine's fp32). With no data parallelism each rank's data-parallel group is itself (``titan.platform``), so
    verl's worker gathers metrics as usual."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3")).state_dict()
    # a bf16 round trip changes them: equality below would catch a rounded sync
    assert all(not torch.equal(w, w.bfloat16().float()) for n, w in hf.items() if "norm" not in n)
    for rank in range(2):
        assert ranks[rank]["tp2"]["dp_groups"] == [1, 1], rank
        # PP=2: each stage holds half the parameters; the rollout of either rank gets all of them
        for case in ("tp2", "pp2"):
            synced = ranks[rank][case]["synced"]
            assert sorted(synced) == sorted(hf), (case, rank)
            for name, want in hf.items():
                assert synced[name].dtype == torch.float32 and torch.equal(synced[name], want), (case, rank, name)


def test_tp2_checkpoint_saved_when_verl_asks_and_restored(ranks):
    """verl saves at its ``save_freq``; torchtitan's checkpointer writes only every ``interval`` (500) steps, so
    verl's checkpoint held no weights (``titan.platform`` makes every requested save write). Loading it back
    restores each TP shard of every parameter (zeroed in between); at PP=2 each stage's parameters."""
    for rank in range(2):
        ckpt = ranks[rank]["tp2"]["checkpoint"]
        assert ckpt["interval"] > 3, rank  # torchtitan alone would have skipped step 3
        assert ckpt["written"], rank
        assert ckpt["restored"] == ckpt["params"] and len(ckpt["params"]) > 10, rank
        # PP=2: each stage saves and restores its own parameters
        ckpt = ranks[rank]["pp2"]["checkpoint"]
        assert ckpt["written"] and ckpt["restored"] == ckpt["params"] and len(ckpt["params"]) > 4, rank


def test_fsdp2_with_different_group_structure(ranks):
    """Data-parallel ranks with 2 groups vs 1 group + 4 dense rows: lockstep fillers keep FSDP's collectives
    matched (rank 0 fills in for rank 1's dense chunk, rank 1 for rank 0's second group)."""
    for rank, groups in ((0, 2), (1, 1)):
        r = ranks[rank]["fsdp2"]
        _assert_matches(r, rank, groups=groups, grad_norm=True)
        assert reduced(r["got"]["metrics"])["prefix/time_s/lockstep"] > 0, rank
    assert reduced(ranks[1]["fsdp2"]["got"]["metrics"])["prefix/fallback_small_group"] == 4.0


def test_ep2_matches_verl_torchtitan_engine(ranks):
    """EP=2 over the data-parallel ranks (2 groups vs 1 group + 4 dense rows): gradients as dense, and the
    tokens per expert that torchtitan's load balancing reads equal dense's (the prefix counted once per row)."""
    for rank, groups in ((0, 2), (1, 1)):
        r = ranks[rank]["ep2"]
        _assert_matches(r, rank, groups=groups, grad_norm=True)
        want, got = r["want"]["routed"], r["got"]["routed"]
        assert len(want) == 2 and all(w.sum() > 0 for w in want)
        for w, g in zip(want, got):
            assert torch.equal(w, g), (rank, w, g)
        assert len(r["want"]["bias"]) == 2 and all(b.abs().sum() > 0 for b in r["want"]["bias"])
        for w, g in zip(r["want"]["bias"], r["got"]["bias"]):
            assert torch.equal(w, g), (rank, w, g)
        # negative control: the prefix counted once per group gives other counts
        assert any(not torch.equal(w, g) for w, g in zip(want, r["once_per_group"])), rank


def test_ep2_without_load_balancing(ranks):
    """``load_balance_coeff`` unset: torchtitan counts without moving a bias; the counts still equal dense's."""
    for rank, groups in ((0, 2), (1, 1)):
        r = ranks[rank]["ep2_aux_off"]
        _assert_matches(r, rank, groups=groups, grad_norm=True)
        assert r["want"]["bias"] == [] and r["got"]["bias"] == []
        assert all(w.sum() > 0 and torch.equal(w, g) for w, g in zip(r["want"]["routed"], r["got"]["routed"]))


def _assert_counts_match(r: dict, rank: int) -> None:
    """The tokens per expert torchtitan's load balancing reads, and the bias it moved, equal dense's exactly."""
    want, got = r["want"]["routed"], r["got"]["routed"]
    assert len(want) == 2 and all(w.sum() > 0 for w in want)
    for w, g in zip(want, got):
        assert torch.equal(w, g), (rank, w, g)
    for w, g in zip(r["want"]["bias"], r["got"]["bias"]):
        assert torch.equal(w, g), (rank, w, g)


def test_tp2_x_ep2_matches_verl_torchtitan_engine(ranks_tp_ep, ranks):
    """TP=2 x FSDP=2 with EP=2 (four ranks), torchtitan's load balancing on: its MoE splits every sequence over
    the TP ranks, so phase A's prefix and phase B's suffixes are padded to even lengths and each rank weighs its
    slice of the tokens; gradients, loss, grad norm, log-probs, and the expert counts and bias exactly, as verl's
    engine without reuse. Load balancing off: TP=2 x EP=2 on two ranks (EP over the TP ranks), the same."""
    for rank in range(4):
        r = ranks_tp_ep[rank]["aux_on"]
        _assert_matches(r, rank, groups=2, grad_norm=rank % 2 == 0)  # verl reports it on TP rank 0
        _assert_counts_match(r, rank)
        assert len(r["want"]["bias"]) == 2 and all(b.abs().sum() > 0 for b in r["want"]["bias"])
    for rank in range(2):
        r = ranks[rank]["tp2_ep2_aux_off"]
        _assert_matches(r, rank, groups=2, grad_norm=rank == 0)
        _assert_counts_match(r, rank)
        assert r["want"]["bias"] == [] and r["got"]["bias"] == []


def test_tp2_x_ep2_negative_controls(ranks_tp_ep):
    """Skipping phase C breaks the gradients; weighing every TP rank's slice as the first slice breaks the
    expert counts (on the ranks holding the second slice, whose padding it counts)."""
    for rank in range(4):
        r = ranks_tp_ep[rank]["aux_on"]
        assert _worst(r["want"]["grads"], r["no_phase_c"]["grads"])[0] > 1e-2
        want = r["want"]["routed"]
        assert any(not torch.equal(w, g) for w, g in zip(want, r["unsliced_weights"])), rank


def test_tp2_x_ep2_odd_dense_chunk_is_refused_on_every_rank(ranks_tp_ep):
    """A dense chunk torchtitan's MoE cannot split over TP: all four ranks refuse together (no hang)."""
    for rank in range(4):
        message = ranks_tp_ep[rank]["aux_on"]["odd_dense_refused"]
        words = "a dense chunk of 9 packed tokens" if rank < 2 else "another data-parallel rank's dense chunk"
        assert words in message and "tensor x expert parallelism" in message, (rank, message)


def test_moe_with_tp_only_is_refused_at_build(ranks):
    """TP without EP shards the experts themselves: not tested under reuse, refused (TP x EP is served)."""
    for rank in range(2):
        assert "expert_parallel_size > 1" in ranks[rank]["moe_tp2_refused"], ranks[rank]["moe_tp2_refused"]


def test_refusals_at_config_time():
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.backend.titan.config import PrefixTorchtitanEngineConfig, refusal

    assert refusal(PrefixTorchtitanEngineConfig()) is None
    for knob, value, words in (
        ("context_parallel_size", 2, "context parallelism"),
        ("spmd_backend", "spmd_types", "torch 2.13"),
        ("attn_type", "varlen", "flex"),
        ("activation_checkpoint", "selective", "recompute"),
        ("use_torch_compile", True, "compiled"),
        ("use_remove_padding", False, "actor_rollout_ref.model.use_remove_padding"),
    ):
        reason = refusal(PrefixTorchtitanEngineConfig(**{knob: value}))
        assert reason is not None and knob in reason and words in reason, (knob, reason)
    # the one schedule's knobs: served at every layout, pipeline stages and EP included
    # (tests/backend/test_titan_schedule.py)
    for reuse in (PrefixReuseConfig(tree=True), PrefixReuseConfig(prefix_chunk_tokens=64),
                  PrefixReuseConfig(phase_b_attention="merged")):  # fmt: skip
        for layout in ({}, dict(expert_parallel_size=2), dict(pipeline_parallel_size=2)):
            assert refusal(PrefixTorchtitanEngineConfig(prefix_reuse=reuse, **layout)) is None, (reuse, layout)
    assert refusal(PrefixTorchtitanEngineConfig(prefix_reuse=PrefixReuseConfig(enable=False, tree=True))) is None
    # the reuse knobs from YAML without a _target_ (a mapping) are checked when verl builds the config
    assert PrefixTorchtitanEngineConfig(prefix_reuse={"tree": True}).prefix_reuse.tree is True
    with pytest.raises(ValueError, match="min_prefix_len"):
        PrefixTorchtitanEngineConfig(prefix_reuse={"min_prefix_len": 0})
    # pipeline parallelism is served alone (one stage per rank), reuse on or off: the engine pipelines every pass
    assert refusal(PrefixTorchtitanEngineConfig(pipeline_parallel_size=2)) is None
    for knob in ("tensor_parallel_size", "expert_parallel_size", "context_parallel_size", "data_parallel_shard_size"):
        for reuse in (PrefixReuseConfig(), PrefixReuseConfig(enable=False)):
            config = PrefixTorchtitanEngineConfig(pipeline_parallel_size=2, prefix_reuse=reuse, **{knob: 2})
            reason = refusal(config)
            assert reason is not None and knob in reason and "pipeline_parallel_size=2" in reason, (knob, reason)


def test_model_types_outside_the_allowlist_are_refused_at_build():
    """Reuse on torchtitan serves the model types verl maps to torchtitan's plain-causal Qwen3; Llama-4 (chunked
    attention), GPT-OSS (windows, sinks), DeepSeek-V3 (MLA), Llama-3 (untested) and any type it does not know are
    refused with the reason, never run with a mask that ignores what their attention does; reuse off refuses none."""
    from transformers import CONFIG_MAPPING

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.backend.titan.config import SERVED_MODEL_TYPES, PrefixTorchtitanEngineConfig, model_refusal

    on, off = PrefixTorchtitanEngineConfig(), PrefixTorchtitanEngineConfig(prefix_reuse=PrefixReuseConfig(enable=False))
    for model_type in SERVED_MODEL_TYPES:
        assert model_refusal(CONFIG_MAPPING[model_type](), on) is None
    for model_type, words in (
        ("llama4_text", "does not know"),
        ("gpt_oss", "sliding windows"),
        ("deepseek_v3", "MLA"),
        ("llama", "not tested"),
        ("mistral", "does not know"),
    ):
        config = CONFIG_MAPPING[model_type]()
        reason = model_refusal(config, on)
        assert reason is not None and model_type in reason and words in reason, (model_type, reason)
        assert "+actor_rollout_ref.actor.torchtitan.prefix_reuse.enable=false" in reason
        assert model_refusal(config, off) is None
    llama4 = type("Config", (), {"model_type": "llama4"})()
    assert "chunked attention" in model_refusal(llama4, on)


def test_selected_through_verl_config():
    """``model_engine=torchtitan`` plus the engine config's target and strategy select prefix_torchtitan; verl's
    YAML defaults (spmd_types, selective checkpointing, compile) are refused with the knob to set."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    from verl_prefix.backend.titan.config import refusal
    from verl_prefix.backend.titan.registry import build_prefix_torchtitan
    from verl_prefix.harness.verl_engine import compose_ppo_config

    a = "actor_rollout_ref.actor"
    overrides = [
        "model_engine=torchtitan",
        f"{a}.strategy=prefix_torchtitan",
        f"{a}.torchtitan._target_=verl_prefix.config.PrefixTorchtitanEngineConfig",
        f"{a}.torchtitan.strategy=prefix_torchtitan",
        f"+{a}.torchtitan.prefix_reuse.min_prefix_len=8",
        f"{a}.ppo_micro_batch_size_per_gpu=2",
    ]
    engine = omega_conf_to_dataclass(compose_ppo_config(overrides).actor_rollout_ref.actor).engine
    assert EngineRegistry.get_engine_cls("language_model", engine.strategy) is build_prefix_torchtitan
    assert "spmd_backend" in refusal(engine)
    served = ["spmd_backend=default", "activation_checkpoint=none", "use_torch_compile=false"]
    fixed = compose_ppo_config(overrides + [f"{a}.torchtitan.{kv}" for kv in served]).actor_rollout_ref.actor
    assert refusal(omega_conf_to_dataclass(fixed).engine) is None


def test_flavor_mismatch_is_refused(tiny_model):
    """verl picks a flavor by (hidden, layers, vocab): the dense and MoE debug flavors share them."""
    from torchtitan.models import qwen3
    from transformers import AutoConfig

    from verl_prefix.backend.titan.flavor import check_flavor, flavor_mismatches
    from verl_prefix.harness.titan import register_tiny_flavor

    model_dir = tiny_model("qwen3")
    hf = AutoConfig.from_pretrained(model_dir)
    assert flavor_mismatches(qwen3.model_registry(register_tiny_flavor(model_dir)), hf) == []
    dense_debug = AutoConfig.for_model(
        "qwen3", hidden_size=256, num_hidden_layers=8, vocab_size=2048, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )  # fmt: skip
    assert flavor_mismatches(qwen3.model_registry("debugmodel"), dense_debug) == []
    with pytest.raises(ValueError, match="MoE flavor"):
        check_flavor(qwen3.model_registry("debugmodel_moe"), dense_debug)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        other_heads = AutoConfig.for_model(**{**dense_debug.to_dict(), "num_key_value_heads": 4})
        check_flavor(qwen3.model_registry("debugmodel"), other_heads)


pytestmark = pytest.mark.timeout(600)
