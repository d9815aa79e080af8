"""One selection line: ``actor_rollout_ref.actor.strategy=prefix_<engine>`` builds the prefix engine for the actor and
the reference policy, or the worker stops.

verl copies ``actor.strategy`` into the engine config (what ``EngineRegistry.new`` builds from) only for its FSDP
actor config; its Megatron and TorchTitan actor configs keep ``strategy: megatron`` / ``torchtitan`` on their engine
configs, and its Megatron/TorchTitan reference configs pin ``strategy`` to the stock name. So
``actor.strategy=prefix_megatron`` alone would build verl's own engine: no reuse, no refusal, no warning.

``select_engines`` rewrites a worker's ``actor_rollout_ref`` config before verl converts it: where the actor names a
prefix engine, its engine config becomes the prefix engine's config class (verl's fields and values kept, the reuse
knobs at their defaults unless set), and a reference policy on the same engine family follows it, with the actor's
reuse knobs unless it carries its own (one log line says so). ``install_selection`` runs it at the top of every
``ActorRolloutRefWorker.init_model``, whatever the trainer mode, and afterwards ``built_refusal`` stops the worker
if an engine that is not a prefix engine was built anyway (a custom ``_target_``, an explicit stock strategy).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from verl_prefix.backend.config import PREFIX_BACKEND
from verl_prefix.backend.megatron.config import MEGATRON_BACKEND
from verl_prefix.backend.titan.config import TITAN_BACKEND

logger = logging.getLogger(__name__)

# the dormant-policy knobs travel with ``prefix_reuse`` where the engine config carries them
_KNOBS = ("prefix_reuse", "dormant_prefix", "dormant_prefix_budget_bytes")


@dataclass(frozen=True)
class EngineFamily:
    """A prefix engine and the stock engine it replaces, as verl's actor/ref YAML names them."""

    prefix: str  # the prefix engine's strategy
    stock: tuple[str, ...]  # verl's strategies of the same engine
    engine_key: str  # the actor/ref config's engine sub-config
    stock_targets: tuple[str, ...]  # verl's engine config classes the prefix class replaces
    prefix_target: str  # the prefix engine's config class
    engine_strategy: bool  # whether the engine config carries ``strategy`` itself (verl copies it only for FSDP)


FAMILIES = (
    EngineFamily(
        PREFIX_BACKEND,
        ("fsdp", "fsdp2"),
        "fsdp_config",
        ("verl.workers.config.FSDPEngineConfig",),
        "verl_prefix.config.PrefixFSDPEngineConfig",
        engine_strategy=False,
    ),
    EngineFamily(
        MEGATRON_BACKEND,
        ("megatron",),
        "megatron",
        ("verl.workers.config.McoreEngineConfig",),
        "verl_prefix.config.PrefixMcoreEngineConfig",
        engine_strategy=True,
    ),
    EngineFamily(
        TITAN_BACKEND,
        ("torchtitan",),
        "torchtitan",
        ("verl.workers.config.TorchtitanEngineConfig",),
        "verl_prefix.config.PrefixTorchtitanEngineConfig",
        engine_strategy=True,
    ),
)


def family_of(strategy: Any) -> EngineFamily | None:
    """The family whose prefix engine ``strategy`` names, or None."""
    return next((f for f in FAMILIES if f.prefix == strategy), None)


def _engine_to_prefix(role: DictConfig, family: EngineFamily) -> None:
    """The role's engine config as the prefix engine's config class, where it is verl's own (or unnamed)."""
    engine = role.get(family.engine_key)
    if engine is None:
        return
    target = engine.get("_target_")
    if target is None or target in family.stock_targets:
        engine["_target_"] = family.prefix_target
    if family.engine_strategy and engine.get("strategy", family.stock[0]) in family.stock:
        engine["strategy"] = family.prefix


def _knobs(role: DictConfig, family: EngineFamily) -> dict[str, Any]:
    """The reuse knobs a role's config carries (on the role for ``PrefixFSDPActorConfig``, else on its engine)."""
    found: dict[str, Any] = {}
    for node in (role, role.get(family.engine_key) or {}):
        for key in _KNOBS:
            if key in node and node[key] is not None and key not in found:
                value = node[key]
                found[key] = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
    return found


def select_engines(config: DictConfig) -> list[str]:
    """Rewrite ``config`` (a worker's ``actor_rollout_ref``) in place so that verl builds the prefix engine the
    actor names, for the actor and the reference policy; returns what changed, one line per role."""
    actor = config.get("actor")
    family = family_of(actor.get("strategy")) if actor is not None else None
    if family is None:
        return []
    said = []
    with open_dict(config):
        if family.engine_strategy:  # verl's FSDP actor config copies actor.strategy into its engine config itself
            _engine_to_prefix(actor, family)
        ref = config.get("ref")
        if ref is not None and (ref.get("strategy") in family.stock or ref.get("strategy") == family.prefix):
            pinned = ref.get("strategy")
            ref["strategy"] = family.prefix
            own = _knobs(ref, family)
            # a ref that names its own prefix_reuse was configured on purpose: nothing of the actor's is added
            copied = {} if "prefix_reuse" in own else {k: v for k, v in _knobs(actor, family).items() if k not in own}
            if family.engine_strategy or copied:
                _engine_to_prefix(ref, family)
            engine = ref.get(family.engine_key)
            for key, value in copied.items() if engine is not None else ():
                engine[key] = value
            if pinned != family.prefix or copied:
                said.append(
                    f"reference policy: actor.strategy={family.prefix}, so ref (strategy={pinned}) builds "
                    f"{family.prefix} with "
                    + ("the actor's reuse knobs" if copied else "its own reuse knobs" if own else "the default knobs")
                    + f" (+actor_rollout_ref.ref.{family.engine_key}.prefix_reuse.enable=false turns reuse off there)"
                )
    return said


def built_refusal(strategy: Any, role: str, engine: Any) -> str | None:
    """Why a worker must stop: the actor named a prefix engine and ``engine`` (built for ``role``) is not one."""
    family = family_of(strategy)
    if family is None or engine is None:
        return None
    from verl_prefix.backend.driver import ReuseDriver

    if isinstance(engine, ReuseDriver):
        return None
    return (
        f"actor_rollout_ref.actor.strategy={family.prefix} names a prefix engine, but the {role} built "
        f"{type(engine).__name__} (verl's own engine: no reuse). An override sends it there: "
        f"actor_rollout_ref.{role}.{family.engine_key}._target_ (it must be {family.prefix_target} or a subclass) "
        f"or actor_rollout_ref.{role}.{family.engine_key}.strategy (it must be {family.prefix}); remove it, or "
        f"select verl's engine with actor_rollout_ref.actor.strategy={family.stock[-1]}"
    )


def install_selection() -> None:
    """Wrap verl's ``ActorRolloutRefWorker.init_model`` (every trainer mode builds its engines there): the config
    rewritten first (``select_engines``), the built engines checked after (``built_refusal``). Idempotent."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    original = ActorRolloutRefWorker.init_model
    if getattr(original, "_verl_prefix", False):
        return

    @functools.wraps(original)  # keeps verl's dispatch registration (an attribute of the function)
    def init_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        for line in select_engines(self.config):
            logger.warning(line)
        result = original(self, *args, **kwargs)
        strategy = self.config.actor.get("strategy")
        for role in ("actor", "ref"):
            worker = getattr(self, role, None) if role in self.role else None
            reason = built_refusal(strategy, role, getattr(worker, "engine", None))
            if reason is not None:
                raise RuntimeError(reason)
        return result

    init_model._verl_prefix = True  # type: ignore[attr-defined]
    ActorRolloutRefWorker.init_model = init_model
