"""The engine factories' flavor of the checkpoint (``backend.titan.checkpoint_flavor``): registered where verl's
shape lookup would find no torchtitan flavor, matching the checkpoint field by field, and left alone where
torchtitan has one; plus the CPU platform's training config (no CPU offload on CPU). No engine is built here:
``test_titan_engine`` and the ``ENGINE=torchtitan`` end-to-end run build them."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is an optional dependency (scripts/setup.sh installs it)")
pytest.importorskip("triton", reason="torchtitan 0.3.0's model stack imports triton (scripts/setup.sh installs it)")


def _qwen3(**changes):
    from transformers import AutoConfig

    shape = dict(
        hidden_size=48, num_hidden_layers=3, vocab_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, intermediate_size=80, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )  # fmt: skip
    return AutoConfig.for_model("qwen3", **{**shape, **changes})


def test_flavor_of_the_checkpoint_where_torchtitan_has_none():
    from verl_prefix.backend.titan.platform import ensure_titan_platform

    ensure_titan_platform()  # what the factories do first (verl's torchtitan package imports after it)
    from torchtitan.models import qwen3
    from transformers import AutoConfig
    from verl.workers.engine.torchtitan.utils import derive_torchtitan_name_and_flavor

    from verl_prefix.backend.titan.checkpoint_flavor import ensure_checkpoint_flavor, flavor_name
    from verl_prefix.backend.titan.flavor import flavor_mismatches

    hf = _qwen3()
    name = flavor_name(hf)
    qwen3.qwen3_configs.pop(name, None)
    try:
        with pytest.raises(ValueError, match="No matching torchtitan flavor"):
            derive_torchtitan_name_and_flavor(hf)
        assert ensure_checkpoint_flavor(hf) == name
        assert derive_torchtitan_name_and_flavor(hf) == ("qwen3", name)  # verl's lookup now finds it
        assert flavor_mismatches(qwen3.model_registry(name), hf) == []
        # another checkpoint of the same (hidden, layers, vocab) and other K/V heads: the flavor is rebuilt from it
        other = _qwen3(num_key_value_heads=4)
        assert any("num_key_value_heads" in m for m in flavor_mismatches(qwen3.model_registry(name), other))
        assert ensure_checkpoint_flavor(other) == name
        assert flavor_mismatches(qwen3.model_registry(name), other) == []
    finally:
        qwen3.qwen3_configs.pop(name, None)
    # torchtitan's own flavor of those shapes stands (debugmodel: 256 x 8 x 2048); a type not built here is verl's
    before = set(qwen3.qwen3_configs)
    assert ensure_checkpoint_flavor(_qwen3(hidden_size=256, num_hidden_layers=8, vocab_size=2048)) is None
    assert (
        ensure_checkpoint_flavor(
            AutoConfig.for_model("llama", hidden_size=48, num_hidden_layers=3, num_attention_heads=4)
        )
        is None
    )
    assert set(qwen3.qwen3_configs) == before


def test_cpu_platform_training_config_has_no_cpu_offload():
    """verl offloads a forward-only engine (the reference policy): on CPU that would pin memory, which needs an
    accelerator; the parameters are in host memory already."""
    from verl_prefix.backend.titan.platform import ensure_titan_platform

    impl = ensure_titan_platform()
    assert impl.TrainingConfig(enable_cpu_offload=True).enable_cpu_offload is False
    assert impl.TrainingConfig().disable_cuda_graphs is True
