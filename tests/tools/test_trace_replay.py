"""Trace record/replay: exact round trips, synthetic traces, recording a live engine, replay, CLI errors.

No timing assertions: CI machines are noisy. Replay runs a 20K-parameter model for 2 steps.
"""

import json
import math

import numpy as np
import pytest
import torch
from helpers.reuse import assert_reuse_ran
from tensordict import NonTensorData, NonTensorStack, TensorDict
from transformers import AutoConfig

from verl_prefix.backend import trace as TR
from verl_prefix.harness import grpo_batches, verl_engine
from verl_prefix.tools import cli
from verl_prefix.tools import replay as RP
from verl_prefix.tools.flops import ModelShape, predicted_speedup
from verl_prefix.tools.synthetic_trace import synthetic_trace

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=64)


def same_value(x, y) -> bool:
    """Python/numpy/tensor values equal in type and content, recursively."""
    if type(x) is not type(y):
        return False
    if isinstance(x, torch.Tensor):
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, np.ndarray):
        return x.dtype == y.dtype and x.shape == y.shape and all(same_value(a, b) for a, b in zip(x.flat, y.flat))
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(same_value(a, b) for a, b in zip(x, y))
    if isinstance(x, dict):
        return list(x) == list(y) and all(same_value(x[k], y[k]) for k in x)
    return x == y


def assert_same_tensordict(a: TensorDict, b: TensorDict) -> None:
    """Field by field: key order, kinds, dtypes, values, nested layouts, non-tensor wrappers and data."""
    assert list(a.keys()) == list(b.keys())
    assert a.batch_size == b.batch_size
    for key in a.keys():
        x, y = a.get(key), b.get(key)
        assert type(x) is type(y), key
        if isinstance(x, TensorDict):
            assert_same_tensordict(x, y)
        elif isinstance(x, NonTensorStack):
            assert same_value(x.tolist(), y.tolist()), key
        elif isinstance(x, NonTensorData):
            assert x.batch_size == y.batch_size and same_value(x.data, y.data), key
        elif x.is_nested:
            assert y.is_nested and x.layout == y.layout and x.dtype == y.dtype, key
            assert x._ragged_idx == y._ragged_idx, key
            assert torch.equal(x.values(), y.values()) and torch.equal(x.offsets(), y.offsets()), key
            assert [t.tolist() for t in x.unbind()] == [t.tolist() for t in y.unbind()], key
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), key


@pytest.mark.parametrize("layout", ["v1", "legacy"])
def test_round_trip_is_exact(tmp_path, layout):
    from verl.utils import tensordict_utils as tu

    batch = grpo_batches.make_grpo_batch(
        num_groups=3, group_size=4, prompt_lens=[9, 12, 5], response_len_range=(1, 7), vocab_size=64, use_kl=True
    )
    if layout == "legacy":
        batch = grpo_batches.make_grpo_batch(
            num_groups=2, group_size=3, prompt_lens=7, response_len_range=(2, 5), vocab_size=64, layout="legacy"
        )
    tu.assign_non_tensor(
        batch,
        np_array=np.arange(4, dtype=np.int32),
        np_scalar=np.float32(0.25),
        np_objects=np.array(["a", "b"], dtype=object),
        settings={"mode": "x", "betas": (0.9, 0.99), "none": None},
        per_sample=[{"score": float(i)} for i in range(len(batch))],
        micro_batch_size_per_gpu=2,
    )
    batch["sub"] = TensorDict({"x": torch.arange(len(batch) * 2.0).view(-1, 2)}, batch_size=batch.batch_size)
    writer = TR.TraceWriter(tmp_path / "t", model_ref="some/model@step3", config={"lr": 1e-6})
    path = writer.record(batch, step=7)
    assert path.is_file()
    trace = TR.load_trace(tmp_path / "t")
    assert len(trace) == 1 and trace.steps[0].step == 7
    assert_same_tensordict(batch, trace.batch(0))


def test_manifest_and_append(tmp_path):
    batch = grpo_batches.make_grpo_batch(
        num_groups=2, group_size=3, prompt_lens=10, response_len_range=(2, 5), vocab_size=64
    )
    writer = TR.TraceWriter(tmp_path, model_ref="m", config={"lr": 1e-6, "micro_batch_size_per_gpu": 2})
    writer.record(batch, step=0)
    writer.record(batch, step=0, config={"lr": 2e-6})
    manifest = json.loads((tmp_path / TR.MANIFEST).read_text())
    assert manifest["format"] == TR.FORMAT and manifest["version"] == TR.VERSION
    assert manifest["model_ref"] == "m" and manifest["config"]["lr"] == 1e-6 and manifest["created"]
    assert {"torch", "verl", "tensordict"} <= manifest["versions"].keys()
    assert [s["file"] for s in manifest["steps"]] == ["batch_000000.pt", "batch_000001.pt"]
    assert manifest["steps"][1]["config"] == {"lr": 2e-6}
    assert manifest["steps"][0]["rows"] == 6 and manifest["steps"][0]["groups"] == 2
    with pytest.raises(TR.TraceError, match="already holds a trace"):
        TR.TraceWriter(tmp_path)
    TR.TraceWriter(tmp_path, append=True).record(batch, step=1)
    assert len(TR.load_trace(tmp_path)) == 3


def test_load_trace_errors(tmp_path):
    with pytest.raises(TR.TraceError, match="does not exist"):
        TR.load_trace(tmp_path / "nope")
    with pytest.raises(TR.TraceError, match="no manifest"):
        TR.load_trace(tmp_path)
    (tmp_path / TR.MANIFEST).write_text("{not json")
    with pytest.raises(TR.TraceError, match="not valid JSON"):
        TR.load_trace(tmp_path)
    (tmp_path / TR.MANIFEST).write_text(json.dumps({"format": "other"}))
    with pytest.raises(TR.TraceError, match="manifest"):
        TR.load_trace(tmp_path)

    good = tmp_path / "good"
    batch = grpo_batches.make_grpo_batch(
        num_groups=1, group_size=2, prompt_lens=4, response_len_range=(1, 2), vocab_size=64
    )
    TR.TraceWriter(good).record(batch)
    TR.TraceWriter(good, append=True).record(batch)
    (good / "batch_000000.pt").write_bytes(b"garbage")
    with pytest.raises(TR.TraceError, match="cannot read batch_000000.pt"):
        TR.load_trace(good).batch(0)
    (good / "batch_000001.pt").unlink()
    with pytest.raises(TR.TraceError, match="missing"):
        TR.load_trace(good)


def test_unplain_values_are_refused(tmp_path):
    batch = grpo_batches.make_grpo_batch(
        num_groups=1, group_size=2, prompt_lens=4, response_len_range=(1, 2), vocab_size=64
    )
    batch["weird"] = NonTensorData(object())
    with pytest.raises(TR.TraceError, match="weird"):
        TR.TraceWriter(tmp_path).record(batch)


def test_chat_messages_with_images_round_trip(tmp_path):
    """A vision-language batch's ``raw_prompt`` holds the decoded PIL images (verl's data set puts them in the
    messages): recorded as PNG, read back as the same pixels (a ``record_trace_dir`` VL run failed on them)."""
    from PIL import Image
    from verl.utils import tensordict_utils as tu

    batch = grpo_batches.make_grpo_batch(
        num_groups=1, group_size=2, prompt_lens=4, response_len_range=(1, 2), vocab_size=64
    )
    image = Image.fromarray(np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3))
    message = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "t9"}]}]
    tu.assign_non_tensor(batch, raw_prompt=[message, message])
    TR.TraceWriter(tmp_path / "t").record(batch, step=1)
    got = TR.load_trace(tmp_path / "t").batch(0)["raw_prompt"]
    for row in got:
        back = row[0]["content"][0]["image"]
        assert np.array_equal(np.asarray(back), np.asarray(image)) and row[0]["content"][1]["text"] == "t9"


def test_synthetic_trace_shapes(tmp_path):
    root = synthetic_trace(
        tmp_path,
        steps=3,
        groups=2,
        group_size=4,
        prefix_len=(20, 30),
        suffix_len=(3, 9),
        vocab_size=64,
        micro_batch_size=2,
        seed=5,
    )
    trace = TR.load_trace(root)
    assert len(trace) == 3 and trace.manifest["source"] == "synthetic"
    assert trace.config["micro_batch_size_per_gpu"] == 2
    seen_uids = set()
    for entry, batch in trace:
        assert entry.rows == len(batch) == 8 and entry.groups == 2
        assert batch["micro_batch_size_per_gpu"] == 2  # what the worker injects is in the batch
        groups = TR.batch_groups(batch)
        assert len(groups) == 2
        for prompt_len, responses in groups:
            assert 20 <= prompt_len <= 30 and len(responses) == 4
            assert all(3 <= r <= 9 for r in responses)
        uids = batch.get("uid").tolist()
        assert not seen_uids & set(uids)  # every step brings new prompts
        seen_uids |= set(uids)
        prompts = batch["prompts"].unbind()
        assert all(torch.equal(prompts[0], p) for p in prompts[:4])
    with pytest.raises(TR.TraceError, match="prefix_len"):
        synthetic_trace(tmp_path / "x", steps=1, groups=1, group_size=2, prefix_len=0, suffix_len=3, vocab_size=64)


def test_recording_a_live_engine(tmp_path, tiny_model):
    model = tiny_model("qwen3", **TINY)
    engine, loss_fn, _ = verl_engine.build_verl_engine(model, backend="fsdp2", micro_batch_size_per_gpu=2, lr=1e-4)
    batch = grpo_batches.make_grpo_batch(
        num_groups=2, group_size=3, prompt_lens=12, response_len_range=(2, 5), vocab_size=64
    )
    received = []
    original = engine.train_batch

    def spy(data, loss_function):
        received.append(data.copy())
        return original(data, loss_function)

    engine.train_batch = spy
    with TR.recording(engine, tmp_path / "rec", model_ref=str(model)) as writer:
        verl_engine.run_train_step(engine, loss_fn, batch)
        verl_engine.run_train_step(engine, loss_fn, batch)
    assert engine.train_batch is spy  # the instance's own override is restored, not dropped
    del engine.train_batch
    assert len(writer) == 2
    trace = TR.load_trace(tmp_path / "rec")
    assert trace.model_ref == str(model)
    config = trace.steps[0].config
    assert config["micro_batch_size_per_gpu"] == 2 and config["lr"] == 1e-4
    assert config["loss_agg_mode"] == "token-mean" and config["policy_loss_mode"] == "vanilla"
    assert any(o.startswith("actor_rollout_ref.actor.clip_ratio=") for o in config["overrides"])
    assert_same_tensordict(received[0], trace.batch(0))  # exactly what the engine received


def test_record_trace_dir_option_records_from_a_yaml_config(tmp_path, tiny_model):
    """The config route a real run uses: every update_actor batch lands in the trace, then replays."""
    model = tiny_model("qwen3", **TINY)
    actor = "actor_rollout_ref.actor"
    engine, loss_fn, _ = verl_engine.build_verl_engine(
        model,
        backend="prefix_fsdp2",
        micro_batch_size_per_gpu=2,
        overrides=[f"{actor}._target_=verl_prefix.PrefixFSDPActorConfig", f"+{actor}.record_trace_dir={tmp_path}/run"],
    )
    batch = grpo_batches.make_grpo_batch(
        num_groups=2, group_size=3, prompt_lens=12, response_len_range=(2, 5), vocab_size=64
    )
    for _ in range(2):
        verl_engine.run_train_step(engine, loss_fn, batch)
    trace = TR.load_trace(tmp_path / "run")
    assert len(trace) == 2 and trace.model_ref == str(model)
    assert trace.steps[0].config["backend"] == "fsdp2"  # what verl's FSDP code sees; replay picks both engines
    recorded = trace.batch(1)  # the worker's defaults are added on top of the trainer's batch
    assert set(batch.keys()) <= set(recorded.keys())
    assert_same_tensordict(batch, recorded.select(*batch.keys()))


@pytest.fixture(scope="module")
def replay_result(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("replay")
    model = tiny_model("qwen3", **TINY)
    synthetic_trace(
        root / "trace",
        steps=3,
        groups=2,
        group_size=4,
        prefix_len=(36, 44),
        suffix_len=(3, 8),
        vocab_size=64,
        micro_batch_size=2,
        lr=1e-3,
        model_ref=str(model),
    )
    out = root / "replay.json"
    result = RP.replay(root / "trace", steps=2, reps=1, out_json=out)
    return result, out, root / "trace", model


def test_replay_rows(replay_result):
    result, out, trace_dir, model = replay_result
    assert json.loads(out.read_text())["kind"] == "replay"
    assert result["initial_params_identical"]
    assert result["engine_kwargs"] == {"micro_batch_size_per_gpu": 2, "use_dynamic_bsz": False, "lr": 1e-3}
    assert len(result["steps"]) == 2  # --steps cut the 3-batch trace
    trace = TR.load_trace(trace_dir)
    shape = ModelShape.from_config(AutoConfig.from_pretrained(model))
    for i, row in enumerate(result["steps"]):
        # no timing assertions: timings are finite and the derived figures are computed from them
        assert len(row["dense_s"]) == len(row["prefix_s"]) == 1
        assert all(math.isfinite(t) for t in row["dense_s"] + row["prefix_s"])
        assert (row["dense_median_s"], row["prefix_median_s"]) == (row["dense_s"][0], row["prefix_s"][0])
        assert row["ratio_median"] == pytest.approx(row["dense_s"][0] / row["prefix_s"][0])
        assert row["ratio_of_medians"] == pytest.approx(row["ratio_median"])
        # the FLOP model and the token counts follow from the replayed batch's groups
        groups = TR.batch_groups(trace.batch(i))
        assert len(groups) == row["groups"] == 2 and all(len(r) == 4 for _, r in groups)
        assert row["predicted_speedup"] == pytest.approx(predicted_speedup(shape, groups), rel=1e-12)
        logical = sum(p + s for p, r in groups for s in r)
        physical = sum(p - 1 + sum(r) for p, r in groups)
        assert row["predicted_speedup"] > 1
        assert row["tokens"] == logical
        assert row["update_norm"] > 0
        assert math.isfinite(row["noise_floor"]) and row["noise_variant"] == "micro_batch_size_per_gpu 2 -> 1"
        assert 0 <= row["drift"] < 1e-3  # fp32 rounding, not a schedule difference
        assert 0 <= row["noise_floor"] < 1e-3
        assert_reuse_ran(row["prefix_metrics"], groups=2)  # the prefix engine reused, it did not fall back
        assert row["prefix_metrics"]["prefix/logical_tokens"] == logical
        assert row["prefix_metrics"]["prefix/physical_tokens"] == physical
        assert {"A", "B"} <= row["memory"]["prefix"]["saved_for_backward_mib"].keys()
        assert row["memory"]["dense"]["saved_for_backward_held_mib"] > 0
        assert {"A", "B", "C", "optimizer"} <= row["prefix_time_s"].keys()
        assert row["grad_norm_dense"] == pytest.approx(row["grad_norm_prefix"], rel=1e-4)
    assert result["summary"]["steps"] == 2
    table = RP.replay_table(result)
    assert table.count("\n") == 3


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err, err
    return err


def test_cli_replay_user_mistakes(tmp_path, tiny_model, capsys):
    small = tiny_model("qwen3", **{**TINY, "vocab_size": 16})
    capsys.readouterr()
    assert cli.main(["replay", "--trace", str(tmp_path / "missing"), "--out", str(tmp_path / "r.json")]) == 2
    assert "does not exist" in one_line_error(capsys)

    (tmp_path / "empty").mkdir()
    assert cli.main(["replay", "--trace", str(tmp_path / "empty"), "--out", str(tmp_path / "r.json")]) == 2
    assert "not a trace" in one_line_error(capsys)

    trace = synthetic_trace(tmp_path / "t", steps=1, groups=1, group_size=2, prefix_len=8, suffix_len=2, vocab_size=64)
    out = str(tmp_path / "r.json")
    assert cli.main(["replay", "--trace", str(trace), "--out", out]) == 2  # no model_ref, no --model
    assert "pass one" in one_line_error(capsys)
    assert cli.main(["replay", "--trace", str(trace), "--model", str(tmp_path / "nope"), "--out", out]) == 2
    assert "does not exist" in one_line_error(capsys)
    assert cli.main(["replay", "--trace", str(trace), "--model", str(tmp_path), "--out", out]) == 2
    assert "config.json" in one_line_error(capsys)
    assert cli.main(["replay", "--trace", str(trace), "--model", str(small), "--out", out]) == 2
    assert "vocab_size 16" in one_line_error(capsys)
    assert cli.main(["replay", "--trace", str(trace), "--steps", "0"]) == 2
    one_line_error(capsys)


def test_cli_trace_synthetic_and_show(tmp_path, capsys):
    out = tmp_path / "t"
    argv = ["trace", "synthetic", "--out", str(out), "--steps", "2", "--groups", "1", "--group-size", "3"]
    argv += ["--prefix-len", "10:12", "--suffix-len", "2", "--write-model", "tiny"]
    assert cli.main(argv) == 0
    trace = TR.load_trace(out)
    assert len(trace) == 2 and trace.model_ref == "model" and (out / "model" / "config.json").is_file()
    assert all(r == 2 for _, rs in TR.batch_groups(trace.batch(0)) for r in rs)
    capsys.readouterr()
    assert cli.main(argv) == 2  # refuses to overwrite
    assert "--force" in one_line_error(capsys)
    assert cli.main([*argv, "--force"]) == 0
    assert cli.main(["trace", "show", str(out)]) == 0
    assert "2 batches" in capsys.readouterr().out
    assert cli.main(["trace", "synthetic", "--out", str(tmp_path / "u"), "--prefix-len", "9:3"]) == 2
    one_line_error(capsys)
    assert cli.main(["trace", "synthetic", "--out", str(tmp_path / "u")]) == 2  # no vocab size anywhere
    assert "--vocab-size" in one_line_error(capsys)
    assert cli.main(["trace", "show", str(tmp_path / "nope")]) == 2
    one_line_error(capsys)


def test_a_recorded_tree_batch_replays_with_the_same_result(tmp_path, tiny_model):
    """A live prefix_fsdp2 engine with ``prefix_reuse.tree`` records its batch; replay rebuilds the tree from the
    trace's config and reaches the recorded loss, gradient norm and trie (system block once), and prices the
    trie with the tree FLOP model. A synthetic trace can carry a system block and the knob too."""
    import verl_prefix
    from verl_prefix.tools.tree_flops import tree_model

    model = tiny_model("qwen3", **TINY)
    engine, loss_fn, _ = verl_engine.build_verl_engine(
        model, backend="prefix_fsdp2", micro_batch_size_per_gpu=2, lr=1e-3
    )
    engine.reuse_config = verl_prefix.PrefixReuseConfig(min_prefix_len=2, tree=True, min_shared_tokens=8)
    batch = grpo_batches.make_grpo_batch(
        num_groups=2, group_size=3, prompt_lens=[5, 9], response_len_range=(2, 5), vocab_size=64, shared_system=24
    )
    with TR.recording(engine, tmp_path / "rec", model_ref=str(model)):
        recorded = verl_engine.run_train_step(engine, loss_fn, batch)
    del engine
    trace = TR.load_trace(tmp_path / "rec")
    assert trace.steps[0].config["prefix_reuse"]["tree"] is True
    result = RP.replay(tmp_path / "rec", reps=1, warmup=0, noise=False)
    row = result["steps"][0]
    assert row["loss_prefix"] == pytest.approx(recorded["loss"], rel=1e-6)
    assert row["grad_norm_prefix"] == pytest.approx(recorded["grad_norm"], rel=1e-6)
    want = recorded["reduced_metrics"]
    for key in ("tree_nodes", "tree_depth", "tree_shared_tokens/level1", "tree_saved_tokens", "physical_tokens"):
        assert row["prefix_metrics"][f"prefix/{key}"] == want[f"prefix/{key}"], key
    assert want["prefix/tree_nodes"] == 3 and want["prefix/tree_shared_tokens/level1"] == 24
    assert want["prefix/physical_tokens"] < want["prefix/logical_tokens"]
    assert 0 <= row["drift"] < 1e-3  # against the stock engine: rounding only
    shape = ModelShape.from_config(AutoConfig.from_pretrained(model))
    assert row["tree"]["nodes"] == 3 and row["tree"]["depth"] == 2
    assert row["predicted_speedup"] == row["tree"]["tree"] > row["tree"]["one_level"] > 1
    groups = TR.batch_groups(batch)
    assert row["tree"]["one_level"] == pytest.approx(predicted_speedup(shape, groups), rel=1e-12)
    # the model follows the knobs: with the default min_shared_tokens (32) the 24-token block is merged away
    merged = tree_model(batch, verl_prefix.PrefixReuseConfig(min_prefix_len=2, tree=True))
    assert len(merged.nodes) == 2 and merged.depth == 1
    assert merged.speedups(shape)["tree"] == pytest.approx(row["tree"]["one_level"], rel=1e-12)

    synthetic_trace(
        tmp_path / "syn",
        steps=1,
        groups=2,
        group_size=2,
        prefix_len=4,
        suffix_len=2,
        vocab_size=64,
        system_len=12,
        prefix_reuse={"tree": True},
    )
    syn = TR.load_trace(tmp_path / "syn")
    prompts = syn.batch(0)["prompts"].unbind()
    assert syn.config["prefix_reuse"] == {"tree": True} and syn.config["synthetic"]["system_len"] == 12
    assert torch.equal(prompts[0][:12], prompts[2][:12]) and not torch.equal(prompts[0], prompts[2])
    with pytest.raises(TR.TraceError, match="prefix_reuse"):
        synthetic_trace(
            tmp_path / "bad",
            steps=1,
            groups=1,
            group_size=2,
            prefix_len=4,
            suffix_len=2,
            vocab_size=64,
            prefix_reuse={"tree": True, "min_shared_tokens": 0},  # a trie node of no token
        )
