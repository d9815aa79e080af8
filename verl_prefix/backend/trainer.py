"""A verl v1 trainer mode that keeps uid groups whole per rank, with our actor worker.

Select it with two lines on top of the stock ``python -m verl.trainer.main_ppo`` config::

    trainer.v1.trainer_mode=prefix_sync
    actor_rollout_ref.actor.strategy=prefix_fsdp2

It is verl's synchronous trainer with three changes: ``_balance_batch`` packs whole groups into
(rank, mini-batch) slots (``verl_prefix.backend.balance``) instead of sorting samples by length, the
actor/ref roles run ``PrefixActorRolloutRefWorker``, and the forward-only passes' ``prefix/...``
telemetry, which verl's trainer drops, is logged as ``actor/prefix/old_log_prob/...`` and
``actor/prefix/ref_log_prob/...``. verl compares ``trainer_mode == "sync"`` in
several places (replay buffer, refill, parameter sync), all read while the trainer is built: the
config says ``sync`` during construction, so every such check sees a synchronous trainer, and
``prefix_sync`` again afterwards, so the logged config says what was chosen.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from omegaconf import DictConfig, open_dict
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.metric import reduce_metrics
from verl.workers.engine_workers import ActorRolloutRefWorker

from verl_prefix.backend.balance import balance_groups
from verl_prefix.backend.plugin_check import check_plugin_on_nodes
from verl_prefix.backend.roots import prompt_rows, shared_roots
from verl_prefix.schedule.trie import DEFAULT_MIN_SHARED_TOKENS

logger = logging.getLogger(__name__)

TRAINER_MODE = "prefix_sync"
_ACTOR_ROLES = ("ActorRolloutRef", "ActorRollout", "Actor", "RefPolicy")


class PrefixActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's actor/rollout/ref worker, refusing to start if the prefix engine is not registered.

    verl skips a plugin that fails to import with a DEBUG log only; without this check a broken
    install would surface as an unknown-backend error deep inside engine construction, or not at all.
    """

    def __init__(self, config: DictConfig, role: str, **kwargs: Any) -> None:
        import verl_prefix

        if not verl_prefix.is_registered():
            raise RuntimeError(
                "verl_prefix is imported but prefix_fsdp2 is not registered in verl's EngineRegistry in this "
                "worker: install verl-prefix on every node (or ship it with the job's runtime_env)"
            )
        super().__init__(config, role, **kwargs)


@register_trainer(TRAINER_MODE)
class PrefixPPOTrainer(PPOTrainerSync):
    """The synchronous v1 trainer with group-keeping balancing and the prefix actor worker."""

    def __init__(self, config: DictConfig, *args: Any, **kwargs: Any) -> None:
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
        with forward_only_telemetry(self.actor_rollout_wg, "compute_log_prob", metrics, "actor/prefix/old_log_prob/"):
            return super()._compute_old_log_prob(batch, metrics)

    def _compute_ref_log_prob(self, batch: Any, metrics: dict) -> Any:
        # the worker group and method verl's _compute_ref_log_prob calls
        if self.ref_in_actor:
            worker_group, method = self.actor_rollout_wg, "compute_log_prob"
        else:
            worker_group, method = self.ref_policy_wg, "compute_ref_log_prob"
        with forward_only_telemetry(worker_group, method, metrics, "actor/prefix/ref_log_prob/"):
            return super()._compute_ref_log_prob(batch, metrics)

    def _mini_batches_per_rank(self, batch_size: int, dp_size: int) -> int:
        global_mini_batch = self.config.actor_rollout_ref.actor.ppo_mini_batch_size
        global_mini_batch *= self.config.actor_rollout_ref.rollout.n
        return max(batch_size // global_mini_batch, 1) if batch_size % global_mini_batch == 0 else 1

    def _tree_min_shared_tokens(self) -> int | None:
        """``min_shared_tokens`` where the actor runs ``prefix_reuse.tree`` (placement keeps shared roots
        together), else ``None``."""
        actor = self.config.actor_rollout_ref.actor
        reuse = actor.get("prefix_reuse") or (actor.get("fsdp_config") or {}).get("prefix_reuse") or {}
        if not reuse.get("tree", False) or not reuse.get("enable", True):
            return None
        return int(reuse.get("min_shared_tokens", DEFAULT_MIN_SHARED_TOKENS))

    def _balance_batch(
        self, batch: Any, metrics: dict, logging_prefix: str = "global_seqlen", keep_minibatch: bool = False
    ) -> Any:
        import transfer_queue as tq

        worker_group = self.actor_rollout_wg
        if "actor" not in worker_group._dispatch_info:
            worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
        dp_size = max(worker_group._dispatch_info["actor"]) + 1

        batch = upsample_batch_to_divisible_size(
            batch, self._get_required_batch_multiple(dp_size), self.tokenizer.eos_token_id
        )
        tree = self._tree_min_shared_tokens()
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
            mini_batches_per_rank=self._mini_batches_per_rank(len(batch), dp_size),
            splittable=[bool(tag.get("is_padding", False)) for tag in batch.tags],
            roots=roots,
        )
        batch.reorder(plan.order)
        metrics.update({f"actor/{k}": v for k, v in plan.metrics().items()})
        return batch


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


__all__ = [
    "PrefixActorRolloutRefWorker",
    "PrefixPPOTrainer",
    "TRAINER_MODE",
    "forward_only_telemetry",
    "prefix_metrics_of",
]
