"""What a whole `fabric reconcile` process imported: at activation (when the
pass enters the applier, `Applier.run`; a memo hit never gets there) and at
its end, noted by tests/support/harness/pass_child.py's child interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from tests.conftest import REPO
from tests.support.harness.pass_child import CHILD
from tests.support.memo_sandbox import Sandbox


@dataclass(frozen=True)
class Imported:
    at_activation: frozenset[str] | None  # None: the pass never got to the applier (a memo hit)
    at_end: frozenset[str]
    stderr: str


def one_pass(s: Sandbox, *extra: str) -> Imported:
    report = s.root.parent / "imports.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", CHILD, "", str(report), *s.argv(*extra)], capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    seen = json.loads(report.read_text())
    at = seen.get("at_activation")
    return Imported(frozenset(at) if at is not None else None, frozenset(seen["at_end"]), done.stderr)


def loaded(modules: frozenset[str], *packages: str) -> list[str]:
    """Which of `packages` (or their submodules) are in `modules`."""
    return sorted(p for p in packages if any(m == p or m.startswith(f"{p}.") for m in modules))
