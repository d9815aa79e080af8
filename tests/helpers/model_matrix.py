"""The coverage matrix's per-family checks (``tests/tools/test_model_matrix_*.py``): each family of the installed
transformers lands in one column (``verl_prefix.harness.model_zoo``). Served families train under reuse against plain
HF dense gradients, under one-level reuse and under the tree schedule (``prefix_reuse.tree``: two groups behind one
system block); the others are refused by the capability check with a reason naming a module.

Families are split between test files by a stable hash, so xdist (``--dist loadfile``) spreads them; models are
built once per family and dtype and cached for the module."""

from __future__ import annotations

import copy
import functools
import zlib

import torch

from helpers.layouts import make_layout, token_weights
from helpers.precision import fp64_throughout
from helpers.schedule_runs import reused_grads
from verl_prefix.harness import model_zoo as Z
from verl_prefix.schedule.grouping import RowLayout, plan_batch
from verl_prefix.schedule.models.capability import structure_refusal
from verl_prefix.schedule.options import ScheduleOptions
from verl_prefix.schedule.tree.schedule import train_tree
from verl_prefix.schedule.tree.trie import build_trie, trie_stats

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
GROUPS = [(Z.PROMPT_LEN, list(Z.RESPONSE_LENS))]  # G = 3, two suffix micro-batches of <= 2 rows
ROWS = 2


def shard_families(index: int, shards: int) -> list:
    """This file's families."""
    return [family for family in Z.decoder_families() if shard(family, shards) == index]


def check_family(family: str) -> None:
    """The family's column: skipped with the reason, or each build (the default lengths, and the short ones where
    the family has lengths besides the window) held to its own outcome: dense with a reason decided at
    initialisation (checked), dense per batch with the engine's reason (checked on the matrix's own batches), or
    exact under reuse."""
    import pytest

    if Z.skip_reason(family) is not None:
        row = Z.classify(family)
    else:
        try:
            default = model(family, torch.float32, Z.DEFAULT_LENGTHS)  # built once, reused below
            short = model(family, torch.float32, Z.SHORT_LENGTHS) if Z.length_changes(family) else None
            row = Z.classify(family, default, short)
        except Exception:  # noqa: BLE001 - the builder's own error, reported by classify
            row = Z.classify(family)
    assert page_rows().get(family) == row, "docs/models.md is stale: run verl-prefix models --write docs/models.md"
    if row.status == Z.SKIP:
        pytest.skip(row.reason)
    assert "do not build" not in row.lengths, row.lengths
    cases = Z.LENGTH_CASES if Z.length_changes(family) else (Z.DEFAULT_LENGTHS,)
    for lengths in cases:
        check_case(family, lengths)


def check_case(family: str, lengths: str) -> None:
    """One build of the family: refused at initialisation (``check_dense_with_reason``), dense per batch (the
    engine's own per-batch function names a reason on the matrix's batches: asserted, not assumed), or exact."""
    net = model(family, torch.float32, lengths)
    if structure_refusal(net) is not None:
        check_dense_with_reason(family, lengths)
        return
    status, reason = Z.case_outcome(net)
    batch_reasons = {Z.batch_fallback_reason(net, layout.input_ids) for layout in matrix_layouts()}
    assert len(batch_reasons) == 1, f"{family} ({lengths} lengths): the matrix's batches disagree: {batch_reasons}"
    (batch_reason,) = batch_reasons
    if batch_reason is not None:
        assert (status, reason) == (Z.DENSE, f"`{batch_reason}` per batch"), (status, reason, batch_reason)
        return
    assert status == Z.EXACT, (family, lengths, status, reason)
    check_exact(family, lengths)


def matrix_layouts() -> list[RowLayout]:
    """The batches the matrix trains (one-level reuse, the tree's system block), none longer than ``Z.LONGEST``
    (what ``classify`` asks the per-batch reasons about)."""
    layouts = [make_layout(GROUPS, vocab=100), system_block_layout()]
    assert max(len(ids) for layout in layouts for ids in layout.input_ids) == Z.LONGEST
    return layouts


def shard(name: str, shards: int) -> int:
    return zlib.crc32(name.encode()) % shards


@functools.cache
def model(family: str, dtype: torch.dtype, lengths: str) -> torch.nn.Module:
    return Z.build(family, dtype, lengths=lengths)


def relative_errors(got: dict, want: dict) -> float:
    """The worst parameter's ``|got - want| / |want|``, the denominator floored at 1e-3 of the largest parameter
    gradient: a gradient that is zero in exact arithmetic (a key bias under softmax with absolute positions)
    holds only rounding noise, which no relative measure can compare."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    floor = 1e-3 * max(w.norm().item() for w in want.values())
    return max(((got[n] - w).norm() / max(w.norm().item(), floor)).item() for n, w in want.items())


def dense_grads(net: torch.nn.Module, layout, weights) -> dict[str, torch.Tensor]:
    """Plain HF: each full sequence on its own (positions 0..L-1), the weighted response log-probs' gradient."""
    net.zero_grad()
    total = 0.0
    for ids, p, s, w in zip(layout.input_ids, layout.prompt_lens, layout.response_lens, weights):
        positions = torch.arange(len(ids))[None]
        logits = net(input_ids=ids[None], position_ids=positions, use_cache=False).logits[0, p - 1 : p - 1 + s]
        total = total + (torch.log_softmax(logits.to(w.dtype), -1).gather(-1, ids[p:, None])[:, 0] * w).sum()
    total.backward()
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def reuse_grads(net: torch.nn.Module, layout, weights) -> dict[str, torch.Tensor]:
    def loss_fn(rows, log_probs, entropy):
        return sum((lp * weights[i]).sum() for i, lp in zip(rows, log_probs))

    return reused_grads(net, layout, loss_fn, rows=ROWS)


def system_block_layout(vocab: int = 100) -> RowLayout:
    """Two groups (G = 2) whose prompts are one system block of ``Z.PROMPT_LEN`` tokens (longer than the
    window) and 4 tokens of their own: a trie of depth 2, the block computed once."""
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(0, vocab, (Z.PROMPT_LEN,), generator=gen)
    ids, p_lens, r_lens, uids = [], [], [], []
    for g, responses in enumerate(([5, 3], [2, 4])):
        prompt = torch.cat([system, torch.randint(0, vocab, (4,), generator=gen)])
        for s in responses:
            ids.append(torch.cat([prompt, torch.randint(0, vocab, (s,), generator=gen)]))
            p_lens.append(len(prompt))
            r_lens.append(s)
            uids.append(f"g{g}")
    return RowLayout(ids, [torch.arange(len(row)) for row in ids], p_lens, r_lens, uids)


def tree_grads(net: torch.nn.Module, layout: RowLayout, weights) -> dict[str, torch.Tensor]:
    """The tree schedule's gradients over ``layout``, after asserting the trie shares the system block."""

    def loss_fn(rows, log_probs, entropy):
        return sum((lp * weights[i]).sum() for i, lp in zip(rows, log_probs))

    net.zero_grad()
    plan = plan_batch(layout, max_rows=ROWS, max_tokens=None, min_prefix_len=1, min_group_size=1)
    roots = build_trie(layout, plan.groups, min_shared_tokens=2)
    stats = trie_stats(roots)
    assert not plan.dense_rows and stats.depth == 2 and stats.node_tokens < stats.prefix_tokens, stats
    train_tree(net, layout, roots, loss_fn, ScheduleOptions(device=torch.device("cpu")))
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def tree_exactness(family: str, lengths: str) -> float:
    """The tree schedule against dense on ``system_block_layout``, fp64."""
    net = model(family, torch.float64, lengths)
    layout = system_block_layout()
    weights = token_weights(layout, torch.float64)
    with fp64_throughout():
        return relative_errors(tree_grads(net, layout, weights), dense_grads(net, layout, weights))


def exactness(family: str, dtype: torch.dtype, lengths: str) -> float:
    """Reuse against dense on the matrix's group, in ``dtype`` (fp64 under ``fp64_throughout``)."""
    net = model(family, dtype, lengths)
    layout = make_layout(GROUPS, vocab=100)
    weights = token_weights(layout, dtype)
    if dtype == torch.float64:
        with fp64_throughout():
            return relative_errors(reuse_grads(net, layout, weights), dense_grads(net, layout, weights))
    return relative_errors(reuse_grads(net, layout, weights), dense_grads(net, layout, weights))


def check_exact(family: str, lengths: str) -> None:
    """fp64 within 1e-10 (one-level reuse and the tree), fp32 within 1e-5 (or, where dense fp32 rounds past that
    on its own, within 1.5x of dense fp32's own error against fp64)."""
    error = exactness(family, torch.float64, lengths)
    assert error < TOLERANCE[torch.float64], (
        f"{family} ({lengths} lengths) fp64: worst relative gradient error {error:.3g}"
    )
    error = tree_exactness(family, lengths)
    assert error < TOLERANCE[torch.float64], f"{family} ({lengths} lengths) tree fp64: worst relative error {error:.3g}"
    error = exactness(family, torch.float32, lengths)
    if error >= TOLERANCE[torch.float32]:
        check_fp32_against_own_rounding(family, lengths, error)


def check_fp32_against_own_rounding(family: str, lengths: str, error: float) -> None:
    """Families whose fp32 forward rounds more than 1e-5 on its own (Qwen3.5's gated delta rule runs its
    chunked recurrence in fp32 with exponentials of cumulative decays) are judged as the stock engine is: reuse's
    fp32 gradients against an fp64 run of the same weights must stay within 1.5x of dense fp32's own error."""
    net = model(family, torch.float32, lengths)
    layout = make_layout(GROUPS, vocab=100)
    weights = token_weights(layout, torch.float32)
    reuse = {n: g.double() for n, g in reuse_grads(net, layout, weights).items()}
    dense = {n: g.double() for n, g in dense_grads(net, layout, weights).items()}
    with fp64_throughout():
        reference = dense_grads(copy.deepcopy(net).double(), layout, token_weights(layout, torch.float64))
    own, ours = relative_errors(dense, reference), relative_errors(reuse, reference)
    assert ours <= 1.5 * own, (
        f"{family} fp32: reuse differs from dense by {error:.3g}; against fp64 reuse's error {ours:.3g} exceeds "
        f"1.5x dense fp32's own {own:.3g}"
    )


@functools.cache
def page_rows() -> dict[str, Z.MatrixRow]:
    """The committed ``docs/models.md``, parsed back into rows."""
    import pathlib

    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"
    return {row.family: row for row in Z.parse(page.read_text())}


def check_dense_with_reason(family: str, lengths: str = Z.DEFAULT_LENGTHS) -> None:
    """The capability check refuses the family naming a module; the engine's decision (agreed by every rank)
    is dense with that reason under ``unsupported_model=dense`` and ``UnsupportedModel`` under ``raise``."""
    import pytest

    from verl_prefix.backend.distributed.once import UnsupportedModel, agree_on_structure

    net = model(family, torch.float32, lengths)
    refusal = structure_refusal(net)
    assert refusal is not None and refusal.reason and refusal.module and refusal.detail, refusal
    assert agree_on_structure(net, "dense") == refusal.reason
    with pytest.raises(UnsupportedModel, match=refusal.module.split(" ")[0].replace(".", r"\.")):
        agree_on_structure(net, "raise")
