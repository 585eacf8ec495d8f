"""The example fleet on one machine: every host a systemd container on a shared bridge.

Used by the scenario tests (tests/e2e/test_fleet.py, one fleet per module) and
by hand through `scripts/fleet up|down|status` (which runs `python -m
tests.e2e.fleet`).

    with running_fleet(work_dir, progress=print) as fleet:
        desired = load_desired(fleet.desired_dir)
        plan = wait_for(lambda: converged(fleet, desired, tuple(HOST_OCTETS)), timeout=120, what="convergence")
        fleet.request("encode.researchstack.info")   # (200, "vaapi-encode on lux\n")
        fleet.stop_host("qfox-1"); fleet.start_host("qfox-1")
        fleet.stop_etcd(); fleet.start_etcd()
        with fleet.registry() as registry: registry.snapshot()   # as fabric-admin
        with fleet.registry("root") as registry: ...               # or another identity

The topology
------------
A Linux bridge on the host (`fab<id>`) carries a /24 inside Tailscale's
100.64.0.0/10 (100.64.250.0/24, or the next free /24 below it while another
fleet on this machine holds that one). It stands in for the tailnet: the
nftables rules the fabric renders admit service ports from 100.64.0.0/10 only,
so the hosts must sit on tailnet addresses for the edge to reach them (10.250
addresses would be dropped by the very rules under test). On it:

    .2 racknerd (edge)   .10 lux   .11 qfox-1   .21 a1-arm64   .22 x86-spill
    .5 etcd (its own namespace)   .100 client (its own namespace)   .254 this host

phaze's broker, the lane queue (SAQ on PostgreSQL; tests/support/harness/postgres.py),
listens on this host's bridge address (.254:5432, database `phaze`, trusted
from the /24 only): the hosts' passes and the leaders in the containers read
the lanes' load and workers from it, the test client dispatches into it. Its
DSN is /run/secrets/phaze/queue_url in each container and WORK/queue_url here
(0600), named by [phaze] queue_url_file in each desired state.

Each fabric host is systemd as PID 1 in its own namespaces
(`tests.support.harness.systemd.systemd_container(private_network=True)`); a veth pair
is moved into its network namespace by PID, so stopping the container takes its
link down with it, as a dead machine's would.

In each container
-----------------
- the project: the test venv's site-packages bind-mounted read-only at
  /opt/fabric/site-packages (the editable install points at this checkout) and
  /opt/fabric/bin/fabric, a launcher for the system python3. The units the
  fabric installs run with ProtectHome= and PrivateTmp=, which would hide a
  venv under /tmp and the interpreter under /root, hence the bind;
- the desired state at /var/lib/fabric/desired: a copy of hosts/ changed for
  this machine by `e2e_desired_state` (registry = the etcd on the bridge over
  TLS, plan keys = throwaway ones, addresses = bridge addresses, the tailnet
  interface = eth0, the container's link to the bridge, short
  timings, service commands = service_stub.py);
- its own etcd identity at [registry]'s fleet-wide paths: the fleet CA at
  /etc/fabric/etcd/ca.crt, its client certificate (CN = its host name) and
  key (0600) at /etc/fabric/etcd/client.crt and client.key; on lux and qfox-1
  only, that candidate's own plan signing key at /etc/fabric/plan-signing.key
  (0600, the default of --plan-key-file);
- /etc/fabric/node.toml and the units `fabric units` renders from it (the single
  source of the reconcile service, timer and leader service), plus one drop-in
  that appends `--replay tests/fixtures/probe/<host>` to the pass: the
  container's hardware identity is the captured machine's;
- on the edge, the packaged caddy.service with the admin API on localhost:2019,
  the address `fabric reconcile` loads into, and a main Caddyfile importing the
  fabric's snippet with `local_certs` (this machine cannot reach ACME);
- /usr/bin/podman is podman_standin.py (the lane agents' images cannot be
  pulled here) and the braid credential file exists.

Trying a change of the reconciler in the fleet without touching the checkout:
FABRIC_E2E_BIND=HOSTFILE:PATH[,...] bind-mounts each HOSTFILE over PATH in
every container as it boots (for example a patched copy of
reconciler/cli/reconcile.py over /work/main/reconciler/cli/reconcile.py).

Identities
----------
`up()` makes a throwaway CA with `tests.support.harness.etcd.TestPki` (in WORK/pki):
etcd's server certificate for its bridge address, a client certificate per
host and for `root` and `fabric-admin`; and a plan signing key per leader
candidate with `fabric leader keygen` (in WORK/plan-keys), whose public
halves replace hosts/'s [[plan_keys]]. etcd runs with `--client-cert-auth`,
and `fabric registry init-auth` (as root) creates the users and roles and
turns auth on before any host's first pass. This host's test client reads
WORK/client-desired (the same desired state, [registry] pointing at the
fabric-admin identity's files here): `Fleet.registry(identity)` and
`Fleet.fabric(..., identity=...)` act as another identity (lux for lane jobs,
root for a forger's raw writes). Teardown removes the keys with the rest.

Teardown is by PID and handle, in reverse order of creation, even when bring-up
fails half-way: every resource registers its undo on an ExitStack the moment
it exists, and is recorded in `state.json` so `scripts/fleet down` can remove a
fleet whose supervisor died (`force_down`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from reconciler.core.desired.model import DesiredState
from reconciler.core.install.nodeconfig import TimerSection, timespan_seconds
from reconciler.core.install.units import PASS_DIRECTORIES, RECONCILE_SERVICE, RECONCILE_TIMER
from reconciler.core.live.models import FleetPlan
from reconciler.core.scheduling.lanes import agent_unit
from reconciler.core.timestamps import utc
from tests.support.harness.etcd import TestPki
from tests.support.harness.postgres import PostgresServer, postgres_server
from tests.support.harness.postgres import stop_by_pid as stop_postgres
from tests.support.harness.systemd import SystemdContainer, systemd_container

REPO = Path(__file__).resolve().parent.parent.parent
EXAMPLE_FLEET = REPO / "hosts"
PROBE_FIXTURES = REPO / "tests" / "fixtures" / "probe"
SERVICE_STUB = REPO / "tests" / "e2e" / "service_stub.py"
PODMAN_STANDIN = REPO / "tests" / "e2e" / "podman_standin.py"

# Host -> last octet of its bridge address. Leader candidates first, so they
# are up (and one of them leads) by the time the others send their first beat.
HOST_OCTETS: dict[str, int] = {"lux": 10, "qfox-1": 11, "racknerd": 2, "a1-arm64": 21, "x86-spill": 22}
ETCD_OCTET = 5
CLIENT_OCTET = 100
# A source outside the tailnet (TEST-NET-1, not in 100.64.0.0/10): the client
# namespace takes it as a second address and the edge answers it on its link,
# so a request can come from where the tailnet-only sites refuse it.
OUTSIDE_ADDRESS = "192.0.2.100"
THIS_HOST_OCTET = 254
# Held while a fleet picks its /24 and puts its bridge address on it, so two
# fleets brought up at once (several test runs on one machine) never pick the same.
SUBNET_LOCK = Path("/run/fabric-e2e-subnet.lock")
SUBNETS_TRIED = 50
ETCD_CLIENT_PORT = 2379

DESIRED_DIR = "/var/lib/fabric/desired"
NODE_CONFIG = "/etc/fabric/node.toml"
# [registry]'s TLS files: fleet-wide paths, per-host files (each host its own
# certificate, CN = its host name, and key).
ETCD_TLS_DIR = "/etc/fabric/etcd"
ETCD_CA_FILE = f"{ETCD_TLS_DIR}/ca.crt"
ETCD_CERT_FILE = f"{ETCD_TLS_DIR}/client.crt"
ETCD_KEY_FILE = f"{ETCD_TLS_DIR}/client.key"
# The joining identity ([registry] joining_cert_file/joining_key_file, CN =
# fabric-joining): a machine with the fabric installed and no host file
# reports itself pending with it (`Fleet.add_machine`); the files exist only
# on such a machine.
JOINING = "fabric-joining"
JOINING_CERT_FILE = f"{ETCD_TLS_DIR}/joining.crt"
JOINING_KEY_FILE = f"{ETCD_TLS_DIR}/joining.key"
# Where a machine `add_machine` boots keeps its probe capture (replayed by its pass).
MACHINE_CAPTURE_DIR = "/var/lib/fabric-e2e/probe"
# A leader candidate's private plan signing key (the default of --plan-key-file).
PLAN_KEY_FILE = "/etc/fabric/plan-signing.key"
# The etcd identities of this host's test client: reads and drains as the
# operator, init-auth and raw writes as root.
ADMIN = "fabric-admin"
ROOT = "root"
PREFIX = "/opt/fabric"
# This checkout, bind-mounted read-only inside every container. Not under /tmp:
# the pass and the agent units run with PrivateTmp=, which hides /tmp (where CI
# may clone), so everything a unit runs is named by this path.
SOURCE = f"{PREFIX}/src"
FABRIC_BIN = f"{PREFIX}/bin/fabric"
SEARCH_PATH = f"{PREFIX}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
REPLAY_DROPIN = "/etc/systemd/system/fabric-reconcile.service.d/50-e2e-replay.conf"
# The example fleet's braid service reads this credential (LoadCredential=):
# a unit whose credential file is missing does not start.
# Every secret a unit names: systemd refuses to start a unit whose
# LoadCredential= file is missing (the lane agents hand theirs over that way).
SECRET_FILES = {
    "/run/secrets/braid/api_token": "e2e-not-a-real-token\n",
    # Each agent's own token (agent.token_dir/<agent_ref>/token): a token
    # resolves to one agent id at phaze's API (tests/e2e/phaze_api_stub.py, AGENT_TOKENS).
    "/run/secrets/phaze/agents/a1-arm64/token": "e2e-token-a1-arm64\n",
    "/run/secrets/phaze/agents/x86-spill/token": "e2e-token-x86-spill\n",
    # The CA of phaze's agent API (the example's agent.ca_file).
    "/run/secrets/phaze/ca.crt": "e2e-not-a-real-ca\n",
}
GPU_GROUPS = ("render", "video")
AGENT_TOKENS = {"e2e-token-a1-arm64": "a1-arm64", "e2e-token-x86-spill": "x86-spill"}
# phaze's broker URL (the fleet's PostgreSQL, known once it runs): the
# example's PHAZE_QUEUE_URL_FILE, named by [phaze] queue_url_file.
QUEUE_URL_FILE = "/run/secrets/phaze/queue_url"

# The edge operator's main Caddyfile: the pass inlines its snippet at the
# import line and keeps these global options. The example's domain is public,
# and this machine cannot reach an ACME issuer: `local_certs` has Caddy issue
# every site's certificate from its own CA (the client does not verify it).
EDGE_CADDYFILE = """{
	admin localhost:2019
	local_certs
	skip_install_trust
}

import /etc/caddy/fabric.caddy
"""

DEFAULT_STATE_DIR = Path("/run/fabric-fleet")
Progress = Callable[[str], None]


# --------------------------------------------------------------------------
# Settings and the e2e desired state


@dataclass(frozen=True)
class FleetSettings:
    # First three octets of the bridge's /24 (inside 100.64.0.0/10, see above);
    # Fleet.up() takes the next free one below it when this machine has it already.
    subnet: str = "100.64.250"
    # fabric-reconcile.timer's interval on every host (node.toml [timer]).
    pass_interval: str = "1s"
    # One beat per pass. Five hosts' passes and two leaders share this
    # machine's two cores with whatever else runs, and a pass then takes
    # 1.5-3 s: with a 3 s node timeout healthy nodes went offline (and were
    # held off as flapping) within a minute. 8 s (a few passes) keeps them up;
    # the leader's lease TTL is heartbeat_s.
    heartbeat_s: int = 2
    node_timeout_s: int = 8
    drain_grace_s: int = 120
    # The staleness gate of the local lane (the example's is 15 min).
    local_spill_after_s: int = 10
    flap_window_s: int = 120
    flap_toggles: int = 3
    hold_off_s: int = 30
    # fabric-watch.service on every host (installed and enabled, as join.sh
    # and the NixOS module do): a plan or this host's entries changing starts
    # a pass at once. Off by default: with the 1 s timer of the scenario
    # modules it adds nothing but load; the modules and the bench that run
    # the production 30 s timer turn it on.
    watcher: bool = False
    # fabric-watch's fast liveness record (issue 30: [timing] liveness_s,
    # liveness_ttl_s); it is kept only where fabric-watch.service runs.
    # 0: none, the node timeout alone decides (as before issue 30).
    liveness_s: int = 2
    liveness_ttl_s: int = 6
    # Services the e2e desired state declares `singleton = true` (never run
    # twice: not hedged, moved only at the node timeout).
    singletons: tuple[str, ...] = ()

    def address(self, octet: int) -> str:
        return f"{self.subnet}.{octet}"

    def host_address(self, host: str) -> str:
        return self.address(HOST_OCTETS[host])

    @property
    def etcd_endpoint(self) -> str:
        return f"https://{self.address(ETCD_OCTET)}:{ETCD_CLIENT_PORT}"


def in_container(path: Path) -> str:
    """Where a file of this checkout is inside the containers (see SOURCE)."""
    return f"{SOURCE}/{path.relative_to(REPO)}"


def e2e_desired_state(
    settings: FleetSettings,
    source: Path = EXAMPLE_FLEET,
    *,
    plan_keys: list[dict[str, str]] | None = None,
    tls: dict[str, str] | None = None,
    queue_url_file: str = QUEUE_URL_FILE,
) -> dict[str, str]:
    """The example fleet's files (name -> TOML text) changed for this machine.

    Changed: the registry (etcd on the bridge over TLS: [registry] ca_file,
    cert_file, key_file are `tls`, by default the fleet-wide paths under
    /etc/fabric/etcd), the [[plan_keys]] (`plan_keys`: the throwaway keys of
    lux and qfox-1; None keeps the example's, whose private halves are not
    here), the timings (the local lane's staleness gate included), every
    host's address (its bridge address) and tailnet interface (eth0), every service's program (service_stub.py
    on the service's own port; braid's images become that command too), and
    the scaling cloud hooks (gh and wrangler, which this machine cannot run)
    and the [ray] cluster are removed. The lane agents stay podman images: each container gets
    podman_standin.py as its /usr/bin/podman. Everything else, placement rules
    included, is the example's own.
    """
    files: dict[str, str] = {}
    for path in sorted(source.glob("*.toml")):
        data = tomllib.loads(path.read_text())
        if path.name == "fabric.toml":
            data = _e2e_fleet(data, settings)
            data.setdefault("phaze", {})["queue_url_file"] = queue_url_file
            # The tests drive each dispatch pass with `fabric lane dispatch --once`
            # and assert its decisions: the leader must not take the jobs first.
            data["phaze"]["leader_dispatches"] = False
            # The fabric's own lanes (the dispatcher's tests); test_fleet_live.py's
            # phaze test makes it a phaze fleet for its run (phaze_fleet there).
            data["phaze"].pop("api_url", None)
            data["registry"].update(
                tls
                or {
                    "ca_file": ETCD_CA_FILE,
                    "cert_file": ETCD_CERT_FILE,
                    "key_file": ETCD_KEY_FILE,
                    "joining_cert_file": JOINING_CERT_FILE,
                    "joining_key_file": JOINING_KEY_FILE,
                }
            )
            if plan_keys is not None:
                data["plan_keys"] = plan_keys
        else:
            host = data["host"]["name"]
            data["host"]["address"] = settings.host_address(host)
            # The bridge plays the tailnet: each container's link to it is
            # its eth0, where the tables' tailnet rules must see it arrive.
            data["host"]["tailnet_interface"] = "eth0"
        files[path.name] = toml_text(data)
    return files


def _e2e_fleet(data: dict[str, Any], settings: FleetSettings) -> dict[str, Any]:
    data["timing"] = {
        "heartbeat_s": settings.heartbeat_s,
        "node_timeout_s": settings.node_timeout_s,
        "relayed_heartbeat_s": settings.heartbeat_s,
        "missed_beats": 3,
        "drain_grace_s": settings.drain_grace_s,
        "liveness_s": settings.liveness_s,
        "liveness_ttl_s": settings.liveness_ttl_s,
    }
    data["flap"] = {"window_s": settings.flap_window_s, "toggles": settings.flap_toggles, "hold_off_s": settings.hold_off_s}
    data["registry"] = {"backend": "etcd", "endpoints": [settings.etcd_endpoint], "prefix": "/fabric"}
    data.setdefault("scheduler", {})["local_spill_after_s"] = settings.local_spill_after_s
    data.get("scaling", {}).pop("cloud_hooks", None)
    # No Ray cluster: five Ray nodes would not fit this 2-core machine beside
    # the fleet (tests/integration/test_ray_units.py runs the rendered units),
    # and a host without `ray` cannot pass the rendered worker's verification.
    data.pop("ray", None)
    for service in data.get("services", []):
        if service["id"] in settings.singletons:
            service["singleton"] = True
        argv = ["/usr/bin/python3", in_container(SERVICE_STUB), service["id"], str(service["port"])]
        runs = service.pop("command", None) or service.pop("image")
        service["command"] = {arch: list(argv) for arch in runs}
    return data


def e2e_host_file(text: str) -> str:
    """A host file as the hosts of this fleet get it: the bridge plays the
    tailnet, so its tailnet interface is eth0 (e2e_desired_state does the
    same to the example's host files); its address is the probed one."""
    data = tomllib.loads(text)
    data["host"]["tailnet_interface"] = "eth0"
    return toml_text(data)


def toml_text(data: dict[str, Any]) -> str:
    """TOML for the shapes the desired state uses: tables, arrays of tables,
    strings, numbers, booleans and arrays of those (tomllib only reads)."""
    out: list[str] = []
    _toml_table(out, [], data)
    return "\n".join(out).lstrip("\n") + "\n"


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {type(value).__name__}")


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _toml_table(out: list[str], path: list[str], table: dict[str, Any]) -> None:
    for key, value in table.items():
        if not isinstance(value, dict) and not _is_table_array(value):
            out.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in table.items():
        if isinstance(value, dict):
            out.append("")
            out.append("[" + ".".join(_toml_key(k) for k in [*path, key]) + "]")
            _toml_table(out, [*path, key], value)
    for key, value in table.items():
        if _is_table_array(value):
            for item in value:
                out.append("")
                out.append("[[" + ".".join(_toml_key(k) for k in [*path, key]) + "]]")
                _toml_table(out, [*path, key], item)


# --------------------------------------------------------------------------
# Small process helpers


def _run(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


def _free_subnet(preferred: str) -> str:
    """`preferred` or the next /24 below it that no address on this host lies
    in (another fleet's bridge); call it holding SUBNET_LOCK."""
    return free_subnet(preferred, _run("ip", "-4", "-o", "addr", "show").stdout)


def free_subnet(preferred: str, addresses: str) -> str:
    """`preferred` (three octets) or the next /24 below it in which no address
    of `addresses` (what `ip -4 -o addr show` prints) lies."""
    used = {word.split("/")[0].rsplit(".", 1)[0] for word in addresses.split() if "/" in word}
    first, second, third = preferred.split(".")
    for candidate in (f"{first}.{second}.{int(third) - n}" for n in range(SUBNETS_TRIED) if int(third) - n >= 0):
        if candidate not in used:
            return candidate
    raise RuntimeError(f"no free /24 from {preferred} down: {sorted(used)}")


def bridge_mac(tag: str) -> str:
    """A fixed, locally administered MAC for the fleet's bridge (one per
    fleet: its tag)."""
    digits = f"{int(tag) % 0x1000000:06x}"
    return f"02:fa:b0:{digits[0:2]}:{digits[2:4]}:{digits[4:6]}"


def add_bridge(name: str, mac: str) -> None:
    """A bridge with its own MAC address. Without one, Linux gives a bridge the
    lowest MAC of its ports and changes it when that port goes: powering off
    the host whose veth it was moved the bridge's MAC, and every other host's
    neighbour entry for the bridge's address (phaze's broker listens there)
    pointed at the old one until it went stale. The broker was a black hole
    for some 40 s, the leader's step hung on it, and a lost node went offline
    30 s after its lapse (a CI rehearsal of issue 14's e2e test)."""
    _run("ip", "link", "add", "name", name, "address", mac, "type", "bridge")


def _process_is(pid: int, needle: str) -> bool:
    """Whether PID still runs a program whose command line contains `needle`
    (a recorded PID is only signalled while it is still ours)."""
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def _stop_pid(pid: int, needle: str, timeout: float = 10.0, first: int = signal.SIGTERM) -> None:
    if not _process_is(pid, needle):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, first)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _process_is(pid, needle):
        time.sleep(0.05)
    if _process_is(pid, needle):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_for(probe: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll until `probe` returns something truthy; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
        except Exception as exc:  # a probe of a half-up fleet may raise; keep polling
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def first_answer(
    request: Callable[[], tuple[int, str]], accept: Callable[[int, str], bool], *, timeout: float, what: str, every: float = 0.1
) -> datetime:
    """When the first answer that `accept`s came back, from requests started
    every `every` s, each on its own, as clients' requests come: one stuck on
    an upstream that vanished (up to its --max-time) does not hold back the
    ones after it, which a request-after-request poll would (and so report a
    route up to a whole request timeout after it was). AssertionError naming
    `what` after `timeout`."""
    answered: list[datetime] = []
    lock = threading.Lock()
    stop = threading.Event()

    def one() -> None:
        if stop.is_set():
            return
        try:
            status, body = request()
        except Exception:  # noqa: BLE001 - a request that failed is no answer
            return
        if accept(status, body):
            with lock:
                answered.append(datetime.now(UTC))
            stop.set()

    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(max_workers=32) as pool:
        while not stop.is_set() and time.monotonic() < deadline:
            pool.submit(one)
            stop.wait(every)
        stop.set()  # the requests still queued go unsent; those running finish
    if not answered:
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
    return min(answered)


# --------------------------------------------------------------------------
# The fleet


@dataclass
class FleetHost:
    name: str
    address: str
    container: SystemdContainer | None = None
    stack: ExitStack | None = None
    # A worker group's member (`Fleet.start_member`): its last octet, its etcd
    # identity (the group's), the probe capture it replays and the extra
    # options of its pass (--member-of GROUP --address IP). Unset: a host of
    # the example, by its name.
    octet: int | None = None
    identity: str | None = None
    probe: str | None = None
    pass_args: tuple[str, ...] = ()
    # A machine `add_machine` boots: its probe capture inside the container
    # (else the fixture of its name), and whether it still has only the
    # joining identity (no host file yet: it reports pending).
    capture: str | None = None
    joining: bool = False

    @property
    def running(self) -> bool:
        return self.container is not None


@dataclass
class Fleet:
    work: Path
    settings: FleetSettings = FleetSettings()
    progress: Progress = lambda message: None
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    hosts: dict[str, FleetHost] = field(default_factory=dict)
    _stack: ExitStack = field(default_factory=ExitStack)
    _state: dict[str, Any] = field(default_factory=dict)
    _etcd: subprocess.Popen[bytes] | None = None
    # phaze's broker (the lane queue) on this host's bridge address, its DSN.
    _postgres: PostgresServer | None = None
    queue_url: str = ""
    # The fleet's CA and every identity's certificate (made by up()).
    pki: TestPki | None = None
    # The candidates' throwaway plan keys: host -> [[plan_keys]] table.
    plan_keys: dict[str, dict[str, str]] = field(default_factory=dict)

    # --- names -------------------------------------------------------------

    @property
    def bridge(self) -> str:
        return f"fab{self.tag}"[:15]

    def namespace_name(self, label: str) -> str:
        return f"fabric-fleet-{self.tag}-{label}"

    @property
    def client_namespace(self) -> str:
        return self.namespace_name("client")

    @property
    def etcd_namespace(self) -> str:
        return self.namespace_name("etcd")

    @property
    def desired_dir(self) -> Path:
        """The e2e desired state as every host has it ([registry]'s TLS files
        at the fleet-wide paths inside the containers)."""
        return self.work / "desired"

    @property
    def client_desired_dir(self) -> Path:
        """The same desired state for this host's test client: [registry]'s
        TLS files are the fabric-admin identity's files here."""
        return self.work / "client-desired"

    @property
    def queue_url_file(self) -> Path:
        """The broker's DSN for this host's test client (0600)."""
        return self.work / "queue_url"

    @property
    def keys_dir(self) -> Path:
        return self.work / "plan-keys"

    def identity(self, name: str) -> tuple[Path, Path]:
        """The (certificate, key) files of the etcd identity CN=name on this host."""
        assert self.pki is not None, "the fleet's PKI is made by up()"
        return self.pki.client(name)

    @property
    def edge(self) -> str:
        return "racknerd"

    # --- state file --------------------------------------------------------

    def _save_state(self, **changes: Any) -> None:
        self._state.update(changes)
        self._state["containers"] = {name: {"pid": h.container.pid} for name, h in self.hosts.items() if h.container is not None}
        self._state["etcd_pid"] = self._etcd.pid if self._etcd is not None and self._etcd.poll() is None else None
        self._state["postgres"] = {"pid": self._postgres.pid, "directory": str(self._postgres.directory)} if self._postgres else None
        tmp = self.work / "state.json.tmp"
        tmp.write_text(json.dumps(self._state, indent=2))
        tmp.replace(self.work / "state.json")

    # --- bring-up ----------------------------------------------------------

    def up(self) -> None:
        """Build everything; on any failure tear down what exists and re-raise."""
        started = time.monotonic()
        self.work.mkdir(parents=True, exist_ok=True)
        self._save_state(supervisor=os.getpid(), bridge=self.bridge, namespaces=[], work=str(self.work), subnet=self.settings.subnet, ready=False)
        # A fresh registry every time (a previous fleet's etcd data would
        # bring back its nodes, plans and epochs).
        shutil.rmtree(self.work / "etcd", ignore_errors=True)
        try:
            self._make_bridge()
            self._save_state(subnet=self.settings.subnet)
            self._make_identities()
            self._start_broker()
            self._write_desired()
            self._make_namespace("etcd", ETCD_OCTET)
            self._make_namespace("client", CLIENT_OCTET)
            compile_bytecode()
            self.start_etcd()
            self._init_auth()
            for name in HOST_OCTETS:
                self.hosts[name] = FleetHost(name, self.settings.host_address(name))
            for name in HOST_OCTETS:
                self.start_host(name, start_timer=False)
            for name in HOST_OCTETS:
                self._start_fabric(name)
            self._save_state(ready=True)
            self.progress(f"fleet up in {time.monotonic() - started:.1f} s: {', '.join(HOST_OCTETS)}; etcd at {self.settings.etcd_endpoint}")
        except BaseException:
            self.down()
            raise

    def _make_identities(self) -> None:
        """A throwaway CA, etcd's server certificate (for its bridge address),
        a client certificate per host (CN = host name), root and fabric-admin;
        a throwaway plan signing key per leader candidate (`fabric leader keygen`)."""
        for directory in ("pki", "plan-keys"):
            shutil.rmtree(self.work / directory, ignore_errors=True)
        self.pki = TestPki(self.work / "pki", server_ips=(self.settings.address(ETCD_OCTET),))
        for name in (*HOST_OCTETS, ROOT, ADMIN, JOINING):
            self.pki.client(name)
        candidates = tomllib.loads((EXAMPLE_FLEET / "fabric.toml").read_text())["fleet"]["leader_candidates"]
        self.keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for host in candidates:
            out = self.keys_dir / f"{host}.key"
            done = subprocess.run(
                [sys.executable, "-m", "reconciler", "leader", "keygen", "--out", str(out), "--host", host, "--id", f"{host}-e2e"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
                cwd=REPO,
            )
            if done.returncode != 0:
                raise RuntimeError(f"fabric leader keygen for {host} failed: {done.stderr.strip()}")
            (table,) = tomllib.loads(done.stdout)["plan_keys"]
            self.plan_keys[host] = table
        self.progress(f"identities: CA and certificates in {self.pki.directory}; plan keys of {', '.join(candidates)} in {self.keys_dir}")

    def _start_broker(self) -> None:
        """phaze's broker: PostgreSQL on this host's bridge address, database
        `phaze`; stopped by PID with the rest (the ExitStack)."""
        address = self.settings.address(THIS_HOST_OCTET)
        self._postgres = self._stack.enter_context(postgres_server(listen_on=address, trusted_net=f"{self.settings.subnet}.0/24"))
        self._postgres.database("phaze")
        self.queue_url = self._postgres.tcp_dsn_of("phaze")
        _write_private(self.queue_url_file, f"{self.queue_url}\n".encode())
        self._save_state()
        self.progress(f"phaze's broker: PostgreSQL at {address}:5432 (pid {self._postgres.pid})")

    def _write_desired(self) -> None:
        cert, key = self.identity(ADMIN)
        assert self.pki is not None
        client_tls = {"ca_file": str(self.pki.ca_file), "cert_file": str(cert), "key_file": str(key)}
        keys = list(self.plan_keys.values())
        for directory, tls, queue_url_file in (
            (self.desired_dir, None, QUEUE_URL_FILE),
            (self.client_desired_dir, client_tls, str(self.queue_url_file)),
        ):
            directory.mkdir(parents=True, exist_ok=True)
            for name, text in e2e_desired_state(self.settings, plan_keys=keys, tls=tls, queue_url_file=queue_url_file).items():
                (directory / name).write_text(text)
        self.progress(f"desired state: {self.desired_dir} (hosts), {self.client_desired_dir} (this host's client, as {ADMIN})")

    def _init_auth(self) -> None:
        """etcd's users and roles from the desired state, then auth on (as root)."""
        done = self.fabric("registry", "init-auth", identity=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"fabric registry init-auth failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
        self.progress(f"etcd auth: {done.stdout.strip().splitlines()[-1]}")

    def _make_bridge(self) -> None:
        """The bridge, on the settings' /24 or, when another fleet on this
        machine routes that one already, the next free /24 below it (the
        settings change to it: addresses, certificates and desired state follow)."""
        add_bridge(self.bridge, bridge_mac(self.tag))
        self._stack.callback(_run, "ip", "link", "del", self.bridge, check=False)
        with open(SUBNET_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.settings = dataclasses.replace(self.settings, subnet=_free_subnet(self.settings.subnet))
            _run("ip", "addr", "add", f"{self.settings.address(THIS_HOST_OCTET)}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        self.progress(f"bridge {self.bridge}: {self.settings.subnet}.0/24")

    def _veth_to_bridge(self, label: str, peer_netns: str) -> str:
        """A veth pair: one end on the bridge, the other in `peer_netns` (a name
        or a PID) named eth0. Returns the bridge end's name."""
        bridge_end = f"fv{self.tag}{label}"[:15]
        _run("ip", "link", "del", bridge_end, check=False)  # a leftover of a killed container
        _run("ip", "link", "add", bridge_end, "type", "veth", "peer", "name", "eth0", "netns", peer_netns)
        _run("ip", "link", "set", bridge_end, "master", self.bridge, "up")
        return bridge_end

    def _make_namespace(self, label: str, octet: int) -> None:
        name = self.namespace_name(label)
        _run("ip", "netns", "add", name)
        self._stack.callback(_run, "ip", "netns", "del", name, check=False)
        self._save_state(namespaces=[*self._state.get("namespaces", []), name])
        self._veth_to_bridge(label[:3], name)
        for argv in (
            ("ip", "link", "set", "lo", "up"),
            ("ip", "addr", "add", f"{self.settings.address(octet)}/24", "dev", "eth0"),
            ("ip", "link", "set", "eth0", "up"),
        ):
            _run("ip", "netns", "exec", name, *argv)
        self.progress(f"namespace {name}: {self.settings.address(octet)}")

    # --- etcd ----------------------------------------------------------------

    def start_etcd(self) -> None:
        if self._etcd is not None and self._etcd.poll() is None:
            return
        address = self.settings.address(ETCD_OCTET)
        assert self.pki is not None, "the fleet's PKI is made by up()"
        data_dir = self.work / "etcd"
        log = open(self.work / "etcd.log", "ab")
        self._etcd = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.etcd_namespace,
                "etcd",
                "--name",
                "fleet",
                "--data-dir",
                str(data_dir),
                "--listen-client-urls",
                self.settings.etcd_endpoint,
                "--advertise-client-urls",
                self.settings.etcd_endpoint,
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-cluster",
                "fleet=http://127.0.0.1:2380",
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
                # Clients over TLS with a certificate of the fleet's CA; once
                # init-auth enabled auth, its CN is the user a client acts as.
                *self.pki.server_argv(),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self._stack.callback(self.stop_etcd)
        self._save_state()

        def healthy() -> bool:
            if self._etcd is None or self._etcd.poll() is not None:
                raise RuntimeError(f"etcd exited: {(self.work / 'etcd.log').read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.settings.etcd_endpoint}/health", timeout=1, context=context) as response:
                    return b'"health":"true"' in response.read()
            except OSError:
                return False

        context = self.pki.ssl_context(ROOT)
        wait_for(healthy, timeout=60, what="etcd /health")  # a bound only: etcd starts slowly on a loaded machine
        self.progress(f"etcd healthy at {address}:{ETCD_CLIENT_PORT} (pid {self._etcd.pid})")

    def stop_etcd(self) -> None:
        """Stop etcd by PID (the registry outage); its data directory stays."""
        if self._etcd is None:
            return
        if self._etcd.poll() is None:
            self._etcd.send_signal(signal.SIGTERM)
            try:
                self._etcd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._etcd.kill()
                self._etcd.wait()
        self._etcd = None
        self._save_state()

    # --- hosts ---------------------------------------------------------------

    def start_host(self, name: str, *, start_timer: bool = True) -> SystemdContainer:
        """Boot host `name`'s container, wire it to the bridge and install the
        fabric (a fresh machine every time: its overlay starts empty)."""
        host = self.hosts[name]
        if host.container is not None:
            return host.container
        began = time.monotonic()
        stack = ExitStack()
        try:
            container = stack.enter_context(systemd_container(hostname=name, private_network=True, boot_timeout=60))
            host.container, host.stack = container, stack
            self._save_state()
            self._veth_to_bridge(name[:3] + host.address.rsplit(".", 1)[1], str(container.pid))
            for argv in (
                ("ip", "link", "set", "lo", "up"),
                ("ip", "addr", "add", f"{host.address}/24", "dev", "eth0"),
                ("ip", "link", "set", "eth0", "up"),
            ):
                self._check(container, *argv)
            self._install(name, container)
        except BaseException:
            host.container, host.stack = None, None
            stack.close()
            self._save_state()
            raise
        self.progress(f"{name}: container up (pid {container.pid}) at {host.address} in {time.monotonic() - began:.1f} s")
        if start_timer:
            self._start_fabric(name)
        return container

    def start_member(self, name: str, group: str, octet: int, *, probe: str = "x86-spill") -> SystemdContainer:
        """Boot a machine with no host file that joins worker group `group` as
        an ephemeral member (a worker a cloud hook started): the fabric
        installed as on every host, the group's etcd identity
        (fabric-group-<group>, which `fabric registry init-auth` made) at the
        fleet-wide paths, its pass with --member-of GROUP --address its
        bridge address, replaying the probe capture `probe`."""
        from reconciler.core.desired.registry_access import group_role

        address = self.settings.address(octet)
        self.hosts[name] = FleetHost(
            name, address, octet=octet, identity=group_role(group), probe=probe, pass_args=("--member-of", group, "--address", address)
        )
        return self.start_host(name)

    def stop_host(self, name: str) -> None:
        """Power the host's container off (its link goes with it)."""
        host = self.hosts[name]
        if host.stack is not None:
            host.stack.close()
        host.container, host.stack = None, None
        self._save_state()
        self.progress(f"{name}: stopped")

    def kill_host(self, name: str) -> None:
        """SIGKILL the host's PID 1: the whole machine dies at once, no resignation."""
        host = self.hosts[name]
        if host.container is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(host.container.pid, signal.SIGKILL)
        self.stop_host(name)

    def pause_host(self, name: str) -> None:
        """Freeze every process of the host's container (its cgroup's
        cgroup.freeze): a machine that stops answering without losing any
        state, as a stalled VM or a suspended laptop does."""
        self._freeze(name, True)
        self.progress(f"{name}: paused")

    def resume_host(self, name: str) -> None:
        """Thaw a host `pause_host` froze: its processes go on where they stopped."""
        self._freeze(name, False)
        self.progress(f"{name}: resumed")

    def paused(self, name: str) -> bool:
        return "frozen 1" in (self._container_cgroup(name) / "cgroup.events").read_text()

    def _container_cgroup(self, name: str) -> Path:
        # The container's systemd (PID 1 inside) sits in <container cgroup>/init.scope.
        membership = Path(f"/proc/{self.container(name).pid}/cgroup").read_text().splitlines()
        (own,) = [line.split("::", 1)[1].strip() for line in membership if line.startswith("0::")]
        (mount,) = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines() if line.split()[2] == "cgroup2"]
        cgroup = Path(mount + own)
        return cgroup.parent if cgroup.name == "init.scope" else cgroup

    def _freeze(self, name: str, frozen: bool) -> None:
        (self._container_cgroup(name) / "cgroup.freeze").write_text("1" if frozen else "0")
        wait_for(lambda: self.paused(name) == frozen, timeout=10.0, what=f"{name}'s cgroup {'frozen' if frozen else 'thawed'}", interval=0.05)

    def container(self, name: str) -> SystemdContainer:
        container = self.hosts[name].container
        if container is None:
            raise AssertionError(f"host {name} is not running")
        return container

    @staticmethod
    def _check(container: SystemdContainer, *argv: str) -> str:
        done = container.run(*argv)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in the container failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def _install(self, name: str, container: SystemdContainer) -> None:
        from reconciler.core.install.nodeconfig import parse_node_config
        from reconciler.core.install.units import Install, reconcile_argv

        site_packages = sysconfig.get_paths()["purelib"]
        self._check(container, "mkdir", "-p", f"{PREFIX}/site-packages", f"{PREFIX}/bin", SOURCE)
        # The container's boot empties its /tmp (systemd-tmpfiles, in its
        # overlay only), so the bind is made from the host's side: in the
        # container's mount namespace but with this process's root, where the
        # venv is still visible; the target is reached through /proc/PID/root.
        for source, inside in ((site_packages, f"{PREFIX}/site-packages"), (str(REPO), SOURCE)):
            target = str(container.host_path(inside))
            for argv in (("mount", "--bind", source, target), ("mount", "-o", "remount,bind,ro", target)):
                _run("nsenter", "-t", str(container.pid), "-m", "--", *argv)
        for pair in filter(None, os.environ.get("FABRIC_E2E_BIND", "").split(",")):
            source, target_path = pair.split(":", 1)
            _run("nsenter", "-t", str(container.pid), "-m", "--", "mount", "--bind", source, str(container.host_path(target_path)))
        container.write_file(
            FABRIC_BIN,
            "#!/usr/bin/python3\n"
            "# e2e fleet: this checkout and the test venv's packages (both bind-mounted)\n"
            "# under the system python3; the checkout first, so `reconciler` is its copy.\n"
            "import site, sys\n"
            "before = list(sys.path)\n"
            f"site.addsitedir({PREFIX + '/site-packages'!r})\n"
            f"sys.path[:] = [{SOURCE!r}] + [p for p in sys.path if p not in before] + before\n"
            "from reconciler.cli import main\n"
            "sys.exit(main())\n",
            mode=0o755,
        )
        for file_name, text in sorted((p.name, p.read_text()) for p in self.desired_dir.glob("*.toml")):
            container.write_file(f"{DESIRED_DIR}/{file_name}", text)
        # Inside the container only (its overlay), never on the host.
        container.write_file("/usr/bin/podman", PODMAN_STANDIN.read_text(), mode=0o755)
        # The directories the pass writes into must exist before it runs: its
        # unit's ProtectSystem=strict leaves the rest of /etc read-only and a
        # missing ReadWritePaths= entry is skipped. scripts/join.sh and the
        # NixOS module create them (reconciler.core.install.units.PASS_DIRECTORIES); so does
        # this, as the installer of these hosts.
        for directory in PASS_DIRECTORIES:
            self._check(container, "mkdir", "-p", directory)
        for path, text in SECRET_FILES.items():
            container.write_file(path, text, mode=0o600)
        _write_private(container.host_path(QUEUE_URL_FILE), f"{self.queue_url}\n".encode())
        # The lanes' ssh_user, as on a host phaze pushes to: a lane agent's
        # unit gives its scratch dir to that user and joins its group.
        self._check(container, "useradd", "--system", "--user-group", "--no-create-home", "phaze")
        # The groups owning the captured machine's /dev/dri nodes, which its
        # GPU services join (SupplementaryGroups=render): a machine with a GPU
        # has them (udev's), this host's image may not, and systemd then
        # refuses to start those services (status 216/GROUP).
        for group in GPU_GROUPS:
            if container.run("getent", "group", group).returncode != 0:
                self._check(container, "groupadd", "--system", group)
        # This host's own etcd identity at the fleet-wide paths (a machine
        # without a host file: the joining identity only); a leader
        # candidate's own plan signing key. No host gets another's.
        assert self.pki is not None
        container.write_file(ETCD_CA_FILE, self.pki.ca_file.read_text())
        if self.hosts[name].joining:
            cert, key = self.identity(JOINING)
            container.write_file(JOINING_CERT_FILE, cert.read_text())
            _write_private(container.host_path(JOINING_KEY_FILE), key.read_bytes())
        else:
            self.give_identity(name)
        if name in self.plan_keys:
            _write_private(container.host_path(PLAN_KEY_FILE), (self.keys_dir / f"{name}.key").read_bytes())
        node_toml = (
            f'[node]\nhost = "{name}"\ndesired = "{DESIRED_DIR}"\n\n[timer]\ninterval = "{self.settings.pass_interval}"\nrandomized_delay = "0"\n'
        )
        container.write_file(NODE_CONFIG, node_toml)
        candidates = tomllib.loads((self.desired_dir / "fabric.toml").read_text())["fleet"]["leader_candidates"]
        argv = [
            FABRIC_BIN,
            "units",
            "--config",
            NODE_CONFIG,
            "--fabric-bin",
            FABRIC_BIN,
            "--search-path",
            SEARCH_PATH,
            "--write",
            "/etc/systemd/system",
        ]
        if name in candidates:
            argv.append("--leader-candidate")
        self._check(container, *argv)
        # The pass as `fabric units` defines it, plus the replayed probe capture.
        install = Install(fabric_bin=FABRIC_BIN, node=parse_node_config(node_toml), config_path=NODE_CONFIG, search_path=SEARCH_PATH)
        host = self.hosts[name]
        replay = [*reconcile_argv(install), "--replay", host.capture or in_container(PROBE_FIXTURES / (host.probe or name)), *host.pass_args]
        container.write_file(REPLAY_DROPIN, "[Service]\nExecStart=\nExecStart=" + " ".join(replay) + "\n")
        if name == self.edge:
            container.write_file("/etc/caddy/Caddyfile", EDGE_CADDYFILE)
            # Caddy starts before the first pass has written the snippet it imports.
            container.write_file("/etc/caddy/fabric.caddy", "# fabric-reconcile writes this file\n")
            self._check(container, "systemctl", "start", "caddy.service")
        self._check(container, "systemctl", "daemon-reload")

    def give_identity(self, name: str) -> None:
        """Host `name`'s own etcd client certificate (CN = name, a group
        member's: its group's) and key at
        [registry]'s fleet-wide paths in its container, as an operator puts
        them on an admitted machine."""
        container = self.container(name)
        cert, key = self.identity(self.hosts[name].identity or name)
        container.write_file(ETCD_CERT_FILE, cert.read_text())
        _write_private(container.host_path(ETCD_KEY_FILE), key.read_bytes())
        self.hosts[name].joining = False

    def add_machine(self, name: str, octet: int, capture: dict[str, str]) -> SystemdContainer:
        """Boot a machine with the fabric installed (node.toml, the units,
        its timer) whose name has no host file: a container on the bridge at
        .`octet`, with the joining identity only, whose pass replays
        `capture` (file name -> text, a probe capture). Stopped with the
        fleet, like the hosts."""
        self.hosts[name] = FleetHost(name, self.settings.address(octet), capture=MACHINE_CAPTURE_DIR, joining=True)
        container = self.start_host(name, start_timer=False)
        for file_name, text in capture.items():
            container.write_file(f"{MACHINE_CAPTURE_DIR}/{file_name}", text)
        self._start_fabric(name)
        return container

    def pull(self, file_name: str, text: str) -> None:
        """A desired-state file changed in the repository reaches every
        running host's checkout (as their `fabric pull` would fetch it) and
        the hosts' copy here (desired_dir; the client's checkout is the
        repository the change was committed to)."""
        for host in self.hosts.values():
            if host.container is not None:
                host.container.write_file(f"{DESIRED_DIR}/{file_name}", text)
        (self.desired_dir / file_name).write_text(text)

    def _start_fabric(self, name: str) -> None:
        container = self.container(name)
        self._check(container, "systemctl", "enable", "--now", "fabric-reconcile.timer")
        self._check(container, "systemctl", "start", "--no-block", "fabric-reconcile.service")
        if container.host_path("/etc/systemd/system/fabric-leader.service").exists():
            self._check(container, "systemctl", "enable", "--now", "fabric-leader.service")
        if self.settings.watcher:
            self._check(container, "systemctl", "enable", "--now", "fabric-watch.service")
        self.progress(
            f"{name}: fabric-reconcile.timer every {self.settings.pass_interval}"
            + (" + fabric-leader.service" if name in ("lux", "qfox-1") else "")
            + (" (no host file: pending)" if self.hosts[name].joining else "")
            + (" + fabric-watch.service" if self.settings.watcher else "")
        )

    # --- looking at the fleet ------------------------------------------------

    @contextmanager
    def registry(self, identity: str = ADMIN) -> Iterator[Any]:
        """The fleet's registry, opened from this host (it is on the bridge) as
        the etcd identity CN=`identity` (default the operator's, fabric-admin)."""
        from reconciler.core.desired.load import load_desired
        from reconciler.wiring import open_registry

        fleet = load_desired(self.client_desired_dir).fleet
        cert, key = self.identity(identity)
        settings = fleet.registry.model_copy(update={"cert_file": str(cert), "key_file": str(key)})
        registry = open_registry(fleet.model_copy(update={"registry": settings}))
        try:
            yield registry
        finally:
            registry.close()

    def fabric(self, *args: str, identity: str | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run `fabric ARGS --desired <the e2e desired state>` on this host, as
        fabric-admin or, given `identity`, with that etcd identity's
        --cert-file/--key-file (a candidate's for lane jobs, root's for init-auth)."""
        extra = ["--desired", str(self.client_desired_dir)]
        if identity is not None:
            cert, key = self.identity(identity)
            extra += ["--cert-file", str(cert), "--key-file", str(key)]
        return subprocess.run(
            [sys.executable, "-m", "reconciler", *args, *extra],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=REPO,
        )

    def request(self, host_name: str, path: str = "/", timeout: float = 3.0, *, outside: bool = False) -> tuple[int, str]:
        """GET https://HOST_NAME/PATH from the client namespace through the edge
        (status, body); status 0 when no HTTP answer came back. `outside`: from
        OUTSIDE_ADDRESS, a source outside the tailnet."""
        edge = self.settings.host_address(self.edge)
        source = ["--interface", self._outside_source()] if outside else []
        done = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.client_namespace,
                "curl",
                "-sk",
                *source,
                "--max-time",
                str(timeout),
                "--resolve",
                f"{host_name}:443:{edge}",
                "-w",
                "\n%{http_code}",
                f"https://{host_name}{path}",
            ],
            capture_output=True,
            text=True,
            timeout=timeout + 10,
            check=False,
        )
        body, _, code = done.stdout.rpartition("\n")
        return (int(code) if code.isdigit() else 0), body

    def _outside_source(self) -> str:
        """OUTSIDE_ADDRESS on the client namespace's link, and an on-link
        route to it in the edge (both idempotent: `replace`). They leave with
        the namespace and the container."""
        _run("ip", "netns", "exec", self.client_namespace, "ip", "addr", "replace", f"{OUTSIDE_ADDRESS}/32", "dev", "eth0")
        done = self.container(self.edge).run("ip", "route", "replace", f"{OUTSIDE_ADDRESS}/32", "dev", "eth0")
        assert done.returncode == 0, f"a route to {OUTSIDE_ADDRESS} in {self.edge}: {done.stderr}"
        return OUTSIDE_ADDRESS

    def journal(self, name: str, *args: str) -> str:
        return self.container(name).journal(*args)

    # --- teardown -------------------------------------------------------------

    def down(self) -> None:
        """Everything, in reverse order; never raises for one part that fails."""
        for name in reversed(list(self.hosts)):
            try:
                self.stop_host(name)
            except Exception as exc:  # keep going: the rest must still go
                self.progress(f"{name}: stop failed: {exc}")
        self._stack.close()
        _remove_fleet_files(self.work)
        state_file = self.work / "state.json"
        state_file.unlink(missing_ok=True)
        self.progress("fleet down")


def compile_bytecode() -> None:
    """Compile this checkout's package to bytecode with the containers'
    interpreter (the system python3), as pip and Nix do when they install it
    (pip compiled the venv's packages when it installed them). The containers
    see the checkout read-only, so without this every pass and leader step
    there compiles each module of the reconciler from source: about 1.5 s of
    CPU per pass, more than the rest of a full pass, and a fresh clone, as
    CI's, has no bytecode at all. Writes only __pycache__ directories
    (ignored by git), each file atomically."""
    _run("/usr/bin/python3", "-m", "compileall", "-q", str(REPO / "reconciler"), timeout=300.0)


def _write_private(path: Path, data: bytes) -> None:
    """A private key: created 0600 (never readable by others, not even for a moment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _remove_fleet_files(work: Path) -> None:
    """The registry's data and the throwaway CA, certificates and plan keys."""
    for directory in ("etcd", "pki", "plan-keys"):
        shutil.rmtree(work / directory, ignore_errors=True)


@contextmanager
def running_fleet(work: Path, settings: FleetSettings = FleetSettings(), progress: Progress = lambda m: None) -> Iterator[Fleet]:
    fleet = Fleet(work=work, settings=settings, progress=progress)
    fleet.up()
    try:
        yield fleet
    finally:
        fleet.down()


def force_down(state_dir: Path, progress: Progress = print) -> None:
    """Remove what a dead supervisor left (state.json): containers, etcd, namespaces, bridge."""
    state_file = state_dir / "state.json"
    if not state_file.exists():
        return
    state = json.loads(state_file.read_text())
    for name, entry in state.get("containers", {}).items():
        # SIGKILL of PID 1 takes its whole PID namespace (and netns) with it.
        _stop_pid(int(entry["pid"]), "systemd", timeout=5, first=signal.SIGKILL)
        progress(f"{name}: killed")
    if state.get("etcd_pid"):
        _stop_pid(int(state["etcd_pid"]), "etcd")
        progress("etcd: stopped")
    if state.get("postgres"):
        stop_postgres(int(state["postgres"]["pid"]))
        shutil.rmtree(state["postgres"]["directory"], ignore_errors=True)
        progress("PostgreSQL: stopped")
    for namespace in reversed(state.get("namespaces", [])):
        _run("ip", "netns", "del", namespace, check=False)
    if state.get("bridge"):
        _run("ip", "link", "del", state["bridge"], check=False)
    _remove_fleet_files(state_dir)
    state_file.unlink(missing_ok=True)
    progress("leftovers removed")


# --------------------------------------------------------------------------
# Reading the fleet (shared by the scenario tests and bench/convergence)


def node_status(fleet: Fleet) -> dict[str, str]:
    with fleet.registry() as registry:
        return {state.node_id: state.status for state in registry.node_states()}


def newest_plan(fleet: Fleet) -> FleetPlan | None:
    with fleet.registry() as registry:
        return registry.newest_plan()


def placed(plan: FleetPlan) -> dict[str, list[str]]:
    """service -> the nodes it is placed on (sorted)."""
    out: dict[str, list[str]] = {}
    for p in plan.placements:
        out.setdefault(p.service, []).append(p.node)
    return {k: sorted(v) for k, v in out.items()}


# --- when things happened on a host (its journal and timers, one clock) ---

# systemd's "unit starting" entry (SD_MESSAGE_UNIT_STARTING): logged when a
# start job runs, not when a start is merged into a running one.
UNIT_STARTING = "7d4958e842da4a758f6c1cdc7b36dcc5"
# systemd's "unit stopped" entry (SD_MESSAGE_UNIT_STOPPED).
UNIT_STOPPED = "9d1aaa27d60140bd96365438aad20286"


def span_seconds(span: str) -> float:
    """A systemd time span as node.toml's [timer] takes it ("30s", "1min",
    "500ms", "2") in seconds, read as the pass reads it; ValueError (pydantic's)
    when [timer] would refuse it."""
    return timespan_seconds(TimerSection(interval=span).interval)


def _journal_json(fleet: Fleet, host: str, *args: str) -> list[dict[str, Any]]:
    lines = fleet.journal(host, "-o", "json", *args).splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def _realtime(entry: dict[str, Any]) -> datetime:
    return datetime.fromtimestamp(int(entry["__REALTIME_TIMESTAMP"]) / 1e6, UTC)


def pass_starts(fleet: Fleet, host: str) -> list[datetime]:
    """When systemd started a pass on `host` (its timer's, the watcher's or anyone's)."""
    entries = _journal_json(fleet, host, "-u", RECONCILE_SERVICE, "--output-fields=MESSAGE_ID,UNIT")
    return [_realtime(e) for e in entries if e.get("MESSAGE_ID") == UNIT_STARTING and e.get("UNIT") == RECONCILE_SERVICE]


def watcher_starts(fleet: Fleet, host: str) -> list[datetime]:
    """When `host`'s fabric-watch.service started a pass (its own log line)."""
    return [moment for moment, message in journal_lines(fleet, host, "fabric-watch") if "started a pass of " in message]


# What a pass says when it reads a fleet plan (core.live.fencing's verdicts)
# and when a plan published meanwhile takes it into another round
# (engine.reconcile.another_round_note).
_PLAN_READ = re.compile(r"plan epoch (\d+) is (?:newer than|the one applied)")
_ANOTHER_ROUND = re.compile(r"registry epoch (\d+) since this pass read plan epoch \d+: another round")


def plan_taken(fleet: Fleet, host: str, epoch: int, since: datetime) -> datetime | None:
    """When `host` began acting on the plan of `epoch` published at `since`
    (None: not yet): `first_taking` of its passes' starts and lines."""
    return first_taking(pass_starts(fleet, host), journal_lines(fleet, host, "fabric-reconcile"), epoch, since)


def first_taking(starts: list[datetime], lines: list[tuple[datetime, str]], epoch: int, since: datetime) -> datetime | None:
    """From when a pass of the host was on its way to the plan of `epoch`
    published at `since` (or a later plan): a pass that started at or after
    `since`, which reads the newest plan; a round that a running pass began
    for it (its note); or, when a pass, or a round of one, that was already
    under way at `since` read it, `since` itself: that pass was on its way
    then, as one the watcher started a moment later would be."""
    moments = [m for m in starts if m >= since]
    rounds = [(m, int(said.group(1))) for m, message in lines if (said := _ANOTHER_ROUND.search(message))]
    moments += [m for m, round_epoch in rounds if m >= since and round_epoch >= epoch]
    for moment, message in lines:
        read = _PLAN_READ.search(message)
        if read is None or moment < since or int(read.group(1)) < epoch:
            continue
        # The pass start or round this read belongs to: the last one before it.
        under_way = max([m for m in starts if m <= moment] + [m for m, _ in rounds if m <= moment], default=since)
        moments.append(max(under_way, since))
    return min(moments, default=None)


def journal_lines(fleet: Fleet, host: str, identifier: str, *match: str) -> list[tuple[datetime, str]]:
    """`host`'s journal lines of `identifier` (and `match`es such as FIELD=VALUE): when, and the message."""
    entries = _journal_json(fleet, host, "-t", identifier, *match, "--output-fields=MESSAGE")
    return [(_realtime(e), str(e.get("MESSAGE", ""))) for e in entries]


def caddy_loads(fleet: Fleet, edge: str) -> list[datetime]:
    """When the edge's passes loaded Caddy (their caddy-load audit entries)."""
    return [moment for moment, message in journal_lines(fleet, edge, "fabric-reconcile") if message.startswith("caddy-load")]


def static_passes(fleet: Fleet, host: str) -> list[tuple[datetime, str]]:
    """When `host`'s passes kept their generation (fail static), and why
    (their "static" audit entries: "static: ok (generation G): REASON")."""
    return journal_lines(fleet, host, "fabric-reconcile", "FABRIC_ACTION=static")


def watcher_says(fleet: Fleet, host: str, text: str) -> list[tuple[datetime, str]]:
    """`host`'s fabric-watch.service log lines that contain `text`."""
    return [(moment, message) for moment, message in journal_lines(fleet, host, "fabric-watch") if text in message]


def first_after(moments: list[datetime], since: datetime) -> datetime | None:
    return min((m for m in moments if m >= since), default=None)


def unit_active_since(fleet: Fleet, host: str, unit: str) -> datetime | None:
    """When `unit` last became active on `host` (systemd's ActiveEnterTimestamp),
    to the microsecond: --timestamp=unix gives whole seconds, up to one early,
    which put a unit's start before the plan that started it."""
    out = fleet.container(host).systemctl("show", "-p", "ActiveEnterTimestamp", "--timestamp=us+utc", "--value", unit).stdout.strip()
    return parse_us_utc(out)


def parse_us_utc(text: str) -> datetime | None:
    """A timestamp as systemctl --timestamp=us+utc prints it ("Tue 2026-12-01
    08:53:51.479920 UTC"); None for an empty one (the unit never was active)."""
    if not text:
        return None
    return datetime.strptime(text, "%a %Y-%m-%d %H:%M:%S.%f UTC").replace(tzinfo=UTC)


def unit_invocation(fleet: Fleet, host: str, unit: str) -> str:
    """`unit`'s InvocationID on `host` (a new one on every start; "" when not running)."""
    return fleet.container(host).systemctl("show", "-p", "InvocationID", "--value", unit).stdout.strip()


def unit_stops(fleet: Fleet, host: str, unit: str) -> list[datetime]:
    """When systemd stopped `unit` on `host` (its "Stopped" entries: they
    outlive the unit, whose timestamps go when a pass removes its file)."""
    entries = _journal_json(fleet, host, "-u", unit, "--output-fields=MESSAGE_ID,UNIT")
    return [_realtime(e) for e in entries if e.get("MESSAGE_ID") == UNIT_STOPPED and e.get("UNIT") == unit]


def next_tick(fleet: Fleet, host: str) -> datetime | None:
    """When `host`'s fabric-reconcile.timer elapses next (None: not armed).

    Its triggers are monotonic (OnBootSec, OnUnitActiveSec), so systemd
    knows the next tick only on CLOCK_MONOTONIC, which a container shares
    with this machine: it is turned into wall-clock time here."""
    usec = _timer_usec(fleet, host, "NextElapseUSecMonotonic")
    return None if usec is None else datetime.fromtimestamp(time.time() - time.monotonic() + usec / 1e6, UTC)


def last_timer_trigger(fleet: Fleet, host: str) -> datetime | None:
    """When `host`'s fabric-reconcile.timer last elapsed (None: not since boot).

    Read over D-Bus: systemd 252's `systemctl show --timestamp=unix` leaves
    LastTriggerUSec in local time."""
    usec = _timer_usec(fleet, host, "LastTriggerUSec")
    return None if usec is None else datetime.fromtimestamp(usec / 1e6, UTC)


def _timer_usec(fleet: Fleet, host: str, prop: str) -> int | None:
    """A microseconds property of `host`'s fabric-reconcile.timer (None: unset)."""
    out = (
        fleet.container(host)
        .run(
            "busctl",
            "get-property",
            "org.freedesktop.systemd1",
            "/org/freedesktop/systemd1/unit/" + "".join(c if c.isalnum() else f"_{ord(c):02x}" for c in RECONCILE_TIMER),
            "org.freedesktop.systemd1.Timer",
            prop,
        )
        .stdout.split()
    )
    if len(out) != 2 or not out[1].isdigit() or int(out[1]) in (0, 2**64 - 1):
        return None
    return int(out[1])


def pass_running(fleet: Fleet, host: str) -> bool:
    return fleet.container(host).systemctl("is-active", RECONCILE_SERVICE).stdout.strip() in ("activating", "active", "deactivating")


# --- a move between ticks (tests/e2e/test_fleet_react.py, bench/convergence) ---

# How often move_applied looks, and how long after the plan's publication it
# first does: its moments come from the journals and systemd, whenever they
# are read, so a late and slow poll measures the same and leaves the two
# cores to the passes it measures (three nsenter processes of about 10 ms of
# CPU each, every 0.1 s from the publication on, took some 15 % of them
# while those passes ran). The first look comes at issue 14's goal.
APPLIED_POLL_S = 0.5
APPLIED_FIRST_LOOK_S = 1.0
# Issue 14's goals: each affected host acts on a new plan within ACTED_ON_S of
# its publication; a lost node's work is served within SERVED_AFTER_TIMEOUT_S
# of its node timeout.
ACTED_ON_S = 1.0
SERVED_AFTER_TIMEOUT_S = 2.0
# "Far from its next tick": a pass started sooner than this after a plan's
# publication cannot be the timer's.
FAR_S = 10.0


def plan_moving(fleet: Fleet, service: str, since: FleetPlan, away_from: str, *, timeout: float) -> FleetPlan:
    """The first plan after `since` that places `service` on another host than `away_from`."""

    # One connection for the whole wait: each of fleet.registry() loads the
    # client's desired state and opens etcd over TLS, some 50 ms of CPU,
    # just as the passes of the hosts the plan concerns begin.
    with fleet.registry() as registry:

        def moved() -> FleetPlan | None:
            plan = registry.newest_plan()
            if plan is None or plan.epoch <= since.epoch or placed(plan).get(service, [away_from]) == [away_from]:
                return None
            return plan

        return wait_for(moved, timeout=timeout, what=f"a plan moving {service} off {away_from}", interval=0.05)


def move_applied(fleet: Fleet, service: str, plan: FleetPlan, serving: str, *, within: float) -> dict[str, datetime]:
    """When each host the move of `service` concerns applied `plan`: the host
    it left stopped its unit, the replacement started it, the edge loaded
    Caddy (each after the plan's publication)."""
    published = utc(plan.created)
    (replacement,) = placed(plan)[service]
    unit = agent_unit(service)

    first_look = published + timedelta(seconds=APPLIED_FIRST_LOOK_S)

    def applied() -> dict[str, datetime] | None:
        if datetime.now(UTC) < first_look:
            return None
        done = {
            serving: first_after(unit_stops(fleet, serving, unit), published),
            replacement: unit_active_since(fleet, replacement, unit),
            fleet.edge: first_after(caddy_loads(fleet, fleet.edge), published),
        }
        if any(moment is None or moment < published for moment in done.values()):
            return None
        return done  # type: ignore[return-value]

    return wait_for(applied, timeout=within, what=f"{service}'s move from {serving} to {replacement} applied", interval=APPLIED_POLL_S)


def align_timers(fleet: Fleet, hosts: tuple[str, ...], *, far_s: float, timeout: float) -> dict[str, datetime]:
    """A pass on every host now, so every timer's next tick (OnUnitActiveSec
    counts from the last pass) is an interval away; then wait until they have
    ended and every tick is still at least `far_s` away: each host's next tick."""

    def aligned() -> dict[str, datetime] | None:
        if any(pass_running(fleet, host) for host in hosts):
            return None
        soonest = datetime.now(UTC) + timedelta(seconds=far_s)
        ticks = {host: next_tick(fleet, host) for host in hosts}
        if all(tick is not None and tick >= soonest for tick in ticks.values()):
            return ticks  # type: ignore[return-value]
        for host in hosts:
            fleet.container(host).systemctl("start", "--no-block", RECONCILE_SERVICE)
        return None

    return wait_for(aligned, timeout=timeout, what="every timer far from its next tick", interval=0.5)


def drain(fleet: Fleet, host: str, reason: str = "e2e: move its work") -> None:
    with fleet.registry() as registry:
        registry.set_drain(host, 0, reason=reason)


def lead_on(fleet: Fleet, host: str, *, timeout: float) -> None:
    """Make `host` (a leader candidate) the leader: the leader's
    fabric-leader.service is stopped (it resigns), `host`'s campaigns, and
    the stopped one is started again (it follows)."""

    def current() -> str | None:
        with fleet.registry() as registry:
            info = registry.leader()
        return info.candidate if info is not None else None

    leader = wait_for(current, timeout=timeout, what="a leader", interval=0.5)
    if leader == host:
        return
    fleet.container(leader).systemctl("stop", "fabric-leader.service")
    try:
        wait_for(lambda: current() == host, timeout=timeout, what=f"{host} leads", interval=0.2)
    finally:
        fleet.container(leader).systemctl("start", "fabric-leader.service")


def undrain(fleet: Fleet, host: str) -> None:
    with fleet.registry() as registry:
        registry.clear_drain(host)


def lanes_on(desired: DesiredState, host: str) -> set[str]:
    """The lane agents a host runs: the compute lanes pushed to it (the local
    lane is phaze's own processing, no agent)."""
    return {lane.id for lane in desired.lanes if lane.kind == "compute" and lane.push_host == host}


def expected_units(desired: DesiredState, plan: FleetPlan, host: str) -> set[str]:
    services = {p.service for p in plan.placements if p.node == host}
    return {f"fabric-agent-{name}.service" for name in services | lanes_on(desired, host)}


def running_agents(fleet: Fleet, host: str) -> dict[str, str]:
    """Active fabric-agent-* units on `host` -> their InvocationID (changes on every (re)start)."""
    container = fleet.container(host)
    listed = container.systemctl("list-units", "--type=service", "--state=active", "--plain", "--no-legend", "fabric-agent-*").stdout
    names = sorted(line.split()[0] for line in listed.splitlines() if line.strip())
    if not names:
        return {}
    shown = container.systemctl("show", "-p", "Id", "-p", "InvocationID", *names).stdout
    out: dict[str, str] = {}
    for block in shown.strip().split("\n\n"):
        fields = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        out[fields["Id"]] = fields.get("InvocationID", "")
    return out


def routed_services(desired: DesiredState) -> dict[str, str]:
    """service id -> its route's host name."""
    return {s.id: s.route.host for s in desired.fleet.services if s.route is not None}


def edge_reaches(fleet: Fleet, desired: DesiredState, plan: FleetPlan) -> dict[str, str]:
    """For every routed service that is placed: the body the edge answers with,
    when it came from one of the nodes it is placed on; {} until all do."""
    answers = {}
    for service, host_name in routed_services(desired).items():
        nodes = placed(plan).get(service)
        if not nodes:
            continue
        status, body = fleet.request(host_name)
        if status != 200 or not any(body.strip() == f"{service} on {node}" for node in nodes):
            return {}
        answers[service] = body.strip()
    return answers


def converged(fleet: Fleet, desired: DesiredState, hosts: tuple[str, ...]) -> FleetPlan | None:
    """The newest plan once the fleet runs it: every host in `hosts` active, a
    leader, the plan placing only on `hosts`, every host running exactly the
    agents the plan gives it, and the edge reaching every routed service on a
    node it is placed on. None until then."""
    status = node_status(fleet)
    if any(status.get(h) != "active" for h in hosts):
        return None
    with fleet.registry() as registry:
        if registry.leader() is None:
            return None
        plan = registry.newest_plan()
    if plan is None or any(p.node not in hosts for p in plan.placements):
        return None
    for host in hosts:
        if set(running_agents(fleet, host)) != expected_units(desired, plan, host):
            return None
    if not edge_reaches(fleet, desired, plan):
        return None
    return plan


# --------------------------------------------------------------------------
# scripts/fleet: up (a supervisor process holds the fleet), down, status


def _stamp(message: str) -> str:
    return f"{time.strftime('%H:%M:%S')} {message}"


def _serve(state_dir: Path, settings: FleetSettings) -> int:
    """The supervisor: bring the fleet up, hold it until SIGTERM, bring it down."""
    log = open(state_dir / "progress.log", "a", buffering=1)

    def progress(message: str) -> None:
        log.write(_stamp(message) + "\n")

    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    fleet = Fleet(work=state_dir, settings=settings, progress=progress)
    try:
        fleet.up()
    except BaseException as exc:
        progress(f"FAILED: {exc}")
        return 1
    progress("READY")
    try:
        while not stop:
            time.sleep(0.2)
    finally:
        fleet.down()
    return 0


def _up(state_dir: Path, settings_args: list[str]) -> int:
    state_dir.mkdir(parents=True, exist_ok=True)
    if (state_dir / "state.json").exists():
        print(f"a fleet is already up ({state_dir}/state.json); scripts/fleet down first", file=sys.stderr)
        return 1
    (state_dir / "progress.log").write_text("")
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.fleet", "serve", "--state-dir", str(state_dir), *settings_args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=open(state_dir / "supervisor.log", "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    shown = 0
    while True:
        lines = (state_dir / "progress.log").read_text().splitlines()
        for line in lines[shown:]:
            print(line, flush=True)
        shown = len(lines)
        if any(line.endswith(" READY") for line in lines):
            print(f"fleet is up (supervisor pid {supervisor.pid}); scripts/fleet status | down")
            return 0
        if supervisor.poll() is not None:
            print(f"fleet failed to come up (see {state_dir}/supervisor.log)", file=sys.stderr)
            return 1
        time.sleep(0.2)


def _down(state_dir: Path) -> int:
    state_file = state_dir / "state.json"
    if not state_file.exists():
        print("no fleet is up")
        return 0
    state = json.loads(state_file.read_text())
    supervisor = int(state.get("supervisor", 0))
    if supervisor and _process_is(supervisor, "tests.e2e.fleet"):
        print(f"stopping the supervisor (pid {supervisor})")
        _stop_pid(supervisor, "tests.e2e.fleet", timeout=90)
    force_down(state_dir)  # whatever the supervisor did not get to
    print("fleet is down")
    return 0


def _status(state_dir: Path) -> int:
    state_file = state_dir / "state.json"
    if not state_file.exists():
        print("no fleet is up")
        return 1
    state = json.loads(state_file.read_text())
    print(f"supervisor pid {state.get('supervisor')}, bridge {state.get('bridge')} ({state.get('subnet')}.0/24), ready: {state.get('ready')}")
    for name, entry in state.get("containers", {}).items():
        alive = "running" if _process_is(int(entry["pid"]), "systemd") else "GONE"
        print(f"  {name:10} pid {entry['pid']:>7}  {alive}")
    print(f"  etcd       pid {state.get('etcd_pid')}")
    for command in (["nodes"], ["leader"]):
        done = subprocess.run(
            [sys.executable, "-m", "reconciler", *command, "--desired", str(state_dir / "client-desired")],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=30,
        )
        print(done.stdout.rstrip() or done.stderr.rstrip())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/fleet", description="The example fleet on this machine: systemd containers on a bridge.")
    parser.add_argument("action", choices=["up", "down", "status", "serve"])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help=f"state file and logs (default {DEFAULT_STATE_DIR})")
    parser.add_argument("--interval", default=FleetSettings.pass_interval, help="fabric-reconcile.timer interval (default %(default)s)")
    parser.add_argument("--node-timeout", type=int, default=FleetSettings.node_timeout_s, help="timing.node_timeout_s (default %(default)s)")
    parser.add_argument("--heartbeat", type=int, default=FleetSettings.heartbeat_s, help="timing.heartbeat_s (default %(default)s)")
    parser.add_argument("--watcher", action="store_true", help="fabric-watch.service on every host (as join.sh and the NixOS module install it)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("scripts/fleet needs root (namespaces, a bridge, containers)", file=sys.stderr)
        return 2
    settings = FleetSettings(pass_interval=args.interval, node_timeout_s=args.node_timeout, heartbeat_s=args.heartbeat, watcher=args.watcher)
    settings_args = ["--interval", args.interval, "--node-timeout", str(args.node_timeout), "--heartbeat", str(args.heartbeat)]
    settings_args += ["--watcher"] if args.watcher else []
    if args.action == "serve":
        return _serve(args.state_dir, settings)
    if args.action == "up":
        return _up(args.state_dir, settings_args)
    if args.action == "down":
        return _down(args.state_dir)
    return _status(args.state_dir)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `scripts/fleet status | head`
        sys.stderr.close()
        sys.exit(0)
