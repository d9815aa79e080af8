"""``verl-prefix report``: PNGs from bench and replay results, and one-line errors for bad inputs."""

import json

import pytest

from verl_prefix.tools import cli
from verl_prefix.tools.report import plots as R

PNG = b"\x89PNG\r\n\x1a\n"
MODEL = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384, vocab_size=1024)


def bench_cell(name, prompt, response, group, *, memory=True, cuda=False):
    cell = {
        "cell": name,
        "model": {**MODEL, "params": 1_050_000},
        "dtype": "float32",
        "num_groups": 1,
        "group_size": group,
        "prompt_len": prompt,
        "response_lens": [response] * group,
        "dense_s": [1.0, 1.1, 0.9],
        "prefix_s": [0.3, 0.35, 0.28],
        "ratio_median": 3.3,
        "infer_ratio_median": 3.8,
        "predicted_speedup": 3.5,
        "prefix_metrics": {
            "prefix/max_saved_for_backward_mib/A": 10.0,
            "prefix/max_saved_for_backward_mib/B": 6.0,
            "prefix/max_saved_for_backward_mib/C": 0.0,
            "prefix/max_saved_for_backward_held_mib": 16.0,
        },
    }
    if cuda:
        cell["prefix_metrics"].update({f"prefix/max_peak_device_mib/{p}": 100.0 + i for i, p in enumerate("ABC")})
    if memory:
        cell["memory"] = {"dense": {"saved_for_backward_held_mib": 40.0}, "prefix": {}}
        if cuda:
            cell["memory"]["dense"]["peak_device_mib"] = 300.0
            cell["memory"]["prefix"]["peak_device_mib"] = 150.0
    return cell


def bench_result(cuda=False):
    cells = [bench_cell(f"P{p}/S{s}/G8", p, s, 8, cuda=cuda) for p, s in ((2048, 128), (1024, 256), (512, 512))]
    cells += [bench_cell(f"P1024/S256/G{g}", 1024, 256, g, memory=False) for g in (4, 16)]
    return {"preset": "cpu", "date": "2026-11-30", "machine": {"processor": "test CPU", "torch": "2"}, "cells": cells}


def replay_result():
    steps = []
    for i in range(3):
        steps.append(
            {
                "index": i,
                "dense_s": [1.0, 1.2],
                "prefix_s": [0.4, 0.5],
                "ratio_median": 2.4,
                "predicted_speedup": 2.6,
                "drift": 1e-6 * (i + 1),
                "noise_floor": 5e-7,
                "noise_variant": "micro_batch_size_per_gpu 4 -> 2",
                "memory": {
                    "dense": {"saved_for_backward_held_mib": 30.0},
                    "prefix": {
                        "saved_for_backward_mib": {"A": 8.0, "B": 4.0, "C": 0.0},
                        "saved_for_backward_held_mib": 12.0,
                    },
                },
            }
        )
    return {"kind": "replay", "date": "2026-11-30", "dtype": "float32", "machine": {}, "steps": steps}


def assert_pngs(paths, names):
    assert sorted(p.name for p in paths) == sorted(names)
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, path


@pytest.mark.parametrize("cuda", [False, True])
def test_bench_report(tmp_path, cuda):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(bench_result(cuda)))
    paths = R.write_report(src, tmp_path / "out")
    assert_pngs(paths, ["speedup_vs_prefix_ratio.png", "speedup_vs_group_size.png", "memory_phases.png"])


def test_replay_report(tmp_path):
    paths = R.write_report(replay_result(), tmp_path / "out")
    assert_pngs(paths, ["replay_speedup.png", "replay_drift.png", "replay_memory.png"])


def test_cli_report(tmp_path, capsys):
    src = tmp_path / "replay.json"
    src.write_text(json.dumps(replay_result()))
    assert cli.main(["report", str(src), "--out", str(tmp_path / "png")]) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 3 and all((tmp_path / "png" / p.split("/")[-1]).is_file() for p in printed)


@pytest.mark.parametrize("content", [None, "{broken", json.dumps({"cells": []}), json.dumps([1, 2])])
def test_cli_report_user_mistakes(tmp_path, capsys, content):
    src = tmp_path / "r.json"
    if content is not None:
        src.write_text(content)
    assert cli.main(["report", str(src), "--out", str(tmp_path / "png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err


def test_report_out_is_a_file(tmp_path, capsys):
    src = tmp_path / "r.json"
    src.write_text(json.dumps(replay_result()))
    (tmp_path / "file").write_text("x")
    assert cli.main(["report", str(src), "--out", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
