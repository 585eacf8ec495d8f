"""The atomic write's durability, as the kernel sees it (strace).

A SIGKILL crash test sees the old file or the new one whether or not the
write fsyncs: only a power loss tells, and no test here can pull the plug.
So the order of the system calls is the contract: the temp file is written
and fsynced before the rename over the target, and the directory is opened
and fsynced after it (so the rename itself is on disk).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require

pytestmark = pytest.mark.integration

# replace_file in a child of its own, so strace records only its calls.
CHILD = """
import sys
from pathlib import Path
from reconciler.adapters.install_files import replace_file
replace_file(Path(sys.argv[1]), b"new contents\\n", 0o640)
"""


def _calls(trace: str, target: Path) -> list[tuple[str, str]]:
    """The calls that touch the target's directory, as (call, what), in order;
    file descriptors are resolved to the path they were opened for."""
    directory = str(target.parent)
    fds: dict[str, str] = {}
    calls: list[tuple[str, str]] = []
    for line in trace.splitlines():
        line = re.sub(r"^\d+\s+", "", line)  # strace -f prefixes the pid
        opened = re.match(r'openat\(AT_FDCWD, "([^"]+)", ([^)]*)\) = (\d+)', line)
        if opened and opened.group(1).startswith(directory):
            fds[opened.group(3)] = opened.group(1)
            kind = "opendir" if "O_DIRECTORY" in opened.group(2) else "open"
            calls.append((kind, opened.group(1)))
            continue
        on_fd = re.match(r"(write|fsync|fdatasync|close)\((\d+)", line)
        if on_fd and on_fd.group(2) in fds:
            calls.append((on_fd.group(1), fds[on_fd.group(2)]))
            if on_fd.group(1) == "close":
                del fds[on_fd.group(2)]
            continue
        renamed = re.match(r'rename(?:at2?)?\((?:AT_FDCWD, )?"([^"]+)", (?:AT_FDCWD, )?"([^"]+)"', line)
        if renamed and renamed.group(2) == str(target):
            calls.append(("rename", renamed.group(1)))
    return calls


def test_the_new_file_is_fsynced_before_the_rename_and_the_directory_after(tmp_path: Path) -> None:
    require("strace")
    target = tmp_path / "etc" / "fabric-unit.service"
    target.parent.mkdir()
    target.write_text("old contents\n")
    trace = tmp_path / "trace"
    proc = subprocess.run(
        [
            "strace",
            "-f",
            "-qq",
            "-o",
            str(trace),
            "-e",
            "trace=openat,write,fsync,fdatasync,close,rename,renameat,renameat2",
            sys.executable,
            "-c",
            CHILD,
            str(target),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert target.read_text() == "new contents\n" and (target.stat().st_mode & 0o777) == 0o640
    calls = _calls(trace.read_text(), target)
    tmp = next(path for kind, path in calls if kind == "open")
    assert Path(tmp).parent == target.parent and Path(tmp).name.startswith(f".{target.name}.fabric-tmp-"), calls
    order = [kind for kind, path in calls if path in (tmp, str(target.parent))]
    # open tmp, write..., fsync tmp, close tmp, rename tmp -> target, open dir, fsync dir, close dir
    writes_end = max(i for i, kind in enumerate(order) if kind == "write")
    assert order[0] == "open" and order[1] == "write", calls
    fsync_tmp = order.index("fsync")
    assert fsync_tmp > writes_end, calls
    rename = order.index("rename")
    assert fsync_tmp < rename, f"the new file must be on disk before it replaces the old one: {calls}"
    after = order[rename + 1 :]
    assert after[:2] == ["opendir", "fsync"], f"the directory must be fsynced after the rename: {calls}"
