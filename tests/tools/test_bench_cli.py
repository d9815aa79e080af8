"""The benchmark and its CLI, end to end on a minuscule model (no timing assertions: CI machines are noisy)."""

import json
import math
import statistics

import pytest
from helpers.reuse import assert_reuse_ran
from transformers import Qwen3Config

from verl_prefix.tools import bench as B
from verl_prefix.tools import cli
from verl_prefix.tools.flops import ModelShape, predicted_speedup

TINY = B.Preset(
    cells=(
        B.Cell(
            "tiny",
            B.ModelSpec(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=64),
            num_groups=2,
            group_size=4,
            prompt_len=40,
            response_len_range=(3, 8),
            micro_batch_size=2,
            min_prefix_len=8,
        ),
    ),
    reps=2,
    threads=1,
)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """``verl-prefix bench`` in-process with the smoke preset swapped for the minuscule one."""
    tmp = tmp_path_factory.mktemp("bench")
    out, table = tmp / "result.json", tmp / "bench.md"
    table.write_text("# Benchmarks\n\n<!-- bench:smoke:start -->\nold\n<!-- bench:smoke:end -->\n\ntail\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(B.PRESETS, "smoke", TINY)
        code = cli.main(["bench", "--preset", "smoke", "--out", str(out), "--table", str(table)])
    return code, json.loads(out.read_text()), table.read_text()


def test_bench_result(cli_run):
    code, result, _ = cli_run
    assert code == 0
    for key in ("preset", "date", "command", "machine", "cells", "wall_s"):
        assert key in result, key
    assert result["command"].startswith("verl-prefix bench --preset smoke")
    assert {"processor", "cpu_count", "torch", "node"} <= result["machine"].keys()
    assert result["machine"]["torch_threads"] == 1
    (cell,) = result["cells"]
    assert len(cell["dense_s"]) == len(cell["prefix_s"]) == len(cell["infer_dense_s"]) == 2
    # no timing assertions: the derived figures are finite and computed from the measured lists
    for tag in ("", "infer_"):
        dense_s, prefix_s = cell[f"{tag}dense_s"], cell[f"{tag}prefix_s"]
        assert all(math.isfinite(t) for t in dense_s + prefix_s), (tag, dense_s, prefix_s)
        assert cell[f"{tag}dense_median_s"] == statistics.median(dense_s)
        assert cell[f"{tag}prefix_median_s"] == statistics.median(prefix_s)
        assert cell[f"{tag}ratio_median"] == pytest.approx(statistics.median(d / p for d, p in zip(dense_s, prefix_s)))
        assert cell[f"{tag}ratio_of_medians"] == pytest.approx(statistics.median(dense_s) / statistics.median(prefix_s))
    spec = TINY.cells[0]
    responses = cell["response_lens"]
    assert len(responses) == spec.num_groups * spec.group_size
    assert all(spec.response_len_range[0] <= s <= spec.response_len_range[1] for s in responses)
    groups = [(spec.prompt_len, responses[g * spec.group_size : (g + 1) * spec.group_size]) for g in range(2)]
    # the FLOP model printed beside the ratio is the model's, for this cell's shape and batch
    m = spec.model
    shape = ModelShape.from_config(
        Qwen3Config(
            hidden_size=m.hidden_size,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads,
            num_key_value_heads=m.num_kv_heads,
            head_dim=m.hidden_size // m.num_heads,
            intermediate_size=m.intermediate_size,
            vocab_size=m.vocab_size,
        )
    )
    assert cell["predicted_speedup"] == pytest.approx(predicted_speedup(shape, groups), rel=1e-12)
    assert cell["predicted_speedup"] > 1
    assert cell["max_rel_grad_diff_param"]  # gradients were actually compared
    assert 0 <= cell["max_rel_grad_diff"] < 1e-5
    # the prefix engine reused, it did not fall back, and counted exactly the tokens dense and reuse compute
    assert_reuse_ran(cell["prefix_metrics"], groups=2)
    assert cell["prefix_metrics"]["prefix/logical_tokens"] == sum(spec.prompt_len + s for s in responses)
    assert cell["prefix_metrics"]["prefix/physical_tokens"] == sum(spec.prompt_len - 1 + sum(r) for _, r in groups)


def test_table_updated_in_place(cli_run):
    _, _, text = cli_run
    assert text.startswith("# Benchmarks\n") and text.endswith("\ntail\n")
    assert "old" not in text and "| tiny |" in text and text.count("bench:smoke:start") == 1


def test_update_table_file_appends(tmp_path):
    path = tmp_path / "new.md"
    cli.update_table_file(path, "cpu", "| a |")
    cli.update_table_file(path, "cpu", "| b |")
    assert path.read_text() == "<!-- bench:cpu:start -->\n| b |\n<!-- bench:cpu:end -->\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--preset", "nope"],
        ["bench", "--reps", "0"],
        ["bench", "--reps", "many"],
        ["bench", "--threads", "-1"],
        ["bench", "--cell", "P1/S1/G1"],
        ["frobnicate"],
        [],
    ],
)
def test_user_mistakes_exit_2_with_one_line(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err


def test_table_in_missing_directory(tmp_path, capsys):
    assert cli.main(["bench", "--table", str(tmp_path / "nope" / "t.md"), "--out", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_gpu_preset_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cli.main(["bench", "--preset", "gpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA" in err


def test_run_bench_rejects_bad_arguments():
    with pytest.raises(B.BenchError):
        B.run_bench("nope")
    with pytest.raises(B.BenchError):
        B.run_bench(TINY, reps=0)
    with pytest.raises(B.BenchError):
        B.run_bench(TINY, threads=0)


def test_compile_switch_turns_on_verls_torch_compile_for_both_engines(tiny_qwen3_dir):
    from verl_prefix.tools import testing as T

    (cell,) = B.compiled(TINY.cells)
    assert cell.name == "tiny compile" and set(B.COMPILE_OVERRIDES) <= set(cell.overrides)
    for backend in ("fsdp2", "prefix_fsdp2"):
        engine, _, _ = T.build_verl_engine(tiny_qwen3_dir, backend=backend, overrides=cell.overrides)
        assert engine.engine_config.use_torch_compile
        assert hasattr(engine.compute_entropy_from_logits, "_torchdynamo_orig_callable")  # torch.compile wrapper


def test_cells_can_be_chosen_and_each_is_saved_as_it_finishes(tmp_path):
    """A lent GPU's minutes are few: ``--cell`` picks cells, and the JSON is rewritten after every cell,
    so a run cut short keeps what it measured."""
    import dataclasses

    first = TINY.cells[0]
    second = dataclasses.replace(first, name="tiny-b", num_groups=1)
    third = dataclasses.replace(first, name="tiny-c")
    preset = dataclasses.replace(TINY, cells=(first, second, third), reps=1)
    out = tmp_path / "r.json"
    seen_during_second: list[dict] = []

    def log(line: str) -> None:
        if line.strip().startswith("tiny-c") and not seen_during_second:
            seen_during_second.append(json.loads(out.read_text()))

    result = B.run_bench(preset, out_json=out, log=log, cells=["tiny", "tiny-c"])
    assert [c["cell"] for c in result["cells"]] == ["tiny", "tiny-c"]
    assert result["complete"] and json.loads(out.read_text()) == json.loads(json.dumps(result))
    (partial,) = seen_during_second
    assert [c["cell"] for c in partial["cells"]] == ["tiny"] and partial["complete"] is False
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(B.BenchError, match="tiny, tiny-b, tiny-c"):
        B.resolve_preset(preset, cells=["nope"])
