"""Phase B's attention on torchtitan: suffix queries over ``cat(prefix K/V, row K/V)`` under the flex block mask
of key length ``P - 1 + S`` equal the dense attention of the whole sequence (prefix + row) at the row's
positions. On CPU through the platform layer's dense attention over the materialised mask; on CUDA through
flex_attention itself (the kernel the GPU path runs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is an optional dependency (scripts/setup.sh installs it)")
pytest.importorskip("triton", reason="torchtitan 0.3.0's model stack imports triton (scripts/setup.sh installs it)")


def _inputs(device: str, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(0)
    batch, prefix, suffix, heads, kv_heads, dim = 3, 11, 5, 4, 2, 16

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    q = rand(batch, heads, suffix, dim)
    k_prefix, v_prefix = rand(1, kv_heads, prefix, dim), rand(1, kv_heads, prefix, dim)
    k_rows, v_rows = rand(batch, kv_heads, suffix, dim), rand(batch, kv_heads, suffix, dim)
    k = torch.cat([k_prefix.expand(batch, -1, -1, -1), k_rows], dim=2)
    v = torch.cat([v_prefix.expand(batch, -1, -1, -1), v_rows], dim=2)
    return q, k, v, prefix, suffix


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, suffix: int) -> torch.Tensor:
    """Dense causal attention of the whole sequence, the rows' queries sitting at positions prefix..prefix+S-1."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    full_q = torch.cat([torch.zeros_like(k[:, :, :prefix]).expand(-1, q.shape[1], -1, -1), q], dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(full_q, k, v, is_causal=True)
    return out[:, :, prefix:]


def test_suffix_mask_cpu_dense():
    from torch.nn.attention.flex_attention import create_mask

    from verl_prefix.backend.titan.attention import suffix_mask
    from verl_prefix.backend.titan.platform import dense_masked_attention

    q, k, v, prefix, suffix = _inputs("cpu", torch.float64)
    mask = suffix_mask(q.shape[0], prefix, suffix, torch.device("cpu"))
    keep = create_mask(mask.mask_mod, q.shape[0], None, suffix, prefix + suffix, device="cpu")
    got = dense_masked_attention(q, k, v, keep, scale=None)
    torch.testing.assert_close(got, _reference(q, k, v, prefix, suffix), rtol=1e-10, atol=1e-10)
    # negative control: a row that does not see the prefix is another attention
    keep = keep.clone()
    keep[..., :prefix] = False
    assert (dense_masked_attention(q, k, v, keep, scale=None) - got).abs().max() > 1e-2


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="flex_attention's kernel needs CUDA; the CPU test above runs the same mask densely",
)
def test_suffix_mask_cuda_flex():
    from torch.nn.attention.flex_attention import flex_attention

    from verl_prefix.backend.titan.attention import suffix_mask

    q, k, v, prefix, suffix = _inputs("cuda", torch.float32)
    mask = suffix_mask(q.shape[0], prefix, suffix, torch.device("cuda"))
    got = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, _reference(q, k, v, prefix, suffix), rtol=1e-5, atol=1e-5)
