"""The leader's desired state, loaded again only when its directory changed.

A leader step reloads the desired state (a fleet.toml edit, an admitted host
take effect at the next step). At 10,000 declared hosts a load parses 10,000
files: seconds, against a steady step's goal of 0.1 s. `DesiredMemo` keeps
the last load and loads again only when a cheap look says the directory may
have changed:

- at every call, the stat (inode, size, mtime, ctime) of the directory, its
  fabric.toml and its hosts/ folder, and where the directory leads (a Nix
  store path swapped behind a link): a host file added, removed or replaced
  by a rename (an editor's save, `fabric admit`'s atomic write, a git checkout)
  changes its folder's mtime;
- every `RECHECK_S`, on a thread of its own (so no step pays for it), the
  stat of every host file too (an in-place write of an existing file
  changes only that file's stat): a difference makes the next call load.

A load that fails is not remembered: the next call tries again (the leader
keeps its last good desired state meanwhile: engine.leader).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from reconciler.core.desired.load import FLEET_FILE, host_files, load_desired
from reconciler.core.desired.model import DesiredState

# How often every host file's stat is looked at (not only the folders').
RECHECK_S = 30.0

Stat = tuple[int, int, int, int] | None


def _stat(path: Path) -> Stat:
    try:
        s = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)


class DesiredMemo:
    def __init__(
        self,
        directory: Path | str,
        load: Callable[[Path], DesiredState] = load_desired,
        *,
        recheck_s: float | None = RECHECK_S,
    ) -> None:
        """`recheck_s`: how often the thread looks at every file (None: no
        thread; `recheck` is called by hand)."""
        self.directory = Path(directory)
        self._load = load
        self._recheck_s = recheck_s
        self._desired: DesiredState | None = None
        self._quick: tuple | None = None
        self._full: tuple | None = None
        self._stale = threading.Event()
        self._thread: threading.Thread | None = None
        self.loads = 0

    def _quick_look(self) -> tuple:
        d = self.directory
        return (os.path.realpath(d), _stat(d), _stat(d / FLEET_FILE), _stat(d / "hosts"))

    def _full_look(self) -> tuple:
        return tuple((str(p), _stat(p)) for p in host_files(self.directory))

    def recheck(self) -> bool:
        """Every file looked at: True (and the next call loads) when one changed."""
        if self._full is not None and self._full_look() != self._full:
            self._stale.set()
        return self._stale.is_set()

    def _rechecking(self) -> None:
        assert self._recheck_s is not None
        while True:
            time.sleep(self._recheck_s)
            try:
                self.recheck()
            except OSError:
                self._stale.set()

    def __call__(self) -> DesiredState:
        quick = self._quick_look()
        if self._desired is not None and quick == self._quick and not self._stale.is_set():
            return self._desired
        self._stale.clear()
        # Looked at before the load: a change during it shows next time.
        full = self._full_look()
        if self._desired is None or quick != self._quick or full != self._full:
            self._desired = self._load(self.directory)
            self.loads += 1
        self._quick, self._full = quick, full
        if self._thread is None and self._recheck_s is not None:
            self._thread = threading.Thread(target=self._rechecking, name="desired-recheck", daemon=True)
            self._thread.start()
        return self._desired
