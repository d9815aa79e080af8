"""``verl_prefix.tools.bench.dormant_memory`` on tiny sizes: the figures it reports order the policies as the
schedule promises (recompute holds less in phase B than keep; chunks lower recompute's live peak; offload,
with the CPU stand-in store, leaves nothing of the graph resident in phase B and part of it in phase C), and
the CLI runs each policy in a child process and prints a row per policy."""

from __future__ import annotations

import json

import pytest

from verl_prefix.tools.bench import dormant_memory as M
from verl_prefix.tools.bench.presets import SMOKE_MODEL

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
    # resident dormant bytes per phase: keep's graph throughout, recompute's only in C (one chunk's with chunks)
    assert keep["resident_A_mib"] == keep["resident_B_mib"] == keep["resident_C_mib"] == keep["phase_A_saved_mib"]
    assert recompute["resident_B_mib"] == 0 and recompute["resident_C_mib"] == keep["resident_C_mib"]
    assert chunked["resident_B_mib"] == 0 and 0 < chunked["resident_C_mib"] < 0.5 * recompute["resident_C_mib"]


def test_measure_offload_with_the_stand_in_store():
    """Offload on the stand-in store (CPU): nothing of the graph resident in phase B; in phase C two of the
    smoke model's four layers at most (under 0.7x keep's graph here), and with chunks of 32 one chunk's two
    layers; what moves out is about keep's phase-A graph (the K/V and token ids stay), once."""
    keep = M.measure("keep", **CELL)
    offload = M.measure("offload", **CELL)
    chunked = M.measure("offload", chunk_tokens=32, **CELL)
    for r in (offload, chunked):
        assert r["resident_A_mib"] == r["resident_B_mib"] == 0
        assert r["held_in_B_mib"] < 0.5 * keep["held_in_B_mib"]
        assert 0 < r["restored_mib"] <= r["offloaded_mib"] < keep["phase_A_saved_mib"]
        assert r["offloaded_mib"] > 0.9 * keep["phase_A_saved_mib"]
    assert 0 < offload["resident_C_mib"] < 0.7 * keep["resident_C_mib"]
    assert 0 < chunked["resident_C_mib"] < 0.25 * offload["resident_C_mib"]


def test_parse_policy():
    assert M.parse_policy("recompute:512") == ("recompute", 512)
    assert M.parse_policy("keep") == ("keep", None)
    assert M.parse_policy("offload:64") == ("offload", 64)
    with pytest.raises(ValueError, match="choose one of"):
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
            "keep,recompute:16,offload",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| policy |") and "| resident in B |" in lines[0]
    assert lines[2].startswith("| keep |") and lines[3].startswith("| recompute:16 |")
    assert lines[4].startswith("| offload |")
    results = json.loads(lines[-1])
    assert set(results) == {"keep", "recompute:16", "offload"}
    assert results["recompute:16"]["held_in_B_mib"] < results["keep"]["held_in_B_mib"]
    assert results["offload"]["resident_B_mib"] == 0 < results["keep"]["resident_B_mib"]
