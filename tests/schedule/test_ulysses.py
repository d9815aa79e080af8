"""The A/B/C schedule under Ulysses sequence parallelism (gloo ranks, plain HF model, no FSDP).

Each rank runs its slice of every sequence; summed over the group and divided by its size (what FSDP's
average over the sequence-parallel ranks does), the parameter gradients must be plain HF's dense ones,
and the gathered log-probs dense's log-probs. Prompts of 9 and 6 tokens give prefixes of 8 and 5:
one divides the group size, one does not."""

from __future__ import annotations

import pytest
import torch
from helpers.layouts import make_layout, token_weights
from helpers.ranks import run_ranks
from helpers.schedule_runs import infer_reuse, train_reuse

GROUPS = [(9, [4, 7, 1, 6]), (6, [3, 5, 2])]


def _body(rank: int, kv_heads: int, attn: str, attention: str, control: str | None, variant: str = "") -> dict:
    from helpers.precision import promote_fp32_upcasts

    with promote_fp32_upcasts():
        return _compare(kv_heads, attn, attention, control, variant)


def _compare(kv_heads: int, attn: str, attention: str, control: str | None, variant: str) -> dict:
    import torch.distributed as dist
    from test_merged_attention import gqa_model
    from test_schedule_hf import dense_grads, dense_response_outputs, weighted_loss

    from verl_prefix.schedule import ulysses as ulysses_mod
    from verl_prefix.schedule.dormant import Dormant
    from verl_prefix.schedule.ulysses import Ulysses

    model = gqa_model(kv_heads, torch.float64, attn, heads=max(4, dist.get_world_size()))  # heads divide over ranks
    if variant == "checkpointed-recompute":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layout = make_layout(GROUPS, seed=3)
    weights = token_weights(layout, torch.float64)
    want = dense_grads(model, layout, weights, with_entropy=True)
    want_lp, want_ent = dense_response_outputs(model, layout)

    if control == "padded_prefix_kv":  # phase A keeps the prefix's alignment padding as K/V
        from verl_prefix.schedule.kv import contexts

        init = contexts.CaptureContext.__init__
        contexts.CaptureContext.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "length": None})
    if control == "unscaled_gather":  # log-prob gradients not scaled back by the group size
        ulysses_mod.Ulysses.gather = lambda self, x, length: ulysses_mod.gather_outputs_and_unpad(
            x, 1, 1, self.padded(length) - length, grad_scaler=False, group=self.group
        )
    sp = Ulysses(dist.group.WORLD)
    options = dict(calculate_entropy=True, device=torch.device("cpu"), phase_b_attention=attention, ulysses=sp)
    if variant.startswith("chunked"):  # chunks of 3: prefixes 8 = 3+3+2 and 5 = 3+2, odd slices padded
        options["prefix_chunk_tokens"] = 3
    recompute = (lambda: Dormant("recompute")) if variant.endswith("recompute") else None
    grads, plan = train_reuse(model, layout, weighted_loss(weights), rows=2, dormant=recompute, **options)
    assert not plan.dense_rows and len(plan.groups) == 2
    got = {}
    for name, grad in grads.items():
        dist.all_reduce(grad)
        got[name] = grad / sp.size
    worst = max(((got[n] - want[n]).norm() / want[n].norm()).item() for n in want)
    results = infer_reuse(model, layout, rows=2, **options)
    infer = max(
        max((results[i][0] - want_lp[i]).abs().max().item(), (results[i][1] - want_ent[i]).abs().max().item())
        for i in range(len(layout))
    )
    return {"worst": worst, "infer": infer, "all_to_all_bytes": sp.all_to_all_bytes}


@pytest.mark.parametrize(
    "kv_heads, attn, attention",
    [
        (2, "sdpa", "merged"),
        (2, "sdpa", "concat"),
        (2, "sdpa", "merged_varlen"),
        (1, "sdpa", "merged"),
        (1, "eager", "auto"),
    ],
    ids=["gqa2-merged", "gqa2-concat", "gqa2-merged-varlen", "kv1-repeated-merged", "kv1-eager"],
)
def test_sequence_parallel_schedule_matches_dense_hf(kv_heads, attn, attention):
    """fp64 1e-10 against plain HF on one rank; ``kv_heads=1`` < sp=2 repeats the K/V heads as verl does."""
    results = run_ranks(_body, kv_heads, attn, attention, None, world=2)
    for rank in range(2):
        assert results[rank]["worst"] < 1e-10, results[rank]
        assert results[rank]["infer"] < 1e-10, results[rank]
        assert results[rank]["all_to_all_bytes"] > 0  # the attention really ran sequence-parallel


@pytest.mark.parametrize(
    "world, kv_heads, variant",
    [(4, 2, ""), (8, 2, ""), (2, 2, "checkpointed-recompute"), (2, 1, "chunked-recompute"), (2, 2, "chunked-keep")],
    ids=["sp4-kv2-repeated", "sp8-kv2-repeated", "sp2-checkpointed-recompute", "sp2-chunked-recompute", "sp2-chunked"],
)
def test_more_ranks_and_the_memory_policies(world, kv_heads, variant):
    """SP=4 and 8 over as many query heads and 2 K/V heads (repeated to one per rank); non-reentrant checkpointing with
    the ``recompute`` policy, whose phase C re-runs the prefix (all-to-alls included) before its backward;
    a chunked prefix (each chunk sliced over the ranks, attending to the earlier chunks' head shards)."""
    results = run_ranks(_body, kv_heads, "sdpa", "merged", None, variant, world=world)
    for rank in range(world):
        assert results[rank]["worst"] < 1e-10, results[rank]
        assert results[rank]["infer"] < 1e-10, results[rank]


def test_chunked_prefix_through_merged_varlen_under_sp():
    """Chunks of 3 with ``merged_varlen`` on 2 ranks: each later chunk is padded to the SP size and packed as one
    row of its real tokens against the earlier chunks' head shards (issue 20 item 3)."""
    results = run_ranks(_body, 2, "sdpa", "merged_varlen", None, "chunked-keep", world=2)
    for rank in range(2):
        assert results[rank]["worst"] < 1e-10, results[rank]
        assert results[rank]["infer"] < 1e-10, results[rank]


@pytest.mark.parametrize("control", ["padded_prefix_kv", "unscaled_gather"])
def test_negative_controls_fail(control):
    """Serving the prefix's alignment padding as keys, or dropping the gather's gradient scale, must show."""
    results = run_ranks(_body, 2, "sdpa", "merged", control, world=2)
    assert max(results[r]["worst"] for r in range(2)) > 1e-3


pytestmark = pytest.mark.timeout(600)
