"""verl 0.9.0's 16 Megatron GRPO recipes (``examples/grpo_trainer/*megatron*.sh`` of ``verl-project/verl`` at tag
v0.9.0, the Megatron Lite ones aside) and what ``prefix_megatron`` does with each, switched with the one selection
line (``actor_rollout_ref.actor.strategy=prefix_megatron``) and nothing else changed.

``RECIPES`` holds each recipe's training-side settings at its shell defaults (read from the scripts: the parallel
sizes verl's actor engine gets, offload, recompute, the MoE overrides) and what verl's loader builds from the
model's checkpoint where that decides (Megatron-Bridge 0.3.1's providers: DeepSeek-V3's expert bias; verl forces
``moe_router_load_balancing_type=none`` on that path unless a recipe sets it; sequence parallelism on at TP > 1).
``stops`` runs the engine's own checks on them, each setting on its own, so a recipe lists everything that stands
in its way, not only the first: the engine constructor's (``config.refusal``, ``model_refusal``, router replay)
and initialisation's (``moe.router_refusal``, ``moe.pipeline_refusal``, ``recompute.recompute_refusal``).
``render`` writes the table ``docs/megatron.md`` shows (``verl-prefix compat --megatron docs/megatron.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from verl_prefix.backend.config import PrefixReuseConfig
from verl_prefix.backend.megatron.config import model_refusal, refusal
from verl_prefix.backend.megatron.moe import counted_coefficients, pipeline_refusal, replay_refusal, router_refusal
from verl_prefix.backend.megatron.recompute import recompute_refusal
from verl_prefix.backend.recipe_keys import between_markers

# the engine-config knobs ``config.refusal`` reads, each checked on its own
_ENGINE_KNOBS = (
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "use_megatron_fsdp",
)
_TRANSFORMER_DEFAULTS = dict(
    num_moe_experts=None,
    moe_router_load_balancing_type="none",
    moe_aux_loss_coeff=0.0,
    moe_z_loss_coeff=None,
    moe_input_jitter_eps=None,
    moe_expert_capacity_factor=None,
    moe_router_enable_expert_bias=False,
    moe_router_force_load_balancing=False,
    recompute_granularity=None,
    fp8=None,
    fp4=None,
)


@dataclass(frozen=True)
class MegatronRecipe:
    """One recipe: its file, the HF ``model_type`` of its default model, the engine-config knobs it sets, and the
    megatron-core settings of the model verl builds for it (its overrides on top of the loader's)."""

    name: str
    model_type: str
    parallel: str  # TP / PP / VPP / CP / EP as the recipe sets them, for the table
    engine: dict[str, Any] = field(default_factory=dict)
    transformer: dict[str, Any] = field(default_factory=dict)
    offload: bool = False


def _moe(experts: int = 8, **settings: Any) -> dict[str, Any]:
    return {"num_moe_experts": experts, **settings}


_FULL = {"recompute_granularity": "full"}
_DSV3_BUILT = {"moe_router_enable_expert_bias": True}  # Megatron-Bridge's DeepSeek-V3 provider
_AUX_Z = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}

RECIPES: tuple[MegatronRecipe, ...] = (
    MegatronRecipe(
        "run_deepseek_v3_671b_megatron.sh", "deepseek_v3", "TP8 PP12 EP8",
        {"pipeline_model_parallel_size": 12}, {**_moe(), **_DSV3_BUILT, **_FULL, "sequence_parallel": True}, True,
    ),
    MegatronRecipe(
        "run_deepseek_v4_flash_megatron.sh", "deepseek_v4", "TP1 PP8 (layout) EP8",
        {"pipeline_model_parallel_size": 8, "router_replay": "R3"}, {**_moe(), **_FULL}, True,
    ),
    MegatronRecipe(
        "run_hy_v3_megatron.sh", "hy_v3", "TP1 PP16 CP8 EP8",
        {"pipeline_model_parallel_size": 16, "context_parallel_size": 8},
        {**_moe(moe_router_enable_expert_bias=True), **_FULL}, True,
    ),
    MegatronRecipe(
        "run_moonlight_16b_a3b_megatron.sh", "deepseek_v3", "TP4 PP3 EP4",
        {"pipeline_model_parallel_size": 3}, {**_moe(), **_DSV3_BUILT, "sequence_parallel": True},
    ),
    MegatronRecipe(
        "run_nemotron_nano_v3_30b_a3b_megatron.sh", "nemotron_h", "TP8 EP8",
        {}, {**_moe(), **_FULL, "sequence_parallel": True}, True,
    ),
    MegatronRecipe("run_qwen2-7b_math_megatron_fsdp.sh", "qwen2", "TP4 (megatron FSDP)", {"use_megatron_fsdp": True}),
    MegatronRecipe(
        "run_qwen2_5_vl_7b_megatron.sh", "qwen2_5_vl", "TP2 PP2",
        {"pipeline_model_parallel_size": 2}, {"sequence_parallel": True},
    ),
    MegatronRecipe(
        "run_qwen3_235b_a22b_megatron.sh", "qwen3_moe", "TP4 PP8 EP4",
        {"pipeline_model_parallel_size": 8}, {**_moe(), **_FULL, "sequence_parallel": True}, True,
    ),
    MegatronRecipe(
        "run_qwen3_30b_a3b_megatron.sh", "qwen3_moe", "TP4 PP2 VPP2 EP2",
        {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
        {**_moe(), **_FULL, "sequence_parallel": True}, True,
    ),
    MegatronRecipe(
        "run_qwen3_5_122b_a10b_megatron.sh", "qwen3_5_moe", "TP2 PP2 EP8",
        {"pipeline_model_parallel_size": 2}, {**_moe(), **_FULL, "sequence_parallel": True}, True,
    ),
    MegatronRecipe(
        "run_qwen3_5_35b_megatron.sh", "qwen3_5_moe", "TP2 EP8",
        {}, {**_moe(), **_AUX_Z, **_FULL, "sequence_parallel": True}, True,
    ),
    MegatronRecipe(
        "run_qwen3_5_397b_megatron.sh", "qwen3_5_moe", "TP2 PP2 EP64",
        {"pipeline_model_parallel_size": 2}, {**_moe(), **_AUX_Z, **_FULL, "sequence_parallel": True}, True,
    ),
    MegatronRecipe(
        "run_qwen3_8b_megatron.sh", "qwen3", "TP2 PP2", {"pipeline_model_parallel_size": 2}, {"sequence_parallel": True}
    ),
    MegatronRecipe(
        "run_qwen3_vl_235b_a22b_megatron.sh", "qwen3_vl_moe", "TP4 PP8 CP2 EP8",
        {"pipeline_model_parallel_size": 8, "context_parallel_size": 2},
        {**_moe(), **_FULL, "sequence_parallel": True}, True,
    ),
    MegatronRecipe(
        "run_qwen3_vl_30b_a3b_megatron.sh", "qwen3_vl_moe", "TP2 CP2 EP8",
        {"context_parallel_size": 2}, {**_moe(), **_AUX_Z, **_FULL, "sequence_parallel": True}, True,
    ),
    MegatronRecipe(
        "run_qwen3_vl_8b_megatron.sh", "qwen3_vl", "TP2 PP2",
        {"pipeline_model_parallel_size": 2}, {"sequence_parallel": True},
    ),
)  # fmt: skip


def engine_config(recipe: MegatronRecipe, **only: Any) -> SimpleNamespace:
    """The engine-config view the constructor's checks read: reuse on, the recipe's knobs (or ``only`` these)."""
    knobs = only if only else {k: v for k, v in recipe.engine.items() if k in _ENGINE_KNOBS}
    replay = SimpleNamespace(mode=recipe.engine.get("router_replay", "disabled") if not only else "disabled")
    return SimpleNamespace(prefix_reuse=PrefixReuseConfig(), router_replay=replay, **knobs)


def built_config(recipe: MegatronRecipe) -> SimpleNamespace:
    """The megatron-core ``TransformerConfig`` view initialisation's checks read."""
    return SimpleNamespace(**{**_TRANSFORMER_DEFAULTS, "sequence_parallel": False, **recipe.transformer})


def stops(recipe: MegatronRecipe) -> list[str]:
    """Every refusal the engine raises for the recipe, each setting checked on its own (empty: it reuses)."""
    found: list[str | None] = [
        refusal(engine_config(recipe, **{k: v})) for k, v in recipe.engine.items() if k in _ENGINE_KNOBS
    ]
    found.append(model_refusal(SimpleNamespace(model_type=recipe.model_type), engine_config(recipe)))
    found.append(replay_refusal(engine_config(recipe)))
    tf = built_config(recipe)
    found.append(router_refusal(tf))
    found.append(pipeline_refusal(tf, recipe.engine.get("pipeline_model_parallel_size", 1)))
    found.append(recompute_refusal(tf, aux_counted=any(counted_coefficients(tf))))
    return [reason for reason in found if reason]


def setting_of(reason: str) -> str:
    """The setting a refusal names (``prefix_megatron: KEY=VALUE is refused ...`` / ``model_type 'x'``)."""
    head = reason.removeprefix("prefix_megatron: ")
    return head.split(" is refused")[0].split(" with ")[0].split(" (")[0]


BEGIN, END = "<!-- megatron-recipes:begin -->", "<!-- megatron-recipes:end -->"


def with_table(page: str) -> str:
    """``page`` with ``render()`` between its recipe markers; ValueError without them."""
    return between_markers(page, BEGIN, END, render())


def render() -> str:
    """The table ``docs/megatron.md`` shows between its recipe markers."""
    lines = [
        "| recipe | model type | parallelism | recompute, offload | with `strategy=prefix_megatron` |",
        "|---|---|---|---|---|",
    ]
    for recipe in RECIPES:
        reasons = stops(recipe)
        state = "reuses" if not reasons else "stops at start-up: " + "; ".join(f"`{setting_of(r)}`" for r in reasons)
        extras = ", ".join(
            x for x in (recipe.transformer.get("recompute_granularity"), "offload" if recipe.offload else None) if x
        )
        lines.append(f"| `{recipe.name}` | `{recipe.model_type}` | {recipe.parallel} | {extras or '-'} | {state} |")
    return "\n".join(lines)
