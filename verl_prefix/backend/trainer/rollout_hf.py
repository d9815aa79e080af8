"""``rollout.name=hf``: a CPU rollout with HF ``generate``, registered in verl's rollout registries.

verl 0.9.1 generates through an inference server per rollout replica (vLLM, SGLang, TensorRT-LLM), all
GPU-only, so ``python -m verl.trainer.main_ppo`` cannot run on a CPU machine. This backend fills the
same three slots those servers fill, so the real trainer runs end to end on a laptop or in CI. It is
meant to be correct, not fast:

- ``HFReplica`` (``RolloutReplicaRegistry``, built by verl's ``LLMServerManager``): one ``HFRolloutServer``
  Ray actor per replica, placed on the node of the replica's first actor rank (vLLM places a server per
  node the same way);
- ``HFRolloutServer``: token ids in, token ids and log-probs out, as verl's agent loop calls
  ``server.generate(request_id, prompt_ids, sampling_params)``: ``temperature`` (0 = greedy), ``top_p``,
  ``top_k`` (<= 0 = off), ``max_tokens``/``max_new_tokens`` (default: what is left of
  ``prompt_length + response_length``, at most ``response_length``, as vLLM's server computes it),
  ``logprobs``, ``ignore_eos``; ``n`` is the agent loop's (it sends n requests). Log-probs are those
  of ``logits / temperature`` before top-k/top-p, the quantity verl's actor recomputes, so
  ``training/rollout_probs_diff_*`` measures only numerics and weight staleness. Each request is sampled
  with its own seed (``rollout.seed``, weight version, prompt, and how many times that prompt was requested
  at this version, counted by one seed-book actor for all replicas): a run with the same data and seed
  draws the same group of samples whatever replica serves each request and in whatever order;
- ``HFServerAdapter`` (verl's ``get_rollout_class`` table, built inside each ``ActorRolloutRefWorker``):
  receives the weights verl's naive checkpoint engine hands a colocated rollout
  (``engine.get_per_tensor_param()``, full tensors, every rank iterating because FSDP's ``full_tensor`` is
  a collective) and ships them from the replica's rank 0 to its server in buckets of
  ``checkpoint_engine.update_weights_bucket_megabytes``; the server refuses an update that misses or adds
  parameters.

Vision-language models (a ``config.json`` with a ``vision_config``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) load as
``AutoModelForImageTextToText`` with their processor (verl's ``hf_processor``). A request's ``image_data``
(the PIL images verl's agent loop hands every server) goes through the processor's image processor into
``pixel_values``/``image_grid_thw`` for ``generate``, with ``mm_token_type_ids`` marking the image tokens
(transformers 5 computes the multimodal rotary positions from them); the prompt's image placeholders must
number what the images fill. The images' pixels join the seed's key, so two groups with the same text and
different images draw differently, and a dense and a reuse run with the same data draw the same. Videos and
audio are refused.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
from collections.abc import Iterable
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "hf"
_ADAPTER_FQN = "verl_prefix.backend.trainer.rollout_hf.HFServerAdapter"


def _server_name(prefix: str, replica_rank: int, suffix: str = "") -> str:
    return f"{prefix}server_{replica_rank}{suffix}"


def _rollout_world_size(config: Any) -> int:
    return config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size


def _torch_dtype(name: str) -> torch.dtype:
    from verl.utils.torch_dtypes import PrecisionType

    return PrecisionType.to_dtype(name)


_SEED_BOOK = "hf_rollout_seed_book"


@functools.cache
def _seed_book_class() -> Any:
    """The seed-book actor class: how many times each (weight version, prompt) was requested, across all
    replicas of a job.

    Built inside a function so that Ray ships the class by value: its actor process then starts without
    importing this module, and so without verl (about seven CPU-seconds a job on a small machine).
    """

    class SeedBook:
        def __init__(self) -> None:
            self.seen: dict[str, int] = {}

        def next(self, key: str) -> int:
            k = self.seen.get(key, 0)
            self.seen[key] = k + 1
            return k

    return ray.remote(SeedBook)


def rollout_attention(override_config: Any) -> str:
    """The attention implementation the rollout generates with: the actor's ``eager`` where the model config asks
    for it (GPT-OSS has no sdpa in transformers, and sdpa would drop its attention sinks, which eager applies: the
    sampler's log-probs would not be the actor's), else ``sdpa`` (verl's default, flash_attention_2, has no CPU
    kernel)."""
    asked = (override_config or {}).get("attn_implementation")
    return "eager" if asked == "eager" else "sdpa"


class HFRolloutServer:
    """One replica's generation server: an HF causal LM on CPU behind verl's token-in/token-out interface."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.config, self.replica_rank = config, replica_rank
        path = model_config.local_path
        remote = model_config.trust_remote_code
        vision = getattr(AutoConfig.from_pretrained(path, trust_remote_code=remote), "vision_config", None)
        auto = AutoModelForImageTextToText if vision is not None else AutoModelForCausalLM
        self.model = auto.from_pretrained(
            path,
            dtype=_torch_dtype(config.dtype),
            attn_implementation=rollout_attention(model_config.override_config),
            trust_remote_code=remote,
        )
        self.model.eval()
        self.processor: Any = None
        if vision is not None:
            from verl.utils.tokenizer import hf_processor

            self.processor = hf_processor(path, trust_remote_code=remote)
            if self.processor is None:
                raise ValueError(f"hf rollout: the vision-language model at {path} has no multimodal processor")
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_config.trust_remote_code)
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids: list[int] = [eos] if isinstance(eos, int) else list(eos or [])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos_ids or [0])[0]
        self.global_steps: int | None = None
        self._pending: dict[str, torch.Tensor] = {}
        self._book: Any = None
        self._lock = asyncio.Lock()
        self.requests = 0

    # --- weights -------------------------------------------------------------------------------------------------
    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Stage one bucket of full tensors; ``finish_weight_update`` installs them."""
        for name, tensor in named_tensors:
            self._pending[name] = tensor

    def finish_weight_update(self, global_steps: int | None) -> int:
        """Install the staged tensors; every parameter must be present (tied ones may be absent)."""
        state, self._pending = self._pending, {}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
        if missing or unexpected:
            raise RuntimeError(
                f"hf rollout: weight update does not match the model: missing={missing} unexpected={unexpected}"
            )
        self.global_steps = global_steps
        return len(state)

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # --- generation ----------------------------------------------------------------------------------------------
    def _max_tokens(self, sampling_params: dict[str, Any], prompt_len: int) -> int:
        cfg = self.config
        max_model_len = cfg.max_model_len or (cfg.prompt_length + cfg.response_length)
        room = max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"hf rollout: prompt of {prompt_len} tokens leaves no room within {max_model_len}")
        if "max_tokens" in sampling_params:
            wanted = sampling_params["max_tokens"]
        elif "max_new_tokens" in sampling_params:
            wanted = sampling_params["max_new_tokens"]
        else:
            wanted = min(cfg.response_length, cfg.prompt_length + cfg.response_length - prompt_len)
        return max(1, min(int(wanted), room))

    async def _seed(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], visual: dict[str, torch.Tensor] | None = None
    ) -> int:
        if sampling_params.get("seed") is not None:
            return int(sampling_params["seed"])
        key = f"{self.global_steps}|{self.prompt_digest(prompt_ids, visual)}"
        k = await self._seed_book().next.remote(key)  # shared by all replicas: routing does not change seeds
        material = f"{self.config.seed}|{key}|{k}"
        return int(hashlib.sha256(material.encode()).hexdigest()[:15], 16)

    @staticmethod
    def prompt_digest(prompt_ids: list[int], visual: dict[str, torch.Tensor] | None = None) -> str:
        """What identifies a prompt for seeding: its tokens and its images' pixels (same text, other images,
        other draws)."""
        h = hashlib.sha256(repr(prompt_ids).encode())
        for name in sorted(visual or {}):
            h.update(name.encode())
            h.update(visual[name].detach().to(torch.float64).contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def _seed_book(self) -> Any:
        if self._book is None:
            self._book = _seed_book_class().options(name=_SEED_BOOK, get_if_exists=True, num_cpus=0).remote()
        return self._book

    @torch.no_grad()
    def _generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        seed: int,
        visual: dict[str, torch.Tensor] | None = None,
    ) -> TokenOutput:
        temperature = float(sampling_params.get("temperature", 1.0))
        top_p = float(sampling_params.get("top_p", 1.0))
        top_k = int(sampling_params.get("top_k", -1) or -1)
        greedy = temperature <= 0.0
        ignore_eos = bool(sampling_params.get("ignore_eos", self.config.get("ignore_eos", False)))
        kwargs: dict[str, Any] = dict(
            max_new_tokens=self._max_tokens(sampling_params, len(prompt_ids)),
            do_sample=not greedy,
            num_beams=1,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=self.pad_id,
            eos_token_id=None if ignore_eos else (self.eos_ids or None),
            repetition_penalty=float(sampling_params.get("repetition_penalty", 1.0)),
        )
        if not greedy:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else None)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        ids = torch.tensor([prompt_ids], dtype=torch.int64)
        torch.manual_seed(seed)
        from verl_prefix.schedule.models.hf_forwards import hf_own_forwards

        with hf_own_forwards(self.model):  # HF's forwards where an engine in this process let verl patch them
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **(visual or {}), **kwargs)
        tokens = out.sequences[0, len(prompt_ids) :].tolist()
        stop = len(tokens)
        if not ignore_eos:
            for i, t in enumerate(tokens):
                if t in self.eos_ids:
                    stop = i + 1
                    break
        tokens = tokens[:stop]
        log_probs = None
        if sampling_params.get("logprobs"):
            logits = torch.stack(out.logits, dim=1)[0, :stop].float()
            if not greedy:
                logits = logits / temperature
            picked = torch.tensor(tokens, dtype=torch.int64)
            log_probs = logits.log_softmax(-1).gather(-1, picked[:, None])[:, 0].tolist()
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps, "seed": seed},
        )

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """Sample one response for ``prompt_ids`` (the agent loop sends ``n`` requests for ``n`` samples),
        with the images of ``image_data`` where the prompt holds them."""
        if video_data is not None or audio_data is not None:
            raise NotImplementedError("hf rollout: video and audio inputs are not supported (images are)")
        from verl.utils import normalize_token_ids

        prompt_ids = list(normalize_token_ids(prompt_ids))
        visual = self.image_inputs(prompt_ids, image_data, mm_processor_kwargs) if image_data else None
        seed = await self._seed(prompt_ids, sampling_params, visual)
        async with self._lock:  # one generation at a time
            self.requests += 1
            return await asyncio.to_thread(self._generate, prompt_ids, dict(sampling_params), seed, visual)

    def image_inputs(
        self, prompt_ids: list[int], images: list[Any], mm_processor_kwargs: dict[str, Any] | None = None
    ) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` of ``images`` from the model's image processor, checked
        against the prompt's image placeholders (verl's agent loop expanded them with the same processor)."""
        if self.processor is None:
            raise NotImplementedError(
                f"hf rollout: image inputs need a vision-language model; {type(self.model).__name__} has no processor"
            )
        kwargs = {k: v for k, v in (mm_processor_kwargs or {}).items() if k != "sampling_rate"}
        out = self.processor.image_processor(images=list(images), return_tensors="pt", **kwargs)
        grid = out["image_grid_thw"]
        merge = int(self.processor.image_processor.merge_size)
        want = int(grid.prod(dim=-1).sum()) // merge**2
        got = sum(1 for t in prompt_ids if t == self.processor.image_token_id)
        if got != want:
            raise ValueError(f"hf rollout: the prompt holds {got} image tokens, its {len(grid)} images fill {want}")
        # transformers 5 places the multimodal rotary positions by these types; without them generate would
        # run the image's tokens at text positions, not where verl's actor (its get_rope_index) puts them
        types = torch.tensor([[int(t == self.processor.image_token_id) for t in prompt_ids]], dtype=torch.int32)
        return {
            "pixel_values": out["pixel_values"].to(self.model.dtype),
            "image_grid_thw": grid,
            "mm_token_type_ids": types,
        }

    # --- lifecycle verl's replica and checkpoint manager call; the model stays in host memory ----------------------
    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        async with self._lock:
            return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        """Requests served and the weight version installed (for tests and logs)."""
        return {
            "requests": self.requests,
            "global_steps": self.global_steps,
            "node_id": ray.get_runtime_context().get_node_id(),
        }


class HFReplica(RolloutReplica):
    """A rollout replica served by one ``HFRolloutServer`` on the node of its first rank."""

    def _get_server_name_prefix(self) -> str:
        return f"{ROLLOUT_NAME}_"

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        """Start the server actor (named as the adapter looks it up) and publish its handle and address."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options: dict[str, Any] = {"max_concurrency": self.max_concurrency, "num_cpus": 0}
        if self.workers:
            node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        else:
            node_id = ray.get_runtime_context().get_node_id()
        if self.is_reward_model:
            name = f"{self._get_server_name_prefix()}server_reward_{self.replica_rank}{self.name_suffix}"
        elif self.is_teacher_model:
            name = f"{self._get_server_name_prefix()}server_teacher_{self.replica_rank}{self.name_suffix}"
        else:
            name = _server_name(self._get_server_name_prefix(), self.replica_rank, self.name_suffix)
        server = (
            ray.remote(HFRolloutServer)
            .options(name=name, **options)
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        )
        await server.__ray_ready__.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{name}@{node_id[:12]}"  # a unique key for verl's load balancer; no HTTP


class HFServerAdapter(BaseRollout):
    """The rollout inside each actor worker: forwards the actor's weights to its replica's server."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = _rollout_world_size(self.config)
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.is_leader_rank = self.rollout_rank == 0
        self.server_handle: Any = None

    def _server(self) -> Any:
        if self.server_handle is None:
            self.server_handle = ray.get_actor(_server_name(f"{ROLLOUT_NAME}_", self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        """Ship full tensors to the server in buckets; every rank consumes the generator (collectives)."""
        from verl.workers.rollout.utils import ensure_async_iterator

        if wire_format != "named_tensors":
            raise NotImplementedError(f"hf rollout takes full tensors (wire_format=named_tensors), got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("hf rollout: LoRA adapter sync is not supported; use model.lora.merge=true")
        bucket_bytes = max(1, self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        pending = []
        async for name, tensor in ensure_async_iterator(weights):
            if not self.is_leader_rank:
                continue
            tensor = tensor.detach().to("cpu")
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                pending.append(self._server().load_weights.remote(bucket))
                bucket, size = [], 0
        if self.is_leader_rank:
            if bucket:
                pending.append(self._server().load_weights.remote(bucket))
            await asyncio.gather(*pending)
            await self._server().finish_weight_update.remote(global_steps)


def _load_replica() -> type[RolloutReplica]:
    return HFReplica


def register() -> None:
    """Make ``rollout.name=hf`` known to verl: the replica registry and the in-worker rollout table."""
    from verl.workers.rollout import base as rollout_base

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = _ADAPTER_FQN


def is_registered() -> bool:
    """True when ``rollout.name=hf`` resolves in both of verl's registries."""
    from verl.workers.rollout import base as rollout_base

    return (
        ROLLOUT_NAME in RolloutReplicaRegistry._registry and (ROLLOUT_NAME, "async") in rollout_base._ROLLOUT_REGISTRY
    )


__all__ = [
    "HFReplica",
    "HFRolloutServer",
    "HFServerAdapter",
    "ROLLOUT_NAME",
    "is_registered",
    "register",
    "rollout_attention",
]
