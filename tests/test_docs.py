"""The repository explains itself: every reference to `docs/` (in code, tests, benchmarks and the
Markdown files) names a file that exists and, with `#anchor`, one of its headings; nothing cites
a document that is not in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("value_assets", "tests", "bench", "deploy")
# A path to a Markdown file, optionally with an anchor: docs/rules.md#manifest, (operations.md#warm-workers)
DOC_REF = re.compile(r"(?<![\w/.-])((?:docs/)?[\w./-]*\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\]\(([^)\s]*)\)")
# Team documents that live outside this repository; the repository must not send its reader to them.
OUTSIDE = re.compile(r"\b(SPEC|PLATFORM|DESIGN|STYLE)\.md\b|\bSPEC \d")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for top in SOURCES:
        files += sorted(
            p for p in (ROOT / top).rglob("*") if p.suffix in {".py", ".md", ".sh", ".yaml"} and p.is_file()
        )
    return files


def _references(path: Path) -> list[tuple[int, Path, str | None]]:
    """(line, target file, anchor or None) of every reference to a repository Markdown file in `path`."""
    refs = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        targets = [m.group(1) for m in MD_LINK.finditer(line)] if path.suffix == ".md" else []
        for target in targets:
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            refs.append((n, (path.parent / file).resolve() if file else path, anchor or None))
        if path.suffix != ".md":
            for m in DOC_REF.finditer(line):
                if m.group(1).startswith("docs/"):
                    refs.append((n, ROOT / m.group(1), m.group(2)))
    return refs


def test_every_docs_reference_names_an_existing_file_and_heading():
    bad = []
    anchors: dict[Path, set[str]] = {}
    count = 0
    for path in _files():
        for line, target, anchor in _references(path):
            count += 1
            where = f"{path.relative_to(ROOT)}:{line}"
            if not target.is_file():
                bad.append(f"{where}: {target} does not exist")
            elif anchor is not None and target.suffix == ".md":
                if anchor not in anchors.setdefault(target, _anchors(target)):
                    bad.append(f"{where}: {target.relative_to(ROOT)} has no heading #{anchor}")
    assert not bad, "\n".join(bad)
    assert count > 50  # the scan finds the references the code makes


def test_nothing_cites_documents_outside_the_repository():
    bad = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _files()
        if path != Path(__file__)
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not bad, "\n".join(bad)


def test_the_anchor_rule_matches_githubs():
    md = ROOT / "docs" / "rules.md"
    assert "batch-plan" in _anchors(md) and "hand-off" in _anchors(md)
    assert _slug("Checkpoint binding (every file)") == "checkpoint-binding-every-file"
    assert _slug("`make test` and `.ci/run`") == "make-test-and-cirun"
