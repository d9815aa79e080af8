"""The README is the five-minute page and every relative link in it and in docs/ lands (issue 19)."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "maintainers").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: rendered text, lowercased, punctuation but ``-`` and ``_`` dropped."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading anchors by its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file; repeated headings get GitHub's ``-1``, ``-2`` suffixes."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    """Targets of the inline links, images and reference definitions that are not URLs."""
    targets = []
    for line in prose_lines(path.read_text()):
        line = CODE_SPAN.sub("", line)
        targets += INLINE_LINK.findall(line)
        targets += REFERENCE_DEF.findall(line)
    return [t for t in targets if t and not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def broken_links(path: Path) -> list[str]:
    """``file: target (why)`` for each relative link whose file or heading does not exist."""
    problems = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{path.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{path.name}: {target} (no heading with that anchor in {dest.name})")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_land(page):
    assert relative_links(page) or page != README
    assert broken_links(page) == []


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "other.md").write_text(
        "# Other page\n\n## A `code` heading: with (punctuation)\n\n## Twice\n\n## Twice\n"
    )
    (tmp_path / "pic.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Local part\n\n"
        "[ok](other.md) [ok](other.md#a-code-heading-with-punctuation) [ok](other.md#twice-1) [ok](#local-part)\n"
        "![ok](pic.png) [web](https://example.com/missing.md) `[not a link](nowhere.md)`\n\n"
        "```\n[in a fence](nowhere.md)\n# not a heading\n```\n\n"
        "[gone](missing.md) [bad anchor](other.md#no-such-heading) [bad local](#not-here) ![gone](gone.png)\n"
        "[def]: missing-too.md\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#no-such-heading (no heading with that anchor in other.md)",
        "page.md: #not-here (no heading with that anchor in page.md)",
        "page.md: gone.png (no such file)",
        "page.md: missing-too.md (no such file)",
    ]
    assert "not-a-heading" not in anchors(page)


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        (
            "Capacity: the longest prefix whose update fits (2026-12-01, CPU)",
            "capacity-the-longest-prefix-whose-update-fits-2026-12-01-cpu",
        ),
        ("Replay (the paper's evaluation method)", "replay-the-papers-evaluation-method"),
        ("Keep groups whole: the `prefix_sync` trainer mode", "keep-groups-whole-the-prefix_sync-trainer-mode"),
        (
            "MoE: the router aux loss (`verl_prefix/schedule/models/moe.py`)",
            "moe-the-router-aux-loss-verl_prefixschedulemodelsmoepy",
        ),
    ],
)
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_readme_is_the_short_page():
    text = README.read_text()
    assert len(text.encode()) < 12 * 1024
    for command in [
        "bash scripts/setup.sh",
        ".venv/bin/verl-prefix demo",
        '.venv/bin/python -m pytest -q -m "not e2e"',
    ]:
        assert command in text, command
    for line in [
        "actor_rollout_ref.actor.strategy=prefix_fsdp2",
        "trainer.v1.trainer_mode=prefix_sync",
        "actor_rollout_ref.actor._target_=verl_prefix.PrefixFSDPActorConfig",
        "actor_rollout_ref.actor.fsdp_config._target_=verl_prefix.config.PrefixFSDPEngineConfig",
    ]:
        assert line in text, line


def test_readme_links_every_docs_page():
    linked = {t.partition("#")[0] for t in relative_links(README)}
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in linked, page.name


def _yaml_default(value: object) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def test_readme_knob_table_lists_every_knob_with_its_default():
    from verl_prefix.backend.actor_config import PrefixFSDPActorConfig
    from verl_prefix.backend.config import PrefixReuseConfig

    rows = dict(re.findall(r"^\| `([\w.]+)`(?: \([^)]*\))? \| `([^`]*)` \|", README.read_text(), re.M))
    expected = {
        f"prefix_reuse.{f.name}": _yaml_default(f.default)
        for f in fields(PrefixReuseConfig)
        if not f.name.startswith("_")
    }
    actor = {f.name: f for f in fields(PrefixFSDPActorConfig)}
    for name in ["dormant_prefix", "dormant_prefix_budget_bytes", "moe_aux_loss_coef", "record_trace_dir"]:
        expected[name] = _yaml_default(actor[name].default)
    expected["ulysses_sequence_parallel_size"] = "1"  # verl's own default
    assert rows == expected


def test_maintainers_pages_are_linked():
    """Each page under docs/maintainers/ is reachable: the README or a docs page links it."""
    linked = set()
    for page in PAGES:
        for target in relative_links(page):
            linked.add((page.parent / target.partition("#")[0]).resolve())
    for page in sorted((ROOT / "docs" / "maintainers").glob("*.md")):
        assert page.resolve() in linked, page.name
