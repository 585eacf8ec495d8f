"""The one atomic write (reconciler.adapters.install_files.replace_file) that
the pass's files, the fabric's own units and the pass memo all go through."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from reconciler.adapters import install_files
from reconciler.adapters.files import LocalTree
from reconciler.adapters.memo_io import MemoFiles


def disk_full_after(monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    """os.write in install_files writes `limit` bytes, then fails as a full disk does."""
    real_write = os.write
    left = {"bytes": limit}

    def write(fd: int, data: bytes | memoryview) -> int:
        if left["bytes"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        done = real_write(fd, bytes(data[: left["bytes"]]))
        left["bytes"] -= done
        return done

    monkeypatch.setattr(install_files.os, "write", write)


WRITERS = {
    "pass files (LocalTree)": lambda root, data: LocalTree(root).write("etc/fabric/fabric.nft", data),
    "pass memo (MemoFiles)": lambda root, data: MemoFiles().write(root / "etc/fabric/fabric.nft", data),
    "own units (write_atomic)": lambda root, data: install_files.write_atomic(root / "etc/fabric/fabric.nft", data.decode()),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_write_that_fails_halfway_leaves_the_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    target = tmp_path / "etc/fabric/fabric.nft"
    WRITERS[writer](tmp_path, b"old table\n")
    disk_full_after(monkeypatch, 5)
    with pytest.raises(OSError, match="No space left"):
        WRITERS[writer](tmp_path, b"a new table, longer than five bytes\n")
    assert target.read_bytes() == b"old table\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["fabric.nft"]


@pytest.mark.parametrize("writer", WRITERS)
def test_a_short_write_is_continued_to_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    real_write = os.write
    monkeypatch.setattr(install_files.os, "write", lambda fd, data: real_write(fd, bytes(data[:3])))
    WRITERS[writer](tmp_path, b"a whole table\n")
    assert (tmp_path / "etc/fabric/fabric.nft").read_bytes() == b"a whole table\n"
