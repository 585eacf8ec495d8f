"""The package's Jinja templates kept compiled in the state directory, between passes.

A pass is a new process every 30 s; parsing and compiling its templates was
most of what rendering cost it. Jinja keys each entry by the template's name
and a checksum of its source, and an entry of another Python version is
ignored, so an upgraded package or an edited template is compiled anew.

Compiled templates are read at once but written only by `keep()`, which the
pass calls once its inputs all checked out: a pass refused for bad input
leaves nothing behind, not even this cache.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import FileSystemBytecodeCache
from jinja2.bccache import Bucket

from reconciler.adapters.install_files import replace_file


class CompiledTemplates(FileSystemBytecodeCache):
    def __init__(self, directory: Path) -> None:
        super().__init__(str(directory), pattern="%s.jinja")
        self._path = directory
        self._new: dict[str, bytes] = {}

    def dump_bytecode(self, bucket: Bucket) -> None:
        self._new[self._get_cache_filename(bucket)] = bucket.bytecode_to_string()

    def keep(self) -> None:
        """Write what this process compiled (a cache: a failure only costs a compile next time)."""
        if not self._new:
            return
        try:
            self._path.mkdir(mode=0o755, parents=True, exist_ok=True)
            for name, data in self._new.items():
                replace_file(Path(name), data)
        except OSError:
            return
        finally:
            self._new.clear()


def cache_directory(root: Path, state_dir: str) -> Path:
    return root / state_dir.strip("/") / "templates-compiled"
