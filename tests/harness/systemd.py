"""systemd as PID 1 in a throw-away container, with its own system D-Bus.

Usage (one container per test module keeps the suite fast)::

    from tests.harness.systemd import systemd_container

    @pytest.fixture(scope="module")
    def container():
        require_root()
        require("unshare", "nsenter", "chroot")
        with systemd_container() as c:
            yield c

    def test_something(container):
        container.write_file("/etc/systemd/system/x.service", "[Service]\\nExecStart=/bin/sleep infinity\\n")
        container.systemctl("daemon-reload")
        container.systemctl("start", "x.service")
        # or talk D-Bus from the host: SystemdDbus(bus_address=container.bus_address)

What the object offers:

- `pid`: host PID of the container's systemd (PID 1 inside).
- `bus_address`: D-Bus address of its system bus, usable from the host.
- `root`: the container's filesystem as seen from the host (`/proc/PID/root`).
- `write_file(path, text, mode=0o644)` / `read_file(path)`: paths inside the container.
- `run(*argv, input=None, timeout=60)`: run a program inside every namespace of
  the container (nsenter); returns `subprocess.CompletedProcess` (text).
- `systemctl(*args)`, `journal(*args)`: shorthands for `run("systemctl", ...)`
  and `run("journalctl", "--no-pager", ...)`.

How it is built (method 1 of shared/notes/real-components.md): `unshare` gives
new PID, mount, UTS, IPC and cgroup namespaces (and optionally a network one);
inside them a tmpfs holds an overlay whose lower layer is the host's `/`, so the
container sees every installed program but its writes never reach the host. It
gets its own `proc` (with `/proc/sys` read-only), a read-only `sysfs`, a
`cgroup2` tree, the host's `/dev`, a fresh `/run` and, on `/run/dbus`, a bind of
a host directory: the bus socket therefore appears on the host. systemd boots
only `fabric-harness.target`, which wants D-Bus and nothing else, so the bus is
up in well under a second. The container shares the host's network namespace
unless `private_network=True`, so services it runs are reachable on loopback.

Shutdown is by PID: SIGRTMIN+4 (poweroff) to its systemd, then SIGKILL to it if
it does not finish in time (killing PID 1 of a PID namespace kills all of it).
Every mount lives in the container's private mount namespace, so the kernel
drops them all when its last process exits; the host directory is then removed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BOOT_TARGET = "fabric-harness.target"

# Runs as PID 1 of the new PID namespace, inside the new mount namespace, and
# finally execs systemd in the chroot. $1 is the host work directory.
_BOOT_SCRIPT = r"""
set -eu
work=$1; hostname=$2
root=$work/root
mount -t tmpfs -o mode=755 fabric-harness "$root"
mkdir -p "$root/upper" "$root/work" "$root/merged"
mount -t overlay overlay -o "lowerdir=/,upperdir=$root/upper,workdir=$root/work" "$root/merged"
m=$root/merged
mount -t proc proc "$m/proc"
mount --bind "$m/proc/sys" "$m/proc/sys"
mount -o remount,bind,ro "$m/proc/sys"
mount -t sysfs -o ro sysfs "$m/sys"
mount -t cgroup2 cgroup2 "$m/sys/fs/cgroup"
mount --rbind /dev "$m/dev"
mount -t tmpfs -o mode=755 tmpfs "$m/run"
mkdir -p "$m/run/dbus"
mount --bind "$work/bus" "$m/run/dbus"
# Its own machine id (the host's may be absent; a missing one would mean "first
# boot" and systemd would apply every unit preset).
tr -d - < /proc/sys/kernel/random/uuid > "$m/etc/machine-id"
mkdir -p "$m/etc/systemd/system"
cat > "$m/etc/systemd/system/fabric-harness.target" <<TARGET
[Unit]
Description=fabric test harness: D-Bus and nothing else
Wants=dbus.socket dbus.service
TARGET
# systemd sets the hostname from /etc/hostname at boot.
echo "$hostname" > "$m/etc/hostname"
exec chroot "$m" env -i container=fabric-harness /lib/systemd/systemd --system --unit=fabric-harness.target
"""


class ContainerBootError(RuntimeError):
    """The container's systemd or its bus did not come up; the message has its log."""


class SystemdContainer:
    def __init__(self, pid: int, work: Path) -> None:
        self.pid = pid
        self._work = work
        self.bus_socket = work / "bus" / "system_bus_socket"
        self.bus_address = f"unix:path={self.bus_socket}"

    @property
    def root(self) -> Path:
        return Path(f"/proc/{self.pid}/root")

    def host_path(self, path: str) -> Path:
        """Where an absolute path inside the container is reachable from the host."""
        if not path.startswith("/"):
            raise ValueError(f"container path must be absolute: {path!r}")
        return self.root / path.lstrip("/")

    def write_file(self, path: str, text: str, mode: int = 0o644) -> None:
        target = self.host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)

    def read_file(self, path: str) -> str:
        return self.host_path(path).read_text()

    def remove_file(self, path: str) -> None:
        self.host_path(path).unlink(missing_ok=True)

    def run(self, *argv: str, input: str | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run argv inside the container (all its namespaces, its root and cwd /)."""
        return subprocess.run(
            ["nsenter", "-t", str(self.pid), "-a", "-r", "-w", "--", *argv],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"},
        )

    def systemctl(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", "--no-pager", *args, timeout=timeout)

    def journal(self, *args: str) -> str:
        return self.run("journalctl", "--no-pager", *args).stdout


@contextmanager
def systemd_container(
    *,
    hostname: str = "fabric-harness",
    private_network: bool = False,
    boot_timeout: float = 20.0,
    shutdown_timeout: float = 10.0,
) -> Iterator[SystemdContainer]:
    """Boot systemd as PID 1 with a system bus; always shut it down and clean up."""
    work = Path(tempfile.mkdtemp(prefix="fabric-systemd-"))
    (work / "root").mkdir()
    (work / "bus").mkdir()
    log_path = work / "boot.log"
    namespaces = ["--pid", "--fork", "--mount", "--uts", "--ipc", "--cgroup"]
    if private_network:
        namespaces.append("--net")
    with open(log_path, "wb") as log:
        unshare = subprocess.Popen(
            ["unshare", *namespaces, "--propagation", "private", "--", "sh", "-c", _BOOT_SCRIPT, "sh", str(work), hostname],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the terminal must not reach the container's PID 1
        )
    init_pid: int | None = None
    try:
        init_pid = _wait_for_init(unshare, boot_timeout)
        container = SystemdContainer(init_pid, work)
        _wait_for_bus(unshare, container, boot_timeout, log_path)
        yield container
    finally:
        _shutdown(unshare, init_pid, shutdown_timeout)
        _unmount_leftovers(work)
        shutil.rmtree(work, ignore_errors=True)


def _wait_for_init(unshare: subprocess.Popen[bytes], timeout: float) -> int:
    """The host PID of unshare's forked child: PID 1 of the new namespace."""
    children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if unshare.poll() is not None:
            raise ContainerBootError(f"unshare exited with {unshare.returncode} before the container started")
        try:
            pids = children.read_text().split()
        except FileNotFoundError:
            pids = []
        if pids:
            return int(pids[0])
        time.sleep(0.01)
    raise ContainerBootError("unshare did not fork the container's init")


def _wait_for_bus(unshare: subprocess.Popen[bytes], container: SystemdContainer, timeout: float, log_path: Path) -> None:
    """Wait until systemd runs and its D-Bus answers (dbus.service active)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if unshare.poll() is not None:
            raise ContainerBootError(f"container exited with {unshare.returncode}: {log_path.read_text(errors='replace')[-2000:]}")
        if container.bus_socket.exists():
            # The socket exists as soon as dbus.socket listens; wait for systemd to
            # have reached the target so the first D-Bus call does not race the boot.
            state = container.systemctl("is-active", BOOT_TARGET, timeout=5).stdout.strip()
            if state == "active":
                return
        time.sleep(0.05)
    raise ContainerBootError(f"systemd's bus did not come up in {timeout:.0f} s: {log_path.read_text(errors='replace')[-2000:]}")


def _shutdown(unshare: subprocess.Popen[bytes], init_pid: int | None, timeout: float) -> None:
    if init_pid is not None and unshare.poll() is None:
        try:
            os.kill(init_pid, signal.SIGRTMIN + 4)  # systemd: poweroff
        except ProcessLookupError:
            pass
        try:
            unshare.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            pass
        try:
            os.kill(init_pid, signal.SIGKILL)  # takes the whole PID namespace with it
        except ProcessLookupError:
            pass
    if unshare.poll() is None:
        try:
            unshare.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            unshare.kill()
            unshare.wait()


def _unmount_leftovers(work: Path) -> None:
    """Mounts live in the container's private namespace; this only guards against a
    kernel that propagated one back to the host, so rmtree never descends into it."""
    prefix = str(work)
    with open("/proc/self/mounts") as mounts:
        targets = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    for target in sorted(targets, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], check=False, capture_output=True)
