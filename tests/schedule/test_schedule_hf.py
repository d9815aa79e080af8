"""The A/B/C schedule against a plain-HF dense reference: every supported family, attention kernel,
precision and micro-batch partition; and negative controls that a wrong schedule must fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.layouts import VOCAB, make_layout, token_weights, use_suffix_only_mask
from helpers.precision import promote_fp32_upcasts
from helpers.schedule_runs import infer_reuse, train_reuse
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from verl_prefix.schedule import executor as schedule
from verl_prefix.schedule.executor import infer_group, train_group
from verl_prefix.schedule.grouping import RowLayout, plan_batch
from verl_prefix.schedule.kv import contexts, seam
from verl_prefix.schedule.options import ScheduleOptions

CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def tiny_model(family: str, attn: str, dtype: torch.dtype, *, tied: bool = False, checkpointing: bool = False):
    torch.manual_seed(0)
    config = CONFIGS[family](
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        tie_word_embeddings=tied,
        attn_implementation=attn,
        initializer_range=0.2,
    )
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def weighted_loss(weights: list[torch.Tensor]):
    def loss_fn(rows, log_probs, entropy):
        total = sum((lp * weights[i]).sum() for i, lp in zip(rows, log_probs))
        if entropy is not None:
            total = total + 0.1 * sum(e.sum() for e in entropy)
        return total

    return loss_fn


def dense_response_outputs(model, layout: RowLayout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Plain HF: each full sequence on its own, log-probs and entropy of its response tokens (the logits
    divided by the row's temperature where the layout has them, the fp32 value in the logits' dtype, as verl)."""
    log_probs, entropy = [], []
    for i, (ids, p, s) in enumerate(zip(layout.input_ids, layout.prompt_lens, layout.response_lens)):
        logits = model(input_ids=ids[None], use_cache=False).logits[0, p - 1 : p - 1 + s]
        if layout.temperature is not None:
            logits = logits / layout.temperature[i].to(torch.float32).to(logits.dtype)
        lsm = torch.log_softmax(logits, dim=-1)
        log_probs.append(lsm.gather(-1, ids[p:, None]).squeeze(-1))
        entropy.append(-(lsm.exp() * lsm).sum(-1))
    return log_probs, entropy


def dense_grads(model, layout, weights, with_entropy=False) -> dict[str, torch.Tensor]:
    model.zero_grad()
    log_probs, entropy = dense_response_outputs(model, layout)
    weighted_loss(weights)(list(range(len(layout))), log_probs, entropy if with_entropy else None).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def reuse_grads(model, layout, weights, *, max_rows=None, with_entropy=False, min_group_size=1):
    grads, plan = train_reuse(
        model,
        layout,
        weighted_loss(weights),
        rows=max_rows,
        min_group_size=min_group_size,
        calculate_entropy=with_entropy,
    )
    assert not plan.dense_rows
    return grads


def worst_relative(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).norm() / want[n].norm()).item() for n in want)


RAGGED = [(9, [4, 7, 1, 6, 3, 5, 2, 8])]  # G = 8


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_gradients_match_dense_for_every_partition(family, attn, dtype):
    model = tiny_model(family, attn, dtype, tied=family == "qwen2")
    layout = make_layout(RAGGED)
    weights = token_weights(layout, dtype)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        for rows in (8, 4, 2, 1):  # micro-batch counts 1, 2, 4 and G
            got = reuse_grads(model, layout, weights, max_rows=rows)
            assert worst_relative(got, want) < TOLERANCE[dtype], f"{rows} rows per micro-batch"


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-ckpt"])
def test_several_groups_singletons_entropy_and_checkpointing(checkpointing):
    model = tiny_model("qwen3", "sdpa", torch.float64, tied=True, checkpointing=checkpointing)
    layout = make_layout([(6, [3, 5, 2]), (13, [4]), (2, [6, 1, 2, 7])])  # one group of size 1, one P=2
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        got = reuse_grads(model, layout, weights, max_rows=2, with_entropy=True)
    assert worst_relative(got, want) < 1e-10


def test_shuffled_groups_are_regrouped():
    model = tiny_model("llama", "sdpa", torch.float64)
    layout = make_layout([(7, [3, 5, 2]), (5, [4, 6])])
    perm = [3, 0, 4, 2, 1]
    shuffled = RowLayout(
        *[
            [field[i] for i in perm]
            for field in (layout.input_ids, layout.position_ids, layout.prompt_lens, layout.response_lens, layout.uids)
        ]
    )
    weights = token_weights(shuffled, torch.float64)
    with promote_fp32_upcasts():
        assert (
            worst_relative(reuse_grads(model, shuffled, weights, max_rows=2), dense_grads(model, shuffled, weights))
            < 1e-10
        )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_forward_only_matches_dense_log_probs_and_entropy(attn):
    model = tiny_model("qwen3", attn, torch.float64).eval()
    layout = make_layout([(9, [4, 7, 1, 6]), (4, [2, 3])])
    with promote_fp32_upcasts(), torch.no_grad():
        want_lp, want_ent = dense_response_outputs(model, layout)
        got = infer_reuse(model, layout, rows=3)
    for i in range(len(layout)):
        torch.testing.assert_close(got[i][0], want_lp[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[i][1], want_ent[i], rtol=1e-12, atol=1e-12)


def test_temperature_scales_logits_per_row():
    model = tiny_model("qwen3", "sdpa", torch.float64).eval()
    layout = make_layout([(6, [3, 4])])
    plan = plan_batch(layout, max_rows=None, max_tokens=None, min_prefix_len=1, min_group_size=1)
    temperature = torch.tensor([0.7, 1.3])
    with promote_fp32_upcasts(), torch.no_grad():
        tempered = dataclasses.replace(layout, temperature=temperature)
        got = infer_group(model, tempered, plan.groups[0], ScheduleOptions(device=torch.device("cpu")))
        for i, (ids, p, s) in enumerate(zip(layout.input_ids, layout.prompt_lens, layout.response_lens)):
            logits = model(input_ids=ids[None]).logits[0, p - 1 : p - 1 + s] / temperature[i].double()
            want = torch.log_softmax(logits, -1).gather(-1, ids[p:, None]).squeeze(-1)
            torch.testing.assert_close(got[i][0], want, rtol=1e-12, atol=1e-12)


def test_early_exit_off_gives_the_same_gradients():
    model = tiny_model("qwen3", "eager", torch.float64)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    plan = plan_batch(layout, max_rows=3, max_tokens=None, min_prefix_len=1, min_group_size=1)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        model.zero_grad()
        options = ScheduleOptions(device=torch.device("cpu"), early_exit=False)
        train_group(model, layout, plan.groups[0], weighted_loss(weights), options)
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert worst_relative(got, want) < 1e-10


def test_attention_mode_is_restored_and_loud_outside_the_schedule():
    model = tiny_model("qwen3", "sdpa", torch.float32)
    with seam.prefix_attention_mode(model):
        assert model.config._attn_implementation == "verl_prefix_sdpa"
        with pytest.raises(RuntimeError, match="without a prefix context"):
            model(input_ids=torch.zeros(1, 3, dtype=torch.long))
    assert model.config._attn_implementation == "sdpa"


# -- negative controls: each wrong schedule must be caught by the same comparison ------------------


def _error_with(monkeypatch, patch) -> float:
    model = tiny_model("qwen3", "sdpa", torch.float64)
    layout = make_layout(RAGGED)
    weights = token_weights(layout, torch.float64)
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights)
        patch(monkeypatch)
        return worst_relative(reuse_grads(model, layout, weights, max_rows=4), want)


def test_negative_control_suffix_only_mask(monkeypatch):
    assert _error_with(monkeypatch, use_suffix_only_mask) > 1e-2


def test_sdpa_bias_and_eager_mask_are_the_same_mask():
    """sdpa gets phase B's mask as a bottom-right causal bias, eager as an explicit mask: one mask."""
    for query_len, prefix_len in ((1, 5), (4, 7), (6, 1)):
        bias = contexts.prefix_causal_bias(query_len, prefix_len + query_len)
        explicit = contexts.causal_keep_mask(query_len, prefix_len, torch.device("cpu"))[0, 0]
        assert torch.equal(bias._materialize(torch.device("cpu")), explicit)


def test_sdpa_prefix_attention_matches_hf_sdpa_with_the_explicit_mask():
    """Including GQA (HF repeats K/V heads whenever a mask is given; so do we)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 5, 8, generator=gen, dtype=torch.float64)
    key, value = (torch.randn(3, 2, 12, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = contexts.causal_keep_mask(5, 7, torch.device("cpu"))
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got, _ = contexts.sdpa_lower_right(module, query, key, value, scaling=0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_negative_control_suffix_positions_off_by_one(monkeypatch):
    right = schedule.suffix_positions

    def shifted(positions, prompt_len, response_len):
        return right(positions, prompt_len, response_len) + 1

    assert _error_with(monkeypatch, lambda mp: mp.setattr(schedule, "suffix_positions", shifted)) > 1e-3


def test_negative_control_skipped_phase_c(monkeypatch):
    assert _error_with(monkeypatch, lambda mp: mp.setattr(schedule, "prefix_backward", lambda *a, **k: None)) > 1e-2
