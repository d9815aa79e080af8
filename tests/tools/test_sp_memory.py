"""The sequence-parallel memory figure (``verl_prefix.tools.bench.sp_memory``) on a small cell."""

from __future__ import annotations

import pytest

from verl_prefix.tools.bench import sp_memory


def test_sequence_parallel_halves_what_each_rank_holds_in_phase_b():
    """Issue target: per-rank bytes held during phase B with SP=2 at most 60% of SP=1's. Each rank holds
    its slice of phase A's graph, its head shard of the K/V and of the suffix attention."""
    result = sp_memory.compare(2, (512, 32, 4, 2))
    single, ranks = result["sp1"], result["sp2"]
    assert single["held_in_B_mib"] > 0 and len(ranks) == 2
    assert result["ratio_held_in_B"] <= 0.6
    # not less than half: the ranks split the work, they do not skip any of it
    assert all(r["held_in_B_mib"] >= 0.45 * single["held_in_B_mib"] for r in ranks)
    assert result["ratio_held_in_B"] == pytest.approx(max(r["held_in_B_mib"] for r in ranks) / single["held_in_B_mib"])


def test_cli_prints_the_table(capsys):
    sp_memory.main(["--prefix", "64", "--suffix", "8", "--group", "2", "--rows", "1"])
    out = capsys.readouterr().out
    assert "| SP=2 | 1 |" in out and "SP=2 / SP=1" in out


pytestmark = pytest.mark.timeout(600)
