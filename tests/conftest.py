"""Shared test configuration.

`require(program)` is how a test asks for a real component: under CI=true a
missing one fails the test, elsewhere it skips with the reason. Nothing else in
the suite decides to skip.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_FLEET = REPO / "hosts"
IN_CI = os.environ.get("CI", "").lower() == "true"


def require(*programs: str) -> None:
    missing = [p for p in programs if shutil.which(p) is None]
    if not missing:
        return
    message = f"real component missing: {', '.join(missing)}"
    if IN_CI:
        pytest.fail(message + " (CI=true: a missing component is a failure)")
    pytest.skip(message)


def require_root() -> None:
    if os.geteuid() == 0:
        return
    if IN_CI:
        pytest.fail("this test needs root (namespaces, nft, systemd); CI runs as root")
    pytest.skip("needs root")
