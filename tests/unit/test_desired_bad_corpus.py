"""Every file in tests/fixtures/bad_desired is one bad desired state.

Line 1 `# as: NAME` says which file of the example fleet it replaces (or adds);
line 2 `# expect: FILE: key.path: reason` is the exact message. Each case runs the
real CLI on a copy of the example fleet: exit 2, that exact line on stderr,
nothing on stdout, and no file in the directory changed.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.conftest import EXAMPLE_FLEET, fabric_validate

CORPUS = Path(__file__).resolve().parent.parent / "fixtures" / "bad_desired"
CASES = sorted(CORPUS.glob("*.toml"))


def _header(path: Path) -> tuple[str, str]:
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# as: ") and lines[1].startswith("# expect: "), f"{path.name}: header lines missing"
    return lines[0][len("# as: ") :], lines[1][len("# expect: ") :]


def _tree_hash(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_bad_desired_state_is_rejected_with_its_message(case: Path, tmp_path: Path) -> None:
    target, expected = _header(case)
    desired = tmp_path / "desired"
    shutil.copytree(EXAMPLE_FLEET, desired)
    (desired / target).write_text("\n".join(case.read_text().splitlines()[2:]) + "\n")
    before = _tree_hash(desired)

    proc = fabric_validate(desired)

    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = [line.replace(f"{desired}/", "") for line in proc.stderr.splitlines()]
    assert expected in lines, f"expected {expected!r}, got {lines!r}"
    assert _tree_hash(desired) == before
