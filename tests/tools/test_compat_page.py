"""``docs/compatibility.md`` and the README's compact table are what ``recipe_keys`` renders, and every claim on
them names a test that exists: the page cannot drift from the table the engine tests check
(``tests/backend/test_recipe_keys.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from verl_prefix.backend import recipe_keys
from verl_prefix.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_committed_page_is_the_render():
    page = (ROOT / "docs" / "compatibility.md").read_text()
    assert page == recipe_keys.render(), "stale: run verl-prefix compat --write docs/compatibility.md"


def test_readme_block_is_the_render():
    readme = (ROOT / "README.md").read_text()
    assert recipe_keys.with_readme_block(readme) == readme, "stale: run verl-prefix compat --readme README.md"
    with pytest.raises(ValueError, match="compatibility:begin"):
        recipe_keys.with_readme_block("no markers")


def _exists(citation: str) -> bool:
    path, _, name = citation.partition("::")
    file = ROOT / path
    return file.is_file() and re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M) is not None


def test_every_claim_names_a_test_that_exists():
    cited = {e.test for table in (recipe_keys.KEYS, recipe_keys.MEGATRON_KEYS) for e in table.values() if e.test}
    cited |= {t for _, cells in recipe_keys.MATRIX for cell in cells.values() for t in cell.tests}
    assert cited
    assert not sorted(c for c in cited if not _exists(c))


def test_every_tested_claim_cites_a_test():
    """Claims a run could contradict (reuses, dense, refused; served, dense) cite a test; GPU checks and settings
    an engine lacks cite none."""
    for name, cells in recipe_keys.MATRIX:
        assert set(cells) == set(recipe_keys.ENGINES), name
        for engine, cell in cells.items():
            if cell.status in ("reuses", "dense", "refused", "untested"):
                assert cell.tests, (name, engine)
    for path, effect in {**recipe_keys.KEYS, **recipe_keys.MEGATRON_KEYS}.items():
        if effect.status in ("served", "dense", "refused"):
            assert effect.test, path


def test_cli_prints_and_writes_the_page(tmp_path, capsys):
    assert main(["compat"]) == 0
    assert capsys.readouterr().out == recipe_keys.render()
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{recipe_keys.README_BEGIN}\nold\n{recipe_keys.README_END}\nend\n")
    assert main(["compat", "--write", str(tmp_path / "page.md"), "--readme", str(readme)]) == 0
    assert (tmp_path / "page.md").read_text() == recipe_keys.render()
    assert recipe_keys.readme_block() in readme.read_text() and "old" not in readme.read_text()
    readme.write_text("no markers\n")
    assert main(["compat", "--readme", str(readme)]) == 2  # a user mistake, one line on stderr
