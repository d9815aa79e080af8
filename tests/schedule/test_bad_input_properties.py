"""Property tests of the batch checks and the plan on random group structures and bad input.

Each random mini-batch either passes ``validate_batch`` and is planned with every row run exactly once (in a
reuse group that shares one prompt, or dense under a named reason), or fails with one ``ValueError`` whose
message names offending samples that really are bad. Rows that share a uid but not their prompt are no error:
they reuse in sub-groups of identical prompts, and a sub-group too small to reuse runs dense as
``prompt_mismatch``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from verl_prefix.schedule.grouping import RowLayout, group_rows_by_uid, is_prompt_split, plan_batch, validate_batch

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
VOCAB = 50


@dataclass
class Case:
    layout: RowLayout
    advantages: torch.Tensor  # [rows, longest response], zero-padded
    prompt_key: list[tuple]  # what a row's prompt really is: (tokens, positions)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Random groups in random order, then any mix of: uids reused across groups, a prompt token or position
    changed inside a group, a token moved across the prompt/response boundary, empty responses or prompts,
    non-finite advantages."""
    groups = draw(
        st.lists(
            st.tuples(st.integers(1, 6), st.lists(st.integers(1, 5), min_size=1, max_size=4)), min_size=1, max_size=5
        )
    )
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    rows = []  # (prompt, response, positions, uid)
    for g, (p, lens) in enumerate(groups):
        prompt = torch.randint(0, VOCAB, (p,), generator=gen)
        for n in lens:
            rows.append([prompt.clone(), torch.randint(0, VOCAB, (n,), generator=gen), None, f"g{g}"])
    order = draw(st.permutations(range(len(rows))))
    rows = [rows[i] for i in order]
    n = len(rows)
    index = st.integers(0, n - 1)

    def sometimes() -> bool:  # each kind of damage in about one example of five
        return draw(st.integers(0, 4)) == 0

    if sometimes():  # an empty response
        rows[draw(index)][1] = torch.zeros(0, dtype=torch.long)
    if sometimes():  # reuse another group's uid (same prompt only by chance)
        i, j = draw(index), draw(index)
        rows[i][3] = rows[j][3]
    if sometimes():  # a prompt token changed
        i = draw(index)
        k = draw(st.integers(0, len(rows[i][0]) - 1))
        rows[i][0] = rows[i][0].clone()
        rows[i][0][k] = (rows[i][0][k] + draw(st.integers(1, VOCAB - 1))) % VOCAB
    if sometimes():  # the prompt/response boundary moved: same tokens, different split
        i = draw(index)
        prompt, response = rows[i][0], rows[i][1]
        if len(response) and draw(st.booleans()):
            rows[i][0], rows[i][1] = torch.cat([prompt, response[:1]]), response[1:]
        elif len(prompt) > 0:
            rows[i][0], rows[i][1] = prompt[:-1], torch.cat([prompt[-1:], response])
    for row in rows:
        row[2] = torch.arange(len(row[0]) + len(row[1]))
    if sometimes():  # a prompt position shifted
        i = draw(index)
        rows[i][2] = rows[i][2] + 1
    longest = max(1, max(len(r[1]) for r in rows))
    advantages = torch.zeros(n, longest)
    for i, row in enumerate(rows):
        advantages[i, : len(row[1])] = torch.randn(len(row[1]), generator=gen)
    for i in draw(st.lists(index, max_size=3)) if sometimes() else []:
        if len(rows[i][1]):
            k = draw(st.integers(0, len(rows[i][1]) - 1))
            advantages[i, k] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    layout = RowLayout(
        input_ids=[torch.cat([r[0], r[1]]) for r in rows],
        position_ids=[r[2] for r in rows],
        prompt_lens=[len(r[0]) for r in rows],
        response_lens=[len(r[1]) for r in rows],
        uids=[r[3] for r in rows],
    )
    keys = [(tuple(r[0].tolist()), tuple(r[2][: len(r[0])].tolist())) for r in rows]
    return Case(layout, advantages, keys)


def _named(message: str) -> list[int]:
    found = re.search(r"samples \[([\d, ]+)(, \.\.\.)?\]", message)
    assert found, message
    return [int(x) for x in found.group(1).split(", ")]


@SETTINGS
@given(cases(), st.integers(1, 3), st.sampled_from([None, 4, 9]), st.integers(1, 4), st.integers(1, 3))
def test_a_batch_is_planned_whole_or_rejected_naming_bad_samples(
    case: Case, max_rows: int, max_tokens: int | None, min_prefix_len: int, min_group_size: int
) -> None:
    layout = case.layout
    empty = [i for i, s in enumerate(layout.response_lens) if s == 0]
    empty_prompt = [i for i, p in enumerate(layout.prompt_lens) if p == 0]
    non_finite = (~torch.isfinite(case.advantages)).any(dim=1).nonzero().flatten().tolist()
    groups = group_rows_by_uid(layout.uids)
    conflicts = [uid for uid, rows in groups.items() if len({case.prompt_key[i] for i in rows}) > 1]
    try:
        layout = validate_batch(layout, case.advantages)
    except ValueError as exc:
        message = str(exc)
        event(f"rejected: {message.split(' have ')[-1][:20]}")
        if empty:  # checked first: each rejection names exactly the samples of its kind
            assert "empty responses" in message and _named(message) == empty[:16]
        elif empty_prompt:
            assert "empty prompts" in message and _named(message) == empty_prompt[:16]
        else:
            assert non_finite, message
            assert "non-finite advantages" in message and _named(message) == non_finite[:16]
        return
    assert not (empty or empty_prompt or non_finite), "bad input passed validation"
    # each sub-group is one prompt of one original uid, all of that uid's rows with that prompt, in batch order
    sub_groups = group_rows_by_uid(layout.uids)
    for uid, rows in sub_groups.items():
        original = case.layout.uids[rows[0]]
        assert {case.layout.uids[i] for i in rows} == {original}
        assert len({case.prompt_key[i] for i in rows}) == 1, "a group shares one prompt"
        assert rows == [i for i in groups[original] if case.prompt_key[i] == case.prompt_key[rows[0]]]
        assert is_prompt_split(uid) == (original in conflicts)
    event(f"valid: {'with uid conflicts' if conflicts else 'one prompt per uid'}")

    plan = plan_batch(
        layout, max_rows=max_rows, max_tokens=max_tokens, min_prefix_len=min_prefix_len, min_group_size=min_group_size
    )
    ran = [i for g in plan.groups for i in g.rows] + plan.all_dense_rows
    assert sorted(ran) == list(range(len(layout))), "every row runs exactly once"
    for group in plan.groups:
        assert group.rows == sub_groups[group.uid], "a reuse group is its whole sub-group, in batch order"
        assert group.prefix_len >= min_prefix_len and len(group.rows) >= min_group_size
        assert sorted(i for mb in group.micro_batches for i in mb) == sorted(group.rows)
        for mb in group.micro_batches:
            assert len(mb) <= max_rows
            if max_tokens is not None and len(mb) > 1:
                assert len(mb) * max(layout.response_lens[i] for i in mb) <= max_tokens
    for reason, rows in plan.dense_rows.items():
        for uid in {layout.uids[i] for i in rows}:
            size, prefix = len(sub_groups[uid]), layout.prompt_lens[sub_groups[uid][0]] - 1
            small = "prompt_mismatch" if is_prompt_split(uid) else "small_group"
            why = "short_prefix" if prefix < min_prefix_len else small
            assert reason == why and size == len([i for i in rows if layout.uids[i] == uid])
            assert why == "short_prefix" or size < min_group_size


def test_the_property_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a regrouping that lets samples of one uid keep different prompts fails the property."""
    from verl_prefix.schedule import grouping

    monkeypatch.setattr(grouping, "split_uid_groups", lambda layout: layout)
    with pytest.raises(AssertionError, match="a group shares one prompt"):
        test_a_batch_is_planned_whole_or_rejected_naming_bad_samples()
