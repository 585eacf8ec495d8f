"""README.md and docs/*.md say only what exists: every relative link resolves
(to a file, and to a heading of it when the link names one), every `fabric
...` command they show exists (its `--help` exits 0, run in-process), and
every repository path they cite in inline code is there."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from reconciler.cli import main
from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250

FENCE_RE = re.compile(r"^(```|~~~)")
LINK_RE = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE_RE = re.compile(r"(`+)(.+?)\1", re.DOTALL)  # a code span may wrap onto the next line
# A command line in a code block: optional prompt, sudo or VAR=value first.
COMMAND_LINE_RE = re.compile(r"^\s*(?:\$ )?(?:sudo )?(?:[A-Z_]+=\S+ )*fabric\s+(.*)$")
WORD_RE = re.compile(r"^[a-z][a-z0-9-]*$")
REPO_PATH_RE = re.compile(r"^(?:reconciler|tests|bench|scripts|nix|modules|hosts|docs|templates)/[\w./*-]*$")


def page_id(path: Path) -> str:
    return str(path.relative_to(REPO))


def blocks(text: str) -> tuple[list[str], list[str]]:
    """(lines inside fenced code blocks, lines of prose), code fences removed."""
    code: list[str] = []
    prose: list[str] = []
    inside = False
    for line in text.splitlines():
        if FENCE_RE.match(line.strip()):
            inside = not inside
            continue
        (code if inside or line.startswith("    ") else prose).append(line)
    return code, prose


def inline_code(prose: list[str]) -> list[str]:
    text = "\n".join(prose)
    return [" ".join(m.group(2).split()) for m in INLINE_CODE_RE.finditer(text)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    code, prose = blocks(path.read_text())
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose:
        m = re.match(r"^#{1,6} (.+)$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def commands(path: Path) -> list[list[str]]:
    """Each `fabric ...` command shown: its words up to the first option or argument placeholder."""
    code, prose = blocks(path.read_text())
    shown: list[str] = []
    for line in code:
        m = COMMAND_LINE_RE.match(line.split(" #", 1)[0])
        if m:
            shown.append(m.group(1))
    for span in inline_code(prose):
        if span.startswith("fabric "):
            shown.append(span[len("fabric ") :])
    out: list[list[str]] = []
    for rest in shown:
        words: list[str] = []
        for token in rest.split():
            if not WORD_RE.match(token):
                break
            words.append(token)
        out.append(words)
    return out


def help_exit(words: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main([*words, "--help"])
        except SystemExit as exc:
            status = int(exc.code or 0)
    return status, err.getvalue()


def test_the_readme_is_a_front_page() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "scripts/demo" in text and "scripts/test" in text
    assert "../shared" not in text


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_resolves(page: Path) -> None:
    _, prose = blocks(page.read_text())
    broken = []
    for link in LINK_RE.findall("\n".join(prose)):
        if re.match(r"^[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link}: no heading #{anchor} in {path.relative_to(REPO)}")
    assert not broken, f"{page_id(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_fabric_command_shown_exists(page: Path) -> None:
    missing = []
    for words in commands(page):
        if not words:
            continue
        status, err = help_exit(words)
        if status != 0:
            missing.append(f"fabric {' '.join(words)} --help exits {status}: {err.strip().splitlines()[-1:]}")
    assert not missing, f"{page_id(page)}: " + "; ".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_repository_path_cited_exists(page: Path) -> None:
    _, prose = blocks(page.read_text())
    missing = []
    for span in inline_code(prose):
        path = span.split(":", 1)[0].rstrip(".,")
        if not REPO_PATH_RE.match(path):
            continue
        if not (list(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
            missing.append(path)
    assert not missing, f"{page_id(page)} cites paths that do not exist: {missing}"


def test_the_checks_see_commands_links_and_paths() -> None:
    """The parsers find what they check (a check that sees nothing passes for nothing)."""
    readme = REPO / "README.md"
    assert ["validate"] in commands(readme)
    assert ["status"] in commands(REPO / "docs" / "operating.md")
    assert help_exit(["no-such-command"])[0] != 0
    assert "layout" in anchors(readme)
    assert any(REPO_PATH_RE.match(s) for s in inline_code(blocks((REPO / "docs" / "pass.md").read_text())[1]))
