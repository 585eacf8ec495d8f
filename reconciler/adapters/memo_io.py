"""The reads and writes of a memoized pass (`reconciler.engine.pass_memo`), standard library only.

A memoized pass must cost no more than starting the interpreter a few times
over, so nothing here imports a model, a template or `reconciler.ports` (the
classes at the end implement its MemoStore, MemoReader and Audit structurally).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reconciler.adapters.install_files import replace_file
from reconciler.digests import sha256 as _sha256

if TYPE_CHECKING:
    from reconciler.adapters.journal import JournalAudit
    from reconciler.adapters.systemd_dbus import SystemdDbus


def fingerprint(paths: Iterable[Path | str]) -> str:
    """A digest of what is at `paths` (files, and every file under directories),
    from names and stat fields: size, mtime, ctime and inode change with any
    edit, rename or replacement, without reading a byte of the files.
    Reading the tree's files would make a host's pass grow with the fleet."""
    h = _sha256()
    for path in paths:
        h.update(f"\0{path}\0".encode())
        _walk(Path(path), "", h)
    return h.hexdigest()


# The Nix store: a path in it never changes (built once, then read-only; a
# new desired state is a new store path).
NIX_STORE = "/nix/store/"


def nix_store_path(directory: Path | str) -> str | None:
    """`directory`'s real path when it lies in the Nix store (its identity:
    the store path is a digest of the content), else None."""
    real = os.path.realpath(directory)
    return real if real.startswith(NIX_STORE) and len(real) > len(NIX_STORE) else None


def tree_stamp(directory: Path | str, files: Iterable[str], since: float | None = None) -> str | None:
    """The identity of a desired-state directory that is not a git checkout,
    from a few system calls, whatever the number of hosts:

    - in the Nix store: its store path (`nix_store_path`);
    - a plain directory: the stat of the directory and of its hosts/ (a file
      added, removed or renamed there, as an editor's save by rename,
      changes the directory's mtime) and of `files` (relative to it:
      fabric.toml, this host's file, the files its last full pass depended
      on), so a file edited in place among them changes the stamp too.
      A host file no pass of this host reads, edited in place, is seen by
      the next full pass (pass_memo.MAX_AGE_S at the latest), as an
      uncommitted edit of a git checkout is.

    `since` (seconds since the epoch): None instead when any of them
    changed at or after it (racy: it may have changed while a pass read it,
    in the same timestamp tick), so that pass's memo does not vouch for it."""
    store = nix_store_path(directory)
    if store is not None:
        return f"store {store}"
    top = Path(directory)
    h = _sha256()
    for rel in (".", "hosts", *sorted(set(files))):
        try:
            st = os.stat(top / rel)
        except OSError as exc:
            h.update(f"{rel}:missing:{exc.errno}\n".encode())
            continue
        if since is not None and max(st.st_mtime, st.st_ctime) >= since:
            return None
        h.update(f"{rel}:{st.st_mode:o}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}\n".encode())
    return f"dirs {h.hexdigest()}"


def git_commit(directory: Path | str) -> str | None:
    """The commit checked out in `directory` when it is the top of a git
    checkout (what `fabric pull` keeps), read from .git without running git,
    with the index's stat (git rewrites it whenever it changes the tree);
    None when it is not a plain checkout (then fingerprint the tree)."""
    git = Path(directory) / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            try:
                commit = (git / ref).read_text().strip()
            except FileNotFoundError:
                commit = next((line.split()[0] for line in (git / "packed-refs").read_text().splitlines() if line.endswith(f" {ref}")), "")
        else:
            commit = head
        index = os.stat(git / "index")
    except (OSError, NotADirectoryError):
        return None
    if not commit:
        return None
    return f"{commit}:{index.st_size}:{index.st_mtime_ns}:{index.st_ctime_ns}:{index.st_ino}"


def _walk(path: Path, rel: str, h: Any) -> None:
    try:
        st = os.stat(path)
    except OSError as exc:
        h.update(f"{rel}:missing:{exc.errno}\n".encode())
        return
    if not os.path.isdir(path):
        h.update(f"{rel}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}\n".encode())
        return
    h.update(f"{rel}/:{st.st_mtime_ns}\n".encode())
    with os.scandir(path) as entries:
        names = sorted((e.name, e.is_dir(follow_symlinks=True)) for e in entries if not e.name.startswith("."))
    for name, is_dir in names:
        child = path / name
        if is_dir:
            _walk(child, f"{rel}/{name}", h)
        else:
            try:
                st = os.stat(child)
            except OSError as exc:
                h.update(f"{rel}/{name}:missing:{exc.errno}\n".encode())
                continue
            h.update(f"{rel}/{name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}\n".encode())


def read_under(root: Path, path: str) -> bytes | None:
    try:
        return (root / path.lstrip("/")).read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def read_file(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def rewrite_head(target: Path, edit: Callable[[str], str], head_bytes: int = 64 * 1024) -> bool:
    """Replace `target` atomically with its first lines (up to `head_bytes`)
    passed through `edit` and the rest copied as it is, in constant memory:
    an edge's metrics textfile holds the whole fleet's series, and a memoized
    pass only refreshes the few at its top. False when there is no `target`."""
    try:
        source = open(target, "rb")  # noqa: SIM115 (closed below, after the copy)
    except FileNotFoundError:
        return False
    with source:
        head = source.read(head_bytes)
        cut = head.rfind(b"\n") + 1 if len(head) == head_bytes else len(head)
        source.seek(cut)
        tmp = target.parent / f".{target.name}.fabric-tmp-{os.getpid()}"
        with open(tmp, "wb") as out:
            out.write(edit(head[:cut].decode("utf-8")).encode("utf-8"))
            shutil.copyfileobj(source, out, 256 * 1024)
            out.flush()
            os.fsync(out.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    return True


def remove(target: Path) -> None:
    target.unlink(missing_ok=True)


@contextmanager
def pass_lock(lock_file: Path) -> Iterator[bool]:
    """The pass lock, if free (True), without waiting; the same lock file as `files.FlockLock`."""
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def nft_table_digest(nft: str, family: str = "inet", table: str = "fabric") -> str | None:
    """sha256 of `nft list table` of the fabric's table (a flushed or edited table changes it); None when not loaded."""
    import subprocess  # only a pass that activates asks

    try:
        result = subprocess.run([nft, "list", "table", family, table], capture_output=True, timeout=10, env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return _sha256(result.stdout).hexdigest()


class MemoFiles:
    """reconciler.ports.MemoStore: the memo, the pass counters, the textfile and the pass lock."""

    def read(self, path: Path) -> bytes | None:
        return read_file(path)

    def write(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, data)

    def remove(self, path: Path) -> None:
        remove(path)

    def rewrite_head(self, path: Path, edit: Callable[[str], str]) -> bool:
        return rewrite_head(path, edit)

    def lock(self, lock_file: Path) -> AbstractContextManager[bool]:
        return pass_lock(lock_file)


class MemoWorld:
    """reconciler.ports.MemoReader: files under the root, and with activation
    systemd's unit states (D-Bus, connected when first asked) and the
    nftables table; stat fingerprints, git commits and PATH."""

    def __init__(self, root: Path, *, activating: bool, systemd_bus: str | None) -> None:
        self.root = root
        self.activating = activating
        self.systemd_bus = systemd_bus
        self._systemd: SystemdDbus | None = None

    def read(self, path: str) -> bytes | None:
        return read_under(self.root, path)

    def unit_state(self) -> Callable[[str], str] | None:
        if not self.activating:
            return None

        def state(unit: str) -> str:
            if self._systemd is None:
                from reconciler.adapters.systemd_dbus import SystemdDbus

                self._systemd = SystemdDbus(self.systemd_bus)
            return self._systemd.active_state(unit)

        return state

    def nft_digest(self) -> Callable[[], str | None] | None:
        if not self.activating:
            return None
        nft = shutil.which("nft") or "/usr/sbin/nft"
        return lambda: nft_table_digest(nft)

    def fingerprint(self, paths: Sequence[Path | str]) -> str:
        return fingerprint(paths)

    def git_commit(self, directory: Path) -> str | None:
        return git_commit(directory)

    def tree_stamp(self, directory: Path, files: Sequence[str], since: float | None = None) -> str | None:
        return tree_stamp(directory, files, since)

    def which(self, program: str) -> str | None:
        return shutil.which(program)

    def close(self) -> None:
        if self._systemd is not None:
            self._systemd.close()


class OneLineAudit:
    """reconciler.ports.Audit for the memoized pass's one audit line: the
    journal (adapters.journal.JournalAudit) opened when a line is written, so
    a full pass, which audits through its own, opens nothing here."""

    def __init__(self) -> None:
        self._journal: JournalAudit | None = None

    def record(self, action: str, outcome: str, **fields: str) -> None:
        if self._journal is None:
            from reconciler.adapters.journal import JournalAudit

            self._journal = JournalAudit()
        self._journal.record(action, outcome, **fields)

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
