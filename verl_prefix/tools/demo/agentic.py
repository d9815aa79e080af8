"""``verl-prefix demo --task agentic``: stock, one-level reuse and the tree side by side on agentic batches.

Agentic and tool-use GRPO puts one system prompt in front of every question: one-level reuse computes it once
per group, the tree (``prefix_reuse.tree``) once per rank. The echo demo's Ray loop samples short prompts with
no shared block, so this task drives the three engines directly instead: verl's stock ``fsdp2``,
``prefix_fsdp2`` with one-level reuse and with the tree, built from one random-init model (same weights), each
updating (optimizer step included) on the same agentic batches, step by step. It reports per step each
engine's ``update_actor`` time, the tokens it computed, the trie it ran and how far its parameters are from the
stock engine's, with the FLOP model (``tree_flops``) beside the times. No Ray, no rollout, no wandb.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_prefix.tools.demo.echo import DemoError

# the echo demo's model shape (0.9M parameters), its vocabulary wide enough for random prompts
AGENTIC_MODEL: dict[str, int] = dict(
    hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384, vocab_size=512
)
ENGINES = ("stock", "one_level", "tree")


@dataclass(frozen=True)
class AgenticTask:
    """One step's batch: ``prompts`` groups of ``n`` behind one ``system_len``-token system block, each with a
    question of ``question_len`` tokens and responses of ``response_len`` (inclusive ranges)."""

    system_len: int = 1024
    question_len: tuple[int, int] = (64, 128)
    response_len: tuple[int, int] = (16, 32)


AGENTIC_TASK = AgenticTask()


def agentic_batch(task: AgenticTask, *, prompts: int, n: int, vocab_size: int, seed: int) -> Any:
    """A GRPO mini-batch of the task's shape (one system block per step, a question per group)."""
    from verl_prefix.harness import grpo_batches

    lo, hi = task.question_len
    draw = torch.randint(lo, hi + 1, (prompts,), generator=torch.Generator().manual_seed(seed))
    return grpo_batches.make_grpo_batch(
        num_groups=prompts,
        group_size=n,
        prompt_lens=[int(x) for x in draw],
        response_len_range=task.response_len,
        vocab_size=vocab_size,
        seed=seed,
        shared_system=task.system_len,
    )


def reuse_configs(micro_batch_size: int) -> dict[str, Any]:
    """Each engine's reuse knobs: ``None`` for the stock engine, one-level reuse, and the tree."""
    import verl_prefix

    def reuse(tree: bool) -> Any:
        return verl_prefix.PrefixReuseConfig(suffix_micro_batch_size=micro_batch_size, tree=tree)

    return {"stock": None, "one_level": reuse(False), "tree": reuse(True)}


def build_engines(model_dir: Path, *, micro_batch_size: int, lr: float) -> dict[str, tuple[Any, Callable]]:
    """``(engine, loss_fn)`` per engine of ``ENGINES``, from one model directory (identical weights)."""
    from verl_prefix.harness import verl_engine

    engines = {}
    for name, reuse in reuse_configs(micro_batch_size).items():
        backend = "fsdp2" if reuse is None else "prefix_fsdp2"
        engine, loss_fn, _ = verl_engine.build_verl_engine(
            model_dir, backend=backend, micro_batch_size_per_gpu=micro_batch_size, lr=lr
        )
        if reuse is not None:
            engine.reuse_config = reuse
        engines[name] = (engine, loss_fn)
    return engines


def _relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    """``||got - want|| / ||want - before||`` over all parameters (how far from the stock update)."""
    diff = sum(float((got[k].double() - w.double()).norm()) ** 2 for k, w in want.items())
    update = sum(float((w.double() - before[k].double()).norm()) ** 2 for k, w in want.items())
    return (diff / update) ** 0.5 if update > 0 else 0.0


def check_agentic_options(out_dir: Path, *, steps: int, prompts: int, n: int) -> None:
    """Reject sizes and paths the task cannot run, with the option's name (``DemoError``)."""
    if steps < 1:
        raise DemoError(f"--steps must be >= 1, got {steps}")
    if prompts < 2:
        raise DemoError(f"--task agentic needs --prompts >= 2 (groups sharing the system block), got {prompts}")
    if n < 2:
        raise DemoError(f"--n must be >= 2 (GRPO needs a group to share a prompt), got {n}")
    if out_dir.exists() and not out_dir.is_dir():
        raise DemoError(f"--out-dir {out_dir} exists and is not a directory")


def run_agentic_demo(
    out_dir: str | os.PathLike,
    *,
    steps: int = 3,
    prompts: int = 4,
    n: int = 8,
    task: AgenticTask = AGENTIC_TASK,
    lr: float = 1e-3,
    micro_batch_size: int = 4,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write the model, run ``steps`` updates on each engine in turn per step (same batch), summarise into
    ``OUT/demo_agentic.json``; returns the summary ``agentic_report`` prints."""
    from transformers import AutoConfig

    from verl_prefix.harness import tiny_models, verl_engine
    from verl_prefix.tools.flops import ModelShape
    from verl_prefix.tools.measure import select_platform
    from verl_prefix.tools.tree_flops import tree_model

    select_platform()  # verl on its CPU platform without CUDA (the CLI has done it already)
    say = progress or (lambda _: None)
    out = Path(out_dir)
    check_agentic_options(out, steps=steps, prompts=prompts, n=n)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model_dir = tiny_models.write_tiny_model(out / "model", "qwen3", **AGENTIC_MODEL)
    shape = ModelShape.from_config(AutoConfig.from_pretrained(model_dir))
    engines = build_engines(model_dir, micro_batch_size=micro_batch_size, lr=lr)
    say(f"built stock fsdp2, prefix_fsdp2 one-level and tree from {model_dir}")
    before = verl_engine.params_of(engines["stock"][0])
    rows = []
    for step in range(1, steps + 1):
        batch = agentic_batch(task, prompts=prompts, n=n, vocab_size=AGENTIC_MODEL["vocab_size"], seed=seed + step)
        row: dict[str, Any] = {
            "step": step,
            "flop_model": tree_model(batch, reuse_configs(micro_batch_size)["tree"]).speedups(shape),
        }
        params = {}
        for name, (engine, loss_fn) in engines.items():
            t0 = time.perf_counter()
            result = verl_engine.run_train_step(engine, loss_fn, batch)
            seconds = time.perf_counter() - t0
            metrics = result["reduced_metrics"]
            params[name] = verl_engine.params_of(engine)
            row[name] = {
                "update_s": seconds,
                "loss": result["loss"],
                "logical_tokens": metrics.get("prefix/logical_tokens"),
                "physical_tokens": metrics.get("prefix/physical_tokens"),
                "tree_nodes": metrics.get("prefix/tree_nodes"),
                "tree_depth": metrics.get("prefix/tree_depth"),
            }
        for name in ("one_level", "tree"):
            row[name]["speedup"] = row["stock"]["update_s"] / row[name]["update_s"]
            row[name]["param_rel"] = _relative(params[name], params["stock"], before)
        before = params["stock"]
        rows.append(row)
        say(
            f"step {step}: stock {row['stock']['update_s']:.2f}s, one-level {row['one_level']['update_s']:.2f}s, "
            f"tree {row['tree']['update_s']:.2f}s"
        )
    summary = {
        "task": "agentic",
        "config": {"steps": steps, "prompts": prompts, "n": n, "model": AGENTIC_MODEL, **dataclasses.asdict(task)},
        "steps": rows,
        "speedup_median": {e: statistics.median(r[e]["speedup"] for r in rows) for e in ("one_level", "tree")},
        "wall_s": time.perf_counter() - started,
        "out_dir": str(out),
    }
    (out / "demo_agentic.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def agentic_report(summary: dict[str, Any]) -> str:
    """The table ``verl-prefix demo --task agentic`` prints (markdown)."""
    c = summary["config"]
    lines = [
        f"verl-prefix demo --task agentic: {c['steps']} updates per engine, {c['prompts']} groups x n={c['n']} behind "
        f"one {c['system_len']}-token system block (questions {c['question_len'][0]}-{c['question_len'][1]}, "
        f"responses {c['response_len'][0]}-{c['response_len'][1]} tokens), 1 rank, CPU",
        "",
        "| step | engine | update_actor (s) | speedup vs stock (FLOP model) | logical tokens | physical tokens "
        "| trie nodes / depth | params vs stock |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["steps"]:
        for name in ENGINES:
            e = r[name]
            if name == "stock":
                lines.append(f"| {r['step']} | stock fsdp2 | {e['update_s']:.3f} | | | | | |")
                continue
            trie = "-" if not e["tree_nodes"] else f"{e['tree_nodes']:.0f} / {e['tree_depth']:.0f}"
            lines.append(
                f"| {r['step']} | {name.replace('_', '-')} | {e['update_s']:.3f} | {e['speedup']:.2f}x "
                f"({r['flop_model'][name]:.2f}x) | {e['logical_tokens']:.0f} | {e['physical_tokens']:.0f} | {trie} "
                f"| {e['param_rel']:.1e} |"
            )
    m = summary["speedup_median"]
    lines += [
        "",
        f"update_actor speedup over stock, median of steps: one-level {m['one_level']:.2f}x, tree {m['tree']:.2f}x",
        "params vs stock: ||p - p_stock|| / ||stock update|| after each step",
        f"wall {summary['wall_s']:.1f} s | summary: {Path(summary['out_dir']) / 'demo_agentic.json'}",
    ]
    return "\n".join(lines)


__all__ = [
    "AGENTIC_MODEL",
    "AGENTIC_TASK",
    "ENGINES",
    "AgenticTask",
    "agentic_batch",
    "agentic_report",
    "build_engines",
    "check_agentic_options",
    "reuse_configs",
    "run_agentic_demo",
]
