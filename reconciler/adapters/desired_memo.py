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
- every `RECHECK_S`, the stat of every host file too (an in-place write of an
  existing file changes only that file's stat).

A load that fails is not remembered: the next call tries again (the leader
keeps its last good desired state meanwhile: engine.leader).
"""

from __future__ import annotations

import os
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
        recheck_s: float = RECHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Path(directory)
        self._load = load
        self._recheck_s = recheck_s
        self._clock = clock
        self._desired: DesiredState | None = None
        self._quick: tuple | None = None
        self._full: tuple | None = None
        self._walked_at = 0.0
        self.loads = 0

    def _quick_look(self) -> tuple:
        d = self.directory
        return (os.path.realpath(d), _stat(d), _stat(d / FLEET_FILE), _stat(d / "hosts"))

    def _full_look(self) -> tuple:
        return tuple((str(p), _stat(p)) for p in host_files(self.directory))

    def __call__(self) -> DesiredState:
        quick = self._quick_look()
        now = self._clock()
        if self._desired is not None and quick == self._quick and now - self._walked_at < self._recheck_s:
            return self._desired
        full = self._full_look()
        if self._desired is None or quick != self._quick or full != self._full:
            # Looked at before the load: a change during it shows next time.
            self._desired = self._load(self.directory)
            self.loads += 1
        self._quick, self._full, self._walked_at = quick, full, now
        return self._desired
