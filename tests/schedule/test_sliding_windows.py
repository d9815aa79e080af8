"""Sliding-window attention under reuse against plain HF dense (issue 21, item 1).

Tiny random models of three window styles, each with windows much shorter than its prompts (60-120 tokens):
``gemma3_text`` (sliding and full layers, the window on each sliding module), ``gpt_oss`` (alternating sliding
layers and attention sinks; MoE with eager experts) and Mistral (``config.sliding_window`` on every layer).
HF keeps key ``k`` for query ``q`` iff ``q - W < k <= q``; reuse must give the same gradients in fp64 (1e-10)
and fp32 (1e-5) in phase A, chunked phase A, concat and merged, forward-only too, with every group reused
and each layer counted under the phase-B path that served it (``prefix/phase_b_layers/<path>``). The
negative controls move the prefix part's window by one key either way, or drop it: they must fail.
"""

from __future__ import annotations

import pytest
import torch
from helpers.flash_standin import flash_standin, use_flash
from helpers.layouts import VOCAB, make_layout, token_weights
from helpers.offload import RecordingStore
from helpers.precision import promote_fp32_upcasts
from helpers.schedule_runs import infer_reuse, reused_grads
from test_merged_attention import attention_inputs, weighted_grads
from test_schedule_hf import dense_grads, dense_response_outputs, weighted_loss, worst_relative
from transformers import AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig, MistralConfig

from verl_prefix.schedule.attention import merged as MA
from verl_prefix.schedule.attention.windows import active_window, banded_prefix_keep, cut_prefix, window_keep_mask
from verl_prefix.schedule.dormant import Dormant
from verl_prefix.schedule.kv import contexts
from verl_prefix.schedule.telemetry import PhaseMeter

CPU = torch.device("cpu")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
FLASH = "flash_attention_2"
# prompts of 72 and 100 tokens; suffixes ragged, some past the window (their late queries see no prefix key)
GROUPS = [(72, [5, 30, 1, 12]), (100, [9, 3, 25])]
WINDOW = {"gemma3_text": 16, "gpt_oss": 24, "mistral": 20}
# the dense implementation each family runs under here (gpt_oss: flash applies its sinks; sdpa ignores them)
ATTN = {"gemma3_text": "sdpa", "gpt_oss": FLASH, "mistral": "sdpa"}
SLIDING_LAYERS = {"gemma3_text": 2, "gpt_oss": 1, "mistral": 2}  # of each model's layers


@pytest.fixture
def flash(monkeypatch):
    with flash_standin(monkeypatch):
        yield


def build(family: str, dtype: torch.dtype, attn: str, window: int | None = None) -> torch.nn.Module:
    """A tiny random model of ``family`` whose windowed layers use ``window`` (``WINDOW`` by default)."""
    torch.manual_seed(0)
    window = window or WINDOW[family]
    common = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        sliding_window=window,
        initializer_range=0.2,
        attn_implementation="eager" if attn == FLASH else attn,
    )
    if family == "gemma3_text":
        layers = ["sliding_attention", "full_attention", "sliding_attention"]
        config = Gemma3TextConfig(
            intermediate_size=80, num_hidden_layers=3, layer_types=layers, query_pre_attn_scalar=12, **common
        )
    elif family == "gpt_oss":
        config = GptOssConfig(
            intermediate_size=32,
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_implementation="eager",
            **common,
        )
    else:
        config = MistralConfig(intermediate_size=80, num_hidden_layers=2, **common)
    model = AutoModelForCausalLM.from_config(config).to(dtype).train()
    with torch.no_grad():  # gpt_oss's sinks start at zero; spread them so they matter
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    return use_flash(model) if attn == FLASH else model


def run(model, layout, weights, *, rows, attention="auto", meter=None, **options):
    """Reuse gradients; asserts every row reused (no dense rows, fewer physical than logical tokens)."""
    return reused_grads(
        model, layout, weighted_loss(weights), rows=rows, phase_b_attention=attention, meter=meter, **options
    )


def layer_paths(meter: PhaseMeter) -> dict[str, float]:
    return {k.split("/")[-1]: v for k, v in meter.counts.items() if k.startswith("prefix/phase_b_layers/")}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "mistral"])
def test_windowed_reuse_matches_dense(flash, family, dtype):
    """auto, merged and concat against one dense reference; each layer counted under the path that served it."""
    model = build(family, dtype, ATTN[family])
    layout = make_layout(GROUPS)
    weights = token_weights(layout, dtype)
    sliding, layers = SLIDING_LAYERS[family], len(model.model.layers)
    micro = 2 + 1  # 4 rows -> 3 + 1, 3 rows -> 3
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        for attention in ("auto", "merged", "concat"):
            meter = PhaseMeter(CPU)
            got = run(model, layout, weights, rows=3, attention=attention, meter=meter)
            assert worst_relative(got, want) < TOLERANCE[dtype], attention
            path = "concat" if attention == "concat" else "merged"
            want_paths = {f"{path}_window": sliding * micro, path: (layers - sliding) * micro}
            assert layer_paths(meter) == {k: v for k, v in want_paths.items() if v}, attention
            assert meter.counts[f"prefix/phase_b_attention/{path}"] == micro, attention


@pytest.mark.parametrize("attn, auto_path", [("sdpa", "merged"), ("eager", "concat"), (FLASH, "merged")])
def test_every_attention_implementation(flash, attn, auto_path):
    """The window is HF's under each implementation (an explicit mask for sdpa/eager, flash's window_size);
    ``auto`` serves eager models with concat (the family's own eager maths), the others merged."""
    model = build("gemma3_text", torch.float64, attn)
    layout = make_layout(GROUPS, seed=1)
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        for attention in ("auto", "merged", "concat"):
            meter = PhaseMeter(CPU)
            got = run(model, layout, weights, rows=4, attention=attention, meter=meter)
            assert worst_relative(got, want) < 1e-10, attention
            path = auto_path if attention == "auto" else attention
            assert layer_paths(meter) == {f"{path}_window": 4.0, path: 2.0}, attention


@pytest.fixture(scope="module")
def gemma_fp64():
    """One fp64 gemma3_text model, layout and dense reference shared by the tests below (they leave it as found)."""
    model = build("gemma3_text", torch.float64, "sdpa")
    layout = make_layout(GROUPS, seed=2)
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
    return model, layout, weights, want


@pytest.mark.parametrize(
    "variant",
    ["chunked", "chunked-recompute", "recompute", "offload", "checkpointed", "one-row-micro-batches"],
)
def test_windows_compose_with_chunks_dormant_policies_and_checkpointing(gemma_fp64, variant):
    """A later prefix chunk attends to the earlier chunks like a suffix row (its window banded over them);
    recompute replays phase A's windowed capture; offload and checkpointing change nothing the window sees."""
    model, layout, weights, want = gemma_fp64
    if variant == "checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    options: dict = {"rows": 1 if variant == "one-row-micro-batches" else 3}
    if variant.startswith("chunked"):
        options["prefix_chunk_tokens"] = 13  # chunks shorter than the window, and earlier chunks longer
    if variant.endswith("recompute"):
        options["dormant"] = lambda: Dormant("recompute")
    if variant == "offload":
        options["dormant"] = lambda: Dormant("offload", store_factory=RecordingStore)
    try:
        with promote_fp32_upcasts():
            for attention in ("merged", "concat"):
                meter = PhaseMeter(CPU)
                got = run(model, layout, weights, attention=attention, meter=meter, **options)
                assert worst_relative(got, want) < 1e-10, attention
                if variant.startswith("chunked"):
                    assert meter.counts["prefix/chunked_groups"] == 2
    finally:
        model.gradient_checkpointing_disable()


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "mistral"])
def test_forward_only_matches_dense(flash, family):
    model = build(family, torch.float64, ATTN[family]).eval()
    layout = make_layout(GROUPS, seed=3)
    with promote_fp32_upcasts(), torch.no_grad():
        want_lp, want_ent = dense_response_outputs(model, layout)
        for attention in ("auto", "concat"):
            got = infer_reuse(model, layout, rows=3, phase_b_attention=attention, prefix_chunk_tokens=40)
            for i in range(len(layout)):
                torch.testing.assert_close(got[i][0], want_lp[i], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(got[i][1], want_ent[i], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "family, config",
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1, "head_dim": 12}),
        ("starcoder2", {"sliding_window": 12}),
        ("phi3", {"sliding_window": 12, "pad_token_id": 0}),
    ],
)
def test_other_window_families_match_dense(family, config):
    """Families the issue does not name: Qwen2/Qwen3 (``use_sliding_window`` from ``max_window_layers`` on: layer 0
    full, layer 1 windowed), Starcoder2 and Phi-3 (``config.sliding_window`` on every layer), window 12."""
    from transformers import AutoConfig

    torch.manual_seed(0)
    base = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        attn_implementation="sdpa",
        bos_token_id=None,
        eos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**base, **config})).double().train()
    layout = make_layout(GROUPS)
    weights = token_weights(layout, torch.float64)
    windowed = 1 if family.startswith("qwen") else 2
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        for attention, path in (("auto", "merged"), ("concat", "concat")):
            meter = PhaseMeter(CPU)
            got = run(model, layout, weights, rows=3, attention=attention, meter=meter)
            assert worst_relative(got, want) < 1e-10, attention
            want_paths = {f"{path}_window": 3.0 * windowed, path: 3.0 * (2 - windowed)}
            assert layer_paths(meter) == {k: v for k, v in want_paths.items() if v}, attention


def test_window_covering_every_key_runs_the_plain_kernels():
    """A window longer than prefix + suffix changes nothing: the fused kernels serve, no layer is banded."""
    model = build("gemma3_text", torch.float64, "sdpa", window=200)
    layout = make_layout(GROUPS)
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        meter = PhaseMeter(CPU)
        got = run(model, layout, weights, rows=4, meter=meter)
    assert worst_relative(got, want) < 1e-10
    assert layer_paths(meter) == {"merged": 6.0}  # 2 micro-batches x 3 layers


def ulysses_errors(model, layout, attention: str, chunk: int | None, precision) -> dict:
    """On one gloo rank of an SP group over the whole world: reuse's gradients summed over the group and divided by
    its size (FSDP's average over the sequence-parallel ranks) against plain HF on the rank, and forward-only
    log-probs, each as a worst error, with the all-to-all bytes (under ``precision``)."""
    import torch.distributed as dist

    from verl_prefix.schedule.ulysses import Ulysses

    weights = token_weights(layout, torch.float64)
    sp = Ulysses(dist.group.WORLD)
    options = dict(device=CPU, ulysses=sp, prefix_chunk_tokens=chunk)
    with precision:
        want = dense_grads(model, layout, weights)
        want_lp, _ = dense_response_outputs(model, layout)
        grads = run(model, layout, weights, rows=2, attention=attention, **options)
        results = infer_reuse(model, layout, rows=2, phase_b_attention=attention, **options)
    worst = 0.0
    for name, grad in grads.items():
        dist.all_reduce(grad)
        worst = max(worst, ((grad / sp.size - want[name]).norm() / want[name].norm()).item())
    infer = max((results[i][0] - want_lp[i]).abs().max().item() for i in range(len(layout)))
    return {"worst": worst, "infer": infer, "all_to_all_bytes": sp.all_to_all_bytes}


def _ulysses_body(rank: int, attention: str, chunk: int | None) -> dict:
    """One gloo rank of SP=2: windowed gemma3_text reuse against plain HF (``ulysses_errors``)."""
    model = build("gemma3_text", torch.float64, "sdpa")
    layout = make_layout([(72, [5, 30, 1]), (61, [9, 24])])  # prefixes 71 and 60: odd and even over 2 ranks
    return ulysses_errors(model, layout, attention, chunk, promote_fp32_upcasts())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("attention, chunk", [("merged", None), ("concat", 25)], ids=["merged", "concat-chunked"])
def test_windows_under_ulysses_match_dense(attention, chunk):
    """Under Ulysses each rank attends with the whole (padded) sequence over its head shard: the windows index the
    real positions, so the banded paths compose; chunked too."""
    from helpers.ranks import run_ranks

    results = run_ranks(_ulysses_body, attention, chunk, world=2)
    for rank in range(2):
        assert results[rank]["worst"] < 1e-10, results[rank]
        assert results[rank]["infer"] < 1e-10, results[rank]
        assert results[rank]["all_to_all_bytes"] > 0


# -- negative controls: the prefix part's window off by one, or ignored; phase A without its window ----------


def _shifted(shift: int):
    def cut(prefix, window):
        return cut_prefix(prefix, window + shift)

    def band(query_len, cut_len, window, device):
        return banded_prefix_keep(query_len, cut_len, window + shift, device)

    return cut, band


def _ignored():
    def band(query_len, cut_len, window, device):
        return torch.ones(query_len, cut_len, dtype=torch.bool, device=device)

    return (lambda prefix, window: prefix), band


@pytest.mark.parametrize("control", ["window+1", "window-1", "prefix_window_ignored", "phase_a_window_ignored"])
def test_negative_controls_fail(gemma_fp64, monkeypatch, control):
    model, layout, weights, want = gemma_fp64
    with promote_fp32_upcasts():
        if control == "phase_a_window_ignored":  # phase A causal over the whole prefix, as before: the window
            monkeypatch.setattr(contexts.CaptureContext, "key_span", lambda self, query_len: 1)  # seems to cover
        else:
            cut, band = {"window+1": _shifted(1), "window-1": _shifted(-1)}.get(control) or _ignored()
            monkeypatch.setattr(MA, "cut_prefix", cut)
            monkeypatch.setattr(MA, "banded_prefix_keep", band)
        got = run(model, layout, weights, rows=3, attention="merged")
    assert worst_relative(got, want) > 1e-4, control


# -- the banded two-part attention against a by-the-book reference --------------------------------------------


def book(q, pk, pv, sk, sv, scale, window, softcap=None, sinks=None):
    """Every query over ``cat(prefix, suffix)`` at absolute positions, HF's rule ``q - W < k <= q`` spelled out."""
    rows, heads, length, _ = q.shape
    prefix = pk.shape[2]
    groups = heads // sk.shape[1]
    key = torch.cat([pk.expand(rows, -1, -1, -1), sk], 2).repeat_interleave(groups, 1)
    value = torch.cat([pv.expand(rows, -1, -1, -1), sv], 2).repeat_interleave(groups, 1)
    scores = q @ key.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    position = torch.arange(length)[:, None] + prefix
    k = torch.arange(prefix + length)[None, :]
    scores = scores.masked_fill(~((k <= position) & (k > position - window)), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(rows, -1, length, 1)], -1)
        return (scores.softmax(-1)[..., :-1] @ value).transpose(1, 2)
    return (scores.softmax(-1) @ value).transpose(1, 2)


@pytest.mark.parametrize("window", [1, 2, 5, 9, 13, 40])
@pytest.mark.parametrize("extras", ["plain", "softcap+sinks"])
def test_banded_merged_matches_the_book(window, extras):
    """Prefix 11, suffix 9: windows 1 (only itself), shorter than the suffix (late queries see no prefix key:
    that part is empty and must merge without NaN, forward and backward), between, and covering everything."""
    q, pk, pv, sk, sv, w = attention_inputs(3, 4, 2, prefix=11, suffix=9, dtype=torch.float64)
    sinks = None
    softcap = None
    tensors: tuple = (q, pk, pv, sk, sv)
    if extras != "plain":
        softcap = 1.5
        sinks = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
        tensors = (*tensors, sinks)
    active = active_window(window, 11 + 9)
    want = book(q, pk, pv, sk, sv, 0.3, window, softcap, sinks)
    got = MA.merged_attention(q, pk, pv, sk, sv, 0.3, softcap=softcap, sinks=sinks, window=active)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got_grads = torch.autograd.grad((got * w).sum(), tensors, allow_unused=True, materialize_grads=True)
    want_grads = weighted_grads(want, w, tensors)
    for g_got, g_want in zip(got_grads, want_grads):
        assert torch.isfinite(g_got).all()
        torch.testing.assert_close(g_got, g_want, rtol=1e-11, atol=1e-12)
    unseen = 11 - min(11, window - 1)  # only the last W - 1 prefix positions can get a gradient
    if active is not None and unseen:
        assert got_grads[1][:, :, :unseen].abs().max() == 0 and got_grads[2][:, :, :unseen].abs().max() == 0


def test_window_masks_follow_hf():
    """The keep masks against HF 5.10.4's own sliding-window overlay, bottom-right aligned."""
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    rule = and_masks(causal_mask_function, sliding_window_overlay(4))
    zero = torch.tensor(0)
    for query_len, key_len in ((5, 5), (3, 9), (6, 7)):
        offset = key_len - query_len
        hf = torch.tensor(
            [
                [bool(rule(zero, zero, torch.tensor(q + offset), torch.tensor(k))) for k in range(key_len)]
                for q in range(query_len)
            ]
        )
        assert torch.equal(window_keep_mask(query_len, key_len, 4, CPU)[0, 0], hf)
    band = banded_prefix_keep(5, 3, 4, CPU)  # cut of 3 = W - 1: query 0 sees all 3, query 3 none
    assert band.sum(1).tolist() == [3, 2, 1, 0, 0]
