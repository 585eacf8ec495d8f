"""Reading a secret from its file, only when nobody else may read it (standard library only).

Every secret the fabric reads itself comes from a file named by a `*_FILE`
setting: phaze's broker DSN ([phaze] queue_url_file), the etcd client key
([registry] key_file, or --key-file), a leader candidate's plan signing key
(--plan-key-file). Such a file is used only when it is a regular file owned
by root or by the user this process runs as, and no permission bit of group
or others is set (as ssh treats a private key); otherwise it is refused with
an error naming the path, the owner or the mode, and what to do, never a byte
of its content. A memoized pass reads the DSN file too, so nothing here
imports a model.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# No secret the fabric reads is anywhere near this big; a bigger file is not one.
MAX_SECRET_BYTES = 64 * 1024


class SecretFileRefused(Exception):
    """The file cannot be used as a secret; the message names the path and why
    (its owner, its mode, or the system's reason it cannot be read), never its content.
    Callers raise their port's own error with this message."""


def secret_file_problem(st: os.stat_result, path: Path | str, what: str) -> str | None:
    """Why a file of this stat cannot hold `what`, or None."""
    me = os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        return f"{path}: {what} is not a regular file"
    if st.st_uid not in (0, me):
        return f"{path}: {what} is owned by uid {st.st_uid}, neither root nor the user this runs as (uid {me}); chown it"
    if st.st_mode & 0o077:
        return f"{path}: {what} is open to group or others (mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it"
    return None


def read_secret_file(path: Path | str, what: str, *, follow_symlinks: bool = True, max_bytes: int = MAX_SECRET_BYTES) -> bytes:
    """The content of the secret file `path` (`what` names it in errors,
    e.g. "the etcd client key"). The checks are made on the file opened
    (fstat), so what is checked is what is read. Raises SecretFileRefused."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise SecretFileRefused(f"{path}: cannot read {what}: {exc.strerror or type(exc).__name__}") from None
    try:
        problem = secret_file_problem(os.fstat(fd), path, what)
        if problem is not None:
            raise SecretFileRefused(problem)
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise SecretFileRefused(f"{path}: cannot read {what}: {exc.strerror or type(exc).__name__}") from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise SecretFileRefused(f"{path}: {what} is over {max_bytes} bytes: not a secret file")
    return b"".join(chunks)
