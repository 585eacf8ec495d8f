"""systemd as PID 1 in a throw-away container, with its own system D-Bus.

Usage (one container per test module keeps the suite fast)::

    from tests.support.harness.systemd import systemd_container

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

`ManagerReloads(container.bus_address)` counts the daemon-reloads systemd runs,
from its own D-Bus signal.

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

Each container gets its own cgroup (a child of the caller's in the cgroup2
hierarchy) before its cgroup namespace is made: its systemd then manages
`system.slice` and friends under that cgroup, so two containers running at the
same time (tests of different engineers, say) never share one
`system.slice/dbus.service` and stopping a unit in one cannot kill the other's.

Shutdown is by PID: SIGRTMIN+4 (poweroff) to its systemd, then SIGKILL to it if
it does not finish in time (killing PID 1 of a PID namespace kills all of it).
Every mount lives in the container's private mount namespace, so the kernel
drops them all when its last process exits; the host directory and the cgroup
are then removed. All of that is done by a small guardian shell that owns the
container and acts when its stdin closes, so it also happens when the test
process itself is killed (the kernel closes the pipe).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reconciler.ports import ActivationError, UnitJob

if TYPE_CHECKING:
    from reconciler.adapters.systemd_dbus import SystemdDbus

BOOT_TARGET = "fabric-harness.target"
_SYSTEMD, _MANAGER_PATH, _MANAGER = "org.freedesktop.systemd1", "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager"

# This checkout. Tests run the project inside containers from its path.
CHECKOUT = Path(__file__).resolve().parents[3]
_NOT_COPIED = shutil.ignore_patterns(".venv", ".git", "sandbox", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis")

# Runs as PID 1 of the new PID namespace, inside the new mount namespace, and
# finally execs systemd in the new root. $1 is the host work directory, $3
# "pivot_root" or "chroot" (how systemd is put into that root).
_BOOT_SCRIPT = r"""
set -eu
work=$1; hostname=$2; enter=$3
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
if [ "$enter" = pivot_root ]; then
    # The overlay becomes the root of the mount namespace, so the kernel lets
    # processes inside create user namespaces (it refuses a chrooted one).
    mkdir -p "$m/.harness-old-root"
    cd "$m"
    pivot_root . .harness-old-root
    umount -l /.harness-old-root
    rmdir /.harness-old-root
    # Shared, as systemd makes / on a host (it skips that in a container):
    # LoadCredential= mounts the credentials in a child namespace, and rootless
    # podman wants its mounts to propagate. The peer groups are new ones, so
    # nothing propagates to the host.
    mount --make-rshared /
    exec env -i container=fabric-harness /lib/systemd/systemd --system --unit=fabric-harness.target
fi
exec chroot "$m" env -i container=fabric-harness /lib/systemd/systemd --system --unit=fabric-harness.target
"""

# The guardian: a host-side shell that owns the container. It puts itself (and
# so everything it starts) in the container's cgroup, starts `unshare`, then
# blocks reading its stdin. The harness closes that pipe to shut the container
# down; if the test process dies, the kernel closes it. Either way the guardian
# powers systemd off (SIGRTMIN+4), kills it by PID after the grace period,
# waits for unshare and removes the cgroup tree and the work directory.
# Arguments: cgroup dir, work dir, grace seconds, the poweroff signal number,
# then the unshare argv.
_GUARDIAN = r"""
cgroup=$1; work=$2; grace=$3; poweroff=$4; shift 4
echo $$ > "$cgroup/cgroup.procs"
"$@" &
unshare_pid=$!
echo "$unshare_pid" > "$work/unshare.pid"
cat > /dev/null
init_pid=$(cat "/proc/$unshare_pid/task/$unshare_pid/children" 2>/dev/null)
if [ -n "$init_pid" ]; then
    kill -"$poweroff" "$init_pid" 2>/dev/null
    ticks=$((grace * 20))
    while [ -e "/proc/$init_pid" ] && [ "$ticks" -gt 0 ]; do sleep 0.05; ticks=$((ticks - 1)); done
    # SIGKILL to PID 1 of a PID namespace takes every process in it along.
    kill -KILL "$init_pid" 2>/dev/null
fi
wait "$unshare_pid"
echo $$ > "$cgroup/../cgroup.procs"
find "$cgroup" -depth -type d -exec rmdir {} + 2>/dev/null
# The mounts were private to the container, so the host sees plain empty
# directories here; --one-file-system keeps rm out of anything that is not.
rm -rf --one-file-system "$work"
exit 0
"""

_container_count = itertools.count()


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
    user_namespaces: bool = False,
) -> Iterator[SystemdContainer]:
    """Boot systemd as PID 1 with a system bus; always shut it down and clean up.

    `user_namespaces=True` enters the new root with pivot_root instead of
    chroot (the kernel refuses to create a user namespace, as rootless podman
    does, for a process whose root is not its mount namespace's root) and makes
    it a shared mount, as on a host (LoadCredential= needs that)."""
    work = Path(tempfile.mkdtemp(prefix="fabric-systemd-"))
    (work / "root").mkdir()
    (work / "bus").mkdir()
    log_path = work / "boot.log"
    cgroup = _new_cgroup()
    namespaces = ["--pid", "--fork", "--mount", "--uts", "--ipc", "--cgroup"]
    if private_network:
        namespaces.append("--net")
    guardian: subprocess.Popen[bytes] | None = None
    init_pid: int | None = None
    try:
        with open(log_path, "wb") as log:
            guardian = subprocess.Popen(
                [
                    "sh",
                    "-c",
                    _GUARDIAN,
                    "guardian",
                    str(cgroup),
                    str(work),
                    str(int(shutdown_timeout)),
                    str(int(signal.SIGRTMIN + 4)),
                    "unshare",
                    *namespaces,
                    "--propagation",
                    "private",
                    "--",
                    "sh",
                    "-c",
                    _BOOT_SCRIPT,
                    "boot",
                    str(work),
                    hostname,
                    "pivot_root" if user_namespaces else "chroot",
                ],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal must not reach the container's PID 1
            )
        init_pid = _wait_for_init(guardian, work, boot_timeout)
        container = SystemdContainer(init_pid, work)
        _wait_for_bus(guardian, container, boot_timeout, log_path)
        _make_checkout_visible(container)
        yield container
    finally:
        if guardian is not None:
            _shutdown(guardian, init_pid, shutdown_timeout)
        _remove_cgroup(cgroup)
        _unmount_leftovers(work)
        shutil.rmtree(work, ignore_errors=True)


def _make_checkout_visible(container: SystemdContainer) -> None:
    """The container sees the host's files through its overlay, except /tmp,
    which its boot empties (systemd-tmpfiles): a checkout under /tmp (CI may
    clone anywhere) is copied in at the same path, so tests can name the
    project's files by their host paths. Writes there stay in the container."""
    if container.host_path(str(CHECKOUT / "pyproject.toml")).exists():
        return
    shutil.copytree(CHECKOUT, container.host_path(str(CHECKOUT)), ignore=_NOT_COPIED, symlinks=True, dirs_exist_ok=True)


def _new_cgroup() -> Path:
    """A fresh child of this process's cgroup in the cgroup2 hierarchy."""
    with open("/proc/self/mounts") as mounts:
        cgroup2 = [line.split()[1] for line in mounts if line.split()[2] == "cgroup2"]
    if not cgroup2:
        raise ContainerBootError("no cgroup2 hierarchy is mounted; systemd in the container needs one")
    with open("/proc/self/cgroup") as membership:
        own = next((line.strip()[3:] for line in membership if line.startswith("0::")), "/")
    path = Path(cgroup2[0] + own.rstrip("/")) / f"fabric-harness-{os.getpid()}-{next(_container_count)}"
    path.mkdir()
    return path


def _remove_cgroup(cgroup: Path, timeout: float = 10.0) -> None:
    """Kill (by PID) anything left in the container's cgroup tree, then remove it bottom-up."""
    deadline = time.monotonic() + timeout
    while cgroup.exists():
        for directory in sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [cgroup]:
            try:
                for pid in (directory / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                directory.rmdir()
            except OSError:
                pass  # still busy (a process on its way out) or already gone
        if time.monotonic() >= deadline:
            raise RuntimeError(f"could not remove the container's cgroup {cgroup}")
        if cgroup.exists():
            time.sleep(0.05)


def _wait_for_init(guardian: subprocess.Popen[bytes], work: Path, timeout: float) -> int:
    """The host PID of unshare's forked child: PID 1 of the new namespaces."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if guardian.poll() is not None:
            raise ContainerBootError(f"the container's guardian exited with {guardian.returncode} before the container started")
        try:
            unshare_pid = int((work / "unshare.pid").read_text())
            pids = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
        except (FileNotFoundError, ValueError):
            pids = []
        if pids:
            return int(pids[0])
        time.sleep(0.01)
    raise ContainerBootError("unshare did not fork the container's init")


def _wait_for_bus(guardian: subprocess.Popen[bytes], container: SystemdContainer, timeout: float, log_path: Path) -> None:
    """Wait until systemd runs and its D-Bus answers (dbus.service active)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if guardian.poll() is not None or not Path(f"/proc/{container.pid}").exists():
            raise ContainerBootError(f"the container stopped while booting: {log_path.read_text(errors='replace')[-2000:]}")
        if container.bus_socket.exists():
            # The socket exists as soon as dbus.socket listens; wait for systemd to
            # have reached the target so the first D-Bus call does not race the boot.
            state = container.systemctl("is-active", BOOT_TARGET, timeout=5).stdout.strip()
            if state == "active":
                return
        time.sleep(0.05)
    raise ContainerBootError(f"systemd's bus did not come up in {timeout:.0f} s: {log_path.read_text(errors='replace')[-2000:]}")


def _shutdown(guardian: subprocess.Popen[bytes], init_pid: int | None, timeout: float) -> None:
    """Close the guardian's stdin (it powers off, then kills by PID) and wait for it."""
    assert guardian.stdin is not None
    guardian.stdin.close()
    try:
        guardian.wait(timeout=timeout + 10)
        return
    except subprocess.TimeoutExpired:
        pass
    # The guardian itself is stuck: do its job by PID from here.
    for pid in (init_pid, guardian.pid):
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    guardian.wait()


def _unmount_leftovers(work: Path) -> None:
    """Mounts live in the container's private namespace; this only guards against a
    kernel that propagated one back to the host, so rmtree never descends into it."""
    prefix = str(work)
    with open("/proc/self/mounts") as mounts:
        targets = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    for target in sorted(targets, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], check=False, capture_output=True)


class ManagerReloads:
    """How many daemon-reloads systemd began since this was made: its
    Manager's `Reloading(true)` signal, which it sends to subscribed clients
    as each reload begins, whoever asked for it (`systemctl`, a pass inside
    the container, the adapter).

    `count()` first makes a round trip to systemd (Peer.Ping): systemd sends
    its messages to this connection in order, so every signal of a reload
    that began before the call is in by then, and a count unchanged across a
    pass means that pass reloaded nothing."""

    _MATCH = f"type='signal',sender='{_SYSTEMD}',path='{_MANAGER_PATH}',interface='{_MANAGER}',member='Reloading'"

    def __init__(self, bus_address: str) -> None:
        from dbus_fast import Message, MessageType
        from dbus_fast.aio import MessageBus

        self._message, self._types = Message, MessageType
        self._began = 0
        self._loop = asyncio.new_event_loop()

        async def connect() -> MessageBus:
            bus = await MessageBus(bus_address=bus_address).connect()
            bus.add_message_handler(self._on_message)
            await self._checked(bus, "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "AddMatch", "s", [self._MATCH])
            # systemd sends its signals on the bus only while a client is subscribed.
            await self._checked(bus, _SYSTEMD, _MANAGER_PATH, _MANAGER, "Subscribe", "", [])
            return bus

        self._bus = self._loop.run_until_complete(connect())

    def _on_message(self, message: Any) -> None:
        if message.message_type is self._types.SIGNAL and message.member == "Reloading" and message.body == [True]:
            self._began += 1

    async def _checked(self, bus: Any, destination: str, path: str, interface: str, member: str, signature: str, body: list[Any]) -> None:
        reply = await bus.call(self._message(destination=destination, path=path, interface=interface, member=member, signature=signature, body=body))
        if reply.message_type is self._types.ERROR:
            raise RuntimeError(f"{member}: {reply.error_name}: {reply.body}")

    def count(self) -> int:
        self._loop.run_until_complete(self._checked(self._bus, _SYSTEMD, _MANAGER_PATH, "org.freedesktop.DBus.Peer", "Ping", "", []))
        return self._began

    def close(self) -> None:
        self._bus.disconnect()
        self._loop.run_until_complete(self._bus.wait_for_disconnect())
        self._loop.close()

    def __enter__(self) -> ManagerReloads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_job(systemd: SystemdDbus, job: UnitJob, unit: str) -> None:
    """One unit's job through the adapter's batch method, a failure raised as
    the applier words it ("start x.service: job failed; ...")."""
    [outcome] = systemd.run_jobs(job, [unit])
    if not outcome.ok:
        raise ActivationError(f"{job} {unit}: {outcome.failure}")
