"""prefix_megatron against verl's own Megatron engine (no reuse) on the same batch and weights, fp32, gloo:
TP=2 (two ranks holding the same rows) and DP=2 with the distributed optimizer (data-parallel rank 1 holds one
group and four singletons: lockstep fillers, dense chunks through verl's ``forward_step``). For one-level reuse,
the token trie (``prefix_reuse.tree``), a chunked prefix, merged phase-B attention and ``dormant_prefix=recompute``:
every parameter's gradient as megatron-core's DDP accumulates it (``main_grad``, after ``finalize_model_grads``),
loss, grad norm, forward-only log-probs and entropies; reuse asserted. Negative controls: phase C skipped, phase
B's RoPE one position late, both fail. And what the engine refuses before it builds anything, with the knob.

One prefix engine per layout, its knobs switched between steps (lr 0: every step sees the same weights).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers.engine_batches import (
    MEGATRON_CASES,
    compare_steps,
    inferred,
    megatron_cases,
    megatron_train_step,
    phase_c_skipped,
    shared_system_batch,
    suffix_rope_late,
)
from helpers.megatron_stack import require_megatron_stack
from helpers.ranks import run_ranks, run_two_ranks
from helpers.reuse import assert_infer_matches, assert_reuse_ran

require_megatron_stack()

TOL = 1e-5  # fp32
BUDGET = 40  # verl's max_token_len_per_gpu under dynamic batch size: two suffix rows of a 12-token prompt
CASES = MEGATRON_CASES
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "dp2": dict()}  # DP is what the world leaves over TP


def _layout_body(rank: int, model_dir: str, name: str) -> dict:
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.harness import verl_engine
    from verl_prefix.harness.megatron import build_megatron_engine, ppo_loss

    layout = LAYOUTS[name]
    data_parallel = "tensor_parallel_size" not in layout
    loss_fn, _ = ppo_loss(["use_kl_loss=true", "entropy_coeff=0.01", "ppo_micro_batch_size_per_gpu=4"])
    base = PrefixReuseConfig(min_prefix_len=4, suffix_micro_batch_size=2)
    stock = build_megatron_engine(model_dir, lr=0.0, **layout)
    prefix = build_megatron_engine(model_dir, backend="prefix_megatron", lr=0.0, prefix_reuse=base, **layout)
    assert prefix.causal_lm is not None
    batch = shared_system_batch(stock.get_data_parallel_rank(), data_parallel)
    want = megatron_train_step(stock, loss_fn, batch)
    want_infer = inferred(verl_engine.run_infer(stock, batch))
    controls = {"no_phase_c": phase_c_skipped, "rope_late": suffix_rope_late}
    out: dict = {"source": prefix.is_mp_src_rank_with_outputs(), "dp_rank": stock.get_data_parallel_rank()}
    out.update(megatron_cases(stock, prefix, loss_fn, batch, base, CASES, controls))
    # sequence parallelism's padding (verl's default at TP > 1 on GPU; the CPU platform turns SP off): every call of
    # the schedule padded to a multiple of 4 at the end, the CPU reference of what SP needs
    prefix.causal_lm.sequence_multiple = 4
    for knobs in (dict(), dict(tree=True, min_shared_tokens=4)):
        prefix.reuse_config, prefix.dormant_prefix = dataclasses.replace(base, **knobs), "keep"
        padded = compare_steps(want, megatron_train_step(prefix, loss_fn, batch))
        padded["infer"] = (want_infer, inferred(verl_engine.run_infer(prefix, batch)))
        out.setdefault("padded", []).append(padded)
    prefix.causal_lm.sequence_multiple = 1
    if name == "tp2":  # what the rollout receives, and verl's checkpoint round trip, through the prefix engine
        out["export"] = _export_and_checkpoint(stock, prefix, Path(model_dir).parent / "megatron_tp2_checkpoint")
    if name == "tp2":  # verl's dynamic batch size: suffix micro-batches by its token budget, against the same stock
        from verl.utils import tensordict_utils as tu

        dynamic = batch.copy()
        tu.assign_non_tensor(dynamic, use_dynamic_bsz=True, max_token_len_per_gpu=BUDGET)
        prefix.reuse_config, prefix.dormant_prefix = dataclasses.replace(base, suffix_micro_batch_size=None), "keep"
        want_dynamic = megatron_train_step(stock, loss_fn, dynamic)
        out["dynamic"] = compare_steps(want_dynamic, megatron_train_step(prefix, loss_fn, dynamic))
        out["dynamic"]["vs_fixed"] = compare_steps(want, megatron_train_step(prefix, loss_fn, dynamic))["worst"]
    return out


def _export_and_checkpoint(stock, prefix, root: Path) -> dict:
    """The weights verl syncs to the rollout from the prefix engine equal the stock engine's (the same steps at lr
    0); verl's ``save_checkpoint`` after them, the weights zeroed, ``load_checkpoint`` brings every one back."""
    import torch

    from verl_prefix.harness.megatron import exported_weights

    exported = exported_weights(prefix)
    same = sorted(n for n, w in exported_weights(stock).items() if torch.equal(w, exported[n]))
    path = str(root / "global_step_1" / "actor")
    prefix.save_checkpoint(path, global_step=1)
    with torch.no_grad():
        for param in prefix.module[0].parameters():
            param.zero_()
    prefix.load_checkpoint(path)
    restored = exported_weights(prefix)
    back = sorted(n for n, w in exported.items() if torch.equal(w, restored[n]))
    return {"names": sorted(exported), "same_as_stock": same, "restored": back}


def _body(rank: int, model_dir: str, name: str) -> dict:
    return {name: _layout_body(rank, model_dir, name)}


@pytest.fixture(scope="module")
def ranks(tiny_model) -> dict:
    """Each layout in its own two rank processes (megatron-core's parallel state is set once per process)."""
    runs = [run_two_ranks(_body, str(tiny_model("qwen3")), name, timeout=900) for name in LAYOUTS]
    return {rank: {k: v for run in runs for k, v in run[rank].items()} for rank in (0, 1)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_update_and_log_probs_match_verl_megatron_engine(ranks, layout, case):
    for rank, result in ranks.items():
        r = result[layout][case]
        groups = 2 if layout == "tp2" or rank == 0 else 1
        assert result[layout]["dp_rank"] == (rank if layout == "dp2" else 0)
        assert r["grads"] > 10 and r["worst"] < TOL, f"rank {rank}: {r['name']} off by {r['worst']:.2e}"
        if result[layout]["source"]:  # verl reports loss and grad norm on the model-parallel source rank
            assert r["loss"][1] == pytest.approx(r["loss"][0], rel=TOL, abs=1e-7)
            assert r["grad_norm"][1] == pytest.approx(r["grad_norm"][0], rel=TOL)
        assert_reuse_ran(r["metrics"], groups=groups)
        want_infer, got_infer = r["infer"]
        assert_infer_matches(want_infer, got_infer, TOL, groups=groups)
        m = r["metrics"]
        if case == "tree":
            assert m["prefix/tree_saved_tokens"] > 0 and m["prefix/tree_nodes"] >= groups
        if case == "chunked":
            assert m["prefix/chunked_groups"] > 0 and m["prefix/prefix_chunks"] > m["prefix/chunked_groups"]
        if case == "merged":
            assert m["prefix/phase_b_attention/merged"] > 0 and m["prefix/phase_b_attention/concat"] == 0
        if case == "recompute":
            assert m["prefix/policy/recompute"] > 0
        if layout == "dp2" and rank == 1:  # the singletons ran dense through verl's forward_step
            assert m["prefix/fallback_short_prefix"] == 4.0, {k: v for k, v in m.items() if "fallback" in k}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_calls_padded_for_sequence_parallelism_are_exact(ranks, layout):
    """Every schedule call padded at the end to a multiple of 4 (what sequence parallelism needs of a length): the
    attention sees the real positions, the logits are cut back; one-level and tree, exact as unpadded."""
    for rank, result in ranks.items():
        groups = 2 if layout == "tp2" or rank == 0 else 1
        for r in result[layout]["padded"]:
            assert r["worst"] < TOL, (rank, layout, r["name"], r["worst"])
            assert_infer_matches(*r["infer"], TOL, groups=groups)


def test_weight_export_and_checkpoint_round_trip(ranks):
    """TP=2: verl's weight sync from prefix_megatron sends the stock engine's weights (HF names, full tensors); a
    checkpoint verl saves after reuse steps restores every weight (the CPU platform's ``cuda_synchronize`` and
    ``optimizer_state_load`` entries make verl's distributed checkpointing run on CPU)."""
    for rank, result in ranks.items():
        r = result["tp2"]["export"]
        assert len(r["names"]) > 10 and r["same_as_stock"] == r["names"], rank
        assert r["restored"] == r["names"], (rank, sorted(set(r["names"]) - set(r["restored"])))


def test_dynamic_batch_size_matches_verl_megatron_engine(ranks):
    """Under ``use_dynamic_bsz`` the suffix micro-batches follow verl's ``max_token_len_per_gpu``; the update equals
    the stock engine's under the same setting (and without it: the split changes nothing)."""
    for rank, result in ranks.items():
        r = result["tp2"]["dynamic"]
        assert r["worst"] < TOL and r["vs_fixed"] < TOL, (rank, r["name"], r["worst"])
        assert_reuse_ran(r["metrics"], groups=2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_negative_controls_fail(ranks, layout):
    for rank, result in ranks.items():
        for case in ("one_level", "tree"):
            r = result[layout][case]
            assert r["no_phase_c"] > 1e-2, f"rank {rank} {layout}/{case}: skipping phase C changed nothing"
            assert r["rope_late"] > 1e-3, f"rank {rank} {layout}/{case}: phase B's RoPE a position late passed"


def test_refusals_name_the_knob():
    from transformers import CONFIG_MAPPING

    from verl_prefix import PrefixReuseConfig
    from verl_prefix.backend.megatron.config import SERVED_MODEL_TYPES, lora_refusal, model_refusal, refusal

    class Config:
        prefix_reuse = PrefixReuseConfig()

    assert refusal(Config()) is None
    virtual = Config()
    virtual.virtual_pipeline_model_parallel_size = 2
    assert refusal(virtual) is None  # served (test_megatron_pipeline.py)
    for knob, value in (
        ("context_parallel_size", 2),
        ("use_megatron_fsdp", True),
    ):
        config = Config()
        setattr(config, knob, value)
        reason = refusal(config)
        assert reason is not None and f"actor_rollout_ref.actor.megatron.{knob}=" in reason, (knob, reason)
        config.prefix_reuse = PrefixReuseConfig(enable=False)
        assert refusal(config) is None  # verl's own engine
    recompute = Config()
    recompute.override_transformer_config = {"recompute_granularity": "full"}
    assert refusal(recompute) is None  # served (test_megatron_recompute.py); what is not, at initialisation:
    from types import SimpleNamespace

    from verl_prefix.backend.megatron.recompute import recompute_refusal

    full = dict(recompute_granularity="full", fp8=None, fp4=None)
    assert recompute_refusal(SimpleNamespace(**full), aux_counted=False) is None
    assert recompute_refusal(SimpleNamespace(**{**full, "recompute_granularity": None}), aux_counted=True) is None
    for built, counted, named in ((dict(fp8="hybrid"), False, "te_checkpoint"), (dict(), True, "aux loss")):
        reason = recompute_refusal(SimpleNamespace(**{**full, **built}), aux_counted=counted)
        assert named in reason and "recompute_granularity=null" in reason, reason
    for model_type in SERVED_MODEL_TYPES:
        assert model_refusal(CONFIG_MAPPING[model_type](), Config()) is None
    for model_type in ("qwen2_moe", "deepseek_v2", "gpt_oss", "mistral"):
        reason = model_refusal(CONFIG_MAPPING[model_type](), Config())
        assert reason is not None and model_type in reason and "prefix_reuse.enable=false" in reason, reason
    windowed = CONFIG_MAPPING["qwen2"](use_sliding_window=True, sliding_window=16)
    assert "sliding-window" in model_refusal(windowed, Config())

    class Model:
        lora = {"rank": 8, "alpha": 16}

    assert "actor_rollout_ref.model.lora.rank=8" in lora_refusal(Model(), Config())
    Model.lora = {}
    assert lora_refusal(Model(), Config()) is None


def test_built_model_refusals():
    """What the built model holds that the schedule would leave out is refused at initialisation, with the knob:
    dropout, the per-token loss regime, sliding windows, attention sinks, DeepSeek's sparse attention variant, MLA's
    latent cache, multi-token prediction (MLA itself is served: ``test_megatron_mla.py``)."""
    from types import SimpleNamespace

    from verl_prefix.backend.megatron.config import built_model_refusal

    plain = dict(hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=False, window_size=None,
                 softmax_type="vanilla", experimental_attention_variant=None, cache_mla_latents=False)  # fmt: skip
    model = SimpleNamespace(mtp=SimpleNamespace(enable=False))
    assert built_model_refusal(SimpleNamespace(**plain), model) is None
    for change, words in (
        (dict(hidden_dropout=0.1), "dropout"),
        (dict(calculate_per_token_loss=True), "calculate_per_token_loss"),
        (dict(window_size=(128, 0)), "window_size"),
        (dict(softmax_type="learnable"), "attention sinks"),
        (dict(experimental_attention_variant="dsa"), "sparse attention"),
        (dict(cache_mla_latents=True), "latent cache"),
    ):
        reason = built_model_refusal(SimpleNamespace(**{**plain, **change}), model)
        assert reason is not None and words in reason and "prefix_reuse.enable=false" in reason, (change, reason)
    mtp = built_model_refusal(SimpleNamespace(**plain), SimpleNamespace(mtp=SimpleNamespace(enable=True)))
    assert "actor_rollout_ref.model.mtp.enable" in mtp


def test_engine_config_accepts_the_prefix_strategy():
    from verl_prefix.backend.megatron.config import PrefixMcoreEngineConfig

    config = PrefixMcoreEngineConfig(dormant_prefix="recompute")  # verl's validation ran (bf16, its default)
    assert config.strategy == "prefix_megatron" and config.prefix_reuse.enable
    with pytest.raises(ValueError):
        PrefixMcoreEngineConfig(dormant_prefix="sometimes")
    # the reuse knobs from YAML without a _target_ (a mapping) are checked when verl builds the config
    assert PrefixMcoreEngineConfig(prefix_reuse={"tree": True}).prefix_reuse.tree is True
    with pytest.raises(ValueError, match="min_prefix_len"):
        PrefixMcoreEngineConfig(prefix_reuse={"min_prefix_len": 0})


def test_selected_through_verl_config():
    """``configs/prefix_grpo_megatron.yaml`` (verl's ppo_trainer with ``model_engine=megatron``) selects
    prefix_megatron for the actor and the reference policy, with the reuse knobs on the engine config."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    from verl_prefix.backend.megatron.config import PrefixMcoreEngineConfig, reuse_of
    from verl_prefix.backend.megatron.registry import build_prefix_megatron

    configs = Path(__file__).resolve().parents[2] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base=None):
        config = compose(config_name="prefix_grpo_megatron")
    for role in ("actor", "ref"):
        section = config.actor_rollout_ref[role]
        assert section.strategy == "prefix_megatron", role
        engine = omega_conf_to_dataclass(section.megatron)
        assert isinstance(engine, PrefixMcoreEngineConfig) and engine.strategy == "prefix_megatron", role
        assert reuse_of(engine).min_prefix_len == 32, role
        assert EngineRegistry.get_engine_cls("language_model", engine.strategy) is build_prefix_megatron


def _bench_body(rank: int) -> dict:
    """The bench's megatron cells at a tiny size (``verl-prefix bench --preset megatron`` runs the real ones)."""
    import dataclasses

    from verl_prefix.tools.bench import presets as BP
    from verl_prefix.tools.bench import runner as BR

    spec = BP.ModelSpec(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=64)
    one = BP.Cell("tiny/megatron", spec, 1, 4, 40, (3, 8), micro_batch_size=2, min_prefix_len=8, engine="megatron")
    agentic = dataclasses.replace(
        one, name="tiny-agentic/megatron", num_groups=2, prompt_len=8, system_len=24, question_len_range=(4, 10)
    )
    result = BR.run_bench(BP.Preset(cells=(one, agentic), reps=1, threads=1), log=lambda line: None)
    return {c["cell"]: c for c in result["cells"]}


def test_bench_cells_measure_both_engines():
    """The megatron bench cells build verl's Megatron engine and prefix_megatron, time both (update and forward
    only), and judge the gradients against the stock engine's; the agentic cell runs the tree."""
    cells = run_ranks(_bench_body, world=1, timeout=600)[0]
    for name, cell in cells.items():
        assert cell["grad_check"] == "pass" and 0 < cell["max_rel_grad_diff"] < 1e-4, (name, cell["max_rel_grad_diff"])
        assert cell["prefix_metrics"]["prefix/groups"] > 0, name
        assert cell["ratio_median"] > 0 and cell["infer_ratio_median"] > 0, name
    assert cells["tiny-agentic/megatron"]["prefix_metrics"]["prefix/tree_nodes"] > 0
