"""flash-linear-attention's gated delta rule on CUDA (what transformers runs for Qwen3.5 / Qwen3-Next when ``fla`` is
installed), which the schedule serves (``recurrent.fla_chunk_kernel``): its chunked kernel continues from an initial
state and returns that state's gradient as transformers' torch rule does, and reuse on a model running it matches
dense. Skipped without a GPU and ``fla`` (it needs Triton); ``bench/gpu_check.sh`` runs it on a lent GPU with the
kit's wheels (``scripts/gpu_kit.sh``). On CPU, ``test_recurrent.py``'s
``test_fla_kernels_serve_with_one_token_calls_kept_off_the_fused_kernel`` runs the same serving logic on stand-ins
with fla's contracts."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch
from helpers.layouts import make_layout, token_weights
from test_recurrent import qwen3_5, run
from test_schedule_hf import RAGGED, dense_grads, worst_relative
from transformers.models.qwen3_5 import modeling_qwen3_5

from verl_prefix.schedule.models import recurrent

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
    reason="needs a CUDA GPU and flash-linear-attention (Triton kernels; bench/gpu_check.sh runs it there)",
)


def test_fla_matches_torch_rule_on_cuda():
    """Outputs, final state and every input's gradient, the initial state's included, against transformers' torch
    rule in fp32 on the same GPU (a 70-token call: two chunks plus a remainder)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    assert recurrent.fla_chunk_kernel(chunk_gated_delta_rule)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2, 70, 4, 32)] * 3 + [(2, 70, 4), (2, 70, 4), (2, 4, 32, 32)]
    inputs = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    inputs[3] = -torch.rand(shapes[3], device="cuda", generator=gen)  # log decays
    inputs[4] = torch.rand(shapes[4], device="cuda", generator=gen)  # beta
    results = []
    for rule in (chunk_gated_delta_rule, modeling_qwen3_5.torch_chunk_gated_delta_rule):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        q, k, v, g, beta, state = leaves
        out, final = rule(
            q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        (out.square().sum() + final.square().sum()).backward()
        results.append([out.detach(), final.detach()] + [x.grad for x in leaves])
    names = ["out", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]
    for name, got, want in zip(names, *results):
        assert got is not None and torch.isfinite(got).all(), name
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 1e-3, f"{name}: fla differs from the torch rule by {rel:.2e}"


def test_reuse_on_fla_kernels_matches_dense_on_cuda():
    """A tiny Qwen3.5 on CUDA whose layers run fla (transformers picks it up when installed): reuse's gradients
    against dense on the same kernels, fp32, micro-batches of 1 row (one-token rows run the chunked kernel)."""
    model = qwen3_5(torch.float32).cuda()
    layers = recurrent.recurrent_layers(model).values()
    if not all(recurrent.fla_chunk_kernel(m.chunk_gated_delta_rule) for m in layers):
        pytest.skip("transformers did not pick fla's kernels up (causal_conv1d or an older fla installed?)")
    assert recurrent.recurrent_refusal(model) is None
    layout = make_layout(RAGGED)  # the schedule takes CPU rows and moves what it runs to ``device``
    on_gpu = dataclasses.replace(layout, input_ids=[ids.cuda() for ids in layout.input_ids])
    weights = [w.cuda() for w in token_weights(layout, torch.float32)]
    want = dense_grads(model, on_gpu, weights)
    got = run(model, layout, weights, rows=1, device=torch.device("cuda"))
    assert worst_relative(got, want) < 1e-4


def test_fla_dispatch_keeps_flashqla_off_under_reuse(monkeypatch):
    """Issue 27 item 7 on the device: a bf16 call with K = V = 128 (Qwen3.5's shape, what fla's dispatch may send to
    FlashQLA on SM90/SM100 where ``flash_qla`` is installed) made inside the schedule's mode never reaches FlashQLA,
    and matches the Triton kernel's own result and initial-state gradient. Where ``flash_qla`` is absent the
    dispatch has nothing to send it to: the switch is still checked to be on inside and restored after."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    qla_calls = []
    if importlib.util.find_spec("flash_qla") is not None:
        import flash_qla

        real = flash_qla.chunk_gated_delta_rule
        monkeypatch.setattr(flash_qla, "chunk_gated_delta_rule", lambda *a, **k: qla_calls.append(1) or real(*a, **k))
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1, 96, 2, 128)] * 3 + [(1, 96, 2), (1, 96, 2), (1, 2, 128, 128)]
    inputs = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    inputs[3] = -torch.rand(shapes[3], device="cuda", generator=gen)
    inputs[4] = torch.rand(shapes[4], device="cuda", generator=gen)
    inputs = [x.bfloat16() if i < 3 else x for i, x in enumerate(inputs)]

    def call():
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        q, k, v, g, beta, state = leaves
        out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state, use_qk_l2norm_in_kernel=True)
        out.float().square().sum().backward()
        return out.detach(), state.grad

    with recurrent.fla_triton_backend():
        assert os.environ["FLA_FLASH_QLA"] == "0"
        pinned = call()
    assert "FLA_FLASH_QLA" not in os.environ and not qla_calls
    monkeypatch.setenv("FLA_FLASH_QLA", "0")
    triton = call()
    for got, want in zip(pinned, triton):
        torch.testing.assert_close(got, want)
    print(f"fla dispatch: flash_qla {'present' if qla_calls or importlib.util.find_spec('flash_qla') else 'absent'}")
