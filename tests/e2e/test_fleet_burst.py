"""A burst brings up a worker group's member, which takes the work; the idle group is deactivated (issue 35 item 7).

The harness of tests/e2e/conftest.py, this module's own fleet (longer beats:
FLEET_SETTINGS). The desired state changes as a `git pull` brings it (every host's
copy and this client's): the example's worker group `batch` gets a short idle
window and one member at most, the scaling a short burst window, and the
batch tier's cloud hook becomes the example's workflow dispatch against a
stand-in of GitHub's API on this host (`sh` by PATH, then curl: `gh` is not
installed here; and no token: see `hook`). Two services that need the group's
label (`crunch-a`, `crunch-b`: a batch of work) are added. In order:

    burst       no node has the group's label: the two replicas wait for a
                member of the group and count in the queue depth (2 > 1)
                for the burst window -> the leader runs the batch hook (a
                transient sandboxed unit) -> the stand-in receives the
                workflow dispatch (tier=batch)
    join        the stand-in's "runner": a new container `gh-1`, no host
                file, the group's etcd identity (fabric-group-batch, which
                may write only P/members/batch/), its pass with
                --member-of batch -> the leader admits it (declared group,
                the group's tier) -> both services run on it and answer
    deactivate  the batch is done (the services leave the desired state):
                the queue is empty and the member idle for the group's
                window -> the group is deactivated, its stop hook runs (the
                stand-in's cancel), the stand-in stops the runner, and the
                member's record expires
    timeline    the leader's scaling record shows each step in order.

Every wait is a condition with a deadline from the configured timings.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.e2e.fleet import (
    DESIRED_DIR,
    SERVICE_STUB,
    THIS_HOST_OCTET,
    Fleet,
    FleetSettings,
    in_container,
    toml_text,
    wait_for,
)
from tests.support.harness.waiting import deadline_for

pytestmark = pytest.mark.e2e

# Longer beats than the default: the scenario needs no fast failure
# detection, and a loaded machine (passes of several seconds) must not make
# the fleet's nodes flap while the burst runs. The member's record lives for
# the node timeout too.
FLEET_SETTINGS = FleetSettings(heartbeat_s=4, node_timeout_s=24)
GROUP, MEMBER, MEMBER_OCTET = "batch", "gh-1", 31
POOL = {"topology.researchstack.io/pool": "batch"}
WORK = {"crunch-a": 8791, "crunch-b": 8792}
BURST_WINDOW_S, IDLE_WINDOW_S = 2, 4
# A step of the leader and a pass or two (bounds of a broken run only).
REACT_S = deadline_for(3.0 * FLEET_SETTINGS.node_timeout_s)


@dataclass
class GitHubStandIn:
    """GitHub's workflow dispatch API as the hooks call it: a POST is a
    dispatch (the runner the test then boots), or a cancel of the run."""

    port: int = 0
    dispatches: list[dict[str, Any]] = field(default_factory=list)
    cancels: list[dict[str, Any]] = field(default_factory=list)

    def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
                if self.path.endswith("/dispatches"):
                    stand_in.dispatches.append({"path": self.path, **json.loads(body or b"{}")})
                    self.send_response(204)
                elif self.path.endswith("/cancel"):
                    stand_in.cancels.append({"path": self.path})
                    self.send_response(202)
                else:
                    self.send_response(404)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


@pytest.fixture(scope="module")
def github(fleet: Fleet) -> Iterator[GitHubStandIn]:
    stand_in = GitHubStandIn()
    server = http.server.ThreadingHTTPServer((fleet.settings.address(THIS_HOST_OCTET), 0), stand_in.handler())
    stand_in.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield stand_in
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def hook(url: str, *args: str) -> dict[str, Any]:
    """The example's hook shape (sh by PATH, its program's arguments passed
    through "$@"), without its token: the fleet's containers are chrooted,
    and systemd sets up no credential for a unit there (even a root unit gets
    an empty $CREDENTIALS_DIRECTORY), so the credential file is proven by
    tests/integration/test_hook_sandbox.py's pivot_root container instead."""
    return {"command": ["sh", "-c", 'exec curl -fsS -X POST "$@"', "curl", *args, url], "timeout_s": 20}


def burst_desired(fleet: Fleet, github: GitHubStandIn) -> None:
    """The desired state of this scenario, as a pull brings it (every copy)."""
    api = f"http://{fleet.settings.address(THIS_HOST_OCTET)}:{github.port}/repos/owner/repo/actions"

    def change(data: dict[str, Any]) -> None:
        dispatch = hook(f"{api}/workflows/adaptive-compute.yml/dispatches", "-d", json.dumps({"ref": "main", "inputs": {"tier": "batch"}}))
        data["scaling"].update(queue_high=1, burst_window_s=BURST_WINDOW_S, group_interval_s=3600)
        data["scaling"]["cloud_hooks"] = {"batch": {**dispatch, "group": GROUP}}
        group = data["groups"][GROUP]
        group.update(max_members=1, idle_window_s=IDLE_WINDOW_S, max_concurrent_tasks=2, labels=dict(POOL))
        group["stop_hook"] = hook(f"{api}/runs/{MEMBER}/cancel")
        argv = ["/usr/bin/python3", in_container(SERVICE_STUB)]
        for service, port in WORK.items():
            data["services"].append(
                {
                    "id": service,
                    "min_tier": "batch",
                    "floor": "batch",
                    "port": port,
                    "labels": dict(POOL),
                    "command": {"any": [*argv, service, str(port)]},
                }
            )

    change_fleet(fleet, change)


def change_fleet(fleet: Fleet, change: Any) -> None:
    for directory in (fleet.desired_dir, fleet.client_desired_dir):
        data = tomllib.loads((directory / "fabric.toml").read_text())
        change(data)
        text = toml_text(data)
        (directory / "fabric.toml").write_text(text)
        if directory == fleet.desired_dir:
            for name, host in fleet.hosts.items():
                if host.running:
                    fleet.container(name).write_file(f"{DESIRED_DIR}/fabric.toml", text)


def end_the_batch(fleet: Fleet) -> None:
    change_fleet(fleet, lambda data: data.update(services=[s for s in data["services"] if s["id"] not in WORK]))


def leads(fleet: Fleet) -> bool:
    with fleet.registry() as registry:
        return registry.newest_plan() is not None


def timeline(fleet: Fleet) -> list[tuple[str, str]]:
    with fleet.registry() as registry:
        return [(e.kind, e.node or e.tier or "") for e in registry.scaling_record().recent]


def members(fleet: Fleet) -> list[tuple[str, str]]:
    with fleet.registry() as registry:
        return [(r.group, r.node_id) for r in registry.group_members()[0]]


def placed_on(fleet: Fleet, node: str) -> set[str]:
    with fleet.registry() as registry:
        plan = registry.newest_plan()
    return {p.service for p in plan.placements if p.node == node} if plan is not None else set()


def answers(fleet: Fleet, service: str) -> str:
    done = fleet.container(MEMBER).run("curl", "-fsS", "--max-time", "2", f"http://127.0.0.1:{WORK[service]}/", timeout=10)
    return done.stdout.strip() if done.returncode == 0 else ""


def test_a_burst_brings_up_a_group_member_that_takes_the_work_and_the_idle_group_is_deactivated(fleet: Fleet, github: GitHubStandIn):
    started = time.monotonic()
    wait_for(lambda: leads(fleet), timeout=REACT_S, what="a leader's plan", interval=0.5)
    burst_desired(fleet, github)

    # burst: the work waits for the group's members; the leader runs the batch hook.
    wait_for(lambda: github.dispatches, timeout=REACT_S + BURST_WINDOW_S, what="the batch hook's workflow dispatch", interval=0.2)
    assert github.dispatches[0]["inputs"] == {"tier": "batch"} and github.dispatches[0]["ref"] == "main"
    assert "/workflows/adaptive-compute.yml/dispatches" in github.dispatches[0]["path"]

    # join: the dispatched runner boots and joins as a member of the group; the work runs there.
    fleet.start_member(MEMBER, GROUP, MEMBER_OCTET)
    wait_for(lambda: placed_on(fleet, MEMBER) == set(WORK), timeout=REACT_S, what=f"the work placed on {MEMBER}", interval=0.5)
    for service in WORK:
        wait_for(lambda s=service: answers(fleet, s) == f"{s} on {MEMBER}", timeout=REACT_S, what=f"{service} answering on {MEMBER}", interval=0.5)
    joined = time.monotonic()

    # deactivate: the batch is done; the queue stays empty and the member idle for the window.
    end_the_batch(fleet)
    wait_for(lambda: github.cancels, timeout=REACT_S + IDLE_WINDOW_S, what="the group's stop hook", interval=0.2)
    fleet.stop_host(MEMBER)  # the stand-in cancels the run: the runner stops
    wait_for(lambda: (GROUP, MEMBER) not in members(fleet), timeout=deadline_for(FLEET_SETTINGS.node_timeout_s), what="the member's record to expire")

    steps = [step for step in timeline(fleet) if step[0] in ("run_cloud_hook", "member_joined", "deactivate_group", "run_stop_hook", "member_left")]
    assert steps == [
        ("run_cloud_hook", GROUP),
        ("member_joined", MEMBER),
        ("deactivate_group", GROUP),
        ("run_stop_hook", GROUP),
        ("member_left", MEMBER),
    ], timeline(fleet)
    print(f"[burst] start to the work answering on {MEMBER} {joined - started:.1f} s, whole scenario {time.monotonic() - started:.1f} s")
