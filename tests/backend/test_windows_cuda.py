"""Sliding windows on CUDA (issue 21, item 1): what CPU cannot check. Skipped without a GPU; ``bench/gpu_check.sh``
runs this file on a lent one (``WINDOW_TESTS``).

- The alignment convention of the GPU kernels' window arguments when the queries are fewer than the keys (phase
  B's shape): torch's ``aten::_flash_attention_forward`` (``window_size_left/right``) and flash-attn's
  ``flash_attn_func`` (``window_size=(left, right)``), both with ``causal=True``, against
  ``schedule.attention.windows.window_keep_mask`` (queries bottom-right aligned, HF's ``q - W < k <= q``). This is what
  a fused windowed kernel path would rest on; today windowed calls run the plain-torch banded merge (any device)
  or concat with an explicit boolean mask (torch's memory-efficient kernel).
- The engine on CUDA: a windowed ``gemma3_text`` in fp32 against the stock engine (auto then runs concat, the
  flash kernels being half precision only), and in bf16 within 1.5x the stock engine's own bf16 error against
  an fp32 run, every layer counted under the path that served it.
"""

from __future__ import annotations

import os

import pytest
import test_sliding_window_engine as W
import torch
from helpers.reuse import assert_reuse_ran, reduced
from test_cuda import assert_bf16_within_stocks_own, bf16_outputs
from test_engine_exactness import compare_update
from test_sliding_window_engine import layer_paths, windowed_batch

from verl_prefix import PrefixReuseConfig
from verl_prefix.schedule.attention.windows import window_keep_mask

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("VERL_PLATFORM") == "cpu",
    reason="needs a CUDA GPU and VERL_PLATFORM=nvidia (the suite defaults verl to its CPU platform)",
)
CUDA = torch.device("cuda")
windowed_model = W.windowed_model  # the engine tests' fixture: tiny models with a 16-token window on layer 0


def _reference(q, k, v, window, scale):
    """``[B, S, H, d]`` layout; fp32 softmax over ``window_keep_mask`` (bottom-right, HF's window rule)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    keep = window_keep_mask(q.shape[1], k.shape[1], window, q.device)
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.float())


@pytest.mark.parametrize("query_len, key_len, window", [(7, 40, 16), (33, 45, 16), (20, 20, 5), (5, 30, 64)])
def test_torch_flash_window_arguments_align_bottom_right(query_len, key_len, window):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, n, 4, 64, device=CUDA, dtype=torch.bfloat16, generator=gen)
        for n in (query_len, key_len, key_len)
    )
    scale = 64**-0.5
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, query_len, key_len, 0.0, True, False,
        scale=scale, window_size_left=window - 1, window_size_right=0,
    )[0]  # fmt: skip
    want = _reference(q, k, v, window, scale)
    err = (out.float() - want).abs().max()
    print(f"torch flash window {window}, {query_len} queries over {key_len} keys: max err {err:.2e}")
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_flash_attn_window_size_aligns_bottom_right():
    flash_attn = pytest.importorskip("flash_attn")
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, n, 4, 64, device=CUDA, dtype=torch.bfloat16, generator=gen) for n in (9, 50, 50))
    out = flash_attn.flash_attn_func(q, k, v, causal=True, window_size=(15, 0))
    torch.testing.assert_close(out.float(), _reference(q, k, v, 16, 64**-0.5), rtol=2e-2, atol=2e-2)


def test_windowed_update_matches_stock_engine_in_fp32_on_cuda(windowed_model):
    grads, _, _, prefix = compare_update(
        windowed_model("gemma3_text"),
        windowed_batch(),
        dtype="float32",
        reuse=PrefixReuseConfig(min_prefix_len=2, suffix_micro_batch_size=2),
        micro_batch_size_per_gpu=2,
    )
    assert grads < 1e-4
    assert_reuse_ran(prefix["metrics"], groups=2)
    assert reduced(prefix["metrics"]).get("prefix/fallback_sliding_window", 0.0) == 0.0
    assert set(layer_paths(prefix["metrics"])) == {"concat_window", "concat"}  # fp32: the kernels refuse


def test_windowed_bf16_error_within_the_stock_engines_own(windowed_model):
    model_dir = windowed_model("gemma3_text")
    batch = windowed_batch(use_kl=False)
    reference = bf16_outputs(model_dir, "fsdp2", batch, bf16=False)
    metrics = assert_bf16_within_stocks_own(model_dir, batch, reference, groups=2)
    assert set(layer_paths(metrics)) == {"merged_window", "merged"}  # banded in plain torch, the full layer fused
