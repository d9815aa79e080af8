"""The CPU loop's Ray worker processes: one run's own, or shared by a series of runs.

A run of the CPU loop builds its trainer's actor (and ref) worker classes into Ray actors, one per
data-parallel rank, as ``PPOTrainer._setup`` does. Starting those processes (the Python interpreter, verl,
torch and transformers imported in each) costs about ten CPU-seconds a rank, most of a short run's work.
``WorkerHosts`` starts the ranks once for a series of runs known in advance: each run's worker classes are
colocated in the same Ray actors (verl's ``create_colocated_worker_cls``, as verl colocates the actor and
ref roles), each under its own name, and a run builds its workers' engines (``init_model``) when it starts.
The worker instances are the classes the run's trainer registered, with its own config; what they share
is the process, the gloo process group and the imports.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

WORKER_ENV = {
    "VERL_PLATFORM": "cpu",
    "VERL_ENGINE_DEVICE": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "offline",
    "HF_HUB_OFFLINE": "1",
}
ACTOR, REF = "actor", "ref"  # verl's role names (str(Role.Actor), str(Role.RefPolicy)): the group keys


@dataclass(frozen=True)
class RoleClasses:
    """The worker classes a trainer registered, keyed by verl's role name (``actor``, and ``ref`` if used)."""

    classes: dict[str, Any]  # role -> RayClassWithInitArgs
    ref_in_actor: bool

    def names(self) -> dict[str, str]:
        """Role -> worker class name, as the run reports them."""
        return {role: c.cls.__ray_actor_class__.__name__ for role, c in self.classes.items()}


def role_classes(trainer: Any) -> RoleClasses:
    """The actor (and ref) worker classes of ``trainer``, with the actor-only role of non-colocated rollouts.

    The classes come from the trainer's own ``_init_resource_pool_mgr`` (where ``prefix_sync`` registers
    ``PrefixActorRolloutRefWorker``). As in ``PPOTrainer._setup``, a ref role sits in the actor's pool, and
    LoRA (``ref_in_actor``) needs no ref worker.
    """
    from verl.single_controller.ray import RayClassWithInitArgs
    from verl.trainer.ppo.utils import Role

    trainer._enable_hybrid_replicas = False  # role = Role.Actor: no rollout engine inside the worker
    trainer._init_resource_pool_mgr()
    model = trainer.config.actor_rollout_ref.model
    lora_rank = model.get("lora", {}).get("rank", 0)
    if lora_rank <= 0:
        lora_rank = model.get("lora_rank", 0)
    ref_in_actor = lora_rank > 0 or model.get("lora_adapter_path") is not None
    classes = {
        ACTOR: RayClassWithInitArgs(
            cls=trainer.role_worker_mapping[Role.Actor],
            config=trainer.config.actor_rollout_ref,
            distillation_config=trainer.config.get("distillation"),
            role=ACTOR,
        )
    }
    if trainer.use_reference_policy and not ref_in_actor:
        if trainer.mapping[Role.RefPolicy] != trainer.mapping[Role.Actor]:
            raise NotImplementedError("the CPU loop colocates the ref with the actor, as verl's global_pool does")
        classes[REF] = RayClassWithInitArgs(
            cls=trainer.role_worker_mapping[Role.RefPolicy],
            config=trainer.config.actor_rollout_ref,
            role=REF,
        )
    return RoleClasses(classes, ref_in_actor)


@dataclass
class RunWorkers:
    """One run's worker groups: the actor group and the ref group (``None`` without a ref worker)."""

    actor: Any
    ref: Any | None
    names: dict[str, str]  # role -> worker class name

    def init_models(self, trainer: Any, ref_in_actor: bool) -> None:
        """Build the engines in ``_setup``'s order (actor first, then ref) and hand the ref group to ``trainer``."""
        self.actor.init_model()
        if self.ref is not None:
            self.ref.init_model()
            trainer.ref_policy_wg = self.ref
        trainer.ref_in_actor = ref_in_actor
        if ref_in_actor:
            trainer.ref_policy_wg = self.actor


def _start(class_dict: dict[str, Any], world_size: int) -> tuple[dict[str, Any], Any, list[Any]]:
    """``world_size`` Ray actors colocating every class of ``class_dict``; (groups by key, pool, actors)."""
    from verl.single_controller.ray import RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import create_colocated_worker_cls

    pool = RayResourcePool(
        process_on_nodes=[world_size], use_gpu=False, max_colocate_count=1, name_prefix=f"cpu_{uuid.uuid4().hex[:6]}"
    )
    wg_dict = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=create_colocated_worker_cls(class_dict=class_dict),
        device_name="cpu",
        worker_env={**WORKER_ENV, "OMP_NUM_THREADS": "1"},
    )
    return wg_dict.spawn(prefix_set=class_dict.keys()), pool, list(wg_dict.workers)


def _stop(actors: list[Any], pool: Any) -> None:
    """Kill the Ray actors (every colocated group shares them) and free their bundles."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for worker in actors:
        ray.kill(worker)
    for pg in pool.pgs or []:
        remove_placement_group(pg)


@contextmanager
def own_workers(trainer: Any, world_size: int) -> Iterator[RunWorkers]:
    """One run's worker processes, started for it and killed after it; engines built, ref group set."""
    roles = role_classes(trainer)
    groups, pool, actors = _start(roles.classes, world_size)
    try:
        workers = RunWorkers(groups[ACTOR], groups.get(REF), roles.names())
        workers.init_models(trainer, roles.ref_in_actor)
        yield workers
    finally:
        _stop(actors, pool)


class WorkerHosts:
    """Ray actors, one per rank, hosting the workers of every run of a series (see the module docstring).

    Built by ``worker_hosts`` from the runs' configs. A run reserves the slot of its config (``reserve``, with
    the config as ``cpu_grpo_config`` returned it: a trainer edits its config) and builds its workers with
    ``build`` once its trainer exists.
    """

    def __init__(self, configs: Sequence[Any], slots: list[RunWorkers], ref_in_actor: list[bool]) -> None:
        self._configs = list(configs)  # plain containers, taken before any trainer saw the configs
        self._slots = slots
        self._ref_in_actor = ref_in_actor
        self._taken = [False] * len(slots)

    def reserve(self, config: Any) -> int:
        """The first unused slot reserved for ``config``; a clear error if there is none."""
        want = plain_config(config)
        for i, have in enumerate(self._configs):
            if not self._taken[i] and have == want:
                self._taken[i] = True
                return i
        raise ValueError(
            "no unused worker slot for this run's config: pass every run's cpu_grpo_config(...) to worker_hosts, "
            "with the same arguments as the run (each slot serves one run)"
        )

    def build(self, slot: int, trainer: Any) -> RunWorkers:
        """Slot ``slot``'s workers with their engines built for ``trainer`` (the classes it registered)."""
        names = role_classes(trainer).names()
        if self._slots[slot].names != names:
            raise RuntimeError(f"slot {slot} hosts {self._slots[slot].names}, the trainer registered {names}")
        self._slots[slot].init_models(trainer, self._ref_in_actor[slot])
        return self._slots[slot]


def plain_config(config: Any) -> Any:
    """``config`` as plain Python containers, interpolations resolved: what two runs' configs compare by."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(config, resolve=True)


@contextmanager
def worker_hosts(configs: Sequence[Any], world_size: int) -> Iterator[WorkerHosts]:
    """Start ``world_size`` Ray actors hosting the workers of one run per config (``cpu_grpo_config``).

    Needs a Ray cluster and TransferQueue (``cpu_loop.local_cluster``). Each config's trainer is built here
    only to learn its worker classes; ``run_cpu_grpo(..., workers=hosts)`` builds the run's own trainer.
    """
    from verl.trainer.ppo.v1 import get_trainer_cls

    class_dict, keys, ref_in_actor = {}, [], []
    requested = [plain_config(c) for c in configs]
    for i, config in enumerate(configs):
        roles = role_classes(get_trainer_cls(config.trainer.v1.trainer_mode)(config))
        keys.append({role: f"r{i}_{role}" for role in roles.classes})
        class_dict.update({keys[-1][role]: cls for role, cls in roles.classes.items()})
        ref_in_actor.append(roles.ref_in_actor)
    groups, pool, actors = _start(class_dict, world_size)
    try:
        slots = [
            RunWorkers(
                groups[k[ACTOR]],
                groups[k[REF]] if REF in k else None,
                {role: class_dict[key].cls.__ray_actor_class__.__name__ for role, key in k.items()},
            )
            for k in keys
        ]
        yield WorkerHosts(requested, slots, ref_in_actor)
    finally:
        _stop(actors, pool)


__all__ = [
    "WORKER_ENV",
    "RoleClasses",
    "RunWorkers",
    "WorkerHosts",
    "own_workers",
    "plain_config",
    "role_classes",
    "worker_hosts",
]
