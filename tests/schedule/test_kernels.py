"""Whether torch's flash kernels serve phase B on this GPU (issue 20 item 5), decided on CPU with torch's checks
mocked: ``kernels.cuda_merged_refusal`` asks ``torch.backends.cuda.can_use_flash_attention`` with the call's
real query (causal and not), refuses ROCm builds and an activated flash implementation, and ``auto`` turns
each refusal into concat counted as ``prefix/phase_b_attention/concat_<reason>``; the mini-batch preflight
(``preflight.phase_b_kernel_refusal``) asks the same and explains it in one line."""

from __future__ import annotations

import pytest
import torch
from test_varlen_attention import OnDevice

from verl_prefix.schedule.attention import kernels, preflight
from verl_prefix.schedule.attention import merged as MA


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA build of torch on an Ampere-or-later GPU, as far as the checks can tell: records what
    ``can_use_flash_attention`` was asked; ``gpu.serves`` is its answer."""

    class Gpu:
        serves = True
        asked: list = []

    def can_use(params, debug=False):
        Gpu.asked.append((tuple(params.query.shape), params.query.dtype, params.query.requires_grad, params.is_causal))
        return Gpu.serves

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.nn.attention, "current_flash_attention_impl", lambda: None, raising=False)
    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", can_use)
    Gpu.asked = []
    return Gpu


def test_torch_is_asked_with_the_real_query(gpu):
    query = torch.zeros(3, 4, 17, 64, dtype=torch.bfloat16, requires_grad=True)
    assert kernels.cuda_merged_refusal(query) is None
    # both parts: the causal suffix part and the unmasked prefix part, with the query's shape, dtype and grad
    assert gpu.asked == [((3, 4, 17, 64), torch.bfloat16, True, True), ((3, 4, 17, 64), torch.bfloat16, True, False)]


@pytest.mark.parametrize(
    "case, reason",
    [
        ("pre_ampere", "kernel_arch"),  # T4/V100, fp16 or bf16: can_use_flash_attention says no
        ("rocm", "kernel_rocm"),
        ("fa4_activated", "kernel_impl"),
        ("fp32", "kernel_dtype"),
        ("head_dim_12", "kernel_head_dim"),
        ("head_dim_320", "kernel_head_dim"),
    ],
)
def test_each_refusal(gpu, monkeypatch, case, reason):
    query = torch.zeros(2, 4, 9, 64, dtype=torch.float16)
    if case == "pre_ampere":
        gpu.serves = False
    elif case == "rocm":
        monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    elif case == "fa4_activated":
        monkeypatch.setattr(torch.nn.attention, "current_flash_attention_impl", lambda: "FA4", raising=False)
    elif case == "fp32":
        query = query.float()
    else:
        query = torch.zeros(2, 4, 9, int(case.rsplit("_", 1)[1]), dtype=torch.float16)
    assert kernels.cuda_merged_refusal(query) == reason
    gpu.serves = True


def test_cuda_suffix_kv_go_in_unrepeated_where_torch_takes_gqa(monkeypatch):
    """Issue 27 item 4: on CUDA ``merged`` hands torch's flash op the suffix K/V at ``Hkv`` heads where
    ``can_use_flash_attention`` accepts them with ``enable_gqa`` (its GQA check, torch >= 2.5), so it saves them
    unrepeated for backward; where torch says no (or cannot be asked: a torch without ``enable_gqa``), they are
    repeated as before."""
    asked = []

    def can_use(params, debug=False):
        asked.append((params.query.shape[1], params.key.shape[1], params.enable_gqa, params.is_causal))
        return True

    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", can_use)
    query = torch.zeros(2, 8, 9, 64, dtype=torch.bfloat16)
    assert kernels.flash_takes_gqa(query, 2) and asked == [(8, 2, True, True)]
    assert kernels.flash_takes_gqa(query, 8) and len(asked) == 1  # equal heads: nothing to ask
    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", lambda params, debug=False: False)
    assert not kernels.flash_takes_gqa(query, 2)

    class SixArguments:  # a torch before enable_gqa
        def __init__(self, *args):
            if len(args) > 6:
                raise TypeError("takes 6 positional arguments")

    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", can_use)
    monkeypatch.setattr(torch.backends.cuda, "SDPAParams", SixArguments)
    assert not kernels.flash_takes_gqa(query, 2)
    # merged asks it on CUDA only (the CPU op always takes GQA), with the suffix K/V's real head count
    answers = []
    monkeypatch.setattr(MA, "flash_takes_gqa", lambda q, kv_heads: answers.append(kv_heads) or kv_heads == 2)
    assert MA.native_gqa(OnDevice(query, "cuda"), 2) and not MA.native_gqa(OnDevice(query, "cuda"), 4)
    assert MA.native_gqa(query, 4) and answers == [2, 4]


def test_torch_says_no_on_a_build_without_cuda():
    """Unmocked: this CPU build's own ``can_use_flash_attention`` (real ``SDPAParams``) refuses."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA build")
    assert not kernels.can_use_flash(*(torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16),) * 3, True)
    assert kernels.cuda_merged_refusal(torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)) == "kernel_arch"


def test_merged_refusal_asks_torch_on_cuda(monkeypatch):
    query = OnDevice(torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16), "cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.nn.attention, "current_flash_attention_impl", lambda: None, raising=False)
    monkeypatch.setattr(kernels, "can_use_flash", lambda q, k, v, causal: False)
    assert MA.merged_refusal(query, {}) == "kernel_arch"
    assert MA.merged_refusal(query, {"sliding_window": 8}) == "sliding_window"  # the model's reasons first
    monkeypatch.setattr(kernels, "can_use_flash", lambda q, k, v, causal: True)
    assert MA.merged_refusal(query, {}) is None
    assert MA.merged_refusal(torch.zeros(1, 2, 8, 64), {}) is None  # CPU: its own flash op serves fp32


def test_preflight_explains_what_refused(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(preflight, "probe_query", lambda device, dtype, head_dim, grad: OnDevice(
        torch.zeros(1, 1, 8, head_dim, dtype=dtype), device.type))  # fmt: skip
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.nn.attention, "current_flash_attention_impl", lambda: None, raising=False)
    monkeypatch.setattr(kernels, "can_use_flash", lambda q, k, v, causal: False)
    reason, text = preflight.phase_b_kernel_refusal("auto", cuda, torch.float16, 128, True)
    assert reason == "kernel_arch"
    assert text.startswith("kernel_arch: torch.backends.cuda.can_use_flash_attention refuses torch.float16 head_dim")
    assert torch.__version__ in text
    assert preflight.phase_b_kernel_refusal("concat", cuda, torch.float16, 128, True) is None
    monkeypatch.setattr(kernels, "can_use_flash", lambda q, k, v, causal: True)
    assert preflight.phase_b_kernel_refusal("merged", cuda, torch.bfloat16, 128, True) is None
    reason, text = preflight.phase_b_kernel_refusal("merged", cuda, torch.float32, 128, True)
    assert reason == "kernel_dtype" and "fp16/bf16, the model computes in torch.float32" in text
    # CPU: the CPU flash op serves every float dtype
    assert preflight.phase_b_kernel_refusal("merged_varlen", torch.device("cpu"), torch.float64, 12, True) is None


@pytest.mark.parametrize("chunk_tokens", [None, 4])
def test_an_agreed_refusal_makes_auto_run_concat(chunk_tokens):
    """``ScheduleOptions.phase_b_refusal`` (what the ranks agreed before the mini-batch): ``auto`` runs concat for
    it in every micro-batch and prefix chunk, counted as ``concat_<reason>``, exact against plain HF."""
    from helpers.layouts import make_layout, token_weights
    from helpers.precision import promote_fp32_upcasts
    from helpers.schedule_runs import train_reuse
    from test_schedule_hf import dense_grads, tiny_model, weighted_loss, worst_relative

    from verl_prefix.schedule.telemetry import PhaseMeter

    model = tiny_model("qwen3", "sdpa", torch.float64)
    layout = make_layout([(13, [4, 7, 1, 6, 3]), (8, [5, 3, 6])])
    weights = token_weights(layout, torch.float64)
    meter = PhaseMeter(torch.device("cpu"))
    with promote_fp32_upcasts():
        want = dense_grads(model, layout, weights, with_entropy=True)
        got, plan = train_reuse(
            model, layout, weighted_loss(weights), rows=2, calculate_entropy=True, meter=meter,
            phase_b_refusal="kernel_arch", prefix_chunk_tokens=chunk_tokens,
        )  # fmt: skip
    assert len(plan.groups) == 2 and worst_relative(got, want) < 1e-10
    micro_batches = sum(len(g.micro_batches) for g in plan.groups)
    assert meter.counts["prefix/phase_b_attention/concat"] == micro_batches == 5
    assert meter.counts["prefix/phase_b_attention/concat_kernel_arch"] == micro_batches
    assert not meter.counts.get("prefix/phase_b_attention/merged")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("groups", [1, 4])
def test_cuda_merged_takes_gqa_unrepeated(monkeypatch, groups):
    """On the device: ``merged`` in bf16 with GQA hands ``MergedAttention`` the suffix K/V at ``Hkv`` heads (no
    repeat: what it saves for backward is ``1/groups`` of the repeated copy), and output and gradients match the
    CPU fp32 run of the same inputs (bf16 bounds, as the varlen kernels' CUDA check)."""
    from test_merged_attention import attention_inputs, weighted_grads

    q, pk, pv, sk, sv, w = attention_inputs(3, 2 * groups, 2, prefix=70, suffix=33, dtype=torch.float32, dim=64)
    want_out = MA.merged_attention(q, pk, pv, sk, sv, 0.125)
    want = weighted_grads(want_out, w, (q, pk, pv, sk, sv))
    cuda = torch.device("cuda")
    tensors = [t.detach().to(cuda, torch.bfloat16).requires_grad_() for t in (q, sk, sv)]
    leaves = [t.detach().to(cuda).requires_grad_() for t in (pk, pv)]
    seen, apply = [], MA.MergedAttention.apply
    monkeypatch.setattr(MA.MergedAttention, "apply", lambda *a: seen.append(a[3].shape[1]) or apply(*a))
    out = MA.merged_attention(tensors[0], *leaves, tensors[1], tensors[2], 0.125)
    assert seen == [2]  # the suffix K at its KV heads
    assert ((out.float().cpu() - want_out).norm() / want_out.norm()) < 2e-2
    got = weighted_grads(out, w.to(cuda, torch.bfloat16), (tensors[0], *leaves, *tensors[1:]))
    for g, r in zip(got, want):
        assert g.shape == r.shape and ((g.float().cpu() - r).norm() / r.norm()) < 3e-2
