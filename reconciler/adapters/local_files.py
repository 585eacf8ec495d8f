"""reconciler.ports.ProbeFiles over this machine's /proc, /sys and /dev/dri (the live probe's reads).

Standard library only: a memoized pass probes live through it and must
import no model (reconciler.adapters.probe_io re-exports it).
"""

from __future__ import annotations

import os
import shutil

READ_CAP = 4 * 1024 * 1024
READ_CHUNK = 64 * 1024


class LocalFiles:
    def read_text(self, path: str) -> str:
        with open(path, encoding="utf-8", errors="replace") as handle:
            # sysfs and procfs files are small; the cap guards a wrong path.
            # Read in chunks: a /proc/sys file refuses one read of the whole
            # cap (ENOMEM: the kernel allocates what the read asks for).
            chunks: list[str] = []
            left = READ_CAP
            while left > 0:
                chunk = handle.read(min(READ_CHUNK, left))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return "".join(chunks)

    def list_dir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def read_link(self, path: str) -> str:
        return os.readlink(path)

    def stat(self, path: str) -> str:
        st = os.stat(path)
        return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"

    def program(self, name: str) -> str | None:
        # The PATH the command runner's children search (it adds only LC_ALL).
        found = shutil.which(name)
        if found is None:
            return None
        real = os.path.realpath(found)
        try:
            return f"{real}:{self.stat(real)}"
        except OSError:
            return None
