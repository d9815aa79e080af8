"""``prefix/flops_saved_ratio`` on a tiny engine run is the FLOP model's prediction for that batch.

The prediction is computed apart from the engine: the batch's prompt and response lengths, grouped by uid, priced
with the benches' model (``verl_prefix.tools.flops``, ``tools.tree_flops`` under the tree). Reuse gives a ratio
above 1, a mini-batch that runs dense exactly 1, and the forward-only passes (old/ref log-probs) log it too.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from transformers import AutoConfig

from verl_prefix import PrefixReuseConfig
from verl_prefix.harness import grpo_batches, verl_engine
from verl_prefix.tools.flops import ModelShape, dense_flops, predicted_speedup, reuse_flops
from verl_prefix.tools.tree_flops import tree_model

VOCAB = 128


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def engine(model_dir):
    engine, loss_fn, _ = verl_engine.build_verl_engine(model_dir, backend="prefix_fsdp2", micro_batch_size_per_gpu=2)
    return engine, loss_fn


@pytest.fixture(scope="module")
def shape(model_dir) -> ModelShape:
    return ModelShape.from_config(AutoConfig.from_pretrained(model_dir))


def lengths(batch) -> tuple[list[int], list[int], list[str]]:
    """Prompt and response length and uid of every row, read from the batch's masks."""
    total = batch["input_ids"].offsets().diff().tolist()
    responses = [int(m.sum()) for m in batch["response_mask"].unbind()]
    return [n - s for n, s in zip(total, responses)], responses, [str(u) for u in batch["uid"]]


def groups_of(batch, min_group_size: int = 2) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """``(prompt_len, response_lens)`` per uid group that reuses, and the token counts of the rows left dense."""
    prompts, responses, uids = lengths(batch)
    by_uid: dict[str, list[int]] = defaultdict(list)
    for i, uid in enumerate(uids):
        by_uid[uid].append(i)
    groups, dense = [], []
    for rows in by_uid.values():
        if len(rows) >= min_group_size:
            groups.append((prompts[rows[0]], [responses[i] for i in rows]))
        else:
            dense += [prompts[i] + responses[i] for i in rows]
    return groups, dense


def grouped_batch():
    return grpo_batches.make_grpo_batch(
        num_groups=2, group_size=4, prompt_lens=[48, 40], response_len_range=(2, 6), vocab_size=VOCAB, seed=4
    )


def assert_consistent(m: dict[str, float]) -> None:
    assert m["prefix/flops_saved_ratio"] == pytest.approx(m["prefix/flops_dense"] / m["prefix/flops_schedule"])
    assert m["prefix/est_dense_time_s"] == pytest.approx(m["prefix/time_s/schedule"] * m["prefix/flops_saved_ratio"])


def test_update_ratio_is_the_flop_models(engine, shape):
    eng, loss_fn = engine
    eng.reuse_config = PrefixReuseConfig()
    batch = grouped_batch()
    m = verl_engine.run_train_step(eng, loss_fn, batch)["reduced_metrics"]
    groups, _ = groups_of(batch)
    assert m["prefix/flops_saved_ratio"] == pytest.approx(predicted_speedup(shape, groups), rel=1e-12)
    assert m["prefix/flops_saved_ratio"] > 1
    assert m["prefix/flops_dense"] == pytest.approx(sum(dense_flops(shape, p, s) for p, s in groups), rel=1e-12)
    assert m["prefix/dense_samples"] == 0
    assert_consistent(m)
    rss = max(v for k, v in m.items() if k.startswith("prefix/max_rss_mib/"))
    assert m["prefix/max_rss_gb"] == pytest.approx(rss / 1024)


def test_forward_only_pass_logs_the_same_ratio(engine, shape):
    eng, _ = engine
    eng.reuse_config = PrefixReuseConfig()
    batch = grouped_batch()
    m = verl_engine.reduce_step_metrics(verl_engine.run_infer(eng, batch)["metrics"])
    groups, _ = groups_of(batch)
    assert m["prefix/flops_saved_ratio"] == pytest.approx(predicted_speedup(shape, groups), rel=1e-12)
    assert_consistent(m)


def test_dense_rows_count_on_both_sides(engine, shape):
    """A group of one runs dense beside two reusing groups: its FLOPs are added to dense and schedule alike."""
    eng, loss_fn = engine
    eng.reuse_config = PrefixReuseConfig()
    batch = grpo_batches.make_grpo_batch(
        num_groups=3, group_size=3, prompt_lens=[48, 40, 36], response_len_range=(2, 6), vocab_size=VOCAB, seed=5
    )
    batch["uid"] = np.array([*list(batch["uid"])[:-1], "alone"], dtype=object)  # a group of one: small_group
    m = verl_engine.run_train_step(eng, loss_fn, batch)["reduced_metrics"]
    groups, dense = groups_of(batch)
    assert m["prefix/fallback_small_group"] == 1 == m["prefix/dense_samples"] == len(dense)
    row = sum(dense_flops(shape, n, [0]) for n in dense)
    want = (sum(dense_flops(shape, p, s) for p, s in groups) + row) / (
        sum(reuse_flops(shape, p, s) for p, s in groups) + row
    )
    assert m["prefix/flops_saved_ratio"] == pytest.approx(want, rel=1e-12) and want > 1
    assert_consistent(m)


@pytest.mark.parametrize(
    "config, reason",
    [(PrefixReuseConfig(enable=False), "disabled"), (PrefixReuseConfig(min_prefix_len=10_000), "short_prefix")],
)
def test_everything_dense_saves_exactly_nothing(engine, shape, config, reason):
    eng, loss_fn = engine
    eng.reuse_config = config
    try:
        batch = grouped_batch()
        for m in (
            verl_engine.run_train_step(eng, loss_fn, batch)["reduced_metrics"],
            verl_engine.reduce_step_metrics(verl_engine.run_infer(eng, batch)["metrics"]),
        ):
            assert m[f"prefix/fallback_{reason}"] == len(batch) == m["prefix/dense_samples"]
            assert m["prefix/flops_saved_ratio"] == 1.0
            assert m["prefix/flops_dense"] == m["prefix/flops_schedule"]
            prompts, responses, _ = lengths(batch)
            want = sum(dense_flops(shape, p, [s]) for p, s in zip(prompts, responses))
            assert m["prefix/flops_dense"] == pytest.approx(want, rel=1e-12)
            assert m["prefix/est_dense_time_s"] == pytest.approx(m["prefix/time_s/schedule"])
    finally:
        eng.reuse_config = PrefixReuseConfig()


def test_tree_counts_shared_nodes_once(engine, shape):
    """Under the tree a system block the groups share runs once: the ratio is the tree's FLOP model, above
    one-level reuse's."""
    eng, loss_fn = engine
    config = PrefixReuseConfig(tree=True, min_shared_tokens=8)
    eng.reuse_config = config
    try:
        batch = grpo_batches.make_grpo_batch(
            num_groups=3,
            group_size=3,
            prompt_lens=[48, 44, 40],
            response_len_range=(2, 6),
            vocab_size=VOCAB,
            seed=6,
            shared_system=32,
        )
        m = verl_engine.run_train_step(eng, loss_fn, batch)["reduced_metrics"]
        model = tree_model(batch, config)
        assert m["prefix/tree_nodes"] > len(model.groups)  # the shared block is a node of its own
        assert m["prefix/flops_saved_ratio"] == pytest.approx(model.speedups(shape)["tree"], rel=1e-12)
        assert m["prefix/flops_saved_ratio"] > predicted_speedup(shape, groups_of(batch)[0]) > 1
        assert_consistent(m)
    finally:
        eng.reuse_config = PrefixReuseConfig()
