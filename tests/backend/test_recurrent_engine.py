"""Hybrid linear-attention models (gated delta-net + full attention: ``qwen3_5_text``, ``qwen3_5_moe_text``,
``qwen3_next``) through ``prefix_fsdp2`` against verl's stock ``fsdp2`` engine on the same TensorDict (issue 22):
gradients, the update and forward-only log-probs/entropy in fp64 (``helpers.delta_rule.fp64_delta_net`` on both
engines' models); ragged suffixes in micro-batches of 1, 2 and G rows; prefix chunks of 2 tokens (every chunk
boundary inside the 3-token convolution window); the MoE router aux loss on (against the engine's own dense path)
and off (against stock); two data-parallel ranks; an fp32 and a bf16 run judged against the stock engine's own
rounding; verl's patched delta-net/decoder-layer forwards in the stock engine against HF's, remembered, in the
schedule. Each asserts reuse ran; settings the schedule does not serve for recurrent layers are refused at
initialisation."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import pytest
import torch
from helpers.delta_rule import fp64_delta_net
from helpers.precision import promote_fp32_upcasts
from helpers.ranks import run_two_ranks
from helpers.reuse import assert_infer_matches, assert_reuse_ran
from test_cuda import assert_bf16_within_stocks_own, bf16_outputs
from test_engine_exactness import engines, grpo_batch, worst_relative
from transformers import AutoModelForCausalLM

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend import fallbacks
from verl_prefix.backend.fsdp import engine as engine_module
from verl_prefix.backend.fsdp import refusals
from verl_prefix.harness import grpo_batches, model_zoo, tiny_models, verl_engine
from verl_prefix.schedule import executor
from verl_prefix.schedule.models import hf_forwards, structure

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
MOE_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return tiny_models.write_tiny_model(
        tmp_path_factory.mktemp("tiny_qwen3_5_text"),
        "qwen3_5_text",
        num_layers=4,
        hidden_size=32,
        extra_config={"layer_types": LAYER_TYPES},
    )


def fp64_engines(*engines_):
    """True fp64 on these engines' models: the delta rule and its norms (``fp64_delta_net``), routers' softmax."""
    stack = contextlib.ExitStack()
    for engine in engines_:
        stack.enter_context(fp64_delta_net(engine.module))
    stack.enter_context(promote_fp32_upcasts())
    return stack


def test_update_and_infer_match_stock_engine_fp64(hybrid_dir, monkeypatch):
    """One pair of engines (building them is most of the cost): forward-only log-probs/entropy, then an update.
    The model's layer roles (KV-shared and recurrent layers) are found once per engine, not once per group."""
    (d_engine, d_loss, _), (p_engine, p_loss, _) = engines(
        hybrid_dir, dtype="float64", micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01
    )
    walks = []
    counted = lambda model: walks.append(model) or structure.layer_roles(model)  # noqa: E731
    monkeypatch.setattr(engine_module, "layer_roles", counted)
    monkeypatch.setattr(executor, "layer_roles", counted)
    batch = grpo_batch()
    with fp64_engines(d_engine, p_engine):
        dense = verl_engine.run_infer(d_engine, batch, calculate_entropy=True)
        prefix = verl_engine.run_infer(p_engine, batch, calculate_entropy=True)
    assert_infer_matches(dense, prefix, 1e-10, groups=3)

    before = verl_engine.params_of(d_engine)
    with fp64_engines(d_engine, p_engine):
        dense = verl_engine.run_train_step(d_engine, d_loss, batch, capture_grads=True)
        prefix = verl_engine.run_train_step(p_engine, p_loss, batch, capture_grads=True)
    assert_reuse_ran(prefix["metrics"], groups=3)
    assert worst_relative(prefix["grads"], dense["grads"]) < 1e-10
    d_after, p_after = verl_engine.params_of(d_engine), verl_engine.params_of(p_engine)
    update = worst_relative({n: p_after[n] - before[n] for n in before}, {n: d_after[n] - before[n] for n in before})
    assert update < 1e-9
    assert prefix["loss"] == pytest.approx(dense["loss"], rel=1e-10)
    assert walks == [p_engine.module], "layer roles found more than once (or not by the engine)"


def test_unserved_settings_are_refused_at_initialisation(hybrid_dir, tmp_path):
    """Ulysses and ``merged_varlen`` do not serve recurrent layers: the engine refuses them at initialisation
    with the reason (``refusals.recurrent_settings_error``), not a dense run each step. The served settings
    (every dormant policy, chunked prefixes) pass; models without recurrent layers are never refused."""
    model = AutoModelForCausalLM.from_pretrained(hybrid_dir)
    served = PrefixReuseConfig()
    for reuse in (served, PrefixReuseConfig(prefix_chunk_tokens=64), PrefixReuseConfig(phase_b_attention="concat")):
        assert refusals.recurrent_settings_error(model, reuse, ulysses=False) is None
    assert fallbacks.recurrent_fallback_reason(model) is None
    assert "Ulysses sequence parallelism" in refusals.recurrent_settings_error(model, served, ulysses=True)
    varlen = PrefixReuseConfig(phase_b_attention="merged_varlen")
    assert "merged_varlen" in refusals.recurrent_settings_error(model, varlen, ulysses=False)
    assert refusals.recurrent_settings_error(model, PrefixReuseConfig(enable=False), ulysses=True) is None
    plain = AutoModelForCausalLM.from_pretrained(tiny_models.write_tiny_model(tmp_path / "qwen3", "qwen3"))
    assert refusals.recurrent_settings_error(plain, varlen, ulysses=True) is None
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    with pytest.raises(ValueError, match=r"merged_varlen \(its packed suffix row.*not served"):
        verl_engine.build_verl_engine(
            hybrid_dir,
            backend="prefix_fsdp2",
            overrides=[
                f"{fsdp}._target_=verl_prefix.config.PrefixFSDPEngineConfig",
                f"+{fsdp}.prefix_reuse.phase_b_attention=merged_varlen",
            ],
        )


def assert_partitions_match(dense: tuple, prefix: tuple, cases: tuple) -> None:
    """``grpo_batch()`` (3 groups of G = 4, prefixes of 8, 4 and 11 tokens) in micro-batches of ``rows`` rows and
    prefix chunks of ``chunk`` tokens, one ``(rows, chunk)`` case after another: the prefix engine's gradients
    match the stock engine's at 1e-10, reusing all three groups; the last case chunks by 2 tokens (a boundary
    inside a 3-token convolution window)."""
    (d_engine, d_loss), (p_engine, p_loss) = dense, prefix
    for rows, chunk in cases:
        p_engine.reuse_config = PrefixReuseConfig(min_prefix_len=2, prefix_chunk_tokens=chunk)
        batch = grpo_batch(worker_settings={"micro_batch_size_per_gpu": rows})
        want = verl_engine.run_train_step(d_engine, d_loss, batch, capture_grads=True)
        got = verl_engine.run_train_step(p_engine, p_loss, batch, capture_grads=True)
        assert_reuse_ran(got["metrics"], groups=3)
        assert worst_relative(got["grads"], want["grads"]) < 1e-10, (rows, chunk)
    assert cases[-1][1] == 2
    assert got["reduced_metrics"]["prefix/prefix_chunks"] == 4.0 + 2.0 + 6.0  # prefixes of 8, 4 and 11 tokens


def batch_of(rows: int):
    """``grpo_batch()`` (3 groups of G = 4, ragged responses) in micro-batches of ``rows`` rows."""
    return grpo_batch(worker_settings={"micro_batch_size_per_gpu": rows})


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next"])
def test_moe_hybrids_match_stock_engine_fp64(tmp_path, family):
    """One pair of engines per family (``lr=0``: the weights stay put, so every case compares on the same
    model; the update itself is compared above): forward-only, training in micro-batches of 2, 1 and G = 4 rows,
    prefix chunks of 2 tokens; then the router aux loss on, against the engine's own dense path with the aux."""
    model_dir = tiny_models.write_tiny_model(
        tmp_path,
        family,
        num_layers=3,
        hidden_size=32,
        experts_implementation="eager",
        extra_config={"layer_types": MOE_LAYER_TYPES},
    )
    (d_engine, d_loss, _), (p_engine, p_loss, _) = engines(
        model_dir, dtype="float64", micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01, lr=0.0
    )
    with fp64_engines(d_engine, p_engine):
        dense = verl_engine.run_infer(d_engine, grpo_batch(), calculate_entropy=True)
        prefix = verl_engine.run_infer(p_engine, grpo_batch(), calculate_entropy=True)
        assert_infer_matches(dense, prefix, 1e-10, groups=3)
        assert_partitions_match((d_engine, d_loss), (p_engine, p_loss), ((2, None), (1, None), (4, None), (2, 2)))
        # the aux is a mean per micro-batch: both paths must cut the mini-batch alike, here one group per micro-batch
        p_engine.moe_aux_loss_coef = 0.5
        aux = {}
        for name, reuse in (("dense", PrefixReuseConfig(enable=False)), ("reuse", PrefixReuseConfig(min_prefix_len=2))):
            p_engine.reuse_config = reuse
            aux[name] = verl_engine.run_train_step(p_engine, p_loss, batch_of(4), capture_grads=True)
    assert_reuse_ran(aux["reuse"]["metrics"], groups=3)
    assert worst_relative(aux["reuse"]["grads"], aux["dense"]["grads"]) < 1e-10
    got_aux, want_aux = (aux[k]["reduced_metrics"]["moe_aux_loss"] for k in ("reuse", "dense"))
    assert got_aux == pytest.approx(want_aux, rel=1e-10) and want_aux > 1.0
    gates = [n for n in aux["reuse"]["grads"] if n.endswith("mlp.gate.weight")]
    assert gates and all(aux["reuse"]["grads"][n].norm() > 0 for n in gates)


def rank_batch(rank: int):
    """Rank 0: two groups of four. Rank 1: one group of four and four singletons with a 3-token prompt (dense)."""
    from verl.utils import tensordict_utils as tu

    shape = dict(response_len_range=(1, 6), vocab_size=128, global_batch_size=16)
    if rank == 0:
        return grpo_batches.make_grpo_batch(num_groups=2, group_size=4, prompt_lens=[9, 5], seed=11, **shape)
    group = grpo_batches.make_grpo_batch(num_groups=1, group_size=4, prompt_lens=12, seed=12, **shape)
    return tu.concat_tensordict(
        [group, grpo_batches.make_grpo_batch(num_groups=4, group_size=1, prompt_lens=3, seed=13, **shape)]
    )


def two_rank_step(rank: int, model_dir: str, fp64: Callable) -> dict:
    """One fp64 update of ``rank_batch(rank)`` through both engines on this rank, under ``fp64(dense, prefix)``
    (the family's true-fp64 context): the worst relative gradient difference and the prefix engine's metrics."""
    batch = rank_batch(rank)
    kwargs = dict(dtype="float64", micro_batch_size_per_gpu=2, use_kl_loss=False, entropy_coeff=0.01)
    dense, d_loss, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs)
    prefix, p_loss, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **kwargs)
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=4)
    with fp64(dense, prefix):
        want = verl_engine.run_train_step(dense, d_loss, batch, capture_grads=True)
        got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
    worst = max(((got["grads"][n] - g).norm() / g.norm()).item() for n, g in want["grads"].items())
    return {"worst": worst, "metrics": got["reduced_metrics"]}


def _two_rank_body(rank: int, model_dir: str) -> dict:
    return two_rank_step(rank, model_dir, fp64_engines)


def test_two_ranks_match_stock_engine_fp64(hybrid_dir):
    """Two data-parallel ranks (gloo, FSDP2 over both) with different group structure: rank 1 runs one group
    under reuse and four short-prompt singletons dense, so the ranks' recurrent-state phases run in lockstep."""
    assert_ranks_matched(run_two_ranks(_two_rank_body, str(hybrid_dir)))


def assert_ranks_matched(results: list[dict]) -> None:
    """``rank_batch``'s two ranks each matched the stock engine (1e-10), reusing their groups, rank 1's four
    singletons dense."""
    for rank, groups in ((0, 2), (1, 1)):
        assert results[rank]["worst"] < 1e-10, rank
        assert_reuse_ran(results[rank]["metrics"], groups=groups)
    assert results[1]["metrics"]["prefix/fallback_short_prefix"] == 4.0


def test_fp32_and_bf16_within_the_stock_engines_own_rounding(hybrid_dir):
    """G = 16 single-row micro-batches through transformers' own fp32 kernels (the chunked delta rule rounds
    differently when a sequence is split at the prefix): fp32 reuse's gradients against an fp64 stock run are
    within 1.5x the fp32 stock engine's own error; bf16 (verl's mixed precision) against the fp32 stock run
    likewise (mean |log-prob| error and the gradients' relative error), as ``test_cuda`` judges bf16 on a GPU."""
    batch = grpo_batch(num_groups=1, group_size=16, prompt_lens=[40], response_len_range=(4, 12), use_kl=False)
    truth, t_loss, _ = verl_engine.build_verl_engine(hybrid_dir, dtype="float64", micro_batch_size_per_gpu=1)
    with fp64_engines(truth):
        truth_grads = verl_engine.run_train_step(truth, t_loss, batch, capture_grads=True)["grads"]
    reference = bf16_outputs(hybrid_dir, "fsdp2", batch, bf16=False)
    fp32 = bf16_outputs(hybrid_dir, "prefix_fsdp2", batch, bf16=False)
    as64 = lambda grads: {n: g.double() for n, g in grads.items()}  # noqa: E731
    own, ours = worst_relative(as64(reference[1]), truth_grads), worst_relative(as64(fp32[1]), truth_grads)
    assert own < 1e-3 and ours <= max(1.5 * own, 1e-5), (ours, own)
    assert_reuse_ran(fp32[2], groups=1)
    assert_bf16_within_stocks_own(hybrid_dir, batch, reference, groups=1)


def _counted(calls: list, forward):
    """``forward`` (verl's, by its name and module), recording each call."""

    @functools.wraps(forward)
    def counted(*args, **kwargs):
        calls.append(forward.__name__)
        return forward(*args, **kwargs)

    return counted


def test_verl_patched_forward_serves_with_hf_forwards(hybrid_dir, monkeypatch):
    """verl's patch for ``qwen3_5``/``qwen3_5_moe`` checkpoints replaces the delta-net's and the decoder layer's
    forward class-wide (so a ``qwen3_5_text`` model in the process runs it too). The stock engine runs verl's
    forwards; the schedule runs HF's own, remembered before the patch (``schedule.models.hf_forwards``): same log-probs
    and gradients in fp64. Without the remembered forwards the model runs dense with the reason."""
    from verl.models.transformers import qwen3_5 as verl_qwen3_5

    from verl_prefix.schedule.models import hf_forwards, recurrent

    for cls in hf_forwards.PATCHED_CLASSES:
        monkeypatch.setattr(cls, "forward", cls.forward)  # verl's patch is undone after the test
    hf_forwards.remember_hf_forwards()
    calls = []
    for cls in hf_forwards.PATCHED_CLASSES:
        patch = "qwen3_5_decoder_layer_forward" if "DecoderLayer" in cls.__name__ else "qwen3_5_gated_delta_net_forward"
        verl_forward = getattr(verl_qwen3_5, patch)
        cls.forward = _counted(calls, verl_forward)
    args = dict(dtype="float64", micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01)
    (d_engine, d_loss, _), (p_engine, p_loss, _) = engines(hybrid_dir, **args)
    assert all(hf_forwards.patched_by_verl(cls) for cls in hf_forwards.PATCHED_CLASSES), "verl's patch is in"
    batch = grpo_batch(num_groups=2, prompt_lens=[9, 12])
    with fp64_engines(d_engine, p_engine):
        dense = verl_engine.run_infer(d_engine, batch, calculate_entropy=True)
        assert calls, "the stock engine did not run verl's forwards"
        calls.clear()
        prefix = verl_engine.run_infer(p_engine, batch, calculate_entropy=True)
        assert not calls, "the schedule ran verl's forwards"
        assert_infer_matches(dense, prefix, 1e-10, groups=2)
        dense = verl_engine.run_train_step(d_engine, d_loss, batch, capture_grads=True)
        prefix = verl_engine.run_train_step(p_engine, p_loss, batch, capture_grads=True)
    assert_reuse_ran(prefix["metrics"], groups=2)
    assert worst_relative(prefix["grads"], dense["grads"]) < 1e-10
    assert all(hf_forwards.patched_by_verl(cls) for cls in hf_forwards.PATCHED_CLASSES), "verl's patch is back"

    # negative control: verl's forward with nothing remembered is not served (dense, with the reason)
    assert fallbacks.recurrent_fallback_reason(p_engine.module) is None
    monkeypatch.setattr(recurrent, "hf_forward", lambda cls: None if hf_forwards.patched_by_verl(cls) else cls.forward)
    fallbacks.LOGGED_REASONS.clear()
    reason = fallbacks.recurrent_fallback_reason(p_engine.module)
    assert reason == "recurrent_layers"


def _packed_vs_alone(model, lengths: list[int]) -> float:
    """Largest |log-prob| gap between sequences run one a row and the same sequences packed into one row with
    their position ids restarting (verl's remove-padding layout)."""
    torch.manual_seed(5)
    seqs = [torch.randint(3, 100, (n,)) for n in lengths]
    with torch.no_grad():
        alone = torch.cat([model(s[None]).logits[0].log_softmax(-1) for s in seqs])
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        packed = model(torch.cat(seqs)[None], position_ids=positions).logits[0].log_softmax(-1)
    return (packed - alone).abs().max().item()


def test_remove_padding_is_refused_at_initialisation(hybrid_dir):
    """verl's packed layout runs a micro-batch's sequences as one row; transformers' delta-net and Mamba-2
    forwards take no sequence boundaries, so the stock engine starts each sequence from the previous one's
    state (shown on the HF models: packed differs from one sequence a row). Reuse runs a sequence a row, so the
    engine refuses remove-padding with these layers at initialisation; padded (what both engines compute alike,
    the tests above), or verl's own Qwen3.5 patch (which splits the packed row per sequence), passes.

    verl patches the delta-net class-wide when a ``qwen3_5`` checkpoint loads (another test in this process may
    have built one): HF's own forwards are put back for this test, as for a process that loaded only this
    ``qwen3_5_text`` checkpoint."""
    qwen = AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float64)
    nemotron = model_zoo.build("nemotron_h", torch.float64)
    served = PrefixReuseConfig()
    with hf_forwards.hf_recurrent(qwen):
        for model in (qwen, nemotron):
            assert _packed_vs_alone(model, [7, 9]) > 1e-3, type(model).__name__
            assert refusals.recurrent_packed_error(model, served, use_remove_padding=False) is None
            error = refusals.recurrent_packed_error(model, served, use_remove_padding=True)
            assert "use_remove_padding=true" in error and "+actor_rollout_ref.actor.prefix_reuse.enable=false" in error
            off = PrefixReuseConfig(enable=False)
            assert refusals.recurrent_packed_error(model, off, use_remove_padding=True) is None
        match = r"use_remove_padding=true with recurrent layers \['Qwen3_5GatedDeltaNet'\]"
        with pytest.raises(ValueError, match=match):
            verl_engine.build_verl_engine(hybrid_dir, backend="prefix_fsdp2", use_remove_padding=True)
