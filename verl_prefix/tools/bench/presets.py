"""The benchmark's vocabulary: model shapes, cells (one measured configuration), presets (named sets of
cells, or a capacity search), and what a cell builds: its GRPO batch and each variant's engine.

Every bench command, the fresh-process probes and ``dormant_memory`` take their models and cells from
here; nothing here times or measures anything (``bench_runner`` does).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_prefix.harness import grpo_batches, tiny_models, verl_engine
from verl_prefix.tools.bench.capacity import CapacitySpec


class BenchError(ValueError):
    """A user mistake or an unmet requirement (no CUDA for the gpu preset): one line, no traceback."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a random-init Qwen3-style model, as ``tiny_models.write_tiny_model`` takes it.

    The capacity search (``capacity.CapacitySpec.model``) and ``dormant_memory`` use these shapes too."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    family: str = "qwen3"
    num_experts: int = 0  # > 0 with family "qwen3_moe": intermediate_size is each expert's
    num_experts_per_tok: int = 0
    # a sliding window on the layers ``layer_types`` marks "sliding_attention" (every layer without them)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # > 0: a vision-language family of ``harness.vl`` (its vision tower's blocks, width and heads)
    vision_depth: int = 0
    vision_hidden: int = 0
    vision_heads: int = 2

    def write(self, directory: Path) -> Path:
        """A random-init model of this shape, with a local tokenizer."""
        if self.vision_depth:
            return self._write_vl(directory)
        kwargs = dataclasses.asdict(self)
        for key in ("vision_depth", "vision_hidden", "vision_heads"):
            kwargs.pop(key)
        family = kwargs.pop("family")
        if not self.num_experts:
            kwargs.pop("num_experts")
            kwargs.pop("num_experts_per_tok")
        extra = {"sliding_window": kwargs.pop("sliding_window"), "layer_types": kwargs.pop("layer_types")}
        extra = {k: (list(v) if isinstance(v, tuple) else v) for k, v in extra.items() if v is not None}
        return tiny_models.write_tiny_model(directory, family, extra_config=extra or None, **kwargs)

    def _write_vl(self, directory: Path) -> Path:
        from verl_prefix.harness import vl as V

        return V.write_tiny_vl_model(
            directory,
            self.family,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            vision_depth=self.vision_depth,
            vision_hidden=self.vision_hidden,
            heads=self.num_heads,
            kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            vision_heads=self.vision_heads,
        )


@dataclass(frozen=True)
class Cell:
    """One measured configuration: a model, a dtype and one GRPO mini-batch shape."""

    name: str
    model: ModelSpec
    num_groups: int
    group_size: int
    prompt_len: int
    response_len_range: tuple[int, int]
    micro_batch_size: int = 4
    dtype: str = "float32"
    min_prefix_len: int = 32
    overrides: tuple[str, ...] = ()
    # Non-empty: a phase-B attention cell (``measure_variants``) timing these engines side by side, any of
    # ``ALL_VARIANTS``: "fsdp2" (the stock engine), "merged"/"concat"/"merged_varlen" (``prefix_fsdp2`` with
    # that ``prefix_reuse.phase_b_attention``). Empty: the classic dense vs prefix cell (``measure_cell``).
    variants: tuple[str, ...] = ()
    dense_micro_batch_size: int | None = None  # the stock engine's rows per micro-batch, if not micro_batch_size
    max_reps: int | None = None  # at most this many timed reps for this cell (the slow ones)
    time_forward_only: bool = False  # variant cells: also time the forward-only log-prob pass
    # an agentic batch (``prefix_reuse.tree``): every prompt starts with one ``system_len``-token block, then
    # each group's own question, of ``question_len_range`` tokens drawn per group (else ``prompt_len``)
    system_len: int = 0
    question_len_range: tuple[int, int] | None = None
    # tree rollouts (``prefix_reuse.tree`` with loss on shared tokens): each group's responses open with a tree
    # of shared stems, level k 2**k stems of ``response_stems[k]`` tokens, then ``response_len_range`` own tokens
    response_stems: tuple[int, ...] = ()
    # "fsdp2": stock fsdp2 vs prefix_fsdp2; "torchtitan": verl's TorchTitan engine vs prefix_torchtitan (one rank,
    # a qwen3 model: ``harness.titan`` registers the flavor of its shapes; classic cells only); "megatron": verl's
    # Megatron engine vs prefix_megatron (one rank; classic cells, an agentic batch runs the tree)
    engine: str = "fsdp2"
    # a vision-language cell: the patch grid (height, width) of the one image every prompt holds, placed
    # among ``prompt_len`` text tokens (half before it); its visual tokens add to the prompt
    image: tuple[int, int] | None = None


@dataclass(frozen=True)
class Preset:
    """A named set of cells with its default reps and torch thread count."""

    cells: tuple[Cell, ...]
    reps: int
    needs_cuda: bool = False
    # CPU presets pin 1 torch thread: on the shared 2-vCPU dev VM, 2 threads made the same update take
    # 0.7 s to 80 s from rep to rep (OpenMP barriers wait on preempted vCPUs); 1 thread was steady.
    threads: int | None = None
    description: str = ""
    # variant cells: each variant's first update also runs once in a fresh process, for its peak RSS
    fresh_rss: bool = False
    # a capacity preset: a search (``verl_prefix.tools.bench.capacity``) instead of timed cells
    capacity: CapacitySpec | None = None


SMOKE_MODEL = ModelSpec(
    hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384, vocab_size=1024
)
# ~29.6M parameters (untied embeddings), the model DESIGN.md's CPU measurements use.
MODEL_29M = ModelSpec(
    hidden_size=512,
    num_layers=6,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=1792,
    vocab_size=8192,
    max_position_embeddings=16384,  # the gpu preset's 12K-token sequences
)
# bf16 on GPU: fp32 master weights, bf16 compute, fp32 gradient reduction (verl's usual mixed precision).
BF16 = (
    "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:bf16,reduce_dtype:fp32,buffer_dtype:fp32}",
)


# A Qwen3-MoE-style model of the smoke model's size: 8 experts, top-2 (router aux loss off, so the stock
# fsdp2 engine is the reference; tests/schedule/test_moe.py covers the aux loss).
SMOKE_MOE_MODEL = ModelSpec(
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=192,
    vocab_size=1024,
    family="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
)


# A Gemma-3-style model half the smoke model's width: three 512-token sliding-window layers, then a full one
# (Gemma 3 alternates five to one), for the ``window`` preset at prefix 2048.
SMOKE_WINDOW_MODEL = dataclasses.replace(
    SMOKE_MODEL,
    hidden_size=64,  # head_dim 16: the stock engine's masked L x L attention dominates its time at prefix 2048
    intermediate_size=192,
    family="gemma3_text",
    sliding_window=512,
    layer_types=("sliding_attention", "sliding_attention", "sliding_attention", "full_attention"),
)


# A Qwen3.5-style hybrid of the same width: three gated delta-net layers, then a full-attention one (Qwen3.5
# interleaves three to one), for the ``hybrid`` presets: the suffixes start from the prefix's recurrent state.
SMOKE_HYBRID_MODEL = dataclasses.replace(
    SMOKE_MODEL,
    hidden_size=64,
    intermediate_size=192,
    family="qwen3_5_text",
    layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"),
)


# A tiny Qwen2.5-VL (issue 23's cell): the smoke model's decoder (hidden 128, 4 layers) behind a 2-block vision
# tower of width 32 (one windowed block, one full), 14-pixel patches merged 2 x 2, random init; the ``vl`` preset.
SMOKE_VL_MODEL = dataclasses.replace(
    SMOKE_MODEL, intermediate_size=256, vocab_size=128, family="qwen2_5_vl", vision_depth=2, vision_hidden=32
)
# One image of 64 x 64 patches (896 x 896 pixels: 1,024 visual tokens after the 2 x 2 merge) among 200 text tokens,
# responses of 128, G=8: every row's prompt holds the same image, which the stock engine encodes once per row.
_VL_CELL = dict(num_groups=1, group_size=8, prompt_len=200, response_len_range=(128, 128), image=(64, 64))


# Qwen3-1.7B's shape (28 layers, GQA 16/8, vocab 151936): the largest Qwen3 whose full fine-tune (fp32
# master weights and Adam states, about 27 GB) leaves one H200 room for 16 x 12K-token sequences.
MODEL_GPU = ModelSpec(
    hidden_size=2048,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=6144,
    vocab_size=151936,
    max_position_embeddings=16384,
)
_GPU = (*BF16, "actor_rollout_ref.model.enable_gradient_checkpointing=true")


VARIANTS = ("fsdp2", "merged", "concat")
# the gpu preset also runs merged_varlen (flash-attn's varlen kernels; skipped where flash_attn does not import)
GPU_VARIANTS = (*VARIANTS, "merged_varlen")
# prefix_fsdp2 with one-level reuse and with ``prefix_reuse.tree`` (phase-B attention ``auto``): the tree cells
TREE_VARIANTS = ("one_level", "tree")
ALL_VARIANTS = (*GPU_VARIANTS, *TREE_VARIANTS)
PHASE_B_ATTENTIONS = ("merged", "concat", "merged_varlen")  # the prefix_fsdp2 variants


def unavailable_variant(variant: str, cuda: bool | None = None) -> str | None:
    """Why a variant cannot run on this machine (then the cell skips it, saying so), or None."""
    from verl_prefix.schedule.attention.varlen import varlen_kernel_problem

    cuda = torch.cuda.is_available() if cuda is None else cuda
    if variant == "merged_varlen" and cuda:
        return varlen_kernel_problem()  # neither torch's varlen attention nor flash-attn >= 2.7
    return None


# Qwen2.5-VL's vision tower (32 blocks of width 1280, 16 heads) on the gpu preset's Qwen3-1.7B-shaped decoder,
# random init: the ``gpu_vl`` preset's model (about 2.3B parameters).
MODEL_GPU_VL = dataclasses.replace(MODEL_GPU, family="qwen2_5_vl", vision_depth=32, vision_hidden=1280, vision_heads=16)


# The capacity presets' models: the 29M and smoke models' shapes with positions long enough for the grids.
CAPACITY_MODEL = dataclasses.replace(MODEL_29M, max_position_embeddings=65536)
CAPACITY_SMOKE_MODEL = dataclasses.replace(SMOKE_MODEL, max_position_embeddings=65536)
# The gpu preset's offload cell: prefix_fsdp2 with dormant_prefix=offload (set on the engine config).
_OFFLOAD = (
    "actor_rollout_ref.actor.fsdp_config._target_=verl_prefix.config.PrefixFSDPEngineConfig",
    "+actor_rollout_ref.actor.fsdp_config.dormant_prefix=offload",
)


def _capacity_spec(kind: str) -> CapacitySpec:
    if kind == "gpu":  # the gpu preset's model and precision; budget 40 GiB above the loaded model, G=16, suffix 2048
        return CapacitySpec(
            model=MODEL_GPU,
            group_size=16,
            suffix_len=2048,
            budget_mib=40 * 1024,
            # few probes: each loads the 1.7B model in a fresh process (a lent GPU has minutes, not hours)
            grid=(4096, 8192, 16384, 32768, 65536),
            engines=("fsdp2:1", "keep", "recompute:4096"),
            micro_batch_size=2,
            overrides=_GPU,
            timeout_s=600.0,
        )
    if kind == "cpu":  # issue 11's setting: the 29M model, G=8, suffix 128, 2 GiB above the loaded model
        return CapacitySpec(
            model=CAPACITY_MODEL,
            group_size=8,
            suffix_len=128,
            budget_mib=2048.0,
            grid=(1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768),
            # the stock engine's memory grows with its rows per micro-batch: 1 is its best, 2 shows the slope
            engines=("fsdp2:1", "fsdp2:2", "keep", "recompute", "recompute:1024", "recompute:512"),
            micro_batch_size=4,
            timeout_s=3600.0,
            repeats=3,
        )
    # the same search in minutes: the 1M smoke model, G=8, suffix 128, 256 MiB
    return CapacitySpec(
        model=CAPACITY_SMOKE_MODEL,
        group_size=8,
        suffix_len=128,
        budget_mib=256.0,
        grid=(512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384),
        engines=("fsdp2:1", "fsdp2:2", "fsdp2:4", "keep", "recompute", "recompute:1024"),
        micro_batch_size=4,
    )


def _phase_b_cells() -> tuple[Cell, ...]:
    """Issue 14: merged vs concat phase-B attention beside the stock engine, one G=8 group, suffix 128.

    The stock engine runs 2 rows per micro-batch in every cell (its work does not depend on the prefix
    engine's suffix micro-batch; it saves 1.6 GB for backward per 2-row micro-batch at prefix 2048, so 8
    rows would hold about 6.5 GB on a shared 23 GB VM) and only at prefix 2048: at 8192 it would save about
    6 GB per 2-row micro-batch and take several times the 2048 update's 50 s per rep."""
    cells = []
    for prefix in (2048, 8192):
        for rows in (2, 8):
            cells.append(
                Cell(
                    f"P{prefix}/S128/G8/mb{rows}",
                    MODEL_29M,
                    1,
                    8,
                    prefix,
                    (128, 128),
                    micro_batch_size=rows,
                    variants=VARIANTS if prefix <= 2048 else VARIANTS[1:],
                    dense_micro_batch_size=2,
                    max_reps=None,  # 3 timed reps everywhere: two reps that disagree settle no ratio
                )
            )
    return tuple(cells)


def _cpu_cells() -> tuple[Cell, ...]:
    pairs = [(2048, 128), (1024, 256), (512, 512), (256, 1024)]
    cells = [Cell(f"P{p}/S{s}/G8", MODEL_29M, 1, 8, p, (s, s)) for p, s in pairs]
    cells += [Cell(f"P1024/S256/G{g}", MODEL_29M, 1, g, 1024, (256, 256)) for g in (4, 16)]
    cells += [Cell("MoE P1024/S256/G8", SMOKE_MOE_MODEL, 1, 8, 1024, (256, 256))]
    return tuple(cells)


def _agentic_cell(system: int, questions: tuple[int, int], responses: tuple[int, int]) -> Cell:
    """Issue 25's agentic batch: 8 groups of G=8 behind one system block, on the smoke model (the 29M model
    would take an hour per stock update at this size on one CPU thread)."""
    name = f"S{system}/Q{questions[0]}-{questions[1]}/R{responses[0]}-{responses[1]}/8xG8"
    return Cell(
        name,
        SMOKE_MODEL,
        8,
        8,
        questions[0],
        responses,
        system_len=system,
        question_len_range=questions,
        variants=("fsdp2", *TREE_VARIANTS),
        max_reps=3,
    )


def _tree_rollout_cell(prompt: int, stems: tuple[int, ...], tails: tuple[int, int]) -> Cell:
    """Issue 25's tree-rollout batch: 8 groups of G=8 (the agentic cell's 64 rows) whose responses branch inside
    the response, one stem shared by the group, then 2 and 4 sub-stems, loss on every shared stem; the smoke
    model, as the agentic cell."""
    name = f"P{prompt}/T{'-'.join(map(str, stems))}/R{tails[0]}-{tails[1]}/8xG8"
    return Cell(name, SMOKE_MODEL, 8, 8, prompt, tails, response_stems=stems, variants=("fsdp2", *TREE_VARIANTS))


PRESETS: dict[str, Preset] = {
    "smoke": Preset(
        cells=(Cell("P512/S32-64/G8", SMOKE_MODEL, 2, 8, 512, (32, 64)),),
        reps=5,
        threads=1,
        description="1M-param Qwen3-style model, fp32, one 2x8 GRPO mini-batch; about 25 s on 2 cores",
    ),
    "moe": Preset(
        cells=(Cell("MoE P512/S32-64/G8", SMOKE_MOE_MODEL, 2, 8, 512, (32, 64)),),
        reps=5,
        threads=1,
        description="Qwen3-MoE-style model (8 experts, top-2), fp32, one 2x8 GRPO mini-batch",
    ),
    "cpu": Preset(
        cells=_cpu_cells(),
        reps=3,
        threads=1,
        description="29M-param Qwen3-style model, fp32, one group per cell; slow (about half an hour on 2 cores)",
    ),
    "phase_b": Preset(
        cells=_phase_b_cells(),
        reps=3,
        threads=1,
        fresh_rss=True,
        description="29M-param model, fp32: stock fsdp2 vs prefix_fsdp2 with phase_b_attention merged and concat, "
        "prefix 2048/8192, suffix 128, G=8, suffix micro-batches of 2 and 8 rows; slow",
    ),
    "window": Preset(
        cells=(Cell("P2048/S128/G8 window 512", SMOKE_WINDOW_MODEL, 1, 8, 2048, (128, 128)),),
        reps=3,
        threads=1,
        description="0.3M-param Gemma-3-style model (3 of 4 layers with a 512-token sliding window), fp32, one G=8 "
        "group at prefix 2048, suffix 128; about 5 minutes on 2 busy cores",
    ),
    "hybrid": Preset(
        cells=(Cell("P2048/S128/G8 hybrid", SMOKE_HYBRID_MODEL, 1, 8, 2048, (128, 128)),),
        reps=3,
        threads=1,
        description="0.3M-param Qwen3.5-style hybrid (3 gated delta-net layers, 1 full attention), fp32, one G=8 "
        "group at prefix 2048, suffix 128",
    ),
    "hybrid_8192": Preset(
        cells=(Cell("P8192/S128/G8 hybrid", SMOKE_HYBRID_MODEL, 1, 8, 8192, (128, 128), max_reps=1),),
        reps=1,
        threads=1,
        description="the hybrid preset's model at prefix 8192, suffix 128, G=8; slow on a CPU",
    ),
    "titan": Preset(
        cells=(
            # one row per micro-batch: on CPU the attention materialises each packed sequence's L x L scores
            Cell(
                "P2048/S128/G8/torchtitan", SMOKE_MODEL, 1, 8, 2048, (128, 128), micro_batch_size=1, engine="torchtitan"
            ),
        ),
        reps=3,
        threads=1,
        description="1M-param Qwen3-style model, fp32, one G=8 group at prefix 2048, suffix 128: verl's TorchTitan "
        "engine vs prefix_torchtitan on one rank (needs torchtitan, scripts/setup.sh)",
    ),
    "megatron": Preset(
        cells=(
            Cell("P2048/S128/G8/megatron", SMOKE_MODEL, 1, 8, 2048, (128, 128), micro_batch_size=1, engine="megatron"),
            dataclasses.replace(
                _agentic_cell(1024, (32, 128), (32, 64)),
                name="S1024/Q32-128/R32-64/8xG8/megatron",
                variants=(),
                micro_batch_size=8,  # the tree's suffix micro-batches
                # verl's engine one row per micro-batch: without TransformerEngine the CPU platform attends a
                # packed micro-batch through one dense mask over all its tokens (T x T, not each row's L x L)
                dense_micro_batch_size=1,
                engine="megatron",
            ),
        ),
        reps=3,
        threads=1,
        description="1M-param Qwen3-style model, fp32, verl's Megatron engine vs prefix_megatron on one rank: one "
        "G=8 group at prefix 2048, suffix 128; the quarter-size agentic batch (the tree) (needs megatron-core, "
        "scripts/setup.sh)",
    ),
    "vl": Preset(
        cells=(Cell("VL 1024 + P200/S128/G8", SMOKE_VL_MODEL, **_VL_CELL),),
        reps=3,
        threads=1,
        description="tiny Qwen2.5-VL (decoder hidden 128, 4 layers; 2-block tower), fp32: one G=8 group whose "
        "prompt holds one image of 1,024 visual tokens and 200 text tokens, responses 128",
    ),
    "phase_b_smoke": Preset(
        cells=(Cell("P512/S32/G8/mb4", SMOKE_MODEL, 1, 8, 512, (32, 32), variants=VARIANTS),),
        reps=3,
        threads=1,
        description="1M-param model, fp32: the phase_b variants on one small group; about a minute "
        "(also bench/gpu_check.sh's CPU dry run)",
    ),
    "agentic": Preset(
        cells=(_agentic_cell(4096, (128, 512), (128, 256)),),
        reps=3,
        threads=1,
        description="an agentic batch on the 1M smoke model: a 4096-token system block shared by 8 groups, "
        "questions 128-512, G=8, responses 128-256; stock fsdp2, one-level reuse and the tree; slow on a CPU",
    ),
    "agentic_quarter": Preset(
        cells=(_agentic_cell(1024, (32, 128), (32, 64)),),
        reps=3,
        threads=1,
        description="the agentic batch at a quarter of every length (system 1024, questions 32-128, responses "
        "32-64), 8 groups of G=8, smoke model: stock, one-level reuse and the tree; minutes on a busy CPU",
    ),
    "tree_rollout": Preset(
        cells=(_tree_rollout_cell(1024, (256, 128, 64), (32, 64)),),
        reps=3,
        threads=1,
        description="a tree-rollout batch on the 1M smoke model: 8 groups of G=8, prompt 1024, responses "
        "opening with a 256-token stem branching into 2 stems of 128, then 4 of 64, then 32-64 tokens each; stock "
        "fsdp2, one-level reuse and the tree (loss on the shared stems)",
    ),
    "gpu": Preset(
        cells=tuple(
            # 2 rows per micro-batch: the dense engine's fp32 log-softmax over 2 x 12K tokens x 152K vocab
            # is already 15 GB, plus its backward, next to both engines' weights and gradients
            Cell(
                f"P{p}/S{s}/G16",
                MODEL_GPU,
                1,
                16,
                p,
                (s, s),
                micro_batch_size=2,
                dtype="bfloat16",
                overrides=_GPU,
                variants=GPU_VARIANTS,  # phase B's merged, concat and merged_varlen attention side by side
                time_forward_only=True,
            )
            for p, s in ((10240, 2048), (2048, 10240))
        )
        # verl's TorchTitan engine vs prefix_torchtitan on the same model, bf16 parameters, no activation
        # checkpointing (prefix_torchtitan refuses it): a shorter cell, 2 rows per micro-batch
        + (
            Cell(
                "P2048/S128/G8/torchtitan",
                MODEL_GPU,
                1,
                8,
                2048,
                (128, 128),
                micro_batch_size=2,
                dtype="bfloat16",
                engine="torchtitan",
            ),
        ),
        reps=5,
        needs_cuda=True,
        description="1.7B-param Qwen3-style model, bf16 mixed precision, gradient checkpointing, G=16, 12K tokens; "
        "stock fsdp2 vs prefix_fsdp2 with merged, concat and merged_varlen phase-B attention",
    ),
    "gpu_offload": Preset(
        cells=(
            Cell(
                "P10240/S2048/G16 offload",
                MODEL_GPU,
                1,
                16,
                10240,
                (2048, 2048),
                micro_batch_size=2,
                dtype="bfloat16",
                overrides=_GPU + _OFFLOAD,
                variants=("fsdp2", "merged"),
            ),
        ),
        reps=3,
        needs_cuda=True,
        description="the gpu preset's 10K/2K cell with dormant_prefix=offload (saved tensors in pinned host memory)",
    ),
    "gpu_vl": Preset(
        cells=(
            Cell(
                "VL 1024 + P200/S128/G8",
                MODEL_GPU_VL,
                **_VL_CELL,
                micro_batch_size=4,
                dtype="bfloat16",
                overrides=_GPU,
            ),
        ),
        reps=3,
        needs_cuda=True,
        description="the vl preset's cell on Qwen2.5-VL's tower and a Qwen3-1.7B-shaped decoder, bf16 mixed "
        "precision, gradient checkpointing: stock fsdp2 vs prefix_fsdp2, update and forward-only",
    ),
    "capacity": Preset(
        cells=(),
        reps=1,
        threads=1,
        capacity=_capacity_spec("cpu"),
        description="longest prefix whose update fits 2 GiB above the loaded 29M model (G=8, suffix 128), "
        "stock fsdp2 at micro-batches 1/2 vs keep/recompute/recompute with 1024- and 512-token chunks; fresh "
        "processes (3 per grid point), each stopped once over the budget; about 40 minutes on 2 cores with --jobs 2",
    ),
    "capacity_smoke": Preset(
        cells=(),
        reps=1,
        threads=1,
        capacity=_capacity_spec("smoke"),
        description="the capacity search on the 1M smoke model at 256 MiB (stock at micro-batches 1/2/4); "
        "about 8 minutes on 2 cores",
    ),
    "gpu_capacity": Preset(
        cells=(),
        reps=1,
        needs_cuda=True,
        capacity=_capacity_spec("gpu"),
        description="capacity on the gpu preset's 1.7B model: 40 GiB above the loaded model enforced with "
        "set_per_process_memory_fraction (real OOM boundary), G=16, suffix 2048",
    ),
}


def cell_reps(cell: Cell, reps: int) -> int:
    """The timed reps this cell runs: the run's, capped by the cell's ``max_reps``."""
    return min(reps, cell.max_reps) if cell.max_reps else reps


def cell_batch(cell: Cell) -> Any:
    """The cell's GRPO mini-batch; seed 0, so every variant and every probe process gets the same one."""
    prompt_lens: int | list[int] = cell.prompt_len
    if cell.question_len_range is not None:
        lo, hi = cell.question_len_range
        draw = torch.randint(lo, hi + 1, (cell.num_groups,), generator=torch.Generator().manual_seed(0))
        prompt_lens = [int(x) for x in draw]
    if cell.image is not None:
        from verl_prefix.harness import vl as V

        return V.make_vl_grpo_batch(
            images=[[cell.image]] * cell.num_groups,
            group_size=cell.group_size,
            text_before=cell.prompt_len // 2,
            text_after=cell.prompt_len - cell.prompt_len // 2,
            response_len_range=cell.response_len_range,
            seed=0,
            family=cell.model.family,
        )
    return grpo_batches.make_grpo_batch(
        num_groups=cell.num_groups,
        group_size=cell.group_size,
        prompt_lens=prompt_lens,
        response_len_range=cell.response_len_range,
        vocab_size=cell.model.vocab_size,
        seed=0,
        shared_system=cell.system_len,
        response_stems=cell.response_stems,
    )


def build_variant(cell: Cell, variant: str, model_dir: Path) -> tuple[Any, Callable]:
    """``(engine, loss_fn)`` for one variant: the stock engine, or ``prefix_fsdp2`` with that phase-B attention,
    or (``TREE_VARIANTS``) with one-level reuse or the tree."""
    import verl_prefix

    if variant not in ALL_VARIANTS:
        raise BenchError(f"cell {cell.name!r}: unknown variant {variant!r}; choose from {', '.join(ALL_VARIANTS)}")
    dtype = "float32" if cell.dtype in ("float32", "bfloat16") else cell.dtype
    stock = variant == "fsdp2"
    rows = cell.dense_micro_batch_size if stock and cell.dense_micro_batch_size else cell.micro_batch_size
    engine, loss_fn, _ = verl_engine.build_verl_engine(
        model_dir,
        backend="fsdp2" if stock else "prefix_fsdp2",
        dtype=dtype,
        micro_batch_size_per_gpu=rows,
        overrides=cell.overrides,
    )
    if variant in TREE_VARIANTS:
        engine.reuse_config = verl_prefix.PrefixReuseConfig(
            min_prefix_len=cell.min_prefix_len, suffix_micro_batch_size=cell.micro_batch_size, tree=variant == "tree"
        )
    elif not stock:
        engine.reuse_config = verl_prefix.PrefixReuseConfig(
            min_prefix_len=cell.min_prefix_len, suffix_micro_batch_size=cell.micro_batch_size, phase_b_attention=variant
        )
    return engine, loss_fn


def cell_from_dict(raw: dict[str, Any]) -> Cell:
    """The cell ``dataclasses.asdict`` turned into JSON, back (how a fresh probe process receives it)."""
    return Cell(
        **{
            **raw,
            "model": ModelSpec(**raw["model"]),
            "response_len_range": tuple(raw["response_len_range"]),
            "overrides": tuple(raw["overrides"]),
            "variants": tuple(raw["variants"]),
            "question_len_range": tuple(raw["question_len_range"]) if raw.get("question_len_range") else None,
            "image": tuple(raw["image"]) if raw.get("image") else None,
            "response_stems": tuple(raw.get("response_stems", ())),
        }
    )


def resolve_preset(
    preset: str | Preset,
    reps: int | None = None,
    threads: int | None = None,
    cells: Sequence[str] | None = None,
) -> tuple[Preset, int]:
    """Validate a request before anything slow or any file is touched: ``(preset, reps)`` or ``BenchError``.

    ``cells`` keeps only the named cells, in the preset's order (a lent GPU's minutes go to the headline).
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise BenchError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        name, preset = preset, PRESETS[preset]
    else:
        name = "custom"
    reps = preset.reps if reps is None else reps
    if reps < 1:
        raise BenchError(f"reps must be >= 1, got {reps}")
    if threads is not None and threads < 1:
        raise BenchError(f"threads must be >= 1, got {threads}")
    if cells:
        names = [c.name for c in preset.cells]
        unknown = [c for c in cells if c not in names]
        if unknown:
            raise BenchError(f"preset {name!r} has no cell {unknown[0]!r}; its cells: {', '.join(names)}")
        preset = dataclasses.replace(preset, cells=tuple(c for c in preset.cells if c.name in cells))
    if preset.needs_cuda and not torch.cuda.is_available():
        raise BenchError(f"preset {name!r} needs a CUDA GPU (torch.cuda.is_available() is False)")
    titan = [c.name for c in preset.cells if c.engine == "torchtitan"]
    if titan and importlib.util.find_spec("torchtitan") is None:
        raise BenchError(f"cell {titan[0]!r} needs torchtitan 0.3.0 (scripts/setup.sh installs it)")
    megatron = [c.name for c in preset.cells if c.engine == "megatron"]
    if megatron and importlib.util.find_spec("megatron.core") is None:
        raise BenchError(f"cell {megatron[0]!r} needs megatron-core 0.16.1 (scripts/setup.sh installs it)")
    return preset, reps


# verl's use_torch_compile, on for both engines (in verl 0.9.1's FSDP engine it compiles the entropy kernel)
COMPILE_OVERRIDES = (
    "actor_rollout_ref.actor.use_torch_compile=true",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=true",
)


def compiled(cells: tuple[Cell, ...]) -> tuple[Cell, ...]:
    """The same cells with ``use_torch_compile`` on for both engines (the conservative comparison)."""
    return tuple(
        dataclasses.replace(c, name=f"{c.name} compile", overrides=c.overrides + COMPILE_OVERRIDES) for c in cells
    )
