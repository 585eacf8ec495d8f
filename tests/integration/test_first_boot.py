"""fabric-bootstrap.service for real: systemd as PID 1 in a container boots
the units `fabric units` renders (the ones join.sh installs and the NixOS
module mirrors: tests/unit/test_nix_module.py), enabled as join.sh enables
them.

A boot is systemd starting multi-user.target, which wants the enabled
bootstrap unit (the host's own services that target wants are removed from
the container's copy of /etc first); a reboot is multi-user.target started
again: the oneshot has exited, so systemd starts it again unless its
condition (no stamp) fails.

- A machine without a host file ("newbox"): the first boot reports it
  pending (`fabric nodes` lists it), enables the timer and writes the stamp;
  the reboot skips the unit by its condition.
- A failed step (`tailscale up` refused by a stand-in) leaves no stamp; the
  next boot runs the bootstrap again and, the step mended, stamps.
- The same machine renamed and declared as "x86-spill", with a k3s token file: the first
  boot registers it, writes the pass's k3s labels and the join settings,
  restarts k3s-agent.service (a stand-in: k3s cannot run here, so it
  records the configuration it started with and answers, as the API, that
  its Node is Ready) and waits for the Node; once, again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest

from reconciler.core.install.nodeconfig import parse_node_config
from reconciler.core.install.units import BOOTSTRAP_SERVICE, BOOTSTRAP_STAMP_PATH, PASS_DIRECTORIES, Install, host_units
from tests.conftest import EXAMPLE_FLEET, REPO, require, require_root
from tests.support.edge_host import DESIRED, SITE, copy_dependencies
from tests.support.harness.etcd import TestPki
from tests.support.harness.systemd import SystemdContainer, systemd_container
from tests.support.harness.waiting import wait_until
from tests.support.k3s import KUBELET_KUBECONFIG

pytestmark = pytest.mark.integration

FABRIC = "/usr/local/bin/fabric"
REGISTRY = "/var/lib/fabric/registry.sqlite"
SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
K3S_RECORD = "/var/lib/k3s-standin/starts.jsonl"
AGENT_DIR = "/var/lib/rancher/k3s/agent"
TOKEN_FILE = "/etc/fabric/k3s-token"
AUTH_KEY_FILE = "/etc/fabric/tailscale-auth-key"
# How long one bootstrap may take here: a live probe and, for the k3s join,
# the wait for the Node (its poll is every 2 s).
BOOT_TIMEOUT_S = 180.0

# k3s-agent.service's stand-in: records its command line and every
# config.yaml.d file at each start (what a real agent reads once, at its
# start), then serves the API's Node of this machine as Ready, over TLS with
# the kubelet's client certificate required (the paths k3s's kubelet
# kubeconfig names: tests/support/k3s.py).
K3S_STANDIN = f"""
import glob, json, os, socket, ssl, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

node = socket.gethostname().split(".")[0].lower()
config = {{os.path.basename(p): open(p).read() for p in sorted(glob.glob("/etc/rancher/k3s/config.yaml.d/*.yaml"))}}
os.makedirs(os.path.dirname("{K3S_RECORD}"), exist_ok=True)
with open("{K3S_RECORD}", "a") as out:
    out.write(json.dumps({{"argv": sys.argv[1:], "config": config, "node": node}}) + "\\n")

class Api(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        found = self.path == f"/api/v1/nodes/{{node}}"
        body = {{"metadata": {{"name": node, "labels": {{}}}}, "status": {{"conditions": [{{"type": "Ready", "status": "True"}}]}}}}
        data = json.dumps(body if found else {{"kind": "Status", "code": 404}}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain("/etc/k3s-standin/server.crt", "/etc/k3s-standin/server.key")
context.load_verify_locations("{AGENT_DIR}/server-ca.crt")
context.verify_mode = ssl.CERT_REQUIRED
server = ThreadingHTTPServer(("127.0.0.1", 6444), Api)
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"""
K3S_AGENT_UNIT = "[Unit]\nDescription=k3s agent stand-in\n[Service]\nExecStart=/usr/bin/python3 /usr/local/lib/k3s-standin.py agent\n"

# `tailscale` as the bootstrap sees it: logged out, and `up` refused until
# the test lets it through (/run/tailscale-allow), then Running.
TAILSCALE_STANDIN = """#!/bin/sh
case "$1" in
  status) if [ -e /run/tailscale-up ]; then echo '{"BackendState": "Running"}'; else echo '{"BackendState": "NeedsLogin"}'; fi ;;
  up)
    echo "$@" >> /run/tailscale-ups
    [ -e /run/tailscale-allow ] || { echo "tailscale up: backend error: invalid key" >&2; exit 1; }
    touch /run/tailscale-up ;;
  *) exit 1 ;;
esac
"""


def node_toml(host: str | None = None, bootstrap: str = "") -> str:
    named = f'host = "{host}"\n' if host else ""
    return f'[node]\n{named}desired = "{DESIRED}"\nregistry_path = "{REGISTRY}"\nunit_dir = "/etc/systemd/system"\n{bootstrap}'


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdContainer]:
    require_root()
    require("unshare", "nsenter", "chroot", "python3", "nft")
    with systemd_container(hostname="newbox", private_network=True) as container:
        copy_dependencies(container)
        shutil.copytree(REPO / "reconciler", container.host_path(SITE) / "reconciler", ignore=shutil.ignore_patterns("__pycache__"))
        container.write_file(FABRIC, f'#!/bin/sh\nexport PYTHONPATH={SITE} PYTHONDONTWRITEBYTECODE=1\nexec python3 -m reconciler "$@"\n', mode=0o755)
        for toml in sorted(EXAMPLE_FLEET.glob("*.toml")):
            container.write_file(f"{DESIRED}/{toml.name}", toml.read_text())
        # Only what the test installs is wanted at boot, not the host's services.
        done = container.run("sh", "-c", "rm -f /etc/systemd/system/multi-user.target.wants/*")
        assert done.returncode == 0, done.stderr
        install_units(container, node_toml())
        enabled = container.systemctl("enable", BOOTSTRAP_SERVICE)
        assert enabled.returncode == 0, enabled.stderr
        # The k3s stand-in's identities (its API's server certificate, the kubelet's client one).
        pki = TestPki(tmp_path_factory.mktemp("k3s-pki"))
        cert, key = pki.client("system:node:newbox")
        for source, target in (
            (pki.ca_file, f"{AGENT_DIR}/server-ca.crt"),
            (cert, f"{AGENT_DIR}/client-kubelet.crt"),
            (key, f"{AGENT_DIR}/client-kubelet.key"),
            (pki.server_cert, "/etc/k3s-standin/server.crt"),
            (pki.server_key, "/etc/k3s-standin/server.key"),
        ):
            container.write_file(target, source.read_text(), mode=0o600)
        container.write_file(f"{AGENT_DIR}/kubelet.kubeconfig", KUBELET_KUBECONFIG)
        yield container


def install_units(container: SystemdContainer, text: str) -> None:
    """node.toml, the units `fabric units --write` renders from it and the
    directories a pass writes into (join.sh's)."""
    container.write_file("/etc/fabric/node.toml", text)
    made = container.run("mkdir", "-p", *PASS_DIRECTORIES)
    assert made.returncode == 0, made.stderr
    install = Install(fabric_bin=FABRIC, node=parse_node_config(text), search_path=SEARCH_PATH)
    for unit in host_units(install, leader_candidate=False):
        container.write_file(f"/etc/systemd/system/{unit.name}", unit.text())
    assert container.systemctl("daemon-reload").returncode == 0


def boot(container: SystemdContainer) -> dict[str, str]:
    """systemd reaching multi-user.target, as at a boot; the bootstrap unit's
    properties once it has ended (or been skipped)."""
    started = container.systemctl("start", "multi-user.target", timeout=BOOT_TIMEOUT_S)
    assert started.returncode == 0, started.stderr
    return unit_state(container)


def unit_state(container: SystemdContainer) -> dict[str, str]:
    keys = ("ActiveState", "Result", "ConditionResult", "InvocationID", "ExecMainStatus")
    shown = container.systemctl("show", BOOTSTRAP_SERVICE, *(f"-p{k}" for k in keys))
    return dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)


def monotonic(container: SystemdContainer, unit: str, prop: str) -> int:
    return int(container.systemctl("show", unit, "-P", prop).stdout.strip() or 0)


def bootstrap_journal(container: SystemdContainer, invocation: str | None = None) -> str:
    """The unit's journal (of one run: `invocation`)."""
    match = f"_SYSTEMD_INVOCATION_ID={invocation}" if invocation else f"--unit={BOOTSTRAP_SERVICE}"
    return container.journal("-o", "cat", match)


def fabric_nodes(container: SystemdContainer) -> dict[str, dict[str, object]]:
    """`fabric nodes --json`'s nodes (registered and pending) by name."""
    shown = container.run(FABRIC, "nodes", "--json", "--desired", DESIRED, "--registry-path", REGISTRY, timeout=120)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    return {node["node_id"]: node for node in json.loads(shown.stdout)["nodes"]}


def stamped(container: SystemdContainer) -> bool:
    return container.host_path(BOOTSTRAP_STAMP_PATH).exists()


def test_a_machine_without_a_host_file_is_bootstrapped_once_and_shows_up_pending(machine: SystemdContainer) -> None:
    first = boot(machine)
    journal = bootstrap_journal(machine, first["InvocationID"])
    assert (first["Result"], first["ExecMainStatus"], first["ConditionResult"]) == ("success", "0", "yes"), bootstrap_journal(machine)
    # Each step logged as it starts and ends, in order; the stamp last.
    steps = [line for line in journal.splitlines() if line.startswith(("report_pending", "enable_timer", "write_stamp", "done: "))]
    assert [s.split(":", 1)[0] if not s.startswith("done") else s for s in steps] == [
        "report_pending",
        "done: report_pending",
        "enable_timer",
        "done: enable_timer",
        "write_stamp var/lib/fabric/bootstrap.stamp",
        "done: write_stamp",
    ], journal
    assert "note: tailscale is not installed" in journal and "pending: newbox has no host file" in journal
    assert "reported pending" in machine.read_file(BOOTSTRAP_STAMP_PATH)
    assert machine.systemctl("is-active", "fabric-reconcile.timer").stdout.strip() == "active"
    newbox = fabric_nodes(machine)["newbox"]
    assert newbox["status"] == "pending" and str(newbox["admit"]).startswith("fabric admit newbox"), newbox

    # The reboot: the unit is skipped by its condition, nothing runs again.
    again = boot(machine)
    assert again["ConditionResult"] == "no" and again["InvocationID"] == first["InvocationID"], again
    assert f"skipped because of an unmet condition check (ConditionPathExists=!{BOOTSTRAP_STAMP_PATH})" in bootstrap_journal(machine)
    assert bootstrap_journal(machine).count("done: write_stamp") == 1


def test_a_failed_step_leaves_no_stamp_and_the_next_boot_tries_again(machine: SystemdContainer) -> None:
    machine.remove_file(BOOTSTRAP_STAMP_PATH)
    machine.write_file("/usr/local/bin/tailscale", TAILSCALE_STANDIN, mode=0o755)
    machine.write_file(AUTH_KEY_FILE, "tskey-auth-test\n", mode=0o600)
    install_units(machine, node_toml(bootstrap=f'[bootstrap]\ntailscale_auth_key_file = "{AUTH_KEY_FILE}"\n'))
    try:
        failed = boot(machine)
        assert (failed["Result"], failed["ExecMainStatus"]) == ("exit-code", "1"), failed
        assert "bootstrap: tailscale_up failed" in bootstrap_journal(machine)
        assert not stamped(machine)
        # The key went to tailscale as a file reference, never as a value.
        assert machine.read_file("/run/tailscale-ups").split() == ["up", f"--auth-key=file:{AUTH_KEY_FILE}", "--hostname=newbox"]

        machine.write_file("/run/tailscale-allow", "")
        retried = boot(machine)
        assert (retried["Result"], retried["ConditionResult"]) == ("success", "yes") and retried["InvocationID"] != failed["InvocationID"]
        assert stamped(machine)
        assert boot(machine)["ConditionResult"] == "no"
    finally:
        for path in ("/usr/local/bin/tailscale", AUTH_KEY_FILE, "/run/tailscale-allow", "/run/tailscale-up"):
            machine.remove_file(path)


def test_a_declared_host_registers_and_its_k3s_agent_joins_once_with_its_labels(machine: SystemdContainer) -> None:
    machine.remove_file(BOOTSTRAP_STAMP_PATH)
    machine.write_file("/usr/local/lib/k3s-standin.py", K3S_STANDIN)
    machine.write_file("/etc/systemd/system/k3s-agent.service", K3S_AGENT_UNIT)
    machine.write_file(TOKEN_FILE, "K10secret::server:token\n", mode=0o600)
    k3s = f'[bootstrap]\nk3s_server = "https://100.101.7.10:6443"\nk3s_token_file = "{TOKEN_FILE}"\n'
    install_units(machine, node_toml("x86-spill", k3s))
    # The machine carries its declared name (k3s names its Node after it).
    assert machine.run("hostname", "x86-spill").returncode == 0
    # No timer yet, as on a machine that was never bootstrapped: the
    # bootstrap enables it and queues the first pass.
    assert machine.systemctl("disable", "--now", "fabric-reconcile.timer").returncode == 0

    first = boot(machine)
    journal = bootstrap_journal(machine, first["InvocationID"])
    assert (first["Result"], first["ConditionResult"]) == ("success", "yes"), bootstrap_journal(machine)
    order = [line.split(":", 1)[0] for line in journal.splitlines() if not line.startswith(("done: ", "note: ", "ready: "))]
    assert order == [
        "register",
        "write_file etc/rancher/k3s/config.yaml.d/50-fabric-labels.yaml",
        "write_file etc/rancher/k3s/config.yaml.d/10-fabric-join.yaml",
        "restart_k3s_agent",
        "wait_k3s_node",
        "enable_timer",
        "queue_pass",
        "write_stamp var/lib/fabric/bootstrap.stamp",
    ], journal
    assert "ready: x86-spill" in journal
    # The queued pass ran once the bootstrap had ended (the unit is ordered
    # before it; waiting for it from inside would have deadlocked).
    ended = monotonic(machine, BOOTSTRAP_SERVICE, "ExecMainExitTimestampMonotonic")
    wait_until(lambda: monotonic(machine, "fabric-reconcile.service", "ExecMainStartTimestampMonotonic") > ended, timeout=60, what="the queued pass")

    # The agent started once, with the join settings (the token as a path) and the labels.
    (start,) = [json.loads(line) for line in machine.read_file(K3S_RECORD).splitlines()]
    assert start["argv"] == ["agent"] and start["node"] == "x86-spill"
    join = start["config"]["10-fabric-join.yaml"]
    assert 'server: "https://100.101.7.10:6443"' in join and f'token-file: "{TOKEN_FILE}"' in join and "K10secret" not in join
    labels = start["config"]["50-fabric-labels.yaml"]
    assert "node-label+:" in labels and '"topology.researchstack.io/tier=' in labels, labels
    assert fabric_nodes(machine)["x86-spill"]["status"] == "active"

    # The reboot: skipped, the agent not restarted by it.
    assert boot(machine)["ConditionResult"] == "no"
    wait_until(lambda: unit_state(machine)["ActiveState"] == "inactive", timeout=30, what="the skipped bootstrap unit")
    assert len(machine.read_file(K3S_RECORD).splitlines()) == 1


NEWBOX_FILE = f"{DESIRED}/newbox.toml"
# `fabric admit newbox`'s commit, as it reaches the machine's checkout.
NEWBOX_TOML = (
    '[host]\nname = "newbox"\nroles = ["compute"]\naddress = "100.101.7.23"\n\n[limits]\nmax_concurrent_tasks = 2\nmax_concurrent_ceiling = 4\n'
)
ASKED = "/var/lib/fabric/bootstrap-after-admission.json"


def run_pass(container: SystemdContainer) -> None:
    """One pass, as the timer starts it (returns once it has ended)."""
    done = container.systemctl("start", "fabric-reconcile.service", timeout=BOOT_TIMEOUT_S)
    assert done.returncode == 0, done.stderr + container.journal("-o", "cat", "--unit=fabric-reconcile.service")


def test_a_pending_machine_joins_k3s_once_its_host_file_reaches_it(machine: SystemdContainer) -> None:
    """Admission needs nothing else: the first pass of the now-declared host
    starts the bootstrap its first boot left pending, which joins k3s with
    the labels and writes the complete stamp; later passes leave it alone."""
    for path in (BOOTSTRAP_STAMP_PATH, K3S_RECORD, NEWBOX_FILE, ASKED):
        machine.remove_file(path)
    machine.write_file("/usr/local/lib/k3s-standin.py", K3S_STANDIN)
    machine.write_file("/etc/systemd/system/k3s-agent.service", K3S_AGENT_UNIT)
    machine.write_file(TOKEN_FILE, "K10secret::server:token\n", mode=0o600)
    assert machine.systemctl("stop", "k3s-agent.service").returncode == 0
    install_units(machine, node_toml("newbox", f'[bootstrap]\nk3s_server = "https://100.101.7.10:6443"\nk3s_token_file = "{TOKEN_FILE}"\n'))
    assert machine.run("hostname", "newbox").returncode == 0
    try:
        first = boot(machine)
        assert (first["Result"], first["ConditionResult"]) == ("success", "yes"), bootstrap_journal(machine)
        journal = bootstrap_journal(machine, first["InvocationID"])
        assert "k3s join skipped: newbox is pending" in journal and "starts fabric-bootstrap.service again" in journal, journal
        assert machine.read_file(BOOTSTRAP_STAMP_PATH).startswith("pending: newbox reported pending")
        assert not machine.host_path(K3S_RECORD).exists(), "a pending machine's k3s agent must not join"
        # Passes are run by the test from here (the timer would race it).
        assert machine.systemctl("disable", "--now", "fabric-reconcile.timer").returncode == 0
        run_pass(machine)  # still pending: nothing started
        assert unit_state(machine)["InvocationID"] == first["InvocationID"]

        # Admission: `fabric admit newbox`'s commit reaches the machine.
        machine.write_file(NEWBOX_FILE, NEWBOX_TOML)
        run_pass(machine)
        passes = machine.journal("-o", "cat", "--unit=fabric-reconcile.service")
        assert passes.count("started fabric-bootstrap.service (bootstrap left pending at first boot; not waited for)") == 1, passes
        wait_until(
            lambda: (machine.read_file(BOOTSTRAP_STAMP_PATH) if stamped(machine) else "").startswith("complete:"),
            timeout=BOOT_TIMEOUT_S,
            what="the bootstrap after admission to write its complete stamp",
        )
        after = unit_state(machine)
        assert after["InvocationID"] != first["InvocationID"] and after["Result"] == "success", bootstrap_journal(machine)
        journal = bootstrap_journal(machine, after["InvocationID"])
        # The pass registered it and wrote its label drop-in already: the join, the complete stamp last.
        order = [line.split(":", 1)[0] for line in journal.splitlines() if not line.startswith(("done: ", "note: ", "ready: "))]
        joined = ["write_file etc/rancher/k3s/config.yaml.d/10-fabric-join.yaml", "restart_k3s_agent", "wait_k3s_node"]
        assert [step for step in order if step in joined] == joined and order[-1] == "write_stamp var/lib/fabric/bootstrap.stamp", journal
        assert "register" not in order, journal
        assert "ready: newbox" in journal, journal

        # The k3s agent joined once, with the join settings and the pass's labels.
        (start,) = [json.loads(line) for line in machine.read_file(K3S_RECORD).splitlines()]
        assert start["node"] == "newbox" and 'server: "https://100.101.7.10:6443"' in start["config"]["10-fabric-join.yaml"]
        assert '"topology.researchstack.io/tier=' in start["config"]["50-fabric-labels.yaml"], start
        assert fabric_nodes(machine)["newbox"]["status"] == "active"

        # A later pass (once the bootstrap's own queued pass has ended) does nothing about it.
        wait_until(
            lambda: machine.systemctl("is-active", "fabric-reconcile.service").stdout.strip() != "activating", timeout=120, what="the queued pass"
        )
        run_pass(machine)
        run_pass(machine)
        assert unit_state(machine)["InvocationID"] == after["InvocationID"]
        assert machine.journal("-o", "cat", "--unit=fabric-reconcile.service").count("started fabric-bootstrap.service") == 1
        assert len(machine.read_file(K3S_RECORD).splitlines()) == 1
    finally:
        machine.remove_file(NEWBOX_FILE)
