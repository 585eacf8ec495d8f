"""New capacity in one command (issue 31's fleet Done-when): a sixth machine
joins as pending, is admitted, and takes work.

The harness of tests/e2e/conftest.py, this module's own fleet (default
settings). In order:

    pending    a sixth container with the fabric installed (node.toml, the
               units `fabric units` renders, its timer) and no host file:
               the probe capture of a CUDA server (multi-gpu-server) with its
               tailnet address on the bridge, and only the joining identity.
               Its first pass reports it pending with its probed tier; it is
               never a node: no placement, no route, no rendered unit, no
               nft table
    admit      `fabric admit` in the operator's checkout (this client's
               desired state, a git repository) commits hosts' new file;
               the tree validates
    pulled     the operator gives it its own etcd identity and runs
               `fabric registry init-auth`; the file reaches every host's
               checkout (as `fabric pull` would); its next pass is a normal
               one and it is an active node. A node joining moves nothing,
               so a host running a replica of a routed service is powered
               off: the leader places that replica on the new node (the
               highest tier, the least loaded), which runs it, and the
               edge's Caddy answers from it
"""

from __future__ import annotations

import json
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from reconciler.core.desired.model import DesiredState
from tests.e2e.fleet import (
    PROBE_FIXTURES,
    ROOT,
    Fleet,
    e2e_host_file,
    newest_plan,
    node_status,
    placed,
    routed_services,
    span_seconds,
    wait_for,
)
from tests.support.e2e import CONVERGE_S, wait_converged
from tests.support.harness.waiting import deadline_for

pytestmark = pytest.mark.e2e

MACHINE = "gpu-srv-01"  # the capture's own host name
OCTET = 30
CAPTURE = PROBE_FIXTURES / "multi-gpu-server"
# Bounds of the polls (a broken run fails after these; a working one is far faster).
REACT_S = 60.0
FIGURES: dict[str, float] = {}


def capture(address: str) -> dict[str, str]:
    """multi-gpu-server's capture with its tailnet address on the bridge
    (the bridge plays the tailnet: the edge reaches the machine there)."""
    files = {p.name: p.read_text() for p in CAPTURE.iterdir() if p.is_file() and p.name not in ("expected.json", "errors.json")}
    status = json.loads(files["tailscale.json"])
    old = status["Self"]["TailscaleIPs"][0]
    files["tailscale.json"] = json.dumps(status).replace(f'"{old}"', f'"{address}"').replace(f'"{old}/32"', f'"{address}/32"')
    return files


def fabric_nodes(fleet: Fleet) -> dict[str, dict[str, object]]:
    done = fleet.fabric("nodes", "--json")
    assert done.returncode == 0, done.stderr
    return {node["node_id"]: node for node in json.loads(done.stdout)["nodes"]}


def git(checkout: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(checkout), "-c", "user.name=op", "-c", "user.email=op@fleet", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, f"git {' '.join(args)}: {done.stderr}"
    return done.stdout


def assert_given_nothing(fleet: Fleet) -> None:
    """A pending machine is not a node: no placement, no route to it, no unit
    rendered or nft table loaded on it."""
    assert MACHINE not in node_status(fleet)
    plan = newest_plan(fleet)
    assert plan is not None and all(p.node != MACHINE for p in plan.placements), plan
    address = fleet.settings.address(OCTET)
    assert address not in fleet.container(fleet.edge).read_file("/etc/caddy/fabric.caddy")
    machine = fleet.container(MACHINE)
    units = machine.run("sh", "-c", "ls /etc/systemd/system | grep '^fabric-agent-' || true").stdout.split()
    assert units == [], units
    assert not machine.host_path("/var/lib/fabric/generations").exists() or not any(machine.host_path("/var/lib/fabric/generations").iterdir())
    assert machine.run("nft", "list", "table", "inet", "fabric").returncode != 0


def test_a_machine_without_a_host_file_is_pending_after_its_first_pass(fleet: Fleet, desired: DesiredState) -> None:
    wait_converged(fleet, desired)
    began = time.monotonic()
    fleet.add_machine(MACHINE, OCTET, capture(fleet.settings.address(OCTET)))
    booted = time.monotonic()

    def pending() -> dict[str, object] | None:
        node = fabric_nodes(fleet).get(MACHINE)
        return node if node is not None and node["status"] == "pending" else None

    node = wait_for(pending, timeout=CONVERGE_S, what=f"{MACHINE} pending", interval=0.2)
    FIGURES["pending_after_timer_start_s"] = time.monotonic() - booted
    FIGURES["boot_and_install_s"] = booted - began
    assert node["tier"] == "gpu_cuda" and node["tailscale_ip"] == fleet.settings.address(OCTET), node
    assert str(node["admit"]).startswith(f"fabric admit {MACHINE}"), node
    # Its pass said so in its journal, with the command that admits it.
    journal = fleet.journal(MACHINE, "-u", "fabric-reconcile.service", "-o", "cat")
    assert f"pending: {MACHINE} has no host file" in journal and f"fabric admit {MACHINE}" in journal, journal
    assert_given_nothing(fleet)
    print(
        f"[figures] {MACHINE}: booted and installed in {FIGURES['boot_and_install_s']:.1f} s, pending {FIGURES['pending_after_timer_start_s']:.1f} s after its timer started"
    )


def test_admission_commits_a_host_file_that_validates(fleet: Fleet) -> None:
    checkout = fleet.client_desired_dir
    if not (checkout / ".git").exists():
        git(checkout, "init", "--quiet", "--initial-branch=main")
        git(checkout, "add", ".")
        git(checkout, "commit", "--quiet", "-m", "fleet")
    before = git(checkout, "rev-parse", "HEAD").strip()
    done = fleet.fabric("admit", MACHINE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert git(checkout, "rev-parse", "HEAD").strip() != before
    assert git(checkout, "show", "--name-only", "--format=", "HEAD").split() == [f"{MACHINE}.toml"]
    assert git(checkout, "status", "--porcelain") == ""
    host = tomllib.loads((checkout / f"{MACHINE}.toml").read_text())["host"]
    assert host["name"] == MACHINE and host["address"] == fleet.settings.address(OCTET), host
    validated = fleet.fabric("validate")
    assert validated.returncode == 0, validated.stdout + validated.stderr
    # Still pending until the hosts have the file: admission alone gives nothing.
    assert_given_nothing(fleet)


def test_once_pulled_the_leader_places_work_there_and_the_edge_routes_to_it(fleet: Fleet, desired: DesiredState) -> None:
    committed = (fleet.client_desired_dir / f"{MACHINE}.toml").read_text()
    # The operator: the machine's own identity, and its etcd user (init-auth
    # reads the desired state with the new host file).
    done = fleet.fabric("registry", "init-auth", identity=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    fleet.give_identity(MACHINE)
    began = time.monotonic()
    fleet.pull(f"{MACHINE}.toml", e2e_host_file(committed))
    wait_for(lambda: node_status(fleet).get(MACHINE) == "active", timeout=REACT_S, what=f"{MACHINE} an active node", interval=0.2)
    FIGURES["active_after_pull_s"] = time.monotonic() - began
    assert fabric_nodes(fleet)[MACHINE]["declared"] is True

    # A node joining moves nothing: power off a host that runs a replica of
    # a routed service (not the edge; a leader candidate only when no other
    # host runs one, and the leader last). The replica goes to the best node
    # left: the new one is of the highest tier (gpu_cuda, as only qfox-1)
    # and the least loaded, and runs no sibling.
    plan = newest_plan(fleet)
    assert plan is not None
    routes = routed_services(desired)
    candidates = set(desired.fleet.fleet.leader_candidates)
    victims = sorted(
        (p.node in candidates, p.node == plan.leader, p.node, p.service)
        for p in plan.placements
        if p.service in routes and p.node not in (fleet.edge, MACHINE)
    )
    assert victims, f"no routed replica on a host other than the edge: {placed(plan)}"
    *_, victim, service = victims[0]
    began = time.monotonic()
    fleet.stop_host(victim)

    def moved() -> bool:
        now = newest_plan(fleet)
        return now is not None and MACHINE in placed(now).get(service, [])

    wait_for(moved, timeout=deadline_for(3.0 * fleet.settings.node_timeout_s, at_least=REACT_S), what=f"{service} placed on {MACHINE}", interval=0.2)
    FIGURES["placed_after_loss_s"] = time.monotonic() - began

    def routed_there() -> bool:
        status, body = fleet.request(routes[service])
        return status == 200 and body.strip() == f"{service} on {MACHINE}"

    wait_for(routed_there, timeout=REACT_S, what=f"the edge answering {routes[service]} from {MACHINE}", interval=0.2)
    FIGURES["routed_after_loss_s"] = time.monotonic() - began
    machine = fleet.container(MACHINE)
    assert machine.systemctl("is-active", f"fabric-agent-{service}.service").stdout.strip() == "active"
    assert fleet.settings.address(OCTET) in fleet.container(fleet.edge).read_file("/etc/caddy/fabric.caddy")
    print(
        f"[figures] {MACHINE}: active {FIGURES['active_after_pull_s']:.1f} s after the pull; {victim} off: {service} placed there "
        f"after {FIGURES['placed_after_loss_s']:.1f} s, routed after {FIGURES['routed_after_loss_s']:.1f} s "
        f"(node timeout {fleet.settings.node_timeout_s} s, timer {span_seconds(fleet.settings.pass_interval):.0f} s)"
    )
