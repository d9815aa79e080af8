"""Property test of the engine on random verl mini-batches: random group structures and order, both of
verl's layouts, and bad input. A valid batch trains (and scores) exactly like verl's stock ``fsdp2`` engine,
in fp64 to 1e-10, with reuse where a group can reuse; a bad one raises one ``BatchRejected`` naming the
offending samples. One engine pair serves every example (its optimizer step is a no-op, so every example
starts from the same weights)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from helpers.batches import random_tokens, rows_batch
from helpers.precision import promote_fp32_upcasts
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from verl_prefix import PrefixReuseConfig
from verl_prefix.backend.validation import BatchRejected
from verl_prefix.harness import verl_engine

VOCAB = 128
MIN_PREFIX = 2
# uid_conflict: a row takes the uid of a row with another prompt (no error: sub-groups of identical prompts reuse,
# the victim alone in its sub-group runs dense as prompt_mismatch)
DAMAGE = ["none", "none", "none", "same_prompt_two_groups", "nan", "inf", "empty_response", "uid_conflict", "no_uid"]


@dataclass
class Spec:
    groups: list[tuple[int, list[int]]]
    order: list[int]
    layout: str
    damage: str
    victim: int  # the row (batch position) the damage hits
    forward_only: bool
    seed: int


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    groups = draw(
        st.lists(
            st.tuples(st.integers(1, 7), st.lists(st.integers(1, 4), min_size=1, max_size=3)), min_size=1, max_size=3
        )
    )
    n = sum(len(lens) for _, lens in groups)
    return Spec(
        groups=groups,
        order=draw(st.permutations(range(n))),
        layout=draw(st.sampled_from(["v1", "legacy"])),
        damage=draw(st.sampled_from(DAMAGE)),
        victim=draw(st.integers(0, n - 1)),
        forward_only=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def build(spec: Spec) -> tuple[object, str | None, list[list[int]]]:
    """The batch, the error it must raise (a regex) or None, and the rows (batch positions) of each group
    that can reuse: at least two rows sharing a uid, with a prefix of at least ``MIN_PREFIX`` tokens."""
    gen = torch.Generator().manual_seed(spec.seed)
    prompts = [random_tokens(p, gen, VOCAB) for p, _ in spec.groups]
    if spec.damage == "same_prompt_two_groups" and len(prompts) > 1:  # one prompt under two uids: two groups
        prompts[1] = prompts[0].clone()
    rows = [(g, prompts[g]) for g, (_, lens) in enumerate(spec.groups) for _ in lens]
    rows = [rows[i] for i in spec.order]
    lens = [n for _, ls in spec.groups for n in ls]
    responses = [random_tokens(lens[i], gen, VOCAB) for i in spec.order]
    uids = [f"g{g}" for g, _ in rows]
    expected = None
    v = spec.victim
    advantages = [torch.randn(len(r), generator=gen) for r in responses]
    if spec.damage in ("nan", "inf"):
        advantages[v][-1] = float("nan") if spec.damage == "nan" else float("inf")
        expected = None if spec.forward_only else rf"samples \[{v}\] have non-finite advantages"
    elif spec.damage == "empty_response":
        responses[v] = responses[v][:0]
        advantages[v] = advantages[v][:0]
        expected = rf"samples \[{v}\] have empty responses"
    elif spec.damage == "uid_conflict":
        other = next((i for i, (g, p) in enumerate(rows) if not torch.equal(p, rows[v][1])), None)
        if other is not None:  # the victim takes the uid of a row with another prompt: a sub-group of its own
            uids[v] = uids[other]
    elif spec.damage == "no_uid":
        uids = None
        expected = r"`uid`"
    batch = rows_batch(
        [p for _, p in rows], responses, uids, advantages=advantages, layout=spec.layout, seed=spec.seed, vocab=VOCAB
    )
    groups: dict[tuple, list[int]] = {}  # the groups reuse runs: a uid's rows with one prompt
    for i, uid in enumerate(uids or []):
        groups.setdefault((uid, tuple(rows[i][1].tolist())), []).append(i)
    reusable = [g for g in groups.values() if len(g) >= 2 and len(rows[g[0]][1]) - 1 >= MIN_PREFIX]
    return batch, expected, reusable


@pytest.fixture(scope="module")
def engines(tiny_model):
    """(stock, stock loss, reuse engine, reuse loss) in fp64, built once; optimizer steps do nothing."""
    model_dir = tiny_model("qwen3")
    kwargs = dict(dtype="float64", micro_batch_size_per_gpu=1)
    dense, d_loss, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", **kwargs)
    prefix, p_loss, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", **kwargs)
    prefix.reuse_config = PrefixReuseConfig(min_prefix_len=MIN_PREFIX, suffix_micro_batch_size=2)
    for engine in (dense, prefix):
        engine.optimizer.step = lambda *args, **kwargs: None
    return dense, d_loss, prefix, p_loss


def _worst_relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(((got[n] - w).norm() / w.norm().clamp_min(1e-30)).item() for n, w in want.items())


# no shrinking: each example trains two engines, and a failure already prints its Spec
SETTINGS = settings(
    phases=[Phase.explicit, Phase.generate],
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


@SETTINGS
@given(specs())
def test_random_batches_train_like_stock_or_raise_one_clear_error(engines, spec: Spec) -> None:
    dense, d_loss, prefix, p_loss = engines
    batch, expected, reusable = build(spec)
    event("rejected" if expected else f"valid, {'forward-only' if spec.forward_only else 'update'}")
    if expected is not None:
        with pytest.raises(BatchRejected) as raised:
            if spec.forward_only:
                verl_engine.run_infer(prefix, batch)
            else:
                verl_engine.run_train_step(prefix, p_loss, batch)
        assert re.search(expected, str(raised.value)), str(raised.value)
        assert str(raised.value).startswith("rank 0 rejected the mini-batch")
        return

    with promote_fp32_upcasts():
        if spec.forward_only:
            got = verl_engine.run_infer(prefix, batch, calculate_entropy=False)
            want = verl_engine.run_infer(dense, batch, calculate_entropy=False)
        else:
            got = verl_engine.run_train_step(prefix, p_loss, batch, capture_grads=True)
            want = verl_engine.run_train_step(dense, d_loss, batch, capture_grads=True)
    if spec.forward_only:  # every row has its response log-probs, each as the stock engine computes it
        assert torch.equal(got["log_probs"].offsets().diff(), batch["input_ids"].offsets().diff())
        got_lp, want_lp = got["response_log_probs"], want["response_log_probs"]
        if got_lp.is_nested:
            got_lp, want_lp = got_lp.to_padded_tensor(0.0), want_lp.to_padded_tensor(0.0)
        assert got_lp.shape == want_lp.shape
        assert (got_lp - want_lp).abs().max().item() < 1e-10
        metrics = verl_engine.reduce_step_metrics(got["metrics"])
    else:  # every row contributes to the loss exactly as it does in the stock engine
        assert _worst_relative(got["grads"], want["grads"]) < 1e-10
        metrics = got["reduced_metrics"]
    assert metrics["prefix/groups"] == len(reusable)
    dense_rows = sum(v for k, v in metrics.items() if k.startswith("prefix/fallback_"))
    assert dense_rows + sum(len(rows) for rows in reusable) == len(batch)
    if reusable:
        assert metrics["prefix/physical_tokens"] < metrics["prefix/logical_tokens"]
