"""verl's fused kernels (``actor_rollout_ref.model.use_fused_kernels=true``) under reuse, against verl's stock engine.

Before, every mini-batch with fused kernels ran dense (``prefix/fallback_fused_kernels``), and with untied embeddings
it crashed at the first step (verl 0.9.1's fused forward reads the LM head's weight while FSDP2 holds it sharded;
verl's own fsdp2 engine fails the same way). Now phase B, forward-only passes and loss-carrying trie nodes compute
log-probs and entropy with verl's fused kernel (``torch`` backend on CPU) from the final hidden states:

- tied embeddings (Qwen2): against the stock engine with the same setting, fp64 and fp32, updates and forward-only
  passes; the tree with loss on shared response stems in fp64;
- untied embeddings (Qwen3): the stock engine with fused kernels fails (asserted); against the stock engine without
  them (the same maths up to rounding) in fp64, dense rows included (they run verl's unfused path);
- every comparison asserts reuse ran and no mini-batch fell back; the negative control (the fused labels one
  position late) fails. verl's kernel returns fp32 log-probs in any dtype, so fp64 runs are bounded by fp32's
  rounding (1e-6) instead of 1e-10.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.precision import promote_fp32_upcasts
from helpers.reuse import assert_infer_matches, assert_reuse_ran, reduced
from test_tree_loss_engine import assert_shared_loss_ran, shared_loss_batch

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import grpo_batches, verl_engine
from verl_prefix.schedule import executor
from verl_prefix.schedule.fused_head import scalar_temperature
from verl_prefix.schedule.models.hf_forwards import hf_causal_forward

VOCAB = 128
# verl's fused kernel returns fp32 log-probs whatever the model's dtype (its output buffer is fp32): an fp64 run's
# log-probs are rounded to fp32 in both engines, so the fp64 bound is fp32's, not 1e-10 (the control fails by 1e-2)
TOL = {"float64": 1e-6, "float32": 1e-5}
FUSED = [
    "actor_rollout_ref.model.use_fused_kernels=true",
    "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch",
]


@pytest.fixture(autouse=True, scope="module")
def _hf_forwards_back():
    """verl's fused-kernel patch replaces the model class's forward for the whole process: put HF's back after this
    module, so later tests in the same worker build those classes unfused."""
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

    saved = {cls: vars(cls).get("forward") for cls in (Qwen2ForCausalLM, Qwen3ForCausalLM)}
    yield
    for cls, forward in saved.items():
        cls.forward = forward


def batch(**overrides):
    args = dict(
        num_groups=2,
        group_size=4,
        prompt_lens=[9, 12],
        response_len_range=(1, 7),
        vocab_size=VOCAB,
        seed=3,
        use_kl=True,
        calculate_entropy=True,
        temperature=0.7,
    )
    args.update(overrides)
    return grpo_batches.make_grpo_batch(**args)


def precision(dtype: str):
    return promote_fp32_upcasts() if dtype == "float64" else contextlib.nullcontext()


def engines(model_dir, dtype: str, *, stock_fused: bool = True, reuse: PrefixReuseConfig | None = None, **kwargs):
    kwargs = dict(dtype=dtype, micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01, **kwargs)
    dense = verl_engine.build_verl_engine(model_dir, backend="fsdp2", overrides=FUSED if stock_fused else (), **kwargs)
    prefix = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", overrides=FUSED, **kwargs)
    prefix[0].reuse_config = reuse or PrefixReuseConfig(min_prefix_len=2)
    return dense, prefix


def worst(got: dict, want: dict) -> float:
    return max(((got[n] - g).norm() / g.norm()).item() for n, g in want.items())


def unfused(engine):
    """verl patches the fused forward onto the model's class, for every instance in the process: a stock engine
    built without fused kernels runs HF's forward only with it put back (what verl's unfused path expects)."""
    if engine.engine_config.use_fused_kernels:
        return contextlib.nullcontext()
    return hf_causal_forward(engine.module)


def step(dense, prefix, data, dtype: str) -> tuple[float, dict]:
    (d_engine, d_loss, _), (p_engine, p_loss, _) = dense, prefix
    with precision(dtype):
        with unfused(d_engine):
            want = verl_engine.run_train_step(d_engine, d_loss, data, capture_grads=True)
        got = verl_engine.run_train_step(p_engine, p_loss, data, capture_grads=True)
    return worst(got["grads"], want["grads"]), got


def assert_fused_reuse(metrics, groups: int) -> None:
    assert_reuse_ran(metrics, groups=groups)
    m = reduced(metrics)
    assert not any(v for k, v in m.items() if k.startswith("prefix/fallback_")), m


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_tied_embeddings_match_the_stock_engine_with_fused_kernels(tiny_model, dtype):
    model_dir = tiny_model("qwen2", tie_word_embeddings=True)
    dense, prefix = engines(model_dir, dtype)
    error, got = step(dense, prefix, batch(), dtype)
    assert error < TOL[dtype], error
    assert_fused_reuse(got["metrics"], groups=2)
    with precision(dtype):
        want_infer = verl_engine.run_infer(dense[0], batch(), calculate_entropy=True)
        got_infer = verl_engine.run_infer(prefix[0], batch(), calculate_entropy=True)
    assert_infer_matches(want_infer, got_infer, TOL[dtype], groups=2)


def test_untied_embeddings_reuse_where_verls_fused_forward_fails(tiny_model):
    """verl's own fsdp2 engine with fused kernels and an untied head fails at its first step; prefix_fsdp2 trains,
    equal to the stock engine without fused kernels (fp64), its dense rows (the 4-token prefix group, below
    ``min_prefix_len``) on verl's unfused path."""
    model_dir = tiny_model("qwen3")
    stock_fused, stock_loss, _ = verl_engine.build_verl_engine(
        model_dir, backend="fsdp2", dtype="float64", overrides=FUSED
    )
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        verl_engine.run_train_step(stock_fused, stock_loss, batch())
    reuse = PrefixReuseConfig(min_prefix_len=9)  # the 9-token prompts' group (prefix 8) runs dense
    dense, prefix = engines(model_dir, "float64", stock_fused=False, reuse=reuse)
    error, got = step(dense, prefix, batch(), "float64")
    assert error < TOL["float64"], error
    m = reduced(got["metrics"])
    assert_reuse_ran(m, groups=1)
    assert m["prefix/fallback_short_prefix"] == 4
    with promote_fp32_upcasts():
        with unfused(dense[0]):
            want_infer = verl_engine.run_infer(dense[0], batch(), calculate_entropy=True)
        got_infer = verl_engine.run_infer(prefix[0], batch(), calculate_entropy=True)
    assert_infer_matches(want_infer, got_infer, TOL["float64"], groups=1)


def test_negative_control_fused_labels_one_position_late_fails(tiny_model, monkeypatch):
    model_dir = tiny_model("qwen2", tie_word_embeddings=True)
    dense, prefix = engines(model_dir, "float64")
    original = executor.fused_head

    def late(model, labels, temperature, backend):
        return original(model, labels.roll(1, dims=-1), temperature, backend)

    monkeypatch.setattr(executor, "fused_head", late)
    error, got = step(dense, prefix, batch(), "float64")
    assert_fused_reuse(got["metrics"], groups=2)
    assert error > 1e-3, error


def test_tree_loss_carrying_nodes_use_the_fused_kernel(tiny_model):
    """Tree rollouts sharing response stems: the nodes that carry loss compute their fused values in phase A (the
    LM head returns them, no logits), exact against the stock engine with fused kernels in fp64."""
    model_dir = tiny_model("qwen2", tie_word_embeddings=True)
    reuse = PrefixReuseConfig(min_prefix_len=2, min_group_size=1, tree=True, min_shared_tokens=2)
    dense, prefix = engines(model_dir, "float64", reuse=reuse, lr=0.0)
    data = shared_loss_batch()
    error, got = step(dense, prefix, data, "float64")
    assert error < TOL["float64"], error
    assert_shared_loss_ran(got["metrics"])
    with promote_fp32_upcasts():
        assert_infer_matches(
            verl_engine.run_infer(dense[0], data), verl_engine.run_infer(prefix[0], data), TOL["float64"], groups=4
        )


def test_per_sample_temperatures_are_refused_as_verl_refuses_them():
    assert scalar_temperature(torch.tensor([0.7, 0.7])) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="per-sample temperatures.*use_fused_kernels=false"):
        scalar_temperature(torch.tensor([0.7, 1.0]))
