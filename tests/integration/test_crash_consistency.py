"""Crash consistency against real components: a `fabric reconcile` pass
SIGKILLed inside a D-Bus job, inside an nft load and inside a Caddy load, then
the next pass converges.

The edge host "racknerd" of the example fleet runs in a container: systemd as
PID 1 with its own D-Bus, its own network namespace (nft tables, loopback),
Caddy as a systemd service, the socat port maps as the fabric's units. Each
pass is a real process (`python3 -m reconciler reconcile`, activating) run
inside the container exactly as in test_reconcile_activation.py; the test
kills it by PID with SIGKILL once it is, by condition, at one of these points:

(a) a D-Bus job: a drop-in gives the port map's unit an ExecStartPre that,
    while /run/fabric-crash/hold-start exists, writes `start-held` and waits.
    The pass has asked systemd to restart the unit (new listen port) and is
    waiting for the job's JobRemoved signal when it dies; systemd keeps the
    job running. The next pass starts while that job still waits: its restart
    takes the job over (the gate is reached anew), then the hold is lifted.
(b) an nft load: /usr/local/sbin/nft (first on the pass's PATH) passes every
    call to the real nft, except a load from stdin (`nft -f -`, the adapter's
    transaction) while /run/fabric-crash/hold-nft exists: that one is read
    whole, `nft-held` written, and it waits. The pass is inside
    subprocess.run for the transaction when it dies; the kernel's table is the
    old one, whole.
(c) a Caddy load: an nft redirect in the container sends the pass's
    connections to Caddy's admin API (127.0.0.1:2019) through a proxy
    (tests/support/harness/held_requests_proxy.py) that holds `POST /load` while
    /run/fabric-crash/caddy/hold exists. The pass is waiting for Caddy's
    answer when it dies; Caddy still runs the old config, whole.

(b) and (c) run twice: the orphaned load then lands after the pass is gone
(the table or config is then the new one, whole) or is dropped (the old one
stays, whole).

After each kill: the pass lock is free, `current` names the new generation
(complete: every file matching its manifest) and `good` the old one, the
installed files are the new generation's. The next pass (nothing held) exits 0
and leaves everything on the new generation: current = good = new, every
file on disk as the generation has it, every unit active and running its
new file (the moved port carries traffic), the nft table and Caddy's config
the new ones (the same as what the orphaned load left, so that was whole),
and its audit records the step the killed pass did not finish.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from reconciler.adapters.files import LocalTree
from reconciler.engine.apply import GenerationStore
from tests.conftest import REPO
from tests.support.edge_host import DESIRED, FLEET_PLAN, QFOX_ADDRESS, QFOX_ECHO_UNIT, echo_through, edge_container, reconcile_argv
from tests.support.harness.systemd import SystemdContainer
from tests.support.harness.waiting import wait_until

pytestmark = pytest.mark.integration

CRASH = "/run/fabric-crash"
CADDY_ADMIN = "127.0.0.1:2019"
PROXY_PORT = 2020
# The proxy's own connections to Caddy come from here; the redirect spares them.
PROXY_SOURCE = "127.0.0.5"
QFOX_SSH = "fabric-socat-qfox-ssh.service"
PLAN = "/opt/fabric-crash/fleet-plan.json"
# Long enough for a pass that validates with systemd-analyze, nft -c and
# caddy validate on a busy 2-core machine; only a broken run waits this long.
PASS_TIMEOUT = 240.0

NFT_WRAPPER = f"""\
#!/bin/sh
# The real nft, except a load from stdin (the fabric adapter's transaction)
# while {CRASH}/hold-nft exists: read it whole, say so, wait, then load it
# (or, if {CRASH}/drop-nft exists by then, never load it).
if [ "$#" -eq 2 ] && [ "$1" = "-f" ] && [ "$2" = "-" ] && [ -e {CRASH}/hold-nft ]; then
    cat > {CRASH}/nft-transaction
    : > {CRASH}/nft-held
    while [ -e {CRASH}/hold-nft ]; do sleep 0.02; done
    if [ -e {CRASH}/drop-nft ]; then echo dropped > {CRASH}/nft-done; exit 1; fi
    /usr/sbin/nft -f {CRASH}/nft-transaction
    echo $? > {CRASH}/nft-done
    exit 0
fi
exec /usr/sbin/nft "$@"
"""

# `+`: outside the unit's sandbox (DynamicUser, ProtectSystem=strict), so it
# can write under /run.
START_GATE = f"""\
[Service]
ExecStartPre=+/bin/sh -c 'if [ -e {CRASH}/hold-start ]; then : > {CRASH}/start-held; while [ -e {CRASH}/hold-start ]; do sleep 0.02; done; fi'
"""

# Root's connections to Caddy's admin port go through the proxy; the proxy's
# own (from PROXY_SOURCE) go straight to Caddy. A table of the test's, never
# touched by the fabric (which only ever loads `inet fabric`).
REDIRECT_TABLE = f"""\
table ip fabric_crash_test {{
    chain output {{
        type nat hook output priority -100; policy accept;
        ip daddr 127.0.0.1 ip saddr != {PROXY_SOURCE} tcp dport 2019 redirect to :{PROXY_PORT}
    }}
}}
"""

PROXY_UNIT = f"""\
[Service]
ExecStart=/usr/bin/python3 {REPO}/tests/support/harness/held_requests_proxy.py {PROXY_PORT} 2019 {PROXY_SOURCE} "POST /load " {CRASH}/caddy
"""


@pytest.fixture(scope="module")
def edge() -> Iterator[SystemdContainer]:
    with edge_container("flock") as container:
        container.write_file(PLAN, FLEET_PLAN.read_text())
        for argv in (("ip", "link", "set", "lo", "up"), ("ip", "addr", "add", f"{QFOX_ADDRESS}/32", "dev", "lo")):
            done = container.run(*argv)
            assert done.returncode == 0, done.stderr
        container.write_file("/etc/systemd/system/qfox-echo.service", QFOX_ECHO_UNIT)
        container.write_file("/etc/caddy/Caddyfile", f"{{\n\tadmin {CADDY_ADMIN}\n\tauto_https off\n}}\n")
        container.write_file("/usr/local/sbin/nft", NFT_WRAPPER, mode=0o755)
        container.write_file(f"/etc/systemd/system/{QFOX_SSH}.d/50-crash-gate.conf", START_GATE)
        container.write_file("/etc/systemd/system/fabric-crash-proxy.service", PROXY_UNIT)
        container.host_path(f"{CRASH}/caddy").mkdir(parents=True)
        done = container.run("/usr/sbin/nft", "-f", "-", input=REDIRECT_TABLE)
        assert done.returncode == 0, done.stderr
        assert container.systemctl("daemon-reload").returncode == 0
        for unit in ("qfox-echo.service", "caddy.service", "fabric-crash-proxy.service"):
            started = container.systemctl("start", unit)
            assert started.returncode == 0, f"{unit}: {started.stderr}"
        wait_until(lambda: caddy_config(container) is not None, timeout=30, what="Caddy's admin API through the proxy")
        first = run_pass(container)
        assert first.returncode == 0, first.stdout + first.stderr
        yield container


# --------------------------------------------------------------------------
# Passes


@dataclass
class PassRun:
    returncode: int
    stdout: str
    stderr: str
    records: list[dict[str, str]]

    def recorded(self, action: str, outcome: str, **fields: str) -> bool:
        return any(r.get("action") == action and r.get("outcome") == outcome and all(r.get(k) == v for k, v in fields.items()) for r in self.records)


class RunningPass:
    """`fabric reconcile` inside the container, as fabric-reconcile.service runs it."""

    def __init__(self, container: SystemdContainer) -> None:
        self.container = container
        self.cursor = journal_cursor(container)
        self.process = subprocess.Popen(
            [
                "nsenter",
                "-t",
                str(container.pid),
                "-a",
                "-r",
                "-w",
                "--",
                *reconcile_argv(PLAN, "--caddy-admin", CADDY_ADMIN),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"},
        )

    def finish(self) -> PassRun:
        stdout, stderr = self.process.communicate(timeout=PASS_TIMEOUT)
        records = audit_since(self.container, self.cursor)
        # Without journald in the container the records are JSON lines on stderr.
        records += [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
        return PassRun(self.process.returncode, stdout, stderr, records)


def run_pass(container: SystemdContainer) -> PassRun:
    return RunningPass(container).finish()


def journal_cursor(container: SystemdContainer) -> str | None:
    """Where the audit journal ends now."""
    last = container.run("journalctl", "--no-pager", "-t", "fabric-reconcile", "-n", "1", "-o", "json").stdout.strip()
    return json.loads(last)["__CURSOR"] if last else None


def audit_since(container: SystemdContainer, cursor: str | None) -> list[dict[str, str]]:
    """The audit records (action, outcome, unit, file, generation, ...) journald got after `cursor`."""
    # --sync returns once journald has stored every message sent before it.
    container.run("journalctl", "--sync")
    argv = ["journalctl", "--no-pager", "-t", "fabric-reconcile", "-o", "json"]
    if cursor is not None:
        argv.append(f"--after-cursor={cursor}")
    entries = [json.loads(line) for line in container.run(*argv).stdout.splitlines() if line.strip()]
    return [{k.removeprefix("FABRIC_").lower(): str(v) for k, v in e.items() if k.startswith("FABRIC_")} for e in entries]


def pass_pid(process: subprocess.Popen[str]) -> int:
    """The host PID of the pass: nsenter's only child (nsenter forks to enter
    the PID namespace; env then execs python3)."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    assert len(children) == 1, children
    pid = int(children[0])
    assert b"reconciler\0reconcile" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return pid


def kill_pass_when(container: SystemdContainer, hold: str, held: str) -> PassRun:
    """Start a pass with `hold` present; once `held` appears (the pass is inside
    the held operation), SIGKILL the pass by PID."""
    container.write_file(hold, "")
    running = RunningPass(container)
    process = running.process
    try:
        wait_until(lambda: container.host_path(held).exists() or process.poll() is not None, timeout=PASS_TIMEOUT, what=f"{held}")
        assert process.poll() is None, "the pass ended before reaching the held operation:\n" + "".join(process.communicate())
        os.kill(pass_pid(process), signal.SIGKILL)
        killed = running.finish()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # nsenter passes the child's death on: killed by the same signal.
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), killed
    return killed


# --------------------------------------------------------------------------
# What the container runs


def caddy_config(container: SystemdContainer) -> dict | None:
    """Caddy's running config (GET /config/ from inside the container, through the proxy)."""
    done = container.run(
        "python3",
        "-c",
        f"import urllib.request; print(urllib.request.urlopen('http://{CADDY_ADMIN}/config/', timeout=10).read().decode())",
        timeout=30,
    )
    return json.loads(done.stdout) if done.returncode == 0 else None


def nft_table(container: SystemdContainer) -> str:
    done = container.run("/usr/sbin/nft", "list", "table", "inet", "fabric")
    assert done.returncode == 0, done.stderr
    return done.stdout


def listen_port_of(container: SystemdContainer) -> int:
    """The port qfox-ssh's running socat listens on (from its command line)."""
    pid = container.systemctl("show", QFOX_SSH, "-p", "MainPID", "--value").stdout.strip()
    cmdline = container.host_path(f"/proc/{pid}/cmdline").read_bytes().decode()
    match = re.search(r"TCP4?-LISTEN:(\d+)", cmdline)
    assert match, cmdline
    return int(match.group(1))


def set_listen_port(container: SystemdContainer, port: int) -> None:
    path = f"{DESIRED}/fabric.toml"
    text, count = re.subn(r'(name = "qfox-ssh"\nhost = "racknerd"\nlisten_port = )\d+', rf"\g<1>{port}", container.read_file(path))
    assert count == 1
    container.write_file(path, text)


ENCODE_UPSTREAMS = {"qfox-1": "100.88.57.96:8702", "x86-spill": "100.101.7.22:8702"}


def move_encode(container: SystemdContainer) -> str:
    """vaapi-encode's replica moved between qfox-1 and x86-spill (a change of
    the Caddy snippet only); returns its new upstream address."""
    pattern = re.compile(r'("service": "vaapi-encode", "replica": 0, "node": )"([^"]+)"')
    text = container.read_file(PLAN)
    match = pattern.search(text)
    assert match is not None
    node = "x86-spill" if match.group(2) == "qfox-1" else "qfox-1"
    container.write_file(PLAN, pattern.sub(rf'\g<1>"{node}"', text, count=1))
    return ENCODE_UPSTREAMS[node]


def store(container: SystemdContainer) -> GenerationStore:
    return GenerationStore(LocalTree(container.root))


def fresh_start(container: SystemdContainer) -> int:
    """No hold or marker of an earlier test left; the last pass's generation is
    good. Returns its number."""
    for marker in container.host_path(CRASH).rglob("*"):
        if marker.is_file():
            marker.unlink()
    # Every test restarts the port map's unit; its start limit (5 in 300 s)
    # would otherwise count the whole module's starts.
    assert container.systemctl("reset-failed", QFOX_SSH).returncode == 0
    generations = store(container)
    good = generations.good()
    assert good is not None and generations.current() == good
    return good


def assert_after_kill(container: SystemdContainer, old: int) -> int:
    """The lock is free; `current` is a new, complete generation whose files
    are installed; `good` is still the old one. Returns the new number."""
    assert container.run("flock", "--nonblock", "/var/lib/fabric/lock", "true").returncode == 0, "the killed pass's lock is still held"
    generations = store(container)
    new = generations.current()
    assert generations.good() == old
    assert new is not None and new > old, f"current is {new} after the kill, good {old}"
    manifest = generations.manifest(new)
    assert manifest is not None
    for artifact, entry in zip(generations.artifacts(new), manifest.entries, strict=True):
        assert artifact.sha256 == entry.sha256, f"generation {new}: {entry.path} does not match its manifest"
        assert container.host_path(f"/{artifact.path}").read_bytes() == artifact.data, f"{artifact.path} is not generation {new}'s"
    assert not [name for name in os.listdir(container.host_path(f"/{generations.dir}")) if name.startswith(".")], "a staging directory is left"
    return new


def next_pass_converges(edge: SystemdContainer, new: int, *steps: tuple[str, dict[str, str]]) -> PassRun:
    """The pass after the kill, unhindered: it retries the interrupted steps
    (each recorded ok for generation `new`), activates `new`, and leaves the
    world converged on it."""
    again = run_pass(edge)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"generation {new} is active" in again.stdout, again.stdout
    for action, fields in (*steps, ("activate", {})):
        assert again.recorded(action, "ok", generation=str(new), **fields), (action, fields)
    assert_converged(edge, new)
    return again


def assert_converged(container: SystemdContainer, number: int) -> None:
    """Generation `number` is current and good, on disk, loaded and running."""
    generations = store(container)
    assert (generations.current(), generations.good()) == (number, number)
    for artifact in generations.artifacts(number):
        assert container.host_path(f"/{artifact.path}").read_bytes() == artifact.data, f"{artifact.path} is not generation {number}'s"
        if artifact.unit:
            shown = container.systemctl("show", artifact.unit, "-p", "ActiveState", "-p", "NeedDaemonReload", "-p", "Job").stdout
            assert "ActiveState=active\n" in shown and "NeedDaemonReload=no\n" in shown, f"{artifact.unit}: {shown}"
    unit_file = container.read_file(f"/etc/systemd/system/{QFOX_SSH}")
    port = listen_port_of(container)
    assert f"-LISTEN:{port}," in unit_file, "qfox-ssh runs another generation's port"
    assert echo_through(container, port) == "ping"
    assert f"tcp dport {{ {port}, 4445 }} drop" in nft_table(container)


# --------------------------------------------------------------------------
# The three kill points


def test_pass_killed_inside_a_dbus_job_then_the_next_pass_converges(edge: SystemdContainer) -> None:
    old = fresh_start(edge)
    set_listen_port(edge, 2231)

    killed = kill_pass_when(edge, f"{CRASH}/hold-start", f"{CRASH}/start-held")

    # The pass died waiting for its restart job, which systemd still runs.
    assert edge.systemctl("show", QFOX_SSH, "-p", "Job", "--value").stdout.strip(), "no job is running for qfox-ssh"
    assert edge.systemctl("is-active", QFOX_SSH).stdout.strip() == "activating"
    new = assert_after_kill(edge, old)
    assert killed.recorded("generation", "ok", generation=str(new))
    assert killed.recorded("nft-load", "ok", generation=str(new))
    assert not killed.recorded("restart", "ok")
    assert not killed.recorded("activate", "ok")

    # The next pass comes while that job still waits (systemd restarts a
    # killed fabric-reconcile.service at once): its restart takes the job over
    # (systemd merges it and runs it again, so the gate is reached anew).
    edge.remove_file(f"{CRASH}/start-held")
    following = RunningPass(edge)
    wait_until(
        lambda: edge.host_path(f"{CRASH}/start-held").exists() or following.process.poll() is not None,
        timeout=PASS_TIMEOUT,
        what="the next pass's restart to reach the gate",
    )
    edge.remove_file(f"{CRASH}/hold-start")
    again = following.finish()
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"generation {new} is active" in again.stdout, again.stdout
    assert again.recorded("restart", "ok", unit=QFOX_SSH, generation=str(new))
    assert again.recorded("activate", "ok", generation=str(new))
    assert_converged(edge, new)
    assert listen_port_of(edge) == 2231


# What becomes of the operation the killed pass left in flight: it completes
# after the pass is gone, or it never reaches the component.
ORPHAN_FATES = ["lands", "dropped"]


@pytest.mark.parametrize("orphan", ORPHAN_FATES)
def test_pass_killed_inside_an_nft_load_then_the_next_pass_converges(edge: SystemdContainer, orphan: str) -> None:
    old = fresh_start(edge)
    old_table = nft_table(edge)
    port = 2232 if orphan == "lands" else 2233
    set_listen_port(edge, port)

    killed = kill_pass_when(edge, f"{CRASH}/hold-nft", f"{CRASH}/nft-held")

    new = assert_after_kill(edge, old)
    assert killed.recorded("generation", "ok", generation=str(new))
    assert not killed.recorded("nft-load", "ok")
    # The transaction the pass handed nft has not reached the kernel: the old table, whole.
    assert nft_table(edge) == old_table
    assert f"{port}," in edge.read_file(f"{CRASH}/nft-transaction")

    if orphan == "dropped":
        edge.write_file(f"{CRASH}/drop-nft", "")
    edge.remove_file(f"{CRASH}/hold-nft")
    wait_until(lambda: edge.host_path(f"{CRASH}/nft-done").exists(), timeout=60, what="the orphaned nft load")
    after_orphan = nft_table(edge)
    if orphan == "lands":
        # Loaded by the orphaned nft in one transaction: the new table, whole.
        assert edge.read_file(f"{CRASH}/nft-done").strip() == "0"
        assert f"tcp dport {{ {port}, 4445 }} drop" in after_orphan
    else:
        assert after_orphan == old_table

    next_pass_converges(edge, new, ("nft-load", {}), ("restart", {"unit": QFOX_SSH}))
    assert listen_port_of(edge) == port
    if orphan == "lands":
        assert nft_table(edge) == after_orphan


@pytest.mark.parametrize("orphan", ORPHAN_FATES)
def test_pass_killed_inside_a_caddy_load_then_the_next_pass_converges(edge: SystemdContainer, orphan: str) -> None:
    old = fresh_start(edge)
    old_config = caddy_config(edge)
    assert old_config is not None
    address = move_encode(edge)
    assert address not in json.dumps(old_config)

    killed = kill_pass_when(edge, f"{CRASH}/caddy/hold", f"{CRASH}/caddy/held")

    new = assert_after_kill(edge, old)
    assert killed.recorded("generation", "ok", generation=str(new))
    assert not killed.recorded("caddy-load", "ok")
    assert edge.read_file(f"{CRASH}/caddy/held").startswith("POST /load ")
    # Caddy has not seen the load: the old config, whole.
    assert caddy_config(edge) == old_config

    if orphan == "dropped":
        edge.write_file(f"{CRASH}/caddy/drop", "")
    edge.remove_file(f"{CRASH}/caddy/hold")
    wait_until(lambda: edge.host_path(f"{CRASH}/caddy/released").exists(), timeout=60, what="the held load to be let go")
    after_orphan = caddy_config(edge)
    assert after_orphan is not None
    if orphan == "lands":
        # Loaded after the pass was gone: the new config, whole.
        assert edge.read_file(f"{CRASH}/caddy/released").startswith("HTTP/1.1 200")
        assert address in json.dumps(after_orphan)
    else:
        assert after_orphan == old_config

    next_pass_converges(edge, new, ("caddy-load", {}))
    converged = caddy_config(edge)
    assert converged is not None and address in json.dumps(converged)
    if orphan == "lands":
        assert converged == after_orphan
