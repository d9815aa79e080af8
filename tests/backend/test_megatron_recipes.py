"""verl 0.9.0's 16 Megatron GRPO recipes against ``prefix_megatron`` (``backend/megatron/recipes.py``): the table
``docs/megatron.md`` shows is the render of what the engine's checks say of each recipe's settings, and the engine's
constructor itself stops on each recipe's settings with the first of them, naming it (built from verl's own
``McoreEngineConfig`` fields through ``PrefixMcoreEngineConfig``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from verl_prefix.backend.megatron import recipes

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_table_is_the_render():
    page = (ROOT / "docs" / "megatron.md").read_text()
    assert recipes.with_table(page) == page, "regenerate: verl-prefix compat --megatron docs/megatron.md"


def test_sixteen_recipes_each_stopped_or_reusing_with_the_settings_named():
    assert len(recipes.RECIPES) == len({r.name for r in recipes.RECIPES}) == 16
    for recipe in recipes.RECIPES:
        for reason in recipes.stops(recipe):
            # each names the setting and a fix that runs: verl's own engine (reuse off) among them
            assert reason.startswith("prefix_megatron: ") and "prefix_reuse.enable=false" in reason, reason
    # what this release serves stops no recipe on its own: recompute and offload, expert bias under pipeline
    # stages, sequence parallelism and recompute
    plain = recipes.MegatronRecipe("x", "qwen3", "TP2", {}, {"recompute_granularity": "full"}, offload=True)
    assert recipes.stops(plain) == []
    bias = {"num_moe_experts": 4, "moe_router_enable_expert_bias": True, "sequence_parallel": True}
    biased = recipes.MegatronRecipe(
        "x", "qwen3_moe", "TP2 PP2 EP2", {"pipeline_model_parallel_size": 2}, {**bias, "recompute_granularity": "full"}
    )
    assert recipes.stops(biased) == []
    # the aux loss is served without recompute or pipeline stages, refused with either
    aux = {"num_moe_experts": 4, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01}
    assert recipes.stops(recipes.MegatronRecipe("x", "qwen3_moe", "TP2 EP2", {}, aux)) == []
    staged = recipes.MegatronRecipe("x", "qwen3_moe", "PP2", {"pipeline_model_parallel_size": 2}, aux)
    assert [recipes.setting_of(r) for r in recipes.stops(staged)] == ["moe_aux_loss_coeff=0.01"]
    recomputed = recipes.MegatronRecipe("x", "qwen3_moe", "EP2", {}, {**aux, "recompute_granularity": "full"})
    assert [recipes.setting_of(r) for r in recipes.stops(recomputed)] == ["recompute_granularity='full'"]
    virtual = recipes.MegatronRecipe("x", "qwen3", "PP2 VPP2", {"virtual_pipeline_model_parallel_size": 2})
    assert recipes.stops(virtual) == []


# the recipes the table says reuse, and the acceptance test that runs each one's settings, scaled down to four CPU
# ranks with a tiny model of its family, exactly against verl's engine at the same layout
ACCEPTED = {
    "run_qwen3_8b_megatron.sh": "pp2_tp2",  # TP2 PP2, qwen3
    "run_qwen3_235b_a22b_megatron.sh": "pp2_tp2_ep2_moe",  # TP4 PP8 EP4, full recompute, offload, qwen3_moe
    "run_deepseek_v3_671b_megatron.sh": "pp2_tp2_ep2_moe",  # TP8 PP12 EP8, expert bias, full recompute, offload
    "run_moonlight_16b_a3b_megatron.sh": "pp2_tp2_ep2_moe",  # TP4 PP3 EP4, expert bias
    "run_qwen3_30b_a3b_megatron.sh": "pp2_vpp2_tp2_ep2_moe",  # TP4 PP2 VPP2 EP2, full recompute, offload
}


def test_every_recipe_the_table_calls_reusing_has_its_acceptance_run():
    from test_megatron_pipeline import LAYOUTS

    reusing = {r.name for r in recipes.RECIPES if not recipes.stops(r)}
    assert reusing == set(ACCEPTED), reusing
    assert set(ACCEPTED.values()) <= set(LAYOUTS)


def test_negative_control_a_setting_the_engine_refuses_is_reported():
    """A recipe the table would call reusing if a check were skipped: context parallelism added to a plain one."""
    plain = recipes.MegatronRecipe("x", "qwen3", "TP2")
    assert recipes.stops(plain) == []
    with_cp = recipes.MegatronRecipe("x", "qwen3", "TP2 CP2", {"context_parallel_size": 2})
    assert [recipes.setting_of(r) for r in recipes.stops(with_cp)] == ["context_parallel_size=2"]


@pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is optional")
@pytest.mark.parametrize("recipe", recipes.RECIPES, ids=lambda r: r.name)
def test_the_engine_constructor_stops_each_recipe(recipe):
    """The engine as verl's worker constructs it (its engine config from the recipe's knobs, the model's type):
    where a constructor-time setting stands in the way it raises before building anything, naming the first."""
    from verl.workers.config import EngineRouterReplayConfig

    from verl_prefix.backend.megatron.config import PrefixMcoreEngineConfig
    from verl_prefix.backend.megatron.engine import PrefixMegatronEngineWithLMHead

    knobs = {k: v for k, v in recipe.engine.items() if k != "router_replay"}
    replay = EngineRouterReplayConfig(mode=recipe.engine.get("router_replay", "disabled"))
    config = PrefixMcoreEngineConfig(router_replay=replay, **knobs)
    model = SimpleNamespace(hf_config=SimpleNamespace(model_type=recipe.model_type), lora=None)
    constructor = [r for r in recipes.stops(recipe) if "recompute_granularity" not in r and "moe_" not in r]
    if not constructor:  # what the constructor checks lets it through (initialisation's checks: the table's)
        from verl_prefix.backend.megatron.config import model_refusal, refusal
        from verl_prefix.backend.megatron.moe import replay_refusal

        assert refusal(config) is None and replay_refusal(config) is None
        assert model_refusal(model.hf_config, config) is None
        return
    with pytest.raises(ValueError) as raised:
        PrefixMegatronEngineWithLMHead(model, config)
    assert recipes.setting_of(str(raised.value)) == recipes.setting_of(constructor[0])
