"""Images and videos in the tree schedule (``prefix_reuse.tree`` with a vision-language model): every image a
subtree holds is encoded once, and each node takes its slice of the embeddings.

The trie keys a visual placeholder token by the item it belongs to (an image or a video, identified by content:
its grid and its pixels bit for bit, as ``multimodal.same_visual_inputs`` tests a group) and its index in it
(``visual_token_keys``). Every image's placeholder tokens are the same ids, so without that key a trie would
share the prompts of groups whose images differ; with it, groups branch where their items differ and groups
that hold the same item (one document under several questions) share its node. Each node records the token
ranges of the items it holds (``node_segments``).

Encoding (``PathImages``): the topmost node on the path that holds an item's tokens owns it. Its model call runs
the encoder once over every item it owns (images and videos in one call: the encoder treats each item on its
own, so the embeddings are the dense rows' up to rounding), keeps the outputs as leaves and passes its own slice
through ``visual_chunks.JoinLeafGrad``; every descendant that holds more of the item (a chunk boundary or a node
boundary inside it) takes its slice of the leaves. The owner's phase C runs after every descendant's, so the
join adds what they left on the leaves and the encoder's backward runs once per owner, inside the owner's. Where
merging short nodes (``min_shared_tokens``) leaves an item's first tokens in sibling nodes, each sibling owns an
encoding of its own; every row's gradient still reaches the encoder once.

Each node call runs the encoder exactly once (over its own items, or else verl's zero placeholder image, added
as ``0`` times its mean, as verl's text calls do), so data-parallel ranks issue the same encoder collectives per
node, lockstep fillers (text calls) included. Qwen3-VL's deepstack features are sliced with the embeddings.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from verl_prefix.schedule.grouping import GroupPlan, RowLayout
from verl_prefix.schedule.models.multimodal import vision_encoder
from verl_prefix.schedule.models.visual_chunks import (
    VISUAL_KINDS,
    encoder_output,
    encoder_owner,
    encoder_parts,
    encoder_stand_in,
    joined_with_leaves,
    leaves_need_grad,
    with_placeholder_pass,
)


@dataclass(eq=False)
class VisualItem:
    """One image or video of the batch, by content: ``kind`` indexes ``VISUAL_KINDS`` (0 images, 1 videos);
    ``pixels`` its patches, ``grid`` its ``(t, h, w)`` patch grid, ``tokens`` its placeholder tokens. Compared
    and hashed by identity: ``visual_token_keys`` makes one per distinct content."""

    kind: int
    pixels: torch.Tensor
    grid: torch.Tensor
    tokens: int

    def fingerprint(self) -> tuple:
        """Equal for items of equal content (the same sum over the same values in the same order), so only
        items sharing one are compared whole: a rank's distinct images are not compared pairwise."""
        return (
            self.kind,
            tuple(self.grid.reshape(-1).tolist()),
            self.pixels.shape,
            self.pixels.dtype,
            float(self.pixels.sum(dtype=torch.float64)),
        )

    def same_content(self, other: VisualItem) -> bool:
        return (
            self.kind == other.kind
            and torch.equal(self.grid, other.grid)
            and self.pixels.shape == other.pixels.shape
            and self.pixels.dtype == other.pixels.dtype
            and torch.equal(self.pixels, other.pixels)
        )


# a visual placeholder token's trie key: its item and its index in the item (None for a text token)
TokenKey = tuple[VisualItem, int] | None
# a node's visual tokens, in order: (item, first, last) token ranges of the item's embeddings
Segment = tuple[VisualItem, int, int]


@dataclass(frozen=True)
class VisualTokens:
    """What the trie needs of a vision-language model: the placeholder token id of each kind (``None`` where the
    model has none) and the encoder's spatial merge (``merge_size ** 2`` patches make one token)."""

    token_ids: tuple[int | None, int | None]
    merge_size: int

    @staticmethod
    def of(model: nn.Module) -> VisualTokens | None:
        """The model's, or None for a model without a vision encoder."""
        config = getattr(model, "config", None)
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return None
        ids = tuple(getattr(config, field, None) for _, _, field in VISUAL_KINDS)
        return VisualTokens(ids, int(getattr(vision, "spatial_merge_size", 1)))


def row_items(visual: Mapping[str, torch.Tensor], spec: VisualTokens) -> list[list[VisualItem]]:
    """A row's visual inputs split into items, per kind in ``VISUAL_KINDS`` order (verl's processor concatenates
    each kind's patches item after item, ``grid[i].prod()`` rows each)."""
    out: list[list[VisualItem]] = []
    for kind, (pixel_key, grid_key, _) in enumerate(VISUAL_KINDS):
        pixels, grids = visual.get(pixel_key), visual.get(grid_key)
        items: list[VisualItem] = []
        if pixels is not None:
            start = 0
            for grid in grids.reshape(-1, 3):
                patches = int(grid.prod())
                items.append(VisualItem(kind, pixels[start : start + patches], grid, patches // spec.merge_size**2))
                start += patches
            if start != len(pixels):
                raise ValueError(f"{pixel_key} has {len(pixels)} patches but {grid_key} accounts for {start}")
        out.append(items)
    return out


def visual_token_keys(layout: RowLayout, groups: list[GroupPlan], spec: VisualTokens) -> dict[int, list[TokenKey]]:
    """Each row's per-position trie key extension: ``(item, index)`` at a visual placeholder token, None
    elsewhere. Items are made once per distinct content over the groups (a group's rows hold identical visual
    inputs, which grouping checked), so equal images in different groups are one item."""
    catalog: dict[tuple, list[VisualItem]] = {}

    def canonical(item: VisualItem) -> VisualItem:
        alike = catalog.setdefault(item.fingerprint(), [])
        for known in alike:
            if known.same_content(item):
                return known
        alike.append(item)
        return item

    keys: dict[int, list[TokenKey]] = {}
    for group in groups:
        visual = layout.visual_of(group.rows[0])
        kinds = [[canonical(item) for item in items] for items in row_items(visual, spec)] if visual else None
        for row in group.rows:
            ids = layout.input_ids[row]
            row_keys: list[TokenKey] = [None] * len(ids)
            for kind, token_id in enumerate(spec.token_ids):
                items = kinds[kind] if kinds else []
                places = (ids == token_id).nonzero().flatten().tolist() if token_id is not None else []
                expected = sum(item.tokens for item in items)
                if len(places) != expected:
                    raise ValueError(
                        f"sample {row} (uid {layout.uids[row]!r}): {len(places)} {VISUAL_KINDS[kind][2]} tokens "
                        f"but its {VISUAL_KINDS[kind][0]} make {expected} embeddings"
                    )
                flat = [(item, index) for item in items for index in range(item.tokens)]
                for place, key in zip(places, flat):
                    row_keys[place] = key
            keys[row] = row_keys
    return keys


def node_segments(keys: list[TokenKey], start: int, end: int) -> list[Segment]:
    """The visual token ranges of positions ``[start, end)`` of a row with ``keys``: one segment per run of
    consecutive tokens of one item."""
    segments: list[Segment] = []
    for key in keys[start:end]:
        if key is None:
            continue
        item, index = key
        if segments and segments[-1][0] is item and segments[-1][2] == index:
            segments[-1] = (item, segments[-1][1], index + 1)
        else:
            segments.append((item, index, index + 1))
    return segments


class PathImages:
    """The items encoded on the current root-to-node path (``leaves``), and the stand-in that gives a node's
    model call its slices (``node_call``). ``calls`` counts the encoder's runs over real pixels."""

    def __init__(self, model: nn.Module, train: bool) -> None:
        self.owner = encoder_owner(model)
        self.tower = vision_encoder(model)
        self.leaf_grad = leaves_need_grad(self.tower, train)
        self.leaves: dict[VisualItem, list[torch.Tensor] | None] = {}
        self.calls = 0

    def enter(self, segments: list[Segment]) -> list[VisualItem]:
        """The items a node owns (no node above it on the path encoded them), held for its subtree."""
        owned: list[VisualItem] = []
        for item, _, _ in segments:
            if item not in self.leaves:
                self.leaves[item] = None  # encoded in the node's first call
                owned.append(item)
        return owned

    def leave(self, owned: list[VisualItem]) -> None:
        """After the owner's phase C: its items' leaves are done."""
        for item in owned:
            del self.leaves[item]

    def _encode(self, owned: list[VisualItem], device: torch.device) -> dict[VisualItem, list[torch.Tensor]]:
        """The encoder over ``owned`` in one call; each item's outputs joined with its leaves."""
        pixels = torch.cat([item.pixels for item in owned]).to(device, self.tower.dtype)
        grid = torch.stack([item.grid.reshape(3) for item in owned]).to(device)
        roots = encoder_parts(self.tower(pixels, grid_thw=grid))
        self.calls += 1
        per_item = zip(*(root.split([item.tokens for item in owned]) for root in roots))
        joined: dict[VisualItem, list[torch.Tensor]] = {}
        for item, parts in zip(owned, per_item):
            if self.leaves[item] is None:
                self.leaves[item] = [part.detach().requires_grad_(self.leaf_grad) for part in parts]
            # recompute: the owner's rebuild in phase C encodes again; the leaves (and their gradients) stay
            joined[item] = joined_with_leaves(list(parts), self.leaves[item], self.leaf_grad)
        return joined

    @contextmanager
    def node_call(self, segments: list[Segment], owned: list[VisualItem], device: torch.device) -> Iterator[dict]:
        """Inside the block verl's forward gets, for each kind the node holds, the embeddings (and deepstack
        features) of its segments from the encoder; yields the visual keywords that select verl's encode
        branch (the node's items' pixels and grids)."""
        kinds = sorted({item.kind for item, _, _ in segments})
        kwargs: dict[str, torch.Tensor] = {}
        for kind in kinds:
            items = list(dict.fromkeys(item for item, _, _ in segments if item.kind == kind))
            pixel_key, grid_key, _ = VISUAL_KINDS[kind]
            kwargs[pixel_key] = torch.cat([item.pixels for item in items]).to(device)
            kwargs[grid_key] = torch.stack([item.grid.reshape(3) for item in items]).to(device)
        calls = iter(kinds)
        encoded: dict[VisualItem, list[torch.Tensor]] = {}

        def stand_in(pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None) -> object:
            kind = next(calls)
            first_call = kind == kinds[0]
            if first_call and owned:
                encoded.update(self._encode(owned, device))
            pieces = [  # per segment of this kind: its slice of each output (embeddings, deepstack features)
                [part[lo:hi] for part in (encoded[item] if item in encoded else self.leaves[item])]
                for item, lo, hi in segments
                if item.kind == kind
            ]
            parts = [torch.cat(column) for column in zip(*pieces)]
            if first_call and not owned:  # one encoder run per call, as verl's text call
                parts = with_placeholder_pass(self.tower, parts)
            return encoder_output(parts, deepstack=len(parts) > 1)

        with encoder_stand_in(self.owner, stand_in, self.tower.dtype):
            yield kwargs
