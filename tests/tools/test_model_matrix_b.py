"""The coverage matrix, second half of the families (``helpers.model_matrix``; the split lets xdist spread them):
every decoder family of the installed transformers lands in one column of ``docs/models.md``, and that column
holds: exact under reuse (fp32 1e-5, fp64 1e-10 against plain HF dense, prompts longer than the window, a group
that reuses; the tree schedule in fp64 with a system block two groups share), dense with a reason decided by the
capability check (and refused under ``unsupported_model=raise``), or not built, with the reason. A family that
crashes or differs from dense fails."""

from __future__ import annotations

import pytest
from helpers import model_matrix as M

from verl_prefix.harness import model_zoo as Z

SHARD, SHARDS = 1, 2


@pytest.mark.parametrize("family", M.shard_families(SHARD, SHARDS))
def test_family_lands_in_its_column(family):
    M.check_family(family)


def test_negative_control_the_tree_without_its_system_blocks_backward_fails(monkeypatch):
    """The tree comparison can fail: a root whose phase C never runs (the children's and suffixes' dK/dV left
    on its leaves) differs from dense by far more than the tolerance on a served family."""
    from verl_prefix.schedule import executor

    seeded = executor.seeded_backward

    def skip_roots(kv, grads, model, extra=()):
        if kv.keys[0].shape[-2] != Z.PROMPT_LEN:  # the root holds the system block, a child its 4 tokens
            seeded(kv, grads, model, extra)

    monkeypatch.setattr(executor, "seeded_backward", skip_roots)
    assert M.tree_exactness("llama", Z.DEFAULT_LENGTHS) > 1e-3


def test_cli_page_round_trips_lengths_and_the_mamba_note(capsys):
    """``verl-prefix models`` prints the page ``render`` writes and ``parse`` reads back row for row, lengths
    included: a Mamba-2 hybrid names its short scan chunk, the per-batch reason it runs dense with there, and that
    reuse serves it within one scan chunk; Llama-4 names its chunk and floor at 12 and at 8192."""
    from verl_prefix.tools.cli import main

    families = ["bamba", "llama4_text", "llama"]
    assert main(["models", *(f"--family={f}" for f in families)]) == 0
    rows = {r.family: r for r in Z.parse(capsys.readouterr().out)}
    assert list(rows) == families and rows == {f: Z.classify(f) for f in families}
    bamba = rows["bamba"]
    assert "`mamba_chunk_size` 12 and 64 (default)" in bamba.lengths
    assert "at the short lengths: dense, `mamba_multichunk` per batch" in bamba.lengths
    assert bamba.status == Z.EXACT and "only within one scan chunk" in bamba.reason and "mamba_ssm" in bamba.reason
    assert (
        "`attention_chunk_size` 12 and 8192 (default); `floor_scale` 12 and 8192 (default)"
        in rows["llama4_text"].lengths
    )
    assert (rows["llama"].lengths, rows["llama"].reason) == ("none", "")
