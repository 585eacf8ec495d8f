"""Atomic, durable file writes, standard library only (the memoized pass
uses them too): a temp file in the same directory (`.<name>.fabric-tmp-<pid>`,
which a pass cleans up if a crash left it), fsync, rename over the target,
fsync the directory. So a crash (SIGKILL, power loss) at any instant leaves
the old file or the new one, never half of one, and a rename that returned
is on disk."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(target: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `target` (whose directory exists) by `data` with `mode`, atomically and durably."""
    tmp = target.parent / f".{target.name}.fabric-tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not weaken or widen it
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, target)
    fsync_dir(target.parent)


def write_atomic(path: Path, text: str, mode: int = 0o644) -> bool:
    """Write `text` to `path` (installing the fabric's own files: units,
    node.toml, drop-ins); False (and nothing touched) when it already holds it."""
    try:
        if path.read_text() == text and (path.stat().st_mode & 0o7777) == mode:
            return False
    except (FileNotFoundError, NotADirectoryError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, text.encode(), mode)
    return True


def read_text_or_none(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
