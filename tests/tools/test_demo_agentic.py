"""``verl-prefix demo --task agentic`` at function level: the option reaches the agentic task, its batches share
one system block across groups, and its three engines are stock, one-level reuse and the tree (no engine is
built here: the bench's agentic cell runs the same three engines, ``test_bench_cli``)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from verl_prefix.tools import cli
from verl_prefix.tools.demo.agentic import (
    AGENTIC_MODEL,
    AGENTIC_TASK,
    ENGINES,
    agentic_batch,
    check_agentic_options,
    reuse_configs,
)
from verl_prefix.tools.demo.echo import DemoError
from verl_prefix.tools.flops import ModelShape
from verl_prefix.tools.tree_flops import tree_model


def test_agentic_task_batches_and_engines():
    configs = reuse_configs(micro_batch_size=4)
    assert tuple(configs) == ENGINES and configs["stock"] is None
    assert configs["one_level"].tree is False and configs["tree"].tree is True
    assert configs["tree"].suffix_micro_batch_size == 4
    batch = agentic_batch(AGENTIC_TASK, prompts=3, n=2, vocab_size=AGENTIC_MODEL["vocab_size"], seed=1)
    prompts = batch["prompts"].unbind()
    system = AGENTIC_TASK.system_len
    assert len(prompts) == 6 and len({len(p) for p in prompts[::2]}) > 1  # a question length per group
    assert all(torch.equal(p[:system], prompts[0][:system]) for p in prompts)
    assert not torch.equal(prompts[0][system : system + 8], prompts[2][system : system + 8])
    model = tree_model(batch, configs["tree"])
    assert len(model.nodes) == 4 and model.depth == 2 and model.nodes[0] == (0, system)
    shape = ModelShape.from_config(Qwen3Config(**_hf(AGENTIC_MODEL)))
    speedups = model.speedups(shape)
    assert speedups["tree"] > speedups["one_level"] > 1 and speedups["tree_over_one_level"] > 1


def _hf(spec: dict[str, int]) -> dict[str, int]:
    return dict(
        hidden_size=spec["hidden_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        intermediate_size=spec["intermediate_size"],
        vocab_size=spec["vocab_size"],
        head_dim=spec["hidden_size"] // spec["num_heads"],
    )


def test_demo_task_option_reaches_the_agentic_task(tmp_path, capsys):
    # --prompts 1 is fine for the echo loop but not for groups sharing a system block: the agentic task's check
    assert cli.main(["demo", "--task", "agentic", "--prompts", "1", "--out-dir", str(tmp_path)]) == 2
    assert "--task agentic needs --prompts >= 2" in capsys.readouterr().err
    with pytest.raises(DemoError, match="--n must be >= 2"):
        check_agentic_options(tmp_path, steps=1, prompts=2, n=1)
    assert cli.main(["demo", "--task", "nope"]) == 2
