"""The trie's keys for visual tokens (``schedule.tree.visuals``): an image is identified by its content, a
node's visual tokens are recorded as per-item token ranges, and a row whose placeholder tokens do not match its
pixel inputs is an error naming the sample."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_prefix.schedule.grouping import RowLayout, plan_batch
from verl_prefix.schedule.tree.trie import build_trie
from verl_prefix.schedule.tree.visuals import VisualItem, VisualTokens, node_segments, row_items, visual_token_keys

IMAGE, VIDEO = 90, 91
SPEC = VisualTokens((IMAGE, VIDEO), merge_size=2)


def image(seed: int, h: int = 4, w: int = 4) -> dict[str, torch.Tensor]:
    """One image of ``h x w`` patches (``h * w / 4`` tokens), pixels drawn from ``seed``."""
    pixels = torch.randn(h * w, 6, generator=torch.Generator().manual_seed(seed))
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, h, w]])}


def row(system: list[int], tokens: int, tail: list[int]) -> torch.Tensor:
    return torch.tensor([*system, *([IMAGE] * tokens), *tail])


def layout_of(rows: list[torch.Tensor], visual: list, prompt_lens: list[int], uids: list[str]) -> RowLayout:
    positions = [torch.arange(len(r)) for r in rows]
    return RowLayout(rows, positions, prompt_lens, [len(r) - p for r, p in zip(rows, prompt_lens)], uids, visual=visual)


def test_images_branch_by_content_and_share_when_equal():
    """Four groups under one system block: 0 and 1 hold one image, 2 another of the same size. The trie shares
    the image node of 0 and 1 and branches 2 off at the image's first token, though every id and position
    matches; each node records its image's token range."""
    system = [5, 6, 7, 8]
    rows = [row(system, 4, [10 + g, 11, 12, 13]) for g in range(3)]
    visual = [image(1), image(1), image(2)]
    layout = layout_of(rows, visual, [10, 10, 10], ["a", "b", "c"])
    plan = plan_batch(layout, max_rows=None, max_tokens=None, min_prefix_len=1, min_group_size=1)
    keys = visual_token_keys(layout, plan.groups, SPEC)
    assert keys[0][4][0] is keys[1][4][0] and keys[0][4][0] is not keys[2][4][0]
    assert [k for k in keys[0][:4]] == [None] * 4 and [k[1] for k in keys[0][4:8]] == [0, 1, 2, 3]
    (root,) = build_trie(layout, plan.groups, 2, visual_keys=keys)
    assert (root.start, root.end) == (0, 4) and root.images == []
    shared, alone = root.children
    assert (shared.start, shared.end) == (4, 8) and sorted(shared.rows_below()) == [0, 1]
    assert [(lo, hi) for _, lo, hi in shared.images] == [(0, 4)]
    assert (alone.start, alone.end) == (4, 9) and [(lo, hi) for _, lo, hi in alone.images] == [(0, 4)]
    # without the visual keys the three rows' image tokens are one run: the trie cannot tell the images apart
    (plain,) = build_trie(layout, plan.groups, 2)
    assert plain.end == 8


def test_placeholder_count_must_match_the_pixels():
    rows = [row([5, 6], 3, [7, 8])]  # 3 image tokens, but a 4 x 4 image makes 4
    layout = layout_of(rows, [image(1)], [4], ["a"])
    plan = plan_batch(layout, max_rows=None, max_tokens=None, min_prefix_len=1, min_group_size=1)
    with pytest.raises(ValueError, match=r"sample 0 \(uid 'a'\): 3 image_token_id tokens but its pixel_values make 4"):
        visual_token_keys(layout, plan.groups, SPEC)
    bad = {"pixel_values": torch.zeros(15, 6), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(ValueError, match="pixel_values has 15 patches but image_grid_thw accounts for 16"):
        row_items(bad, SPEC)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 2), st.integers(1, 5))), max_size=12))
def test_segments_cover_every_visual_token_in_order(pieces):
    """``node_segments`` over any run of text tokens and image pieces: the segments, expanded, are the run's
    visual keys in order (text between two pieces of one item, as between a Qwen3-VL video's frames, does not
    split its embedding rows), and consecutive segments never continue one another."""
    items = [VisualItem(0, torch.zeros(1), torch.tensor([1, 2, 2]), 8) for _ in range(3)]
    keys, index = [], {}
    for part in pieces:
        if part is None:
            keys.append(None)
            continue
        item, length = items[part[0]], part[1]
        start = index.get(part[0], 0)
        keys.extend((item, start + k) for k in range(length))
        index[part[0]] = start + length
    segments = node_segments(keys, 0, len(keys))
    expanded = [(item, k) for item, lo, hi in segments for k in range(lo, hi)]
    assert expanded == [key for key in keys if key is not None]
    for (a, _, a_hi), (b, b_lo, _) in zip(segments, segments[1:]):
        assert not (a is b and a_hi == b_lo), "adjacent runs of one item are one segment"
