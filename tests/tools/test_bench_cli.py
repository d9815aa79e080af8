"""The benchmark and its CLI, end to end on a minuscule model (no timing assertions: CI machines are noisy)."""

import dataclasses
import json
import math
import statistics

import pytest
import torch
from helpers.reuse import assert_reuse_ran
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3Config

from verl_prefix.tools import cli
from verl_prefix.tools.bench import attention as BA
from verl_prefix.tools.bench import presets as BP
from verl_prefix.tools.bench import runner as BR
from verl_prefix.tools.bench import tables as BT
from verl_prefix.tools.flops import ModelShape, predicted_speedup

TINY = BP.Preset(
    cells=(
        BP.Cell(
            "tiny",
            BP.ModelSpec(
                hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=64
            ),
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
        mp.setitem(BP.PRESETS, "smoke", TINY)
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
    # the result says it passed, and against what (fp32: 1e-4)
    assert cell["grad_check"] == "pass" and cell["max_rel_grad_diff_tolerance"] == 1e-4
    # the prefix engine reused, it did not fall back, and counted exactly the tokens dense and reuse compute
    assert_reuse_ran(cell["prefix_metrics"], groups=2)
    assert cell["prefix_metrics"]["prefix/logical_tokens"] == sum(spec.prompt_len + s for s in responses)
    assert cell["prefix_metrics"]["prefix/physical_tokens"] == sum(spec.prompt_len - 1 + sum(r) for _, r in groups)


def test_table_updated_in_place(cli_run):
    _, _, text = cli_run
    assert text.startswith("# Benchmarks\n") and text.endswith("\ntail\n")
    assert "old" not in text and "| tiny |" in text and text.count("bench:smoke:start") == 1
    assert "| grad check |" in text and "| pass (<= 1e-04) |" in text


def _classic_result(diff: float, dtype: str = "float32") -> dict:
    cell = {
        "cell": "fake", "model": {"params": 1e6}, "dtype": dtype, "dense_median_s": 1.0, "prefix_median_s": 0.5,
        "ratio_median": 2.0, "ratio_of_medians": 2.0, "predicted_speedup": 2.1, "infer_ratio_median": 1.5,
        "max_rel_grad_diff": diff,
    }  # fmt: skip
    return {"preset": "smoke", "date": "now", "machine": {"processor": "cpu", "cpu_count": 2, "torch_threads": 1,
            "torch": torch.__version__}, "wall_s": 1.0, "cells": [cell]}  # fmt: skip


def test_mixed_result_renders_both_tables():
    """The gpu preset's variant cells and its classic torchtitan cell: one table each, none dropped."""
    result = _classic_result(1e-6)
    stock = {
        "update_median_s": 1.0,
        "saved_for_backward_per_micro_batch_mib": None,
        "saved_for_backward_held_mib": None,
    }
    result["cells"].insert(0, {"cell": "variant", "dtype": "float32", "reps": 1, "variants": {"fsdp2": stock}})
    table = BT.markdown_table(result)
    assert "| variant | fsdp2 | 1 | 1.000 |" in table and "| fake | 1.00M | 1.000 | 0.500 | 2.00x |" in table


@pytest.mark.parametrize(
    "dtype, diff, verdict",
    [
        ("float32", 9e-5, "pass"),
        ("float32", 2e-4, "fail"),
        ("float64", 1e-11, "pass"),
        ("float64", 1e-9, "fail"),
        ("bfloat16", 0.3, "pass"),
        ("bfloat16", 0.9, "fail"),
        ("float32", math.nan, "fail"),
    ],
)
def test_grad_check_holds_results_to_a_stated_tolerance(dtype, diff, verdict):
    check = BT.grad_check(diff, dtype)
    assert check == {"grad_check": verdict, "max_rel_grad_diff_tolerance": BT.GRAD_TOLERANCE[dtype]}
    result = _classic_result(diff, dtype)
    word = "pass" if verdict == "pass" else "FAIL"
    assert f"| {word} (<= {BT.GRAD_TOLERANCE[dtype]:.0e}) |" in BT.markdown_table(result)  # old results too
    assert bool(BT.grad_check_failures(result)) == (verdict == "fail")
    assert BT.grad_check(None, dtype) == {}  # the stock row compares nothing


def test_bench_exits_1_when_a_gradient_check_fails(tmp_path, monkeypatch, capsys):
    """The result is saved and tabled as measured; the exit status and one stderr line say it failed."""
    monkeypatch.setattr(BR, "run_bench", lambda *args, **kwargs: _classic_result(3e-3))
    table = tmp_path / "bench.md"
    assert cli.main(["bench", "--preset", "smoke", "--out", str(tmp_path / "r.json"), "--table", str(table)]) == 1
    err = capsys.readouterr().err
    assert "gradient check failed: fake prefix_fsdp2: max_rel_grad_diff 3.000e-03 > 1e-04 (float32)" in err
    assert "| FAIL (<= 1e-04) |" in table.read_text()
    monkeypatch.setattr(BR, "run_bench", lambda *args, **kwargs: _classic_result(3e-6))
    assert cli.main(["bench", "--preset", "smoke", "--out", str(tmp_path / "r.json")]) == 0


def test_update_table_file_appends(tmp_path):
    path = tmp_path / "new.md"
    BT.update_table_file(path, "cpu", "| a |")
    BT.update_table_file(path, "cpu", "| b |")
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
    with pytest.raises(BP.BenchError):
        BR.run_bench("nope")
    with pytest.raises(BP.BenchError):
        BR.run_bench(TINY, reps=0)
    with pytest.raises(BP.BenchError):
        BR.run_bench(TINY, threads=0)


def test_compile_switch_turns_on_verls_torch_compile_for_both_engines(tiny_qwen3_dir):
    from verl_prefix.harness import verl_engine

    (cell,) = BP.compiled(TINY.cells)
    assert cell.name == "tiny compile" and set(BP.COMPILE_OVERRIDES) <= set(cell.overrides)
    for backend in ("fsdp2", "prefix_fsdp2"):
        engine, _, _ = verl_engine.build_verl_engine(tiny_qwen3_dir, backend=backend, overrides=cell.overrides)
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

    result = BR.run_bench(preset, out_json=out, log=log, cells=["tiny", "tiny-c"])
    assert [c["cell"] for c in result["cells"]] == ["tiny", "tiny-c"]
    assert result["complete"] and json.loads(out.read_text()) == json.loads(json.dumps(result))
    (partial,) = seen_during_second
    assert [c["cell"] for c in partial["cells"]] == ["tiny"] and partial["complete"] is False
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(BP.BenchError, match="tiny, tiny-b, tiny-c"):
        BP.resolve_preset(preset, cells=["nope"])


TINY_PHASE_B = BP.Preset(
    cells=(
        BP.Cell(
            "tiny-b",
            BP.ModelSpec(
                hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=64
            ),
            num_groups=1,
            group_size=4,
            prompt_len=40,
            response_len_range=(6, 6),
            micro_batch_size=2,
            min_prefix_len=8,
            variants=BP.VARIANTS,
            dense_micro_batch_size=4,
        ),
    ),
    reps=1,
    threads=1,
    fresh_rss=True,
)


@pytest.fixture(scope="module")
def phase_b_run(tmp_path_factory):
    """``verl-prefix bench --preset phase_b`` in-process with the preset swapped for a minuscule one."""
    tmp = tmp_path_factory.mktemp("phase_b")
    out, table = tmp / "phase_b.json", tmp / "bench.md"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(BP.PRESETS, "phase_b", TINY_PHASE_B)
        code = cli.main(["bench", "--preset", "phase_b", "--no-progress", "--out", str(out), "--table", str(table)])
    return code, json.loads(out.read_text()), table.read_text()


def test_phase_b_variants_run_interleaved_and_report(phase_b_run):
    code, result, _ = phase_b_run
    assert code == 0 and result["complete"]
    (cell,) = result["cells"]
    assert list(cell["variants"]) == ["fsdp2", "merged", "concat"] and cell["reps"] == 1
    assert cell["stock_micro_batch_size"] == 4 and cell["micro_batch_size"] == 2
    for name, v in cell["variants"].items():
        assert len(v["update_s"]) == 1 and math.isfinite(v["update_median_s"]) and v["update_median_s"] > 0, name
        assert v["saved_for_backward_per_micro_batch_mib"] > 0 and v["saved_for_backward_held_mib"] > 0, name
        fresh = v["fresh_process"]  # a fresh process per variant: its peak covers its own update at least
        assert fresh["peak_rss_mib"] >= fresh["rss_before_update_mib"] > 0, name
        assert fresh["peak_reset_before_update"] is True, name  # the peak is the update's own (Linux)
    for name in ("merged", "concat"):
        v = cell["variants"][name]
        assert v["prefix_metrics"]["prefix/groups"] == 1  # reuse ran, no fallback
        assert v["prefix_metrics"]["prefix/physical_tokens"] < v["prefix_metrics"]["prefix/logical_tokens"]
        assert v["speedup_vs_stock_median"] > 0
        # against the stock engine, same update: fp32 rounding, never bit-identical (another attention
        # kernel, another summation order), so a 0.0 means the comparison compared nothing
        assert 1e-9 < v["max_rel_grad_diff"] < 1e-5, name
        assert v["max_rel_grad_diff_vs"] == "fsdp2"
        assert v["grad_check"] == "pass" and v["max_rel_grad_diff_tolerance"] == 1e-4, name
        # 4 rows in micro-batches of 2: both ran the attention asked for, every micro-batch
        other = "concat" if name == "merged" else "merged"
        assert v["phase_b_micro_batches"] == {name: 2.0, other: 0.0, "merged_varlen": 0.0}
        assert len(v["attention_saved_mib"]) == 2 and min(v["attention_saved_mib"]) > 0
    assert math.isfinite(cell["merged_over_concat_time_median"]) and cell["merged_over_concat_time_median"] > 0
    merged, concat = cell["variants"]["merged"], cell["variants"]["concat"]
    # merged saves one prefix copy where concat saves one per row and query head: measured, not just computed
    assert max(merged["attention_saved_mib"]) < max(concat["attention_saved_mib"])
    assert merged["saved_for_backward_per_micro_batch_mib"] < concat["saved_for_backward_per_micro_batch_mib"]


@settings(max_examples=30, deadline=None)
@given(
    scale=st.floats(1e-6, 1e3),
    rel=st.floats(1e-9, 1.0),
    nan_at=st.one_of(st.none(), st.integers(0, 2)),
)
def test_max_rel_grad_diff_reads_the_difference(scale, rel, nan_at):
    """The worst relative difference is what it says (so a constant 0 cannot pass), and a NaN gradient
    reads NaN, not the 0.0 a plain ``>`` comparison would keep."""
    gen = torch.Generator().manual_seed(0)
    dense = {f"p{i}": torch.randn(5, generator=gen, dtype=torch.float64) * scale for i in range(3)}
    prefix = {n: g.clone() for n, g in dense.items()}
    assert BR.max_rel_grad_diff(dense, prefix) == (0.0, "p0")
    noise = torch.randn(5, generator=gen, dtype=torch.float64)
    prefix["p1"] = dense["p1"] + noise / noise.norm() * dense["p1"].norm() * rel
    worst, name = BR.max_rel_grad_diff(dense, prefix)
    assert name == "p1" and worst == pytest.approx(rel, rel=1e-6)
    if nan_at is not None:
        prefix[f"p{nan_at}"] = torch.full((5,), math.nan, dtype=torch.float64)
        worst, name = BR.max_rel_grad_diff(dense, prefix)
        assert math.isnan(worst) and name == f"p{nan_at}"
    with pytest.raises(RuntimeError, match="disagree"):
        BR.max_rel_grad_diff(dense, {"p0": dense["p0"]})


def test_phase_b_table(phase_b_run):
    _, _, text = phase_b_run
    assert "<!-- bench:phase_b:start -->" in text
    for name in ("fsdp2", "merged", "concat"):
        assert f"| tiny-b | {name} | 1 |" in text


def test_attention_kv_bytes_from_shapes():
    """The issue's yardstick: merged hands its kernels one prefix copy plus the suffix rows (heads repeated
    only where the kernel lacks GQA),
    concat a prefix copy per row and query head."""
    model = BP.MODEL_29M  # 6 layers, 8 heads, 4 KV heads, head_dim 64
    merged = BA.attention_kv_bytes(model, "merged", prefix_len=2047, suffix_len=129, rows=8)
    concat = BA.attention_kv_bytes(model, "concat", prefix_len=2047, suffix_len=129, rows=8)
    unit = 2 * 6 * 64 * 4
    assert merged["one_prefix_copy"] == concat["one_prefix_copy"] == unit * 4 * 2047
    assert merged["suffix_rows"] == unit * 8 * 4 * 129
    assert merged["held"] == merged["one_prefix_copy"] + merged["suffix_rows"]  # CPU: GQA native, no repeat
    repeated = BA.attention_kv_bytes(model, "merged", prefix_len=2047, suffix_len=129, rows=8, repeat_suffix=True)
    assert repeated["held"] == merged["one_prefix_copy"] + 2 * merged["suffix_rows"]
    assert concat["held"] == unit * 8 * 8 * (2047 + 129)
    # merged_varlen: one prefix copy plus the real suffix tokens only (no pads, no GQA repeat, on any device)
    varlen = BA.attention_kv_bytes(model, "merged_varlen", prefix_len=2047, suffix_len=129, rows=8)
    assert varlen["held"] == merged["held"]  # equal rows: nothing padded
    ragged = BA.attention_kv_bytes(model, "merged_varlen", prefix_len=2047, suffix_len=129, rows=8, suffix_tokens=300)
    assert ragged["held"] == merged["one_prefix_copy"] + unit * 4 * 300
    with pytest.raises(ValueError):
        BA.attention_kv_bytes(model, "fsdp2", prefix_len=1, suffix_len=1, rows=1)


def test_phase_b_preset_cells():
    preset = BP.PRESETS["phase_b"]
    names = [c.name for c in preset.cells]
    assert names == ["P2048/S128/G8/mb2", "P2048/S128/G8/mb8", "P8192/S128/G8/mb2", "P8192/S128/G8/mb8"]
    assert all(c.model == BP.MODEL_29M and c.dtype == "float32" and c.group_size == 8 for c in preset.cells)
    gpu = [c for c in BP.PRESETS["gpu"].cells if c.engine == "fsdp2"]
    assert all({"merged", "concat"} <= set(c.variants) for c in preset.cells + tuple(gpu))
    assert all("fsdp2" in c.variants for c in gpu)
    # the torchtitan cell: verl's TorchTitan engine vs prefix_torchtitan, a classic (two-engine) cell
    titan = [c for c in BP.PRESETS["gpu"].cells if c.engine == "torchtitan"]
    assert [c.name for c in titan] == ["P2048/S128/G8/torchtitan"] and not titan[0].variants


def test_gpu_preset_runs_merged_varlen_with_a_valid_config():
    """The gpu preset times merged_varlen beside merged and concat; every prefix variant is a valid knob value
    (checked here on CPU, where the preset cannot run), and on CUDA without flash_attn the cell skips
    merged_varlen with a reason instead of failing the whole run."""
    from verl_prefix import PrefixReuseConfig
    from verl_prefix.schedule.attention import varlen as V

    for cell in BP.PRESETS["gpu"].cells:
        if cell.engine == "torchtitan":
            continue
        assert cell.variants == ("fsdp2", "merged", "concat", "merged_varlen")
        for variant in cell.variants[1:]:
            assert PrefixReuseConfig(phase_b_attention=variant).phase_b_attention == variant
    assert BP.unavailable_variant("merged_varlen", cuda=False) is None  # CPU: the reference kernel
    assert BP.unavailable_variant("merged", cuda=True) is None
    # CUDA: torch's varlen attention (torch >= 2.10 with a CUDA build) or flash-attn >= 2.7, else the reason
    assert BP.unavailable_variant("merged_varlen", cuda=True) == V.varlen_kernel_problem()
    if not torch.cuda.is_available():  # this CPU build of torch has no CUDA varlen kernel
        assert "has no CUDA varlen flash attention" in BP.unavailable_variant("merged_varlen", cuda=True)


def test_merged_varlen_variant_runs_and_reports(tmp_path):
    """A tiny ragged cell with concat and merged_varlen: varlen ran every micro-batch, matches concat to fp32
    rounding and hands its kernels fewer K/V bytes (ragged rows: no pads)."""
    import dataclasses

    cell = dataclasses.replace(
        TINY_PHASE_B.cells[0], name="tiny-v", response_len_range=(2, 9), variants=("concat", "merged_varlen")
    )
    result = BR.run_bench(dataclasses.replace(TINY_PHASE_B, cells=(cell,), fresh_rss=False))
    (measured,) = result["cells"]
    varlen, concat = measured["variants"]["merged_varlen"], measured["variants"]["concat"]
    assert varlen["phase_b_micro_batches"] == {"merged": 0.0, "concat": 0.0, "merged_varlen": 2.0}
    assert varlen["prefix_metrics"]["prefix/groups"] == 1
    assert varlen["max_rel_grad_diff_vs"] == "concat" and 0 < varlen["max_rel_grad_diff"] < 1e-5
    assert varlen["attention_kv_mib"]["held"] < concat["attention_kv_mib"]["held"]
    assert math.isfinite(measured["merged_varlen_over_concat_time_median"])
    assert "(varlen 2)" in BT.markdown_table(result)


def test_unknown_variant_is_a_clear_error(tmp_path):
    import dataclasses

    cell = dataclasses.replace(TINY_PHASE_B.cells[0], variants=("merged", "flash"))
    with pytest.raises(BP.BenchError, match="unknown variant 'flash'"):
        BR.run_bench(dataclasses.replace(TINY_PHASE_B, cells=(cell,), fresh_rss=False))


def test_peak_rss_is_this_process_images_own():
    """``ru_maxrss`` of a fork + exec child reports its parent's RSS at the fork; VmHWM after a reset does not."""
    import subprocess
    import sys

    import psutil

    ballast = b"\x01" * (600 * 2**20)  # touched: the parent holds 600 MiB more than a child needs
    parent_rss = psutil.Process().memory_info().rss / 2**20
    code = (
        "from verl_prefix.tools.measure import peak_rss_mib, reset_peak_rss; "
        "before = peak_rss_mib(); assert reset_peak_rss(); block = bytearray(100 * 2**20); "
        "print(before, peak_rss_mib())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    before, after = float(out[0]), float(out[1])
    assert before < parent_rss - 300  # the child's own peak, not the parent's RSS at the fork
    assert after >= 100  # the 100 MiB block counts after the reset
    del ballast


TINY_TREE = BP.Preset(
    cells=(
        BP.Cell(
            "tiny-tree",
            TINY.cells[0].model,
            num_groups=2,
            group_size=4,
            prompt_len=4,
            response_len_range=(3, 6),
            micro_batch_size=2,
            min_prefix_len=8,
            variants=("fsdp2", *BP.TREE_VARIANTS),
            system_len=40,
            question_len_range=(4, 8),
        ),
    ),
    reps=1,
    threads=1,
)


def test_agentic_tree_cell_runs_three_engines_beside_the_flop_model(tmp_path):
    """``--preset agentic`` on a minuscule cell: stock, one-level reuse and the tree on one batch whose groups
    share a system block, each checked against stock, with the trie's FLOP model beside the times."""
    out, table = tmp_path / "agentic.json", tmp_path / "bench.md"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(BP.PRESETS, "agentic", TINY_TREE)
        code = cli.main(["bench", "--preset", "agentic", "--no-progress", "--out", str(out), "--table", str(table)])
    assert code == 0
    (cell,) = json.loads(out.read_text())["cells"]
    assert list(cell["variants"]) == ["fsdp2", "one_level", "tree"]
    one, tree = cell["variants"]["one_level"]["prefix_metrics"], cell["variants"]["tree"]["prefix_metrics"]
    assert_reuse_ran(one, groups=2) and one.get("prefix/tree_nodes", 0) == 0
    assert_reuse_ran(tree, groups=2)
    assert tree["prefix/tree_nodes"] == cell["tree"]["nodes"] == 3 and cell["tree"]["depth"] == 2
    assert tree["prefix/tree_shared_tokens/level1"] == 40
    assert tree["prefix/physical_tokens"] == one["prefix/physical_tokens"] - 40
    for name in ("one_level", "tree"):
        assert cell["variants"][name]["grad_check"] == "pass", name
    predicted = cell["predicted"]
    assert predicted["tree"] > predicted["one_level"] > 1
    assert predicted["one_level"] == pytest.approx(cell["predicted_speedup"], rel=1e-12)
    assert cell["measured_over_predicted"]["tree"] == pytest.approx(cell["measured"]["tree"] / predicted["tree"])
    assert "| tiny-tree | " in table.read_text() and "tree vs one-level (FLOP model)" in table.read_text()
    batch = BP.cell_batch(TINY_TREE.cells[0])
    prompts = batch["prompts"].unbind()
    assert torch.equal(prompts[0][:40], prompts[4][:40]) and 44 <= len(prompts[0]) <= 48


def test_tree_rollout_preset_branches_inside_the_response():
    """``--preset tree_rollout``: the three engines on groups whose responses open with a stem, then 2 and 4
    sub-stems (the batch and its FLOP model checked at a miniature size; the engines run in the agentic test)."""
    import verl_prefix
    from verl_prefix.tools.tree_flops import tree_model

    (cell,) = BP.PRESETS["tree_rollout"].cells
    assert cell.response_stems == (256, 128, 64) and cell.variants == ("fsdp2", *BP.TREE_VARIANTS)
    assert BP.cell_from_dict(dataclasses.asdict(cell)) == cell
    mini = dataclasses.replace(cell, num_groups=2, prompt_len=6, response_stems=(4, 3, 2), response_len_range=(1, 3))
    responses = BP.cell_batch(mini)["responses"].unbind()
    for group in (responses[:8], responses[8:]):
        assert all(torch.equal(r[:4], group[0][:4]) for r in group)
        for level, width, start in ((1, 3, 4), (2, 2, 7)):  # 2 then 4 sub-stems: rows 0-3 | 4-7, then pairs
            share = 8 // 2**level
            for row, r in enumerate(group):
                same = [torch.equal(r[start : start + width], o[start : start + width]) for o in group]
                assert same == [row // share == k // share for k in range(8)], (level, row)
    model = tree_model(
        BP.cell_batch(mini), verl_prefix.PrefixReuseConfig(min_prefix_len=2, tree=True, min_shared_tokens=2)
    )
    assert (len(model.nodes), model.depth) == (2 * 7, 3) and model.node_head_tokens > 0
    assert BP.cell_batch(dataclasses.replace(mini, response_stems=()))["responses"].unbind()[0].numel() <= 3
