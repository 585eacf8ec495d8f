"""reconciler.ports.FileReader over this machine's /proc, /sys and /dev/dri (the live probe's reads).

Standard library only: a memoized pass probes live through it and must
import no model (reconciler.adapters.probe_io re-exports it).
"""

from __future__ import annotations

import os


class LocalFiles:
    def read_text(self, path: str) -> str:
        with open(path, encoding="utf-8", errors="replace") as handle:
            # sysfs and procfs files are small; the cap guards a wrong path.
            return handle.read(4 * 1024 * 1024)

    def list_dir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def read_link(self, path: str) -> str:
        return os.readlink(path)
