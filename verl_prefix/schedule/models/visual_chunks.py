"""Images in a chunked prefix (``prefix_chunk_tokens``): the group's images are encoded once, each chunk
takes its slice of the visual embeddings.

A chunk boundary may fall inside an image's placeholder tokens. The first chunk's model call runs the vision
encoder over the group's images (and over its videos: verl encodes them in a call of their own) from inside the
model's forward, where FSDP2 has the encoder's parameters gathered, and keeps the embeddings as a leaf. Each
chunk's call gets, in place of the encoder's output, the rows of that leaf for the visual tokens it holds (verl's
forward scatters an encoder's output into the placeholder tokens in order, so a chunk's visual tokens are a
contiguous slice of the group's). Phase C runs the first chunk's backward last: its graph holds the encoder, and
``JoinLeafGrad`` adds there what every later chunk left on the leaf, so the encoder's backward runs once, inside
that chunk's. The multimodal positions are the dense row's, as without chunks.

Every chunk after the first also runs the encoder on verl's zero placeholder image and adds ``0`` times its
mean, as verl's forward does for a text call: a text group's chunks do, so data-parallel ranks issue the same
encoder collectives per chunk. Qwen3-VL's deepstack features (one row per visual token, added at the visual
positions of the first decoder layers) are leaves too and sliced alike: verl's forward finds the chunk's visual
positions from its own tokens. The slices reach verl's forwards as the encoder's output object (Qwen2-VL's and
Qwen3-VL's unpack it, Qwen3.5's reads ``pooler_output``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling
from verl.utils.transformers_compat import unpack_visual_output

from verl_prefix.schedule.models.multimodal import VisualInputs, vision_encoder

# verl's forward keywords: (pixel key, grid key, config field of the placeholder token), in the order it encodes
VISUAL_KINDS = (
    ("pixel_values", "image_grid_thw", "image_token_id"),
    ("pixel_values_videos", "video_grid_thw", "video_token_id"),
)


def encoder_owner(model: nn.Module) -> nn.Module:
    """The module whose ``visual`` attribute verl's forward calls (the inner model, or the model itself)."""
    inner = getattr(model, "model", None)
    return inner if inner is not None and isinstance(getattr(inner, "visual", None), nn.Module) else model


class JoinLeafGrad(torch.autograd.Function):
    """Identity on the encoder's output whose backward adds the leaf's gradient, read when it runs (the later
    chunks' backward already left it there)."""

    @staticmethod
    def forward(ctx: object, root: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        ctx.leaf = leaf
        return root.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        later = ctx.leaf.grad
        return (grad if later is None else grad + later.to(grad.dtype)), None


def leaves_need_grad(tower: nn.Module, train: bool) -> bool:
    """Whether the encoder's output leaves take gradients: whenever the tower trains, even where the owning call
    ran without a graph (``recompute``): the later calls leave their gradient on them before the owner's
    rebuilt backward."""
    return train and any(p.requires_grad for p in tower.parameters())


def joined_with_leaves(roots: list[torch.Tensor], leaves: list[torch.Tensor], leaf_grad: bool) -> list[torch.Tensor]:
    """The encoder's outputs as the owning call uses them: through ``JoinLeafGrad`` where they have a graph and
    the leaves take gradients, so their backward adds what the later calls left on the leaves."""
    return [
        JoinLeafGrad.apply(root, leaf) if root.requires_grad and leaf_grad else root
        for root, leaf in zip(roots, leaves)
    ]


def with_placeholder_pass(tower: nn.Module, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``parts`` (embeddings first) plus 0 times the mean of every output of verl's placeholder image: a call
    that encodes nothing itself runs the encoder once, as verl's text call does, so data-parallel ranks issue
    the same encoder collectives."""
    zero = sum(0.0 * p.mean() for p in placeholder_embeddings(tower, parts[0]))
    return [parts[0] + zero, *parts[1:]]


def placeholder_embeddings(tower: nn.Module, like: torch.Tensor) -> list[torch.Tensor]:
    """The encoder on verl's zero placeholder image (16 patches, grid 1 x 4 x 4), as verl's text call runs it:
    its embeddings, then its deepstack features (Qwen3-VL; none for the other families)."""
    config = tower.config
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.zeros((16, patch_dim), dtype=tower.dtype, device=like.device)
    grid = torch.tensor([[1, 4, 4]], dtype=torch.long, device=like.device)
    return encoder_parts(tower(pixels, grid_thw=grid))


def encoder_parts(output: object) -> list[torch.Tensor]:
    """An encoder output as a list: the embeddings, then each deepstack feature (one row per visual token)."""
    embeds, deepstack = unpack_visual_output(output)
    return [embeds, *(deepstack or [])]


def encoder_output(parts: list[torch.Tensor], deepstack: bool) -> BaseModelOutputWithPooling:
    """The encoder's output object again, from ``encoder_parts`` (verl's forwards unpack it or read its fields)."""
    out = BaseModelOutputWithPooling(pooler_output=parts[0])
    if deepstack:
        out.deepstack_features = list(parts[1:])
    return out


class EncodedVisuals:
    """A group's visual inputs for a chunked prefix: encoded in the first chunk's call, handed to every chunk by
    slice (``chunk_call``); ``calls`` counts the encoder's runs over the group's pixels."""

    def __init__(self, model: nn.Module, visual: VisualInputs, prefix_ids: torch.Tensor, requires_grad: bool) -> None:
        self.model = model
        self.owner = encoder_owner(model)
        self.tower = vision_encoder(model)
        self.visual = visual
        self.prefix_ids = prefix_ids
        self.kinds = [(pixels, grid, field) for pixels, grid, field in VISUAL_KINDS if visual.get(pixels) is not None]
        self.leaves: list[list[torch.Tensor]] = []  # per kind: the embeddings, then each deepstack feature
        self.calls = 0
        self.leaf_grad = leaves_need_grad(self.tower, requires_grad)

    def token_range(self, kind: int, start: int, end: int) -> tuple[int, int]:
        """Which rows of ``kind``'s embeddings the prefix tokens ``[start, end)`` hold."""
        is_token = self.prefix_ids == getattr(self.model.config, self.kinds[kind][2])
        return int(is_token[:start].sum()), int(is_token[:end].sum())

    def _encoded(
        self, kind: int, pixel_values: torch.Tensor, grid_thw: torch.Tensor, start: int, end: int
    ) -> list[torch.Tensor]:
        """The first chunk's encoder output for ``kind`` (embeddings and deepstack features, each row a visual
        token): the real encoder, its leaves kept for later chunks."""
        roots = encoder_parts(self.tower(pixel_values, grid_thw=grid_thw))
        self.calls += 1
        leaves = [root.detach().requires_grad_(self.leaf_grad) for root in roots]
        if len(self.leaves) == kind:
            self.leaves.append(leaves)
        else:  # recompute: phase C rebuilds the first chunk; the leaves (and their gradients) stay
            leaves = self.leaves[kind]
        first, last = self.token_range(kind, start, end)
        return [part[first:last] for part in joined_with_leaves(roots, leaves, self.leaf_grad)]

    def chunk_kwargs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The visual keywords every chunk's call takes (the pixels select verl's encode branch)."""
        return {key: self.visual[key].to(device) for kind in self.kinds for key in kind[:2]}

    @contextmanager
    def chunk_call(self, start: int, end: int) -> Iterator[None]:
        """Inside the block verl's forward gets the embeddings (and deepstack features) of tokens ``[start, end)``
        from the encoder."""
        calls = iter(range(len(self.kinds)))

        def stand_in(pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None) -> BaseModelOutputWithPooling:
            kind = next(calls)
            if start == 0:
                parts = self._encoded(kind, pixel_values, grid_thw, start, end)
            else:
                first, last = self.token_range(kind, start, end)
                parts = [leaf[first:last] for leaf in self.leaves[kind]]
                if kind == 0:  # once per chunk, as verl's text call
                    parts = with_placeholder_pass(self.tower, parts)
            # the encoder's output object: verl's Qwen2-VL and Qwen3-VL forwards unpack it, its Qwen3.5 one reads
            # the field
            return encoder_output(parts, deepstack=len(parts) > 1)

        with encoder_stand_in(self.owner, stand_in, self.tower.dtype):
            yield


@contextmanager
def encoder_stand_in(owner: nn.Module, stand_in: Callable, dtype: torch.dtype) -> Iterator[None]:
    """Inside the block verl's forward calls ``stand_in`` where it calls ``owner.visual`` (an instance attribute
    shadows the submodule; verl casts the pixels to its ``dtype``)."""
    stand_in.dtype = dtype
    object.__setattr__(owner, "visual", stand_in)
    try:
        yield
    finally:
        del owner.__dict__["visual"]
