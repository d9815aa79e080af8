"""Reuse knobs, as verl config dataclasses so hydra, ``omega_conf_to_dataclass`` and validation apply."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from verl.base_config import BaseConfig
from verl.workers.config import FSDPEngineConfig

from verl_prefix.schedule.chunked import validate_chunk_tokens
from verl_prefix.schedule.dormant import validate_policy
from verl_prefix.schedule.kv.contexts import PHASE_B_ATTENTION
from verl_prefix.schedule.tree.trie import DEFAULT_MIN_SHARED_TOKENS

PREFIX_BACKEND = "prefix_fsdp2"
# ``prefix_reuse.unsupported_model``: what a model the schedule cannot serve does (``schedule.models.capability``)
UNSUPPORTED_MODEL = ("dense", "raise")
# The override that switches reuse off, as an error message names it: the full path, and the actor config class
# that carries the key (``configs/prefix_grpo.yaml`` has both, and the key, so drop the ``+`` there)
REUSE_OFF = (
    "+actor_rollout_ref.actor.prefix_reuse.enable=false (with "
    "actor_rollout_ref.actor._target_=verl_prefix.PrefixFSDPActorConfig; no '+' where the YAML has the key, "
    "as configs/prefix_grpo.yaml does)"
)
# the same on prefix_torchtitan, whose knobs live on its engine config
TITAN_REUSE_OFF = "+actor_rollout_ref.actor.torchtitan.prefix_reuse.enable=false"


def validate_moe_aux_loss_coef(value: object) -> float:
    """The router aux coefficient as a float; a negative one would train toward imbalance."""
    try:
        coef = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"moe_aux_loss_coef must be a number >= 0, got {value!r}") from None
    if not math.isfinite(coef) or coef < 0:
        raise ValueError(f"moe_aux_loss_coef must be a finite number >= 0 (0 turns it off), got {value!r}")
    return coef


def post_init_as_stock(
    config: Any, prefix_strategy: str, stock_strategy: str, parent_post_init: Callable[[], None]
) -> None:
    """Run a prefix engine config's parent ``__post_init__`` (``parent_post_init``, e.g. ``super().__post_init__``)
    with ``strategy`` read as ``stock_strategy`` where it is ``prefix_strategy``, so verl's validation runs unchanged,
    then put the requested strategy back."""
    requested = config.strategy
    if requested == prefix_strategy:
        object.__setattr__(config, "strategy", stock_strategy)
    parent_post_init()
    object.__setattr__(config, "strategy", requested)


def reuse_knobs_checked(config: Any) -> None:
    """An engine config's ``prefix_reuse`` as the ``PrefixReuseConfig`` it names: from YAML without a ``_target_`` it
    arrives as a mapping, which is validated here, when verl builds the config (in the driver, before any worker),
    instead of when the engine is built."""
    reuse = getattr(config, "prefix_reuse", None)
    if isinstance(reuse, Mapping):
        object.__setattr__(config, "prefix_reuse", PrefixReuseConfig(**reuse))


@dataclass
class PrefixReuseConfig(BaseConfig):
    """How the ``prefix_fsdp2`` engine schedules each uid group.

    Args:
        enable: run the A/B/C schedule; off runs every mini-batch through the stock FSDP2 path
            (counted as ``actor/prefix/fallback_disabled``).
        suffix_micro_batch_size: suffix rows per phase-B micro-batch; ``None`` uses verl's
            ``ppo_micro_batch_size_per_gpu`` (or ``log_prob_micro_batch_size_per_gpu``).
        suffix_token_budget: tokens per phase-B micro-batch, each row counting its padded suffix plus the
            prefix it attends to (what the same row costs in a dense micro-batch); ``None`` uses verl's
            ``max_token_len_per_gpu`` when ``use_dynamic_bsz`` is on, else no budget.
        min_prefix_len: groups whose shared prefix (prompt minus its last token) is shorter run
            dense, counted as ``fallback_short_prefix``: phase A's fixed cost would not pay.
        min_group_size: smaller groups run dense (``fallback_small_group``); a group of one
            shares nothing.
        forward_only_reuse: reuse the prefix for old/ref log-prob passes too.
        early_exit: stop phase A after the last layer's K/V (skips that layer's MLP and the LM
            head over the prefix).
        phase_b_attention: how suffix micro-batches attend to the prefix. ``merged``: two-part
            attention against the one shared prefix K/V, merged by log-sum-exp (the prefix is neither
            copied per row nor repeated for GQA on any device; the rows' own suffix K/V are repeated to
            the query heads on CUDA, not on CPU); logit softcapping and attention sinks run the same
            maths in plain torch ops (scores materialised); ``concat``: ``cat(prefix.expand(B), suffix)``
            per row, GQA heads repeated (the reference path); ``auto``: merged for sdpa/flash models
            wherever the kernels serve the call (on CUDA where torch's ``can_use_flash_attention`` says
            its flash kernels run; eager attention, pre-Ampere GPUs, ROCm or a dtype without a kernel
            run concat), counted as ``prefix/phase_b_attention/{merged,concat,concat_<reason>}`` micro-batches.
            ``merged_varlen``: merged on the rows' real tokens packed without padding (``cu_seqlens``):
            on CUDA torch's own varlen flash attention (torch >= 2.10), else flash-attn >= 2.7's (not yet
            run on a GPU here), a per-row reference on CPU (exact, slower than merged); raises where it
            cannot serve, counted as ``prefix/phase_b_attention/merged_varlen``. ``auto`` does not pick it.
            Whether the kernels serve is agreed by every data-parallel rank before the first mini-batch:
            ``auto`` runs concat on every rank, ``merged``/``merged_varlen`` stop every rank with one error.
        prefix_chunk_tokens: run phase A in chunks of this many prefix tokens, each attending to the
            earlier chunks' K/V as leaves, and phase C chunk by chunk from the last; with
            ``dormant_prefix=recompute`` only one chunk's graph ever exists (memory grows with the K/V,
            not the activations). ``None``/0: the prefix runs whole. Counted as ``prefix/chunked_groups``
            and ``prefix/prefix_chunks``.
        unsupported_model: what the engine does with a model whose structure the schedule cannot serve
            (recurrent or convolution layers, attention outside HF's attention interface, cross-attention,
            compressed attention...; ``verl_prefix.schedule.models.capability``) or does not know (a layer type or
            mask-shaping attribute outside ``schedule.models.known_structures``: ``unknown_structure:<name>``), decided
            once at engine initialisation and agreed by every data-parallel rank: ``dense`` runs every mini-batch
            through the stock path, counted as ``prefix/fallback_<reason>`` with one log line at initialisation
            naming the module; ``raise`` stops every rank with one ``UnsupportedModel`` error naming it.
        tree: run each rank's groups as a token trie (``docs/trees.md``): tokens that several groups' prompts
            share (a system block) run once per rank and mini-batch, not once per group. ``dormant_prefix``
            applies per node and ``merged_varlen`` packs each node's forward (one row over its ancestors' K/V)
            as a chunk's; ``prefix_chunk_tokens`` runs longer nodes as chains of chunks; under Ulysses every node
            and tail runs sliced over the SP group, tested in ``tests/backend/test_tree_ulysses_engine.py``;
            sliding windows, recurrent layers, images and per-row temperatures are served; ranks whose tries
            differ in shape pad them with zero-loss lockstep fillers: every mini-batch one-level reuse serves
            runs the tree.
        min_shared_tokens: a trie node shorter than this on which no group's prompt ends is merged into its
            children (one more prefix forward's fixed cost would not pay).
    """

    enable: bool = True
    suffix_micro_batch_size: int | None = None
    suffix_token_budget: int | None = None
    min_prefix_len: int = 32
    min_group_size: int = 2
    forward_only_reuse: bool = True
    early_exit: bool = True
    phase_b_attention: str = "auto"
    prefix_chunk_tokens: int | None = None
    unsupported_model: str = "dense"
    tree: bool = False
    min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_chunk_tokens", validate_chunk_tokens(self.prefix_chunk_tokens))
        if self.phase_b_attention not in PHASE_B_ATTENTION:
            raise ValueError(
                f"prefix_reuse.phase_b_attention must be one of {PHASE_B_ATTENTION}, got {self.phase_b_attention!r}"
            )
        if self.unsupported_model not in UNSUPPORTED_MODEL:
            raise ValueError(
                f"prefix_reuse.unsupported_model must be one of {UNSUPPORTED_MODEL}, got {self.unsupported_model!r}"
            )
        if self.suffix_micro_batch_size is not None and self.suffix_micro_batch_size < 1:
            raise ValueError(
                f"prefix_reuse.suffix_micro_batch_size must be >= 1 or null, got {self.suffix_micro_batch_size}"
            )
        if self.suffix_token_budget is not None and self.suffix_token_budget < 1:
            raise ValueError(f"prefix_reuse.suffix_token_budget must be >= 1 or null, got {self.suffix_token_budget}")
        if self.min_prefix_len < 1:
            raise ValueError(f"prefix_reuse.min_prefix_len must be >= 1, got {self.min_prefix_len}")
        if self.min_group_size < 1:
            raise ValueError(f"prefix_reuse.min_group_size must be >= 1, got {self.min_group_size}")
        if self.min_shared_tokens < 1:
            raise ValueError(f"prefix_reuse.min_shared_tokens must be >= 1, got {self.min_shared_tokens}")


@dataclass
class PrefixFSDPEngineConfig(FSDPEngineConfig):
    """verl's FSDP engine config plus the reuse knobs; accepts ``strategy: prefix_fsdp2``.

    Select it with ``actor_rollout_ref.actor.fsdp_config._target_=verl_prefix.config.PrefixFSDPEngineConfig``
    to set knobs from YAML; without it the engine uses ``PrefixReuseConfig()`` defaults.

    Args:
        moe_aux_loss_coef: coefficient of HF's MoE router load-balancing loss, added to verl's loss in
            dense and reuse mode alike (verl 0.9.1's FSDP engine adds none). 0 (default) keeps the
            engine a drop-in for the stock one. The model config's ``router_aux_loss_coef`` is not read.
        record_trace_dir: when set, every ``train_batch`` input is recorded there (``rank<r>``
            subdirectories with several ranks) for ``verl-prefix replay``; see ``verl_prefix.backend.trace``.
        dormant_prefix: where a group's phase-A graph waits until phase C: ``keep`` (on the device),
            ``recompute`` (not kept; phase C re-runs the prefix forward), ``offload`` (pinned host memory;
            accelerators only), ``auto`` (per group, the cheapest that fits ``dormant_prefix_budget_bytes``).
        dormant_prefix_budget_bytes: bytes per device the dormant prefix graph may hold (``auto``).
    """

    strategy: str = PREFIX_BACKEND
    prefix_reuse: PrefixReuseConfig = field(default_factory=PrefixReuseConfig)
    moe_aux_loss_coef: float = 0.0
    record_trace_dir: str | None = None
    dormant_prefix: str = "keep"
    dormant_prefix_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        post_init_as_stock(self, PREFIX_BACKEND, "fsdp2", super().__post_init__)
        reuse_knobs_checked(self)
        object.__setattr__(self, "moe_aux_loss_coef", validate_moe_aux_loss_coef(self.moe_aux_loss_coef))
        validate_policy(self.dormant_prefix, self.dormant_prefix_budget_bytes)
