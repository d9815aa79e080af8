"""The coverage matrix, second half of the families (``helpers.model_matrix``; the split lets xdist spread them):
every decoder family of the installed transformers lands in one column of ``docs/models.md``, and that column
holds: exact under reuse (fp32 1e-5, fp64 1e-10 against plain HF dense, prompts longer than the window, a group
that reuses), dense with a reason decided by the capability check (and refused under ``unsupported_model=raise``),
or not built, with the reason. A family that crashes or differs from dense fails."""

from __future__ import annotations

import pytest
from helpers import model_matrix as M

SHARD, SHARDS = 1, 2


@pytest.mark.parametrize("family", M.shard_families(SHARD, SHARDS))
def test_family_lands_in_its_column(family):
    M.check_family(family)
