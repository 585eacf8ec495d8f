"""FileTree and PassLock over the local file system, under a root directory.

Every write is atomic and durable (install_files.replace_file; renames and
removals fsync their directory too). So a crash (SIGKILL, power loss) at any
instant leaves the old file or the new one, never half of one, and a rename
that returned is on disk.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
from pathlib import Path, PurePosixPath

from reconciler.adapters.install_files import fsync_dir, replace_file
from reconciler.ports import LockBusy


class LocalTree:
    """The files under `root` (the host's / or a sandbox)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def path(self, relative: str) -> Path:
        parts = PurePosixPath(relative).parts
        if not parts or relative.startswith("/") or ".." in parts:
            raise ValueError(f"{relative!r} is not a relative path under the root")
        return self.root.joinpath(*parts)

    def real_path(self, path: str) -> str:
        return str(self.path(path).resolve())

    def read(self, path: str) -> bytes | None:
        try:
            return self.path(path).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def _make_dirs(self, directory: Path) -> None:
        # Create missing parents one by one, fsyncing each parent, so a new
        # directory's entry is durable before a file in it is relied on.
        missing = []
        current = directory
        while not current.exists():
            missing.append(current)
            current = current.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                pass
            fsync_dir(d.parent)

    def mode(self, path: str) -> int | None:
        try:
            return stat.S_IMODE(self.path(path).stat().st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        target = self.path(path)
        self._make_dirs(target.parent)
        replace_file(target, data, mode)

    def remove(self, path: str) -> None:
        target = self.path(path)
        try:
            target.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        fsync_dir(target.parent)

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def rename(self, source: str, target: str) -> None:
        src, dst = self.path(source), self.path(target)
        self._make_dirs(dst.parent)
        os.replace(src, dst)
        fsync_dir(dst.parent)
        if src.parent != dst.parent:
            fsync_dir(src.parent)

    def remove_tree(self, path: str) -> None:
        target = self.path(path)
        if not target.exists():
            return
        # Rename first so a crash mid-removal never leaves a half-deleted tree
        # under the original name.
        doomed = target.parent / f".{target.name}.fabric-removing-{os.getpid()}"
        os.replace(target, doomed)
        fsync_dir(target.parent)
        shutil.rmtree(doomed)


class FlockLock:
    """An exclusive flock on a lock file; held until release() or process exit
    (the kernel drops it when the process dies, even by SIGKILL)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise LockBusy(f"{self.path}: another pass is running (pid {holder or 'unknown'})") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
