"""A lane agent image built on this machine (nothing can be pulled here).

A static busybox and a small agent script (`/bin/fabric-test-agent`),
imported with `podman import` into a throw-away storage and saved as an OCI
archive, which a unit names as its image (`oci-archive:PATH`, a transport
podman reads locally). Its layer holds files of other owners, as real images
do: one of group 42 (shadow, as in every Debian image) and a directory and a
0600 file of uid and gid 1000 (OWNED_FILE, an application's user), so a
unit's single-ID user namespace must still unpack them (podman's
ignore_chown_errors, STORAGE_OPTS in the unit). Used by
tests/integration/test_agent_podman.py and bench/agent_start.

The agent proves it got its secret and its writable scratch directory (it
copies $PHAZE_AGENT_TOKEN_FILE and $PHAZE_AGENT_QUEUE into
$PHAZE_CLOUD_SCRATCH_DIR, and whether $MODELS_PATH is read-only; it copies
OWNED_FILE, with the owner it sees, and its user namespace's uid_map and
gid_map there too), then idles like a worker waiting for jobs, answering
every file pushed into the scratch dir as <name>.in with <name>.out
("analysed" and the file's text).
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
# A file of uid and gid 1000 in the image's layer, mode 0600, in a directory of
# that owner (0700), with this text.
OWNED_FILE = "/home/app/owned-by-1000"
OWNED_TEXT = "an application's own file\n"
AGENT_SCRIPT = """#!/bin/sh
cat "$PHAZE_AGENT_TOKEN_FILE" > "$PHAZE_CLOUD_SCRATCH_DIR/token-seen"
echo "$PHAZE_AGENT_QUEUE" > "$PHAZE_CLOUD_SCRATCH_DIR/queue-seen"
# The image's file of uid 1000, and the owner it has in this namespace.
{ stat -c %u:%g OWNED_FILE; cat OWNED_FILE; } > "$PHAZE_CLOUD_SCRATCH_DIR/owned-seen" 2>&1
cat /proc/self/uid_map /proc/self/gid_map > "$PHAZE_CLOUD_SCRATCH_DIR/maps-seen"
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
""".replace("OWNED_FILE", OWNED_FILE)
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

    def owned(info: tarfile.TarInfo, gid: int = 0, uid: int = 0) -> tarfile.TarInfo:
        info.uid, info.gid, info.uname, info.gname = uid, gid, "", ""
        return info

    owned_dir = OWNED_FILE.lstrip("/").rsplit("/", 1)[0]
    with tarfile.open(tarball, "w") as tar:
        for directory in ("bin", "etc", "tmp", "proc", "sys", "dev", "run", "var", "var/lib", "var/lib/phaze", "home", owned_dir):
            uid = 1000 if directory == owned_dir else 0
            info = owned(tarfile.TarInfo(directory), uid, uid)
            info.type, info.mode = tarfile.DIRTYPE, {"tmp": 0o1777, owned_dir: 0o700}.get(directory, 0o755)
            tar.addfile(info)
        tar.add(busybox, "bin/busybox", filter=owned)
        for applet in ("sh", "sleep", "cat", "echo", "id", "stat"):
            info = owned(tarfile.TarInfo(f"bin/{applet}"))
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        for name, text, mode, gid, uid in (
            ("bin/fabric-test-agent", AGENT_SCRIPT, 0o755, 0, 0),
            ("etc/gshadow", "root:*::\n", 0o640, 42, 0),
            (OWNED_FILE.lstrip("/"), OWNED_TEXT, 0o600, 1000, 1000),
        ):
            info = owned(tarfile.TarInfo(name), gid, uid)
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


def layer_owners(archive: Path) -> dict[str, tuple[int, int]]:
    """path -> (uid, gid) of every entry in the layers of an OCI archive
    (what podman unpacks), to show an image really holds the owners a test
    relies on."""
    owners: dict[str, tuple[int, int]] = {}
    with tarfile.open(archive) as outer:
        for member in outer.getmembers():
            if not member.isfile() or not member.name.startswith("blobs/"):
                continue
            blob = outer.extractfile(member)
            assert blob is not None
            data = blob.read()
            try:
                with tarfile.open(fileobj=io.BytesIO(data)) as layer:
                    owners.update({entry.name.lstrip("./"): (entry.uid, entry.gid) for entry in layer.getmembers()})
            except tarfile.ReadError:
                continue  # a manifest or a config, not a layer
    return owners
