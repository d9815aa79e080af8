"""verl's fused kernels (``use_fused_kernels=true``, ``torch`` backend on CPU) on vision-language models under reuse.

verl replaces each family's conditional-generation forward with its fused one (``forward_with_torch_backend`` of
``verl.models.transformers.qwen2_vl`` / ``qwen3_vl`` / ``qwen3_5``), which reads ``lm_head.weight`` directly: with
an untied head (its own FSDP2 unit) it meets the sharded weight (``aten.mm.default got mixed torch.Tensor and
DTensor``). Before, phase B ran that forward and crashed mid-step. Now the schedule's calls run the class's unfused
forward (verl's ``forward_with_normal_backend`` of its visual patch, remembered before the fused patch replaced it:
``hf_forwards.hf_causal_forward``) with the fused kernel computed inside the LM head's own call
(``schedule.fused_head``).

Qwen2.5-VL, Qwen3-VL and Qwen3.5 (its gated delta-nets), tied and untied heads, images in the shared prefix: every
parameter's gradient and the forward-only log-probs and entropies against the stock engine, fp64 (verl's kernel
returns fp32 log-probs, so the bound is fp32's), with the fused kernels where the stock engine runs them (tied) and
without where it cannot (untied: asserted to fail); reuse asserted, no mini-batch dense. The tree with images under
the setting too; the fused labels one position late fail.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from helpers.delta_rule import fp64_delta_net
from helpers.precision import promote_fp32_upcasts
from helpers.reuse import assert_reuse_ran, reduced
from helpers.vl_steps import worst

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import verl_engine
from verl_prefix.harness import vl as V
from verl_prefix.schedule import executor
from verl_prefix.schedule.fused_head import fused_backend
from verl_prefix.schedule.models.hf_forwards import hf_causal_forward
from verl_prefix.schedule.models.multimodal import text_only_call

TOL = 1e-6  # fp64 runs, fp32 log-probs out of verl's kernel
FUSED = [
    "actor_rollout_ref.model.use_fused_kernels=true",
    "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch",
]
IMAGES = [[(4, 4)], [(4, 8)], [(4, 4), (8, 4)], []]
G = 4


@pytest.fixture(autouse=True, scope="module")
def _forwards_back():
    """verl patches its fused forward onto each family's class for the whole process: put the classes' forwards
    back after this module, so later tests in the same worker build those classes unfused."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    classes = (
        modeling_qwen2_5_vl.Qwen2_5_VLForConditionalGeneration,
        modeling_qwen3_vl.Qwen3VLForConditionalGeneration,
        modeling_qwen3_5.Qwen3_5ForConditionalGeneration,
    )
    saved = {cls: vars(cls).get("forward") for cls in classes}
    yield
    for cls, forward in saved.items():
        cls.forward = forward


def _batch(family: str):
    return V.make_vl_grpo_batch(images=IMAGES, group_size=G, seed=5, use_kl=True, calculate_entropy=True, family=family)


def _engines(model_dir, stock_fused: bool, reuse: PrefixReuseConfig):
    args = dict(dtype="float64", micro_batch_size_per_gpu=2, use_kl_loss=True, entropy_coeff=0.01, lr=0.0)
    dense = verl_engine.build_verl_engine(model_dir, backend="fsdp2", overrides=FUSED if stock_fused else (), **args)
    prefix = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", overrides=FUSED, **args)
    prefix[0].reuse_config = reuse
    assert fused_backend(prefix[0].module) == "torch"  # verl patched its fused forward in
    return dense, prefix


def step(engine_and_loss, data) -> dict:
    """One update in fp64 with fp32 upcasts kept at fp64 (verl's fused kernel itself computes in fp32) and Qwen3.5's
    delta rule token by token in fp64; ``text_only_call`` for verl's placeholder vision pass."""
    engine, loss_fn, _ = engine_and_loss
    with promote_fp32_upcasts(), fp64_delta_net(engine.module), text_only_call(engine.module):
        return verl_engine.run_train_step(engine, loss_fn, data, capture_grads=True)


def infer(engine, data) -> dict:
    with promote_fp32_upcasts(), fp64_delta_net(engine.module), text_only_call(engine.module):
        return verl_engine.run_infer(engine, data, calculate_entropy=True)


def assert_same_log_probs(want: dict, got: dict) -> None:
    """Forward-only log-probs and entropies within ``TOL`` (verl's fused kernel returns fp32 values, its unfused path
    the model's dtype: compared in fp64), reuse asserted."""
    for key in ("response_log_probs", "response_entropy"):
        w, g = (x[key].values() if x[key].is_nested else x[key] for x in (want, got))
        torch.testing.assert_close(g.double(), w.double(), rtol=TOL, atol=TOL)
    assert_reuse_ran(reduced(got["metrics"]), groups=G)


def _stock_call(engine, stock_fused: bool):
    """The stock engine without fused kernels runs its class's unfused forward (verl patched the fused one onto
    the class for every instance in the process when the prefix engine was built)."""
    return nullcontext() if stock_fused else hf_causal_forward(engine.module)


def _compare(model_dir, family: str, tied: bool, reuse: PrefixReuseConfig) -> tuple[float, dict, dict, dict]:
    dense, prefix = _engines(model_dir, stock_fused=tied, reuse=reuse)
    data = _batch(family)
    with _stock_call(dense[0], tied):
        want = step(dense, data)
    got = step(prefix, data)
    with _stock_call(dense[0], tied):
        want_infer = infer(dense[0], data)
    got_infer = infer(prefix[0], data)
    return worst(got["grads"], want["grads"]), got, want_infer, got_infer


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_images_in_the_prefix_with_fused_kernels_match_the_stock_engine(tmp_path, family, tied):
    model_dir = V.write_tiny_vl_model(tmp_path / family, family, tie_word_embeddings=tied)
    error, got, want_infer, got_infer = _compare(model_dir, family, tied, PrefixReuseConfig(min_prefix_len=2))
    assert error < TOL, (family, tied, error)
    m = reduced(got["metrics"])
    assert_reuse_ran(m, groups=G)
    assert not any(v for k, v in m.items() if k.startswith("prefix/fallback_")), m
    assert m["prefix/vision_encoder_calls"] == 3  # once per group with images
    assert_same_log_probs(want_infer, got_infer)


def test_the_stock_engine_with_fused_kernels_and_an_untied_head_fails(tmp_path):
    """Why the untied cases compare against the stock engine without fused kernels: verl's own fused forward of a
    vision-language model reads the sharded LM head and fails at its first step."""
    model_dir = V.write_tiny_vl_model(tmp_path / "vl", "qwen2_5_vl")
    stock, loss_fn, _ = verl_engine.build_verl_engine(model_dir, backend="fsdp2", dtype="float64", overrides=FUSED)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        step((stock, loss_fn, None), _batch("qwen2_5_vl"))


def test_tree_with_images_and_fused_kernels(tmp_path):
    model_dir = V.write_tiny_vl_model(tmp_path / "vl", "qwen2_5_vl")
    reuse = PrefixReuseConfig(min_prefix_len=2, tree=True, min_shared_tokens=2)
    error, got, want_infer, got_infer = _compare(model_dir, "qwen2_5_vl", False, reuse)
    assert error < TOL, error
    m = reduced(got["metrics"])
    assert_reuse_ran(m, groups=G)
    assert m["prefix/tree_depth"] >= 1, m
    assert_same_log_probs(want_infer, got_infer)


def test_negative_control_fused_labels_one_position_late_fails(tmp_path, monkeypatch):
    model_dir = V.write_tiny_vl_model(tmp_path / "vl", "qwen2_5_vl")
    original = executor.fused_head

    def late(model, labels, temperature, backend):
        return original(model, labels.roll(1, dims=-1), temperature, backend)

    monkeypatch.setattr(executor, "fused_head", late)
    dense, prefix = _engines(model_dir, stock_fused=False, reuse=PrefixReuseConfig(min_prefix_len=2))
    data = _batch("qwen2_5_vl")
    with hf_causal_forward(dense[0].module):
        want = step(dense, data)
    got = step(prefix, data)
    assert_reuse_ran(reduced(got["metrics"]), groups=G)
    assert worst(got["grads"], want["grads"]) > 1e-3


# verl's fused forwards by the module that defines them, and the test above that runs each family through it
COVERED = {
    "qwen2_vl": "qwen2_5_vl",  # Qwen2-VL and Qwen2.5-VL share verl's module
    "qwen3_vl": "qwen3_vl",  # Qwen3-VL and Qwen3-VL-MoE share it
    "qwen3_5": "qwen3_5",  # Qwen3.5 and Qwen3.5-MoE share it
    "dense_common": "every text causal LM (test_fused_kernels_engine.py)",
}
NOT_COVERED = {"glm4v": "GLM-4.1V's images run dense under reuse (its 3D RoPE is not served yet); no tiny writer"}


def test_every_fused_forward_verl_installs_is_recognised_and_covered():
    """The families come from verl's own ``patch_forward_with_backends``, not a list kept here: each module it takes a
    fused forward from is recognised as fused (so the schedule's calls run the class's unfused forward) and is run
    by a test above, or named with its reason."""
    import importlib
    import inspect
    import re

    from verl.models.transformers import monkey_patch

    from verl_prefix.schedule.models.hf_forwards import is_fused_forward

    source = inspect.getsource(monkey_patch.patch_forward_with_backends)
    modules = set(re.findall(r"from verl\.models\.transformers\.(\w+) import forward_with_torch_backend", source))
    assert modules >= {"qwen2_vl", "qwen3_vl", "qwen3_5", "dense_common"}, modules
    for name in modules:
        module = importlib.import_module(f"verl.models.transformers.{name}")
        for kind in ("torch", "triton"):
            assert is_fused_forward(getattr(module, f"forward_with_{kind}_backend")), (name, kind)
        assert name in COVERED or name in NOT_COVERED, f"verl installs a fused forward from {name}: test it"
    unfused = importlib.import_module("verl.models.transformers.qwen2_vl").forward_with_normal_backend
    assert not is_fused_forward(unfused)
