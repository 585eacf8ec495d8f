"""A lane agent image built on this machine (nothing can be pulled here).

A static busybox and a small agent script (`/bin/fabric-test-agent`),
imported with `podman import` into a throw-away storage and saved as an OCI
archive, which a unit names as its image (`oci-archive:PATH`, a transport
podman reads locally). One of its files is owned by group 42 (shadow, as in
every Debian image), so a unit's single-ID user namespace must still unpack
it. Used by tests/integration/test_agent_podman.py and bench/agent_start.

The agent proves it got its secret and its writable scratch directory (it
copies $PHAZE_AGENT_TOKEN_FILE and $PHAZE_AGENT_QUEUE into
$PHAZE_CLOUD_SCRATCH_DIR, and whether $MODELS_PATH is read-only), then idles like a worker waiting for jobs,
answering every file pushed into the scratch dir as <name>.in with
<name>.out ("analysed" and the file's text).
"""

from __future__ import annotations

import io
import shutil
import struct
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

AGENT_COMMAND = ["/bin/fabric-test-agent"]
AGENT_SCRIPT = """#!/bin/sh
cat "$PHAZE_AGENT_TOKEN_FILE" > "$PHAZE_CLOUD_SCRATCH_DIR/token-seen"
echo "$PHAZE_AGENT_QUEUE" > "$PHAZE_CLOUD_SCRATCH_DIR/queue-seen"
# phaze's models, when bound: readable, not writable.
if [ -n "$MODELS_PATH" ]; then
  { cat "$MODELS_PATH/model-list"; touch "$MODELS_PATH/written" 2>/dev/null && echo writable || echo read-only; } > "$PHAZE_CLOUD_SCRATCH_DIR/models-seen"
fi
# A job: every file pushed as <name>.in is read and answered with <name>.out.
(
  while :; do
    for pushed in "$PHAZE_CLOUD_SCRATCH_DIR"/*.in; do
      [ -f "$pushed" ] && [ ! -e "${pushed%.in}.out" ] && { echo analysed; cat "$pushed"; } > "${pushed%.in}.out"
    done
    sleep 1
  done
) &
exec sleep 2147483647
"""
# What the agent's process looks like (pgrep -f).
AGENT_IDLE = "sleep 2147483647"


def is_static_elf(path: Path) -> bool:
    """No PT_INTERP program header: the binary needs no loader or libraries."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit ELF only
        return False
    endian = "<" if data[5] == 1 else ">"
    (phoff,) = struct.unpack_from(endian + "Q", data, 0x20)
    phentsize, phnum = struct.unpack_from(endian + "HH", data, 0x36)
    types = [struct.unpack_from(endian + "I", data, phoff + i * phentsize)[0] for i in range(phnum)]
    return 3 not in types  # PT_INTERP


def rootfs_tarball(tmp_path: Path) -> Path:
    busybox = shutil.which("busybox")
    assert busybox is not None
    if not is_static_elf(Path(busybox)):
        pytest.fail(f"{busybox} is not statically linked: the image needs busybox-static (scripts/_env.sh installs it)")
    tarball = tmp_path / "rootfs.tar"

    def owned(info: tarfile.TarInfo, gid: int = 0) -> tarfile.TarInfo:
        info.uid, info.gid, info.uname, info.gname = 0, gid, "", ""
        return info

    with tarfile.open(tarball, "w") as tar:
        for directory in ("bin", "etc", "tmp", "proc", "sys", "dev", "run", "var", "var/lib", "var/lib/phaze"):
            info = owned(tarfile.TarInfo(directory))
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755
            tar.addfile(info)
        tar.add(busybox, "bin/busybox", filter=owned)
        for applet in ("sh", "sleep", "cat", "echo", "id"):
            info = owned(tarfile.TarInfo(f"bin/{applet}"))
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        for name, text, mode, gid in (
            ("bin/fabric-test-agent", AGENT_SCRIPT, 0o755, 0),
            ("etc/gshadow", "root:*::\n", 0o640, 42),
        ):
            info = owned(tarfile.TarInfo(name), gid)
            data = text.encode()
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    return tarball


def build_agent_image_archive(tmp_path: Path) -> Path:
    """`podman import` into a throw-away storage, saved as the OCI archive
    tmp_path/agent-image.tar (returned)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    # Not under tmp_path: podman refuses a runroot path longer than 50 characters.
    storage = Path(tempfile.mkdtemp(prefix="fabric-image-"))
    podman = [
        "podman",
        f"--root={storage}/root",
        f"--runroot={storage}/run",
        f"--tmpdir={storage}/tmp",
        "--storage-driver=vfs",
        "--events-backend=none",
    ]
    archive = tmp_path / "agent-image.tar"
    name = "localhost/fabric-test-agent:1"
    try:
        for argv in (
            [*podman, "import", "--change", f"CMD={AGENT_COMMAND[0]}", str(rootfs_tarball(tmp_path)), name],
            [*podman, "save", "--format=oci-archive", f"--output={archive}", name],
        ):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    return archive
