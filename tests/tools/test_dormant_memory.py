"""``verl_prefix.tools.dormant_memory`` on tiny sizes: the figures it reports order the policies as the
schedule promises (recompute holds less in phase B than keep; chunks lower recompute's live peak), and
the CLI runs each policy in a child process and prints a row per policy."""

from __future__ import annotations

import json

import pytest

from verl_prefix.tools import dormant_memory as M
from verl_prefix.tools.bench_presets import SMOKE_MODEL

CELL = dict(prefix_len=192, suffix_len=4, group_size=2, rows=2, spec=SMOKE_MODEL)


def test_measure_orders_the_policies():
    keep = M.measure("keep", **CELL)
    recompute = M.measure("recompute", **CELL)
    chunked = M.measure("recompute", chunk_tokens=32, **CELL)
    assert keep["phase_A_saved_mib"] > 0 and recompute["phase_A_saved_mib"] == 0
    assert recompute["held_in_B_mib"] < 0.5 * keep["held_in_B_mib"]
    assert chunked["held_in_B_mib"] == pytest.approx(recompute["held_in_B_mib"], rel=0.05)
    # recompute's live peak is phase C's whole prefix graph; chunks of 32 rebuild one sixth of it at a time
    assert chunked["peak_live_saved_mib"] < 0.5 * recompute["peak_live_saved_mib"]
    assert recompute["peak_live_saved_mib"] <= keep["peak_live_saved_mib"]
    assert all(r["params_mib"] > 0 for r in (keep, recompute, chunked))


def test_parse_policy():
    assert M.parse_policy("recompute:512") == ("recompute", 512)
    assert M.parse_policy("keep") == ("keep", None)
    with pytest.raises(ValueError, match="offload needs an accelerator"):
        M.parse_policy("offload")
    with pytest.raises(ValueError, match="choose keep or recompute"):
        M.parse_policy("swap:3")


def test_cli_prints_a_row_per_policy(capsys):
    M.main(
        [
            "--model",
            "smoke",
            "--prefix",
            "64",
            "--suffix",
            "4",
            "--group",
            "2",
            "--rows",
            "2",
            "--policies",
            "keep,recompute:16",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| policy |") and lines[2].startswith("| keep |")
    assert lines[3].startswith("| recompute:16 |")
    results = json.loads(lines[-1])
    assert set(results) == {"keep", "recompute:16"}
    assert results["recompute:16"]["held_in_B_mib"] < results["keep"]["held_in_B_mib"]
