"""A real GRPO loop on CPU: verl's trainer and actor workers, with HF ``generate`` standing in for rollout.

verl 0.9.1 has no CPU rollout (its rollout is a vLLM/SGLang server), so ``python -m verl.trainer.main_ppo``
cannot run on a CPU machine. This module runs everything else of a v1 training step for real:

- a local Ray cluster and verl's TransferQueue (the v1 trainer's data plane);
- the trainer class ``trainer.v1.trainer_mode`` selects (``prefix_sync`` -> ``PrefixPPOTrainer``, ``sync`` ->
  verl's ``PPOTrainerSync``), whose ``step()`` does what it does on a GPU cluster: the replay buffer samples
  the finished groups, ``_balance_batch`` orders them over the data-parallel ranks, the actor's
  ``compute_log_prob`` gives old log-probs, GRPO advantages come from ``compute_grpo_outcome_advantage``
  and ``update_actor`` trains;
- the actor worker class the trainer registers for its actor role (``PrefixActorRolloutRefWorker`` or verl's
  ``ActorRolloutRefWorker``), 2 ranks in Ray actors built by verl's ``RayWorkerGroup``, FSDP2 over gloo;
- when the config needs a reference policy (``actor.use_kl_loss`` or ``algorithm.use_kl_in_reward``), the
  class registered for the ref role, colocated in the same Ray actors as verl colocates it, and the ref
  log-prob pass of ``step()`` on its engine (``ref.strategy`` follows ``actor.strategy``).

Three stand-ins replace what needs an inference server; a GPU cluster uses verl's own instead:

- ``HFRollout`` replaces ``AgentLoopManagerTQ`` with its vLLM servers and reward loop: it samples ``n``
  responses per prompt with HF ``generate`` on the driver, scores them with ``EchoTask``'s rule, and writes
  each trajectory into TransferQueue with the keys, fields and tags ``AgentLoopWorkerTQ`` writes;
- ``WeightSync`` replaces the checkpoint-engine weight sync: after each update the actor saves its weights
  with its own registered ``save_checkpoint`` (HF format) and the rollout model loads them;
- a list of toy prompt batches replaces the parquet dataloader.

Each step's metrics go to verl's ``Tracking`` as ``fit()`` logs them (``trainer.logger``; the loop's
default is ``[console]``, add ``wandb`` through ``overrides``; wandb reads ``WANDB_MODE``/``WANDB_DIR``).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl_prefix.tools.cpu_loop.workers import ACTOR, REF, WORKER_ENV, RunWorkers, WorkerHosts, own_workers

logger = logging.getLogger(__name__)

PARTITION = "train"


@dataclass(frozen=True)
class EchoTask:
    """A toy task with a rule-based reward: answer with words that occur in the prompt.

    Prompts are ``<s>`` plus random ordinary words; the reward is the fraction of a response's words
    (EOS excluded) found in the prompt. A random-init policy already scores between 0 and 1 with spread
    inside each group, so GRPO advantages are non-zero from the first step, and the policy can learn it.
    """

    prompt_len: tuple[int, int] = (36, 48)
    max_new_tokens: int = 8
    first_word: int = 4  # ids below are <pad> <unk> <s> </s> in write_tiny_model's tokenizer

    def prompts(self, rng: np.random.Generator, num: int, vocab_size: int) -> list[str]:
        """``num`` prompt texts; the tokenizer maps each word to one id."""
        lo, hi = self.prompt_len
        texts = []
        for _ in range(num):
            words = rng.integers(self.first_word, vocab_size, size=int(rng.integers(lo, hi + 1)))
            texts.append(" ".join(["<s>", *(f"t{w}" for w in words)]))
        return texts

    def reward(self, prompt_ids: Sequence[int], response_ids: Sequence[int], eos_id: int) -> float:
        """Fraction of response words that appear in the prompt; an empty answer scores 0."""
        words = [t for t in response_ids if t != eos_id]
        if not words:
            return 0.0
        allowed = set(prompt_ids)
        return sum(t in allowed for t in words) / len(words)


@dataclass
class Trajectory:
    """One sampled response, as the rollout produced it (kept so another run can replay it)."""

    prompt_ids: list[int]
    response_ids: list[int]
    reward: float
    log_probs: list[float]  # the sampler's log-prob of each response token (verl's rollout_log_probs)


class HFRollout:
    """Stand-in for ``AgentLoopManagerTQ``: HF ``generate`` + rule reward, results written to TransferQueue.

    ``generate_sequences`` has the manager's contract: take the prompt batch the trainer submitted (with
    ``uid`` and ``global_steps``), put ``{uid}_{session}_0`` trajectories with the agent loop's fields and
    tags, then mark each prompt ``finished`` so the replay buffer can sample its group. With ``replay``
    (one list of groups per step, as ``recorded`` holds) it writes those trajectories instead of sampling,
    so two trainer backends can be compared on identical batches.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        task: EchoTask,
        *,
        n: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
        replay: list[list[list[Trajectory]]] | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()
        self.task, self.n, self.seed, self.replay = task, n, seed, replay
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=max(top_k, 0))
        self.weight_version = 0
        self.recorded: list[list[list[Trajectory]]] = []
        self.seconds: list[float] = []  # wall time of each generate_sequences call (sampling or replay)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Install the actor's weights (the checkpoint engine's job on a GPU cluster)."""
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        tied = {k for k in missing if k.endswith("lm_head.weight") and self.model.config.tie_word_embeddings}
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"rollout weights do not match the model: missing={missing}, unexpected={unexpected}")
        self.weight_version = version

    @torch.no_grad()
    def _sample(self, prompt_ids: list[int], step: int, index: int) -> list[Trajectory]:
        torch.manual_seed(self.seed * 1_000_003 + step * 1009 + index)
        ids = torch.tensor([prompt_ids] * self.n, dtype=torch.int64)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=self.task.max_new_tokens,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_scores=True,
            **self.sampling,
        )
        tokens = out.sequences[:, len(prompt_ids) :]
        # scores are the processed logits the sampler drew from (temperature, top-k, top-p applied)
        log_probs = torch.stack(out.scores, dim=1).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        group = []
        for row, lp in zip(tokens.tolist(), log_probs.tolist()):
            if self.tokenizer.eos_token_id in row:  # keep EOS, drop the padding generate adds after it
                row = row[: row.index(self.tokenizer.eos_token_id) + 1]
            reward = self.task.reward(prompt_ids, row, self.tokenizer.eos_token_id)
            group.append(Trajectory(list(prompt_ids), row, reward, lp[: len(row)]))
        return group

    def generate_sequences(self, batch: Any) -> None:
        """Sample (or replay) every prompt's group and publish it to TransferQueue like the agent loop."""
        import transfer_queue as tq
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        start = time.perf_counter()
        step = len(self.recorded)
        global_steps = int(batch["global_steps"])
        uids = [str(u) for u in batch["uid"]]
        texts = list(batch["raw_prompt"])
        groups = []
        if self.replay is not None and (step >= len(self.replay) or len(self.replay[step]) != len(uids)):
            raise ValueError(f"replay has no step {step} of {len(uids)} prompts: use the recorded run's settings")
        for index, (uid, text) in enumerate(zip(uids, texts)):
            if self.replay is not None:
                group = self.replay[step][index]
                if len(group) != self.n:
                    raise ValueError(f"replayed group has {len(group)} samples, rollout.n is {self.n}")
            else:
                prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                group = self._sample(prompt_ids, step, index)
            groups.append(group)
            tq.kv_put(key=uid, partition_id=PARTITION, tag={"status": "running"})
            keys, fields, tags = [], [], []
            for session_id, traj in enumerate(group):
                output = AgentLoopOutput(
                    prompt_ids=traj.prompt_ids,
                    response_ids=traj.response_ids,
                    response_mask=[1] * len(traj.response_ids),
                    response_logprobs=traj.log_probs,
                    reward_score=traj.reward,
                    num_turns=2,
                    metrics=AgentLoopMetrics(),
                    extra_fields={"min_global_steps": self.weight_version, "max_global_steps": self.weight_version},
                )
                sample = output.as_dict()
                sample.update(uid=uid, index=index, global_steps=global_steps, session_id=session_id, raw_prompt=text)
                sample["loss_mask"] = sample["response_mask"]
                sample["input_ids"] = torch.cat([sample["prompts"], sample["responses"]])
                sample["position_ids"] = torch.arange(sample["input_ids"].numel(), dtype=torch.int64)
                p_len, r_len = len(traj.prompt_ids), len(traj.response_ids)
                keys.append(f"{uid}_{session_id}_0")
                fields.append(sample)
                tags.append(
                    {
                        "status": "success",
                        "prompt_len": p_len,
                        "response_len": r_len,
                        "seq_len": p_len + r_len,
                        "global_steps": global_steps,
                        "min_global_steps": self.weight_version,
                        "max_global_steps": self.weight_version,
                    }
                )
            tq.kv_batch_put(keys=keys, fields=list_of_dict_to_tensordict(fields), tags=tags, partition_id=PARTITION)
            tq.kv_put(key=uid, partition_id=PARTITION, tag={"status": "finished"})
        self.recorded.append(groups)
        self.seconds.append(time.perf_counter() - start)


class WeightSync:
    """Stand-in for ``CheckpointEngineManager``: moves the actor's weights to the rollout after each update.

    The actor worker saves them with its registered ``save_checkpoint`` (``save_contents=[hf_model]``:
    the full, unsharded HF state dict, in the training dtype); the rollout loads that file. The same
    snapshots are the run's parameter history.
    """

    def __init__(self, actor_wg: Any, rollout: HFRollout, workdir: Path) -> None:
        self.actor_wg, self.rollout, self.workdir = actor_wg, rollout, workdir
        self.history: dict[int, dict[str, torch.Tensor]] = {}

    def update_weights(self, global_steps: int) -> None:
        """Snapshot the actor after ``global_steps`` updates and load it into the rollout model."""
        from safetensors.torch import load_file

        path = self.workdir / f"global_step_{global_steps}"
        self.actor_wg.save_checkpoint(str(path), None, global_steps, None)
        files = sorted((path / "huggingface").glob("*.safetensors"))
        if not files:
            raise RuntimeError(f"the actor's save_checkpoint wrote no HF weights under {path}")
        state = {k: v for f in files for k, v in load_file(str(f)).items()}
        self.history[global_steps] = state
        self.rollout.load_weights(state, global_steps)

    def sleep_replicas(self) -> None:
        """Nothing to free: the stand-in's rollout model is a CPU copy on the driver."""


class _NoRewardLoop:
    """The stand-in rollout scores trajectories itself, as verl's streaming reward loop does (no colocated RM)."""

    reward_loop_worker_handles: list = []


@dataclass
class StepResult:
    """What one GRPO step of the loop produced."""

    step: int
    metrics: dict[str, float]
    params: dict[str, torch.Tensor]  # full parameters after the update
    rank_uids: list[list[str]]  # uid of each sample in the order dispatched, one list per data-parallel rank
    groups: list[list[Trajectory]]


@dataclass
class CPULoopRun:
    """A finished run: initial parameters, per-step results, and the rollouts (to replay in another run)."""

    mode: str  # trainer.v1.trainer_mode as requested
    trainer: str  # the trainer class that mode selected
    worker: str  # the actor worker class that trainer registered
    strategy: str
    initial_params: dict[str, torch.Tensor]
    steps: list[StepResult] = field(default_factory=list)
    rollouts: list[list[list[Trajectory]]] = field(default_factory=list)
    seconds: float = 0.0
    loggers: list[str] = field(default_factory=list)  # trainer.logger: the Tracking backends that got the metrics
    wandb_run_dir: str | None = None  # the wandb run's directory (offline: the one to `wandb sync`)
    ref_worker: str | None = None  # the ref worker class, when the config needs a reference policy


def cpu_grpo_config(
    model_dir: str | os.PathLike,
    *,
    prefix: bool,
    steps: int,
    num_prompts: int = 4,
    n: int = 4,
    world_size: int = 2,
    micro_batch_size_per_gpu: int = 4,
    optimizer: str = "AdamW",
    lr: float = 1e-3,
    overrides: Sequence[str] = (),
) -> Any:
    """verl's composed ``ppo_trainer`` config for the CPU loop, validated as ``main_ppo`` validates it.

    ``prefix`` selects the two lines a user adds (``trainer.v1.trainer_mode=prefix_sync``,
    ``actor.strategy=prefix_fsdp2``); otherwise the stock ``sync`` mode and ``fsdp2``. One PPO mini-batch
    per step (``ppo_mini_batch_size = train_batch_size``): then the update does not depend on how the
    balancer orders samples, so the two modes can be compared. fp32 throughout, sdpa, no remove-padding.
    Metrics are logged to ``trainer.logger=[console]`` under ``trainer.project_name=verl_prefix_cpu_loop``
    and ``trainer.experiment_name=<mode>-<strategy>``; ``overrides`` may change all three. The reference
    policy is set up like the actor (fp32, no compile, same micro-batch), so that KL runs (``overrides``
    with ``actor.use_kl_loss=true``) compare as sharply; without KL verl builds no ref worker.
    """
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_prefix.harness.verl_engine import compose_ppo_config

    a, r, m = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model"
    ref = "actor_rollout_ref.ref"
    base = [
        f"{m}.path='{Path(model_dir).resolve()}'",
        f"+{m}.override_config.attn_implementation=sdpa",
        f"{m}.use_remove_padding=false",
        f"{m}.enable_gradient_checkpointing=false",
        f"trainer.v1.trainer_mode={'prefix_sync' if prefix else 'sync'}",
        f"{a}.strategy={'prefix_fsdp2' if prefix else 'fsdp2'}",
        "trainer.logger=[console]",
        "trainer.project_name=verl_prefix_cpu_loop",
        f"trainer.experiment_name={'prefix_sync-prefix_fsdp2' if prefix else 'sync-fsdp2'}",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={world_size}",
        "trainer.device=cpu",
        "trainer.critic_warmup=0",
        f"trainer.total_training_steps={steps}",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"data.train_batch_size={num_prompts}",
        f"{r}.n={n}",
        f"{r}.temperature=1.0",
        f"{r}.log_prob_micro_batch_size_per_gpu={micro_batch_size_per_gpu}",
        f"{a}.ppo_mini_batch_size={num_prompts}",
        f"{a}.ppo_micro_batch_size_per_gpu={micro_batch_size_per_gpu}",
        f"{a}.ppo_epochs=1",
        f"{a}.shuffle=false",
        f"{a}.use_kl_loss=false",
        f"{a}.entropy_coeff=0.0",
        f"{a}.use_torch_compile=false",
        f"{a}.optim.optimizer={optimizer}",
        f"{a}.optim.lr={lr}",
        f"{a}.optim.total_training_steps={steps}",
        f"{a}.fsdp_config.model_dtype=fp32",
        f"+{a}.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}",
        f"{a}.fsdp_config.use_torch_compile=false",
        f"{a}.checkpoint.save_contents=[hf_model]",
        # verl's ref FSDP defaults: bf16 params (mixed_precision unset) and torch.compile
        f"{ref}.log_prob_micro_batch_size_per_gpu={micro_batch_size_per_gpu}",
        f"{ref}.fsdp_config.model_dtype=fp32",
        f"+{ref}.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}",
        f"{ref}.fsdp_config.use_torch_compile=false",
        "transfer_queue.enable=true",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]
    config = compose_ppo_config([*base, *overrides])
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    return config


@contextmanager
def local_cluster(num_cpus: int = 16, log_to_driver: bool = True) -> Iterator[None]:
    """A local Ray cluster (no dashboard) and TransferQueue for the loop; reuses ones already running.

    ``log_to_driver=False`` keeps the workers' output in Ray's session logs instead of this terminal.
    ``num_cpus`` is logical (the ranks take one each): Ray keeps at most that many worker processes, actors
    included, and kills an idle task worker above it, so with 4 the two ranks and TransferQueue's two actors
    left no room for the plugin check's task worker, and each check started (and imported verl in) a new one.
    """
    import ray
    import transfer_queue as tq

    from verl_prefix.backend.platform_cpu import ensure_cpu_platform

    ensure_cpu_platform()
    for key, val in WORKER_ENV.items():  # raylet and workers inherit the driver's environment
        if key != "WANDB_MODE":  # the driver's Tracking follows the caller's wandb settings
            os.environ.setdefault(key, val)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=log_to_driver,
            runtime_env={"env_vars": dict(WORKER_ENV)},
        )
    started_tq = False
    try:
        if tq.interface._TQ_CLIENT is None:
            tq.init(_default_tq_config())
            started_tq = True
        yield
    finally:
        if started_tq:
            tq.close()
        if started_ray:
            ray.shutdown()


def _default_tq_config() -> Any:
    from verl_prefix.harness.verl_engine import compose_ppo_config

    conf = compose_ppo_config(["transfer_queue.backend.SimpleStorage.num_data_storage_units=1"]).transfer_queue
    conf.enable = True
    return conf


def run_cpu_grpo(
    model_dir: str | os.PathLike,
    *,
    prefix: bool,
    steps: int = 2,
    num_prompts: int = 4,
    n: int = 4,
    world_size: int = 2,
    seed: int = 0,
    task: EchoTask | None = None,
    overrides: Sequence[str] = (),
    replay: list[list[list[Trajectory]]] | None = None,
    workdir: str | os.PathLike | None = None,
    micro_batch_size_per_gpu: int = 4,
    optimizer: str = "AdamW",
    lr: float = 1e-3,
    progress: Callable[[str], None] | None = None,
    workers: WorkerHosts | None = None,
) -> CPULoopRun:
    """Run ``steps`` GRPO steps of verl's v1 trainer on CPU with ``world_size`` actor ranks.

    ``prefix=True`` is our trainer mode and worker with ``prefix_fsdp2``; ``False`` is verl's stock
    ``sync`` trainer, ``ActorRolloutRefWorker`` and ``fsdp2``. ``replay`` feeds another run's rollouts
    (``CPULoopRun.rollouts``) instead of sampling, so both backends train on identical batches. Starts
    Ray and TransferQueue unless they are running (see ``local_cluster``). ``optimizer`` is a
    ``torch.optim`` class name (verl's ``actor.optim.optimizer``); comparisons of two backends are
    sharpest with ``SGD``, whose update is proportional to the gradient (AdamW's first step is nearly
    ``lr * sign(grad)`` and hides gradient-scale errors). Each step's metrics are logged through verl's
    ``Tracking`` (``trainer.logger``, see ``cpu_grpo_config``); ``progress`` receives one line per stage.
    The run starts its own worker processes and kills them after it, unless ``workers`` (from
    ``cpu_workers.worker_hosts``, which must have been given this run's config) hosts them.
    """
    from verl.trainer.ppo.v1 import get_trainer_cls

    task = task or EchoTask()
    config = cpu_grpo_config(
        model_dir,
        prefix=prefix,
        steps=steps,
        num_prompts=num_prompts,
        n=n,
        world_size=world_size,
        micro_batch_size_per_gpu=micro_batch_size_per_gpu,
        optimizer=optimizer,
        lr=lr,
        overrides=overrides,
    )
    start = time.perf_counter()
    mode = config.trainer.v1.trainer_mode
    say = progress or (lambda _: None)
    with local_cluster(), tempfile.TemporaryDirectory(dir=workdir) as tmp:
        slot = workers.reserve(config) if workers is not None else None  # before the trainer edits the config
        trainer = get_trainer_cls(mode)(config)
        trainer._init_tokenizer()
        ref_note = " with a reference policy" if trainer.use_reference_policy else ""
        where = "in the shared worker processes" if workers is not None else f"on {world_size} new actor ranks"
        say(f"{mode}/{config.actor_rollout_ref.actor.strategy}: starting {where}{ref_note}")
        if workers is not None and slot is not None:
            hosted: AbstractContextManager[RunWorkers] = nullcontext(workers.build(slot, trainer))
        else:
            hosted = own_workers(trainer, world_size)
        with hosted as wg:
            run = CPULoopRun(
                mode=mode,
                trainer=type(trainer).__name__,
                worker=wg.names[ACTOR],
                strategy=config.actor_rollout_ref.actor.strategy,
                initial_params={},
                ref_worker=wg.names.get(REF) if wg.ref is not None else None,
            )
            _train(run, trainer, wg.actor, config, model_dir, task, steps, seed, replay, Path(tmp), say)
    run.seconds = time.perf_counter() - start
    return run


def _train(
    run: CPULoopRun,
    trainer: Any,
    actor_wg: Any,
    config: Any,
    model_dir: str | os.PathLike,
    task: EchoTask,
    steps: int,
    seed: int,
    replay: list[list[list[Trajectory]]] | None,
    workdir: Path,
    say: Callable[[str], None],
) -> None:
    """The body of ``PPOTrainer.fit`` for ``steps`` steps, minus validation and checkpoints."""
    import transfer_queue as tq
    from verl.utils.skip import SkipManager

    stale = list((tq.kv_list(PARTITION) or {}).get(PARTITION, {}))
    if stale:  # left by an earlier run in the same cluster that failed mid-step
        tq.kv_clear(keys=stale, partition_id=PARTITION)
    rollout_cfg = config.actor_rollout_ref.rollout
    rollout = HFRollout(
        model_dir,
        task,
        n=rollout_cfg.n,
        temperature=rollout_cfg.temperature,
        top_p=rollout_cfg.top_p,
        top_k=rollout_cfg.top_k,
        seed=seed,
        replay=replay,
    )
    rng = np.random.default_rng(seed)
    vocab = len(rollout.tokenizer)
    num_prompts = config.data.train_batch_size
    # The dataloader stand-in: the trainer fetches one batch dict per step and adds uids itself.
    trainer.train_dataloader = [
        {"raw_prompt": np.array(task.prompts(rng, num_prompts, vocab), dtype=object)} for _ in range(steps)
    ]
    trainer.train_dataloader_it = None
    trainer.actor_rollout_wg = actor_wg
    trainer.reward_loop_manager = _NoRewardLoop()
    trainer.agent_loop_manager = rollout
    trainer.checkpoint_manager = WeightSync(actor_wg, rollout, workdir)
    trainer.curr_step_profile = False
    trainer.global_steps = 0
    SkipManager.init(config)

    trainer.timing_raw = {}
    trainer.on_init_end()  # PPOTrainerSync: first weight sync to the rollout
    run.initial_params = trainer.checkpoint_manager.history[0]
    tracking = _tracking(config)
    run.loggers = list(tracking.logger)
    if "wandb" in tracking.logger and tracking.logger["wandb"].run is not None:
        run.wandb_run_dir = str(Path(tracking.logger["wandb"].run.dir).parent)
    try:
        _steps(run, trainer, actor_wg, rollout, tracking, steps, say)
    except BaseException:
        tracking.finish(exit_code=1)
        raise
    tracking.finish()
    run.rollouts = rollout.recorded


def _tracking(config: Any) -> Any:
    """verl's ``Tracking`` built as ``PPOTrainer.fit`` builds it (project, experiment, backends, config)."""
    from omegaconf import OmegaConf
    from verl.utils.tracking import Tracking

    return Tracking(
        project_name=config.trainer.project_name,
        experiment_name=config.trainer.experiment_name,
        default_backend=list(config.trainer.logger),
        config=OmegaConf.to_container(config, resolve=True),
    )


def _steps(
    run: CPULoopRun,
    trainer: Any,
    actor_wg: Any,
    rollout: HFRollout,
    tracking: Any,
    steps: int,
    say: Callable[[str], None],
) -> None:
    """``fit()``'s step loop: step, weight sync, metrics, TransferQueue cleanup, ``logger.log``."""
    import transfer_queue as tq
    from verl.utils.debug import marked_timer
    from verl.utils.skip import SkipManager

    for step in range(1, steps + 1):
        trainer.global_steps = step
        SkipManager.set_step(step)
        metrics: dict[str, Any] = {}
        trainer.timing_raw = {}
        with marked_timer("step", trainer.timing_raw):
            batch = trainer.step(metrics, trainer.timing_raw)
            trainer.on_step_end()  # weights -> rollout, and the snapshot we compare
            metrics.update(trainer._consume_sync_metrics())
        trainer._compute_metrics(batch, metrics, trainer.timing_raw, global_steps=step, epoch=0)
        tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
        tracking.log(data=metrics, step=step)
        per_rank = len(batch.keys) // actor_wg.world_size
        rank_uids = [
            [k.split("_")[0] for k in batch.keys[r * per_rank : (r + 1) * per_rank]] for r in range(actor_wg.world_size)
        ]
        run.steps.append(
            StepResult(
                step=step,
                metrics={k: float(v) for k, v in metrics.items() if np.isscalar(v)},
                params=trainer.checkpoint_manager.history[step],
                rank_uids=rank_uids,
                groups=rollout.recorded[-1],
            )
        )
        say(
            f"{run.mode}/{run.strategy}: step {step}/{steps} done in {trainer.timing_raw['step']:.1f} s "
            f"({'replayed' if rollout.replay is not None else 'sampled'} rollout {rollout.seconds[-1]:.2f} s, "
            f"update_actor {trainer.timing_raw.get('update_actor', float('nan')):.2f} s)"
        )


def split_groups(rank_uids: list[list[str]]) -> int:
    """Number of uid groups whose samples landed on more than one data-parallel rank."""
    ranks: dict[str, set[int]] = {}
    for rank, uids in enumerate(rank_uids):
        for uid in uids:
            ranks.setdefault(uid, set()).add(rank)
    return sum(len(r) > 1 for r in ranks.values())


def update_agreement(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], want_before: dict[str, torch.Tensor]
) -> dict[str, float]:
    """How far ``got`` is from ``want``, relative to the update ``want`` made from ``want_before``.

    ``global``: ||got - want|| / ||want - want_before|| over all parameters; ``worst_tensor``: the same per
    tensor, the largest (tensors the update did not move are skipped).
    """
    diff2 = upd2 = 0.0
    worst = 0.0
    for name, w in want.items():
        g, b = got[name].double(), want_before[name].double()
        d = (g - w.double()).norm().item()
        u = (w.double() - b).norm().item()
        diff2, upd2 = diff2 + d * d, upd2 + u * u
        if u > 0:
            worst = max(worst, d / u)
    return {"global": (diff2**0.5) / (upd2**0.5) if upd2 > 0 else 0.0, "worst_tensor": worst}


def compare_runs(reference: CPULoopRun, other: CPULoopRun) -> list[dict[str, float]]:
    """Per step: how far ``other``'s parameters and gradient norm are from ``reference``'s.

    ``update_rel`` / ``update_rel_worst_tensor`` come from ``update_agreement`` against the reference's
    update of that step; ``grad_norm_rel`` compares verl's pre-clip ``actor/grad_norm``.
    """
    out = []
    before = reference.initial_params
    for ref, got in zip(reference.steps, other.steps, strict=True):
        agreement = update_agreement(got.params, ref.params, before)
        ref_norm, got_norm = ref.metrics["actor/grad_norm"], got.metrics["actor/grad_norm"]
        out.append(
            {
                "step": float(ref.step),
                "update_rel": agreement["global"],
                "update_rel_worst_tensor": agreement["worst_tensor"],
                "grad_norm_rel": abs(got_norm - ref_norm) / abs(ref_norm) if ref_norm else abs(got_norm),
            }
        )
        before = ref.params
    return out


__all__ = [
    "CPULoopRun",
    "EchoTask",
    "HFRollout",
    "StepResult",
    "Trajectory",
    "WeightSync",
    "compare_runs",
    "cpu_grpo_config",
    "local_cluster",
    "run_cpu_grpo",
    "split_groups",
    "update_agreement",
]
