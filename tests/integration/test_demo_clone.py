"""`scripts/demo` from a fresh clone in a directory only its owner can enter.

A clone often sits below a directory other users cannot enter (root's home, a
`mktemp -d`). Run as root, the demo's throwaway PostgreSQL runs as the user
postgres, which must still reach its data and socket: they go in a directory
of their own under /tmp, removed at the end. The clone is of this checkout's
committed HEAD, into a 0700 directory; the demo makes its own venv there (pip
with this machine's configuration) and must run to its last step.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, require, require_root

pytestmark = pytest.mark.integration

DEMO_TIMEOUT_S = 1800


def test_demo_runs_to_the_end_from_a_fresh_clone_in_a_0700_directory_as_root(tmp_path: Path) -> None:
    require_root()
    require("git", "runuser", "pgrep")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    clone = private / "fabric"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "FABRIC_VENV")}

    done = subprocess.run([str(clone / "scripts" / "demo")], cwd=clone, env=env, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)

    out = done.stdout
    assert done.returncode == 0, f"scripts/demo exited {done.returncode}\n--- stdout\n{out[-6000:]}\n--- stderr\n{done.stderr[-6000:]}"
    assert re.search(r"^lane a1-arm64 .*OFFLINE", out, re.M), out[-3000:]
    assert "Everything is under" in out
    where = re.search(r"data and socket: (\S+)", out)
    assert where, out
    pg_dir = Path(where.group(1))
    assert not str(pg_dir).startswith(str(private)), "PostgreSQL's directory must be reachable by its user"
    assert not pg_dir.exists(), f"{pg_dir} left behind"
    assert (clone / "sandbox" / "pg.log").is_file()
    # No PostgreSQL left running on that directory.
    left = subprocess.run(["pgrep", "-f", str(pg_dir)], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes left on {pg_dir}: {left.stdout}"
