"""The coverage matrix, first half of the families (``helpers.model_matrix``; the split lets xdist spread them):
every decoder family of the installed transformers lands in one column of ``docs/models.md``, and that column
holds: exact under reuse (fp32 1e-5, fp64 1e-10 against plain HF dense, prompts longer than the window, a group
that reuses; the tree schedule in fp64 with a system block two groups share), dense with a reason decided by the
capability check (and refused under ``unsupported_model=raise``), or not built, with the reason. A family that
crashes or differs from dense fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import model_matrix as M

from verl_prefix.harness import model_zoo as Z

SHARD, SHARDS = 0, 2
PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"


@pytest.mark.parametrize("family", M.shard_families(SHARD, SHARDS))
def test_family_lands_in_its_column(family):
    M.check_family(family)


def test_negative_control_a_wrong_suffix_position_fails():
    """The comparison can fail: suffix rows one position late (DESIGN trap 4) differ from dense by far more
    than the tolerance on a served family."""
    from verl_prefix.schedule import executor

    original = executor.suffix_positions
    executor.suffix_positions = lambda positions, p, s: original(positions, p, s) + 1
    try:
        assert M.exactness("llama", torch.float64, Z.DEFAULT_LENGTHS) > 1e-3
    finally:
        executor.suffix_positions = original


def test_page_lists_every_family_once_with_its_counts():
    """``docs/models.md`` (``verl-prefix models --write docs/models.md``) names every family of the installed
    transformers once; each family's test checks its own row, this one the counts at the top."""
    rows = Z.parse(PAGE.read_text())
    assert sorted(r.family for r in rows) == Z.decoder_families()
    for status in (Z.EXACT, Z.DENSE, Z.REFUSED, Z.SKIP):
        assert f"| {status} | {sum(r.status == status for r in rows)} |" in PAGE.read_text()


def test_short_builds_cross_every_length_the_prompt_would_not():
    """DESIGN trap 19: the short build sets every length attribute the matrix knows below the prompt, on the built
    modules too (Nemotron-H folds ``mamba_chunk_size`` into ``chunk_size``), and holds every attention kind the
    family's full-size defaults interleave within its two layers; the default build keeps the defaults."""
    from transformers import CONFIG_MAPPING

    from verl_prefix.schedule.models.mamba import single_chunk_limit

    for family in Z.decoder_families():
        if Z.skip_reason(family) is not None or family in Z.SKIPPED:
            continue
        short = Z.tiny_config(family, lengths=Z.SHORT_LENGTHS).to_dict()
        long = [k for k in Z.SHORT_VALUES if isinstance(short.get(k), int) and short[k] >= Z.PROMPT_LEN]
        assert not long, f"{family}: {long} not shortened"
        kinds = set(getattr(CONFIG_MAPPING[family](), "layer_types", None) or [])
        if kinds and kinds <= {"full_attention", "sliding_attention", "chunked_attention"}:
            assert kinds <= set(short["layer_types"]), (family, kinds, short["layer_types"])
    llama4 = Z.tiny_config("llama4_text", lengths=Z.SHORT_LENGTHS)
    assert (llama4.attention_chunk_size, llama4.floor_scale) == (Z.SHORT, Z.SHORT)
    assert set(llama4.layer_types) == {"chunked_attention", "full_attention"} and 0 in llama4.no_rope_layers
    assert Z.tiny_config("llama4_text").attention_chunk_size == 8192
    rates = Z.tiny_config("deepseek_v4", lengths=Z.SHORT_LENGTHS).compress_rates
    assert max(rates.values()) < Z.PROMPT_LEN
    for family in ("nemotron_h", "bamba", "granitemoehybrid"):
        assert single_chunk_limit(Z.build(family, lengths=Z.SHORT_LENGTHS)) == Z.SHORT, family
        assert single_chunk_limit(Z.build(family)) >= Z.LONGEST, family
    for family in ("afmoe", "cohere2", "gemma3_text", "olmo3", "exaone4", "qwen2", "smollm3"):
        assert {"sliding_attention", "full_attention"} <= set(
            Z.tiny_config(family, lengths=Z.SHORT_LENGTHS).layer_types
        )
