"""Reuse under every verl trainer mode: selecting a prefix engine is enough.

verl's trainers balance each batch over data-parallel ranks by sequence length alone, which splits GRPO groups
across ranks and mini-batches so that reuse quietly shrinks or vanishes. ``install_trainer_hooks`` (run when the
plugin is imported) wraps the balancing every trainer runs: the v1 trainers' ``_balance_batch`` (``sync``,
``colocate_async``, ``separate_async``: one method of their base class) and the legacy ``RayPPOTrainer``'s
(``trainer.use_v1=false``). When ``actor_rollout_ref.actor.strategy`` names a prefix engine (``prefix_fsdp2``,
``prefix_torchtitan``) the wrapper packs whole groups into (rank, mini-batch) slots
(``verl_prefix.backend.trainer.balance``) and logs the forward-only passes' reuse telemetry; otherwise it
calls verl's own method unchanged, so a run that never selects a prefix engine trains exactly as before. Groups
that still end up split (one larger than a slot) are counted as ``actor/prefix/split_groups`` with one warning
naming the fix.

``prefix_sync``, the trainer mode earlier versions required, stays as an alias: it is verl's synchronous trainer
with the same balancing, refusing to start with a stock engine.

With two lines on top of the stock ``python -m verl.trainer.main_ppo`` config::

    trainer.v1.trainer_mode=prefix_sync
    actor_rollout_ref.actor.strategy=prefix_fsdp2

it is verl's synchronous trainer with three changes: ``_balance_batch`` packs whole groups into
(rank, mini-batch) slots (``verl_prefix.backend.trainer.balance``) instead of sorting samples by length, the
actor/ref roles run ``PrefixActorRolloutRefWorker``, and the forward-only passes' ``prefix/...``
telemetry, which verl's trainer drops, is logged as ``actor/prefix/old_log_prob/...`` and
``actor/prefix/ref_log_prob/...``. verl compares ``trainer_mode == "sync"`` in
several places (replay buffer, refill, parameter sync), all read while the trainer is built: the
config says ``sync`` during construction, so every such check sees a synchronous trainer, and
``prefix_sync`` again afterwards, so the logged config says what was chosen.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.metric import reduce_metrics
from verl.workers.engine_workers import ActorRolloutRefWorker

from verl_prefix.backend.plugin_check import check_plugin_on_nodes
from verl_prefix.backend.trainer.balance import balance_groups
from verl_prefix.backend.trainer.roots import prompt_rows, shared_roots
from verl_prefix.backend.trainer.selection import install_selection
from verl_prefix.schedule.tree.trie import DEFAULT_MIN_SHARED_TOKENS

logger = logging.getLogger(__name__)

TRAINER_MODE = "prefix_sync"
_ACTOR_ROLES = ("ActorRolloutRef", "ActorRollout", "Actor", "RefPolicy")


class PrefixActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's actor/rollout/ref worker, refusing to start if the prefix engine is not registered.

    verl skips a plugin that fails to import with a DEBUG log only; without this check a broken
    install would surface as an unknown-backend error deep inside engine construction, or not at all.
    """

    def __init__(self, config: DictConfig, role: str, **kwargs: Any) -> None:
        from verl_prefix.backend.fsdp.engine import is_registered

        if not is_registered():
            raise RuntimeError(
                "verl_prefix is imported but prefix_fsdp2 is not registered in verl's EngineRegistry in this "
                "worker: install verl-prefix on every node (or ship it with the job's runtime_env)"
            )
        super().__init__(config, role, **kwargs)


@register_trainer(TRAINER_MODE)
class PrefixPPOTrainer(PPOTrainerSync):
    """The synchronous v1 trainer with group-keeping balancing and the prefix actor worker."""

    def __init__(self, config: DictConfig, *args: Any, **kwargs: Any) -> None:
        if not keeps_groups(config):
            strategy = OmegaConf.select(config, "actor_rollout_ref.actor.strategy", default=None)
            raise ValueError(
                f"trainer.v1.trainer_mode={TRAINER_MODE} keeps uid groups whole for a prefix engine, but "
                f"actor_rollout_ref.actor.strategy={strategy} trains dense: add "
                "actor_rollout_ref.actor.strategy=prefix_fsdp2 (or prefix_torchtitan; selecting the engine is "
                f"enough under any trainer mode, {TRAINER_MODE} is an alias of sync). For a stock twin that "
                f"trains on the same mini-batches as a reuse run, add +{KEEP_GROUPS_KEY}=true"
            )
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"
        super().__init__(config, *args, **kwargs)
        # verl read "sync" into self.trainer_mode (and the replay buffer) above; the config a run logs
        # says what the user chose.
        with open_dict(config):
            config.trainer.v1.trainer_mode = TRAINER_MODE

    def _init_resource_pool_mgr(self) -> Any:
        # before any worker exists: a node without verl-prefix would fail with Ray's unpickling error
        check_plugin_on_nodes()
        result = super()._init_resource_pool_mgr()
        for role in list(self.role_worker_mapping):
            if _role_name(role) in _ACTOR_ROLES:
                self.role_worker_mapping[role] = ray.remote(PrefixActorRolloutRefWorker)
        return result

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        with old_log_prob_telemetry(self, metrics):
            return super()._compute_old_log_prob(batch, metrics)

    def _compute_ref_log_prob(self, batch: Any, metrics: dict) -> Any:
        with ref_log_prob_telemetry(self, metrics):
            return super()._compute_ref_log_prob(batch, metrics)

    def _balance_batch(
        self, batch: Any, metrics: dict, logging_prefix: str = "global_seqlen", keep_minibatch: bool = False
    ) -> Any:
        return keep_groups_balance(self, batch, metrics)


# a stock engine's run that balances like a reuse run (an A/B twin on the same mini-batches)
KEEP_GROUPS_KEY = "trainer.v1.keep_groups_for_stock_engine"


def prefix_engine_selected(config: Any) -> bool:
    """Whether the run's actor trains on a prefix engine (``actor_rollout_ref.actor.strategy=prefix_*``)."""
    strategy = OmegaConf.select(config, "actor_rollout_ref.actor.strategy", default=None) if config else None
    return str(strategy or "").startswith("prefix_")


def keeps_groups(config: Any) -> bool:
    """Whether the trainer balances by whole uid groups: a prefix engine, or a stock one asked to
    (``+trainer.v1.keep_groups_for_stock_engine=true``, a twin comparing like with like)."""
    twin = OmegaConf.select(config, KEEP_GROUPS_KEY, default=False) if config else False
    return prefix_engine_selected(config) or bool(twin)


def mini_batches_per_rank(config: Any, batch_size: int) -> int:
    """How many mini-batches each rank's share of a ``batch_size`` batch is cut into (verl's rule)."""
    global_mini_batch = config.actor_rollout_ref.actor.ppo_mini_batch_size
    global_mini_batch *= config.actor_rollout_ref.rollout.n
    return max(batch_size // global_mini_batch, 1) if batch_size % global_mini_batch == 0 else 1


def tree_min_shared_tokens(config: Any) -> int | None:
    """``min_shared_tokens`` where the actor runs ``prefix_reuse.tree`` (placement keeps shared roots together),
    else ``None``."""
    actor = config.actor_rollout_ref.actor
    reuse = actor.get("prefix_reuse") or (actor.get("fsdp_config") or {}).get("prefix_reuse") or {}
    if not reuse.get("tree", False) or not reuse.get("enable", True):
        return None
    return int(reuse.get("min_shared_tokens", DEFAULT_MIN_SHARED_TOKENS))


_SPLIT_WARNED: set[str] = set()


def _report(plan: Any, metrics: dict) -> None:
    """The plan's balance metrics, ``actor/prefix/split_groups``, and one warning per process if any split."""
    metrics.update({f"actor/{k}": v for k, v in plan.metrics().items()})
    metrics["actor/prefix/split_groups"] = float(plan.split_groups)
    if plan.split_groups and "split" not in _SPLIT_WARNED:
        _SPLIT_WARNED.add("split")
        logger.warning(
            "prefix reuse: %d uid groups did not fit one (rank, mini-batch) slot and were split (each part still "
            "reuses its prefix on its rank, the saving shrinks): raise actor_rollout_ref.actor.ppo_mini_batch_size "
            "or lower the number of data-parallel ranks so that a slot holds whole groups "
            "(actor/prefix/split_groups)",
            plan.split_groups,
        )


def keep_groups_balance(trainer: Any, batch: Any, metrics: dict) -> Any:
    """A v1 trainer's ``_balance_batch`` that keeps uid groups whole: upsample as verl does, then pack whole
    groups (and, under the tree, groups sharing a root) into (rank, mini-batch) slots."""
    import transfer_queue as tq

    worker_group = trainer.actor_rollout_wg
    if "actor" not in worker_group._dispatch_info:
        worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
    dp_size = max(worker_group._dispatch_info["actor"]) + 1

    batch = upsample_batch_to_divisible_size(
        batch, trainer._get_required_batch_multiple(dp_size), trainer.tokenizer.eos_token_id
    )
    tree = tree_min_shared_tokens(trainer.config)
    fields = ["uid", "prompts"] if tree else ["uid"]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    uids = data["uid"]
    uids = [str(u) for u in (uids.tolist() if hasattr(uids, "tolist") else list(uids))]
    roots = shared_roots(prompt_rows(data["prompts"], batch.tags), uids, tree) if tree else None
    plan = balance_groups(
        prompt_lens=[int(tag["prompt_len"]) for tag in batch.tags],
        response_lens=[int(tag["response_len"]) for tag in batch.tags],
        uids=uids,
        dp_size=dp_size,
        mini_batches_per_rank=mini_batches_per_rank(trainer.config, len(batch)),
        splittable=[bool(tag.get("is_padding", False)) for tag in batch.tags],
        roots=roots,
    )
    batch.reorder(plan.order)
    _report(plan, metrics)
    return batch


def keep_groups_balance_legacy(trainer: Any, batch: Any, metrics: dict) -> None:
    """The legacy ``RayPPOTrainer._balance_batch`` (``trainer.use_v1=false``, a ``DataProto`` reordered in place)
    keeping uid groups whole, with the same planner."""
    mask = batch.batch["attention_mask"]
    responses = batch.batch["responses"].shape[-1]
    response_lens = mask[:, -responses:].sum(-1).tolist()
    prompt_lens = mask[:, :-responses].sum(-1).tolist()
    uids = [str(u) for u in batch.non_tensor_batch["uid"]]
    dp_size = trainer._get_dp_size(trainer.actor_rollout_wg, "actor")
    tree = tree_min_shared_tokens(trainer.config)
    roots = None
    if tree:
        rows = [row[-int(n) :] if n else row[:0] for row, n in zip(batch.batch["prompts"], prompt_lens)]
        roots = shared_roots(rows, uids, tree)
    plan = balance_groups(
        prompt_lens=[int(p) for p in prompt_lens],
        response_lens=[int(r) for r in response_lens],
        uids=uids,
        dp_size=dp_size,
        mini_batches_per_rank=mini_batches_per_rank(trainer.config, len(uids)),
        splittable=[False] * len(uids),
        roots=roots,
    )
    batch.reorder(torch.tensor(plan.order))
    _report(plan, metrics)


@contextmanager
def old_log_prob_telemetry(trainer: Any, metrics: dict) -> Iterator[None]:
    with forward_only_telemetry(trainer.actor_rollout_wg, "compute_log_prob", metrics, "actor/prefix/old_log_prob/"):
        yield


@contextmanager
def ref_log_prob_telemetry(trainer: Any, metrics: dict) -> Iterator[None]:
    # the worker group and method verl's _compute_ref_log_prob calls
    if trainer.ref_in_actor:
        worker_group, method = trainer.actor_rollout_wg, "compute_log_prob"
    else:
        worker_group, method = trainer.ref_policy_wg, "compute_ref_log_prob"
    with forward_only_telemetry(worker_group, method, metrics, "actor/prefix/ref_log_prob/"):
        yield


def _selected(trainer: Any) -> bool:
    return prefix_engine_selected(getattr(trainer, "config", None))


def _keeps_groups(trainer: Any) -> bool:
    return keeps_groups(getattr(trainer, "config", None))


def _with_telemetry(original: Any, telemetry: Any) -> Any:
    """A forward-only pass of verl's v1 trainer base logging the engine's reuse telemetry when a prefix engine is
    selected (``prefix_sync`` logs its own)."""

    @functools.wraps(original)
    def wrapped(self: Any, batch: Any, metrics: dict) -> Any:
        if not _selected(self) or isinstance(self, PrefixPPOTrainer):
            return original(self, batch, metrics)
        with telemetry(self, metrics):
            return original(self, batch, metrics)

    return wrapped


def install_trainer_hooks() -> None:
    """Wrap the balancing (and the forward-only passes' telemetry) of every verl trainer so that a prefix engine
    gets whole groups under any trainer mode; a run without a prefix engine calls verl's methods unchanged.
    Idempotent."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    if getattr(PPOTrainer._balance_batch, "_verl_prefix", False):
        return
    v1_balance, legacy_balance = PPOTrainer._balance_batch, RayPPOTrainer._balance_batch
    v1_old, v1_ref = PPOTrainer._compute_old_log_prob, PPOTrainer._compute_ref_log_prob
    v1_pools = PPOTrainer._init_resource_pool_mgr

    @functools.wraps(v1_balance)
    def balance(self: Any, batch: Any, metrics: dict, *args: Any, **kwargs: Any) -> Any:
        if _keeps_groups(self):
            return keep_groups_balance(self, batch, metrics)
        return v1_balance(self, batch, metrics, *args, **kwargs)

    @functools.wraps(legacy_balance)
    def balance_legacy(self: Any, batch: Any, metrics: dict, *args: Any, **kwargs: Any) -> Any:
        if _keeps_groups(self):
            return keep_groups_balance_legacy(self, batch, metrics)
        return legacy_balance(self, batch, metrics, *args, **kwargs)

    @functools.wraps(v1_pools)
    def resource_pools(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _selected(self) and not isinstance(self, PrefixPPOTrainer):
            check_plugin_on_nodes()  # before any worker exists, as prefix_sync does
        return v1_pools(self, *args, **kwargs)

    old_log_prob = _with_telemetry(v1_old, old_log_prob_telemetry)
    ref_log_prob = _with_telemetry(v1_ref, ref_log_prob_telemetry)
    for wrapper in (balance, balance_legacy, old_log_prob, ref_log_prob, resource_pools):
        wrapper._verl_prefix = True
    PPOTrainer._init_resource_pool_mgr = resource_pools
    PPOTrainer._balance_batch = balance
    RayPPOTrainer._balance_batch = balance_legacy
    PPOTrainer._compute_old_log_prob = old_log_prob
    PPOTrainer._compute_ref_log_prob = ref_log_prob


@contextmanager
def forward_only_telemetry(worker_group: Any, method: str, metrics: dict, prefix: str) -> Iterator[None]:
    """Log the ``prefix/...`` metrics of every ``worker_group.<method>`` call inside the block under ``prefix``.

    The worker's ``infer_batch`` returns the engine's metrics (all-gathered over data-parallel ranks) in the
    output's ``extra_info``, and verl's v1 trainer discards them. The call is wrapped for the block only,
    then restored.
    """
    original = getattr(worker_group, method)
    shadowed = method in vars(worker_group)

    def call_and_collect(*args: Any, **kwargs: Any) -> Any:
        output = original(*args, **kwargs)
        metrics.update(prefix_metrics_of(output, prefix))
        return output

    setattr(worker_group, method, call_and_collect)
    try:
        yield
    finally:
        if shadowed:
            setattr(worker_group, method, original)
        else:
            delattr(worker_group, method)


def prefix_metrics_of(output: Any, prefix: str) -> dict[str, float]:
    """The engine's ``prefix/...`` metrics in a forward-only worker output, reduced over ranks and
    mini-batches the way verl reduces actor metrics (``max`` in the key: max, else mean)."""
    extra_info = getattr(output, "extra_info", None) or {}
    worker_metrics = extra_info.get("metrics")
    if isinstance(worker_metrics, list):  # one copy per collecting rank, each gathered over the DP group
        worker_metrics = worker_metrics[0] if worker_metrics else None
    if not isinstance(worker_metrics, dict):
        return {}
    flat = {
        prefix + key.removeprefix("prefix/"): _flatten(value)
        for key, value in worker_metrics.items()
        if key.startswith("prefix/")
    }
    return {key: float(value) for key, value in reduce_metrics(flat).items()}


def _flatten(value: Any) -> list[float]:
    if isinstance(value, list | tuple):
        return [x for item in value for x in _flatten(item)]
    return [float(value)]


def _role_name(role: Any) -> str:
    return getattr(role, "name", str(role))


install_trainer_hooks()
install_selection()

__all__ = [
    "PrefixActorRolloutRefWorker",
    "PrefixPPOTrainer",
    "TRAINER_MODE",
    "forward_only_telemetry",
    "install_trainer_hooks",
    "keeps_groups",
    "keep_groups_balance",
    "keep_groups_balance_legacy",
    "prefix_engine_selected",
    "prefix_metrics_of",
]
