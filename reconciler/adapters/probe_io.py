"""The probe's file adapters: the machine's own files, and capture directories.

`LocalFiles` is the live `FileReader` (/proc, /sys, /dev/dri). `CaptureDirectory`
is the `CaptureStore`: a capture is written whole or not at all (files go into a
temporary sibling directory, are fsynced, and the directory is renamed into
place), and an existing non-empty directory is never overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from reconciler.adapters.files import fsync_dir
from reconciler.adapters.local_files import LocalFiles
from reconciler.core.probe.facts import ERRORS_FILE, RAW_NAMES
from reconciler.ports import CaptureError

__all__ = ["CaptureDirectory", "LocalFiles"]


class CaptureDirectory:
    def save(self, directory: str, outputs: dict[str, str], errors: dict[str, str]) -> None:
        target = Path(directory)
        unknown = sorted(set(outputs) - set(RAW_NAMES))
        if unknown:
            raise CaptureError(f"{directory}: not raw probe names: {', '.join(unknown)}")
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise CaptureError(f"{directory}: exists and is not an empty directory (a capture never overwrites)")
        parent = target.parent
        if not parent.is_dir():
            raise CaptureError(f"{directory}: parent directory {parent} does not exist")
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=parent))
        try:
            files = dict(outputs)
            if errors:
                files[ERRORS_FILE] = json.dumps(dict(sorted(errors.items())), indent=2) + "\n"
            for name, text in files.items():
                with open(staging / name, "w", encoding="utf-8") as handle:
                    handle.write(text)
                    handle.flush()
                    os.fsync(handle.fileno())
            staging.chmod(0o755)
            fsync_dir(staging)
            # rename(2) replaces an empty directory atomically; a non-empty one
            # (someone wrote into it meanwhile) makes it fail, and we keep out.
            os.rename(staging, target)
            fsync_dir(parent)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise CaptureError(f"{directory}: {exc.strerror or exc}") from exc
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def load(self, directory: str) -> tuple[dict[str, str], dict[str, str]]:
        source = Path(directory)
        if not source.is_dir():
            raise CaptureError(f"{directory}: not a directory")
        outputs: dict[str, str] = {}
        for name in RAW_NAMES:
            path = source / name
            if path.is_file():
                outputs[name] = path.read_text(encoding="utf-8", errors="replace")
        errors: dict[str, str] = {}
        errors_path = source / ERRORS_FILE
        if errors_path.is_file():
            try:
                document = json.loads(errors_path.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise CaptureError(f"{errors_path}: not JSON: {exc}") from None
            if not isinstance(document, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in document.items()):
                raise CaptureError(f"{errors_path}: must map raw file names to reasons")
            errors = {k: v for k, v in document.items() if k in RAW_NAMES}
        if not outputs and not errors:
            raise CaptureError(f"{directory}: no raw probe file in it ({', '.join(RAW_NAMES)})")
        return outputs, errors
