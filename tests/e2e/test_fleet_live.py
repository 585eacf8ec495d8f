"""The live loop end to end (issue 11's fleet Done-when): real load, lane health, one account.

The same harness as test_fleet.py (tests/e2e/fleet.py; the module-scoped
fleet of tests/e2e/conftest.py: its own five systemd containers and etcd).
Each test leaves the fleet converged, every lane online and the lane queue
empty for the next. The lane queue is phaze's broker (SAQ on the fleet's
PostgreSQL); real SAQ workers in this process (the `lane_workers` fixture)
consume every lane's queue, and a test decides when each job ends.

    measured load    qfox-1's heartbeat: in_flight = services_running = the
                     placed service units its systemd says are active, and
                     `units` names them active
    one account      a1-arm64's lane filled: services placed there plus its
                     lane's jobs never exceed the host's limit, its card says
                     which account is full, and its own heartbeat counts both
    lane health      a1-arm64's host stops beating -> its lane offline with the
                     reason within node timeout + a leader step, the next job
                     goes to x86-spill; x86-spill stops too -> the next job
                     goes local at once (no spill-gate wait); both back -> online
    phaze-shaped     the fleet made a phaze fleet ([phaze] api_url, a stub of
                     phaze's agent API): the rendered agent units' own command
                     (phaze's image cannot run here: tests/e2e/agent_image
                     stands in, phaze's agent at its edges) starts only with
                     the rendered environment, beats on its -analyze queue and
                     processes phaze-format jobs; a1-arm64's agent stopped, its
                     lane goes offline and out of lux's backends.toml after the
                     steering window, and back once the agent is; the fabric
                     writes no job to phaze's queues

A host "stops" as in test_flapping_node_is_held_off: its fabric-reconcile.timer
is stopped (no more passes, so no more heartbeats; its agents keep running, as
on a machine whose uplink died) and started again afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan
from reconciler.core.scheduling.lanes import agent_unit
from tests.e2e.conftest import SETTINGS
from tests.e2e.fleet import AGENT_TOKENS, DESIRED_DIR, Fleet, lanes_on, toml_text, wait_for
from tests.e2e.phaze_api_stub import serve
from tests.support.e2e import HOSTS, dispatched, drain_lanes, lane, wait_converged
from tests.support.harness.saq_workers import LaneWorkers, enqueue_as_phaze, phaze_payload
from tests.support.harness.waiting import deadline_for

pytestmark = pytest.mark.e2e

# A heartbeat is one pass; a changed unit or lane shows in the next beat.
BEAT_S = deadline_for(SETTINGS.heartbeat_s + 1.0)
# The leader steps three times per lease TTL (timing.heartbeat_s).
LEADER_STEP_S = SETTINGS.heartbeat_s / 3.0
# A silent host is offline after node_timeout_s; its lane follows within a
# leader step (the bound is scaled for a loaded two-core machine).
OFFLINE_S = deadline_for(SETTINGS.node_timeout_s + LEADER_STEP_S)
BACK_S = deadline_for(SETTINGS.node_timeout_s)
CLOCK = re.compile(r"\d\d:\d\d:\d\d")


# --------------------------------------------------------------------------
# What the tests read


def node_records(fleet: Fleet) -> dict[str, dict]:
    """`fabric nodes --json`: node id -> its lifecycle state (the record inside)."""
    done = fleet.fabric("nodes", "--json")
    assert done.returncode == 0, done.stderr
    return {n["node_id"]: n for n in json.loads(done.stdout)["nodes"]}


def lane_cards(fleet: Fleet) -> dict[str, dict]:
    """`fabric lane status --json`'s lanes by id."""
    return {v["id"]: v for v in lane(fleet, "status")[0]["lanes"]}


def next_lane(fleet: Fleet, waited_s: float = 0.0) -> dict:
    """`fabric dispatch --lane --json`: where a lane job would go now."""
    done = fleet.fabric("dispatch", "--lane", "--waited-s", str(waited_s), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def active_units(fleet: Fleet, host: str, units: set[str]) -> set[str]:
    """The units of `units` that `host`'s systemd says are active."""
    container = fleet.container(host)
    return {u for u in units if container.systemctl("is-active", u).stdout.strip() == "active"}


def placed_units(plan: FleetPlan, host: str) -> set[str]:
    return {f"fabric-agent-{p.service}.service" for p in plan.placements if p.node == host}


def drain_lane_broker(fleet: Fleet, workers: LaneWorkers) -> None:
    """Finish every running lane job on its worker and dispatch until the queue is empty."""
    drain_lanes(fleet, workers, deadline_for(SETTINGS.local_spill_after_s + BEAT_S))


@contextmanager
def declared_tasks(fleet: Fleet, host: str, tasks: int) -> Iterator[None]:
    """`host`'s host file declares max_concurrent_tasks = `tasks` (every
    host's desired state and this client's, as a pull would bring it); the
    original file is put back afterwards and `host` reports its old limit again."""
    name = f"{host}.toml"
    original = (fleet.desired_dir / name).read_text()
    data = tomllib.loads(original)
    before = data["limits"]["max_concurrent_tasks"]
    data["limits"]["max_concurrent_tasks"] = tasks

    def write(text: str) -> None:
        for directory in (fleet.desired_dir, fleet.client_desired_dir):
            (directory / name).write_text(text)
        for running in (h for h in HOSTS if fleet.hosts[h].running):
            fleet.container(running).write_file(f"{DESIRED_DIR}/{name}", text)

    write(toml_text(data))
    try:
        wait_for(
            lambda: node_records(fleet)[host]["record"]["max_concurrent_tasks"] == tasks,
            timeout=BEAT_S,
            what=f"{host} to report limit {tasks}",
            interval=0.5,
        )
        yield
    finally:
        write(original)
        wait_for(
            lambda: node_records(fleet)[host]["record"]["max_concurrent_tasks"] == before,
            timeout=BEAT_S,
            what=f"{host} to report limit {before}",
            interval=0.5,
        )


@pytest.fixture
def empty_lane_broker(fleet: Fleet, lane_workers: LaneWorkers) -> Iterator[None]:
    """The lane queue empty before and after the test (other tests share the
    fleet), every lane's SAQ worker running."""
    drain_lane_broker(fleet, lane_workers)
    yield
    drain_lane_broker(fleet, lane_workers)


# --------------------------------------------------------------------------
# 1. Measured load


def test_qfox1_reports_the_services_it_runs(fleet: Fleet, desired: DesiredState) -> None:
    plan = wait_converged(fleet, desired)
    host = "qfox-1"
    units = placed_units(plan, host)
    assert units, f"the plan places nothing on {host}: {plan.placements}"
    # No lane's jobs run on qfox-1, so its load is its services alone.
    assert not lanes_on(desired, host) and host not in desired.hosts_with_role("control")
    seen: dict[str, object] = {}

    def reports_what_runs() -> bool:
        running = active_units(fleet, host, units)
        record = node_records(fleet)[host]["record"]
        seen.update(running=sorted(running), in_flight=record["in_flight"], services_running=record["services_running"], units=record["units"])
        return (
            running == units
            and record["in_flight"] == len(running)
            and record["services_running"] == len(running)
            and all(record["units"].get(u) == "active" for u in running)
        )

    wait_for(reports_what_runs, timeout=BEAT_S, what=f"{host}'s heartbeat to report the services its systemd runs", interval=0.5)
    assert seen["in_flight"] == len(units) == seen["services_running"], seen
    # `fabric nodes` shows the same load as utilization of the host's limit.
    state = node_records(fleet)[host]
    assert state["utilization"] == state["record"]["in_flight"] / state["record"]["max_concurrent_tasks"], state


# --------------------------------------------------------------------------
# 2. One account of capacity on a real host


def test_a1_services_and_lane_jobs_share_its_limit(fleet: Fleet, desired: DesiredState, empty_lane_broker: None) -> None:
    host = "a1-arm64"
    plan = wait_converged(fleet, desired)
    record = node_records(fleet)[host]["record"]
    limit = record["max_concurrent_tasks"]
    # The host file declares 2; the replayed probe of the A1 allows 1, and
    # the probe's bound wins (no overrides.limits_above_probe), saying so.
    declared = desired.hosts[host].limits.max_concurrent_tasks
    assert declared is not None and 1 <= limit <= declared, record
    if limit < declared:
        assert any(f"max_concurrent_tasks {declared} lowered to {limit}" in note for note in record["lowered_limits"]), record
    services = len(placed_units(plan, host))
    card = lane_cards(fleet)[host]
    assert card["in_flight"] == 0 and card["host_free"] == limit - services, card
    room = min(card["cap"], limit - services)
    assert room > 0, f"{host}'s services fill its limit: {card}"

    # More jobs than a1-arm64 could ever take: it fills, the rest go elsewhere or wait.
    jobs = [f"fill-{n}" for n in range(limit + 1)]
    lane(fleet, "enqueue", *jobs)
    events = {e["job"]: e for e in dispatched(fleet)}
    on_a1 = [j for j in jobs if events[j]["lane"] == host]
    assert on_a1 == jobs[:room], events

    card = lane_cards(fleet)[host]
    assert card["in_flight"] == room and card["host_free"] == 0, card
    assert services + card["in_flight"] <= limit, (services, card)
    # Its card says which account ran out: the host's when its limit (services
    # and jobs) runs out before the lane's cap, else the lane's own cap.
    assert card["full"] == ("host" if room < card["cap"] else "cap"), card
    assert next_lane(fleet)["lane"] != host

    # The host's own heartbeat counts both: the services its systemd runs
    # plus the jobs on its lane, within its limit; the leader's plan places
    # no more services there than the limit leaves beside the jobs.
    units = placed_units(plan, host)
    seen: dict[str, object] = {}

    def measured_both() -> bool:
        running = active_units(fleet, host, units)
        record = node_records(fleet)[host]["record"]
        seen.update(running=sorted(running), record_in_flight=record["in_flight"], services_running=record["services_running"])
        return record["services_running"] == len(running) and record["in_flight"] == len(running) + room

    wait_for(measured_both, timeout=BEAT_S, what=f"{host}'s heartbeat to count its services and its lane's jobs", interval=0.5)
    assert seen["record_in_flight"] <= limit, seen
    with fleet.registry() as registry:
        newest = registry.newest_plan()
    assert newest is not None
    assert sum(1 for p in newest.placements if p.node == host) + lane_cards(fleet)[host]["in_flight"] <= limit, newest.placements


# --------------------------------------------------------------------------
# 3. Lane health from the hosts' heartbeats


def test_silent_lane_hosts_take_their_lanes_offline_and_jobs_go_elsewhere(
    fleet: Fleet, desired: DesiredState, lane_workers: LaneWorkers, empty_lane_broker: None
) -> None:
    plan = wait_converged(fleet, desired)
    control = desired.hosts_with_role("control")[0]
    # The local lane runs on the control host (lux), whose services fill the
    # 2 its host file declares: one account leaves the local lane no slot.
    # Declared one higher (its probe allows 6) it has room for one job.
    services = sum(1 for p in plan.placements if p.node == control)
    with declared_tasks(fleet, control, services + 1):
        stopped = lane_hosts_go_silent(fleet, desired, lane_workers)

    def online() -> bool:
        cards = lane_cards(fleet)
        return all(cards[h]["online"] and cards[h]["reason"] is None for h in stopped)

    wait_for(online, timeout=BACK_S, what=f"lanes {', '.join(stopped)} online again", interval=0.5)
    assert next_lane(fleet) == {"lane": "a1-arm64", "hold": None}
    wait_converged(fleet, desired, HOSTS)


def lane_hosts_go_silent(fleet: Fleet, desired: DesiredState, workers: LaneWorkers) -> list[str]:
    """a1-arm64's host, then x86-spill's, stop beating: the next job goes to
    the next lane each time; both are beating again when this returns (their
    names returned)."""
    wait_for(lambda: lane_cards(fleet)["local"]["host_free"], timeout=BEAT_S, what="room for the local lane on its host", interval=0.5)

    def all_online() -> dict | None:
        cards = lane_cards(fleet)
        return cards if all(v["online"] and v["reason"] is None for v in cards.values()) else None

    wait_for(
        all_online,
        timeout=BEAT_S,
        what="every lane online (its host active, its SAQ worker beating)",
        interval=0.5,
    )
    assert next_lane(fleet) == {"lane": "a1-arm64", "hold": None}
    gate = desired.fleet.scheduler.local_spill_after_s
    stopped: list[str] = []
    try:
        for host, then in (("a1-arm64", "x86-spill"), ("x86-spill", "local")):
            fleet.container(host).systemctl("stop", "fabric-reconcile.timer")
            stopped.append(host)

            def offline(host: str = host) -> dict | None:
                card = lane_cards(fleet)[host]
                return card if not card["online"] else None

            card = wait_for(offline, timeout=OFFLINE_S, what=f"lane {host} offline", interval=0.5)
            # The reason names the host and when it was last heard from.
            last_seen = node_records(fleet)[host]["last_seen"]
            assert card["reason"] == f"host {host} offline since {last_seen[11:19]}", (card, last_seen)
            assert CLOCK.fullmatch(card["reason"].rsplit(" ", 1)[1]), card
            assert next_lane(fleet) == {"lane": then, "hold": None}, lane_cards(fleet)

        # Every cloud lane offline: a job just enqueued goes local at once,
        # through the real queue, without waiting for the spill gate.
        lane(fleet, "enqueue", "live-local")
        (event,) = [e for e in dispatched(fleet) if e["job"] == "live-local"]
        assert event["lane"] == "local" and event["waited_s"] < gate, event
        local_queue = lane_cards(fleet)["local"]["queue"]
        wait_for(
            lambda: workers.running().get("live-local") == local_queue,
            timeout=BEAT_S,
            what="live-local running on phaze-local's worker",
            interval=0.2,
        )
        workers.finish("live-local")
    finally:
        for host in stopped:
            fleet.container(host).systemctl("start", "fabric-reconcile.timer")
    return stopped


# --------------------------------------------------------------------------
# 4. Real SAQ workers as the lane agents (issue 12's fleet Done-when)

AGENT_IMAGE_DIR = Path(__file__).resolve().parent / "agent_image"


def agent_launch(fleet: Fleet, desired: DesiredState, lane_id: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of lane `lane_id`'s rendered agent unit on
    its host: ExecStart's command after the image (what the image would run)
    and the unit's Environment=, files named there read through the
    container's root. phaze's image cannot run here (the containers' podman is
    tests/e2e/podman_standin.py), so the test runs that command itself, with
    this machine's Python for the image's (`python3`, `uv run`)."""
    (host,) = [lane.push_host for lane in desired.lanes if lane.id == lane_id]
    assert host is not None, lane_id
    container = fleet.container(host)
    unit = container.read_file(f"/etc/systemd/system/{agent_unit(lane_id)}")
    environment: dict[str, str] = {}
    command: list[str] = []
    for line in unit.splitlines():
        key, _, value = line.partition("=")
        if key == "Environment":
            name, _, setting = shlex.split(value)[0].partition("=")
            environment[name] = setting
        elif key == "ExecStart":
            argv = shlex.split(value)
            after_run = argv[argv.index("run") + 1 :]
            image = next(i for i, arg in enumerate(after_run) if not arg.startswith("-"))
            command = after_run[image + 1 :]
    assert command, unit
    if command[:2] == ["python3", "-m"]:
        command = [sys.executable, "-m", *command[2:]]
    elif command[:2] == ["uv", "run"]:
        command = [str(Path(sys.executable).parent / command[2]), *command[3:]]
    for name, setting in list(environment.items()):
        if name.endswith("_FILE"):
            environment[name] = str(container.host_path(setting))
    return command, environment


@contextmanager
def running_agent(fleet: Fleet, desired: DesiredState, lane_id: str, processed: Path, **overrides: str | None) -> Iterator[subprocess.Popen[bytes]]:
    """Lane `lane_id`'s agent (agent_launch) with `overrides` of its
    environment (None: the variable left out), stopped by its PID afterwards.
    MODELS_PATH is the models directory the container would get bound there."""
    command, environment = agent_launch(fleet, desired, lane_id)
    models = processed / "models"
    models.mkdir(exist_ok=True)
    env = {**os.environ, **environment, "MODELS_PATH": str(models), "PYTHONPATH": str(AGENT_IMAGE_DIR), "FABRIC_E2E_PROCESSED_DIR": str(processed)}
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    log = open(processed / f"{lane_id}.log", "ab")
    agent = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        yield agent
    finally:
        stop_agent(agent)


def stop_agent(agent: subprocess.Popen[bytes]) -> None:
    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()


# The steering of the phaze fleet below: a lane dead (or back) this long changes backends.toml.
STEERING_WINDOW_S = 2 * SETTINGS.heartbeat_s


@contextmanager
def phaze_fleet(fleet: Fleet, api_url: str) -> Iterator[DesiredState]:
    """The fleet as a phaze fleet: fabric.toml names phaze's agent API
    (`api_url`, the stub) with a short steering window and no restart
    interval, on every host and for this client, as a pull would bring it;
    the fabric's own lanes again afterwards."""
    lines = f'api_url = "{api_url}"\nsteering_window_s = {STEERING_WINDOW_S}\nrestart_interval_s = 0\n'
    copies = [fleet.desired_dir / "fabric.toml", fleet.client_desired_dir / "fabric.toml"]
    originals = {path: path.read_text() for path in copies}
    inside = {h: fleet.container(h).read_file(f"{DESIRED_DIR}/fabric.toml") for h in HOSTS if fleet.hosts[h].running}

    def phaze(text: str) -> str:
        assert "[phaze]\n" in text and "api_url" not in text
        return text.replace("[phaze]\n", "[phaze]\n" + lines, 1)

    for path, text in originals.items():
        path.write_text(phaze(text))
    for host, text in inside.items():
        fleet.container(host).write_file(f"{DESIRED_DIR}/fabric.toml", phaze(text))
    try:
        yield load_desired(fleet.desired_dir)
    finally:
        for path, text in originals.items():
            path.write_text(text)
        for host, text in inside.items():
            fleet.container(host).write_file(f"{DESIRED_DIR}/fabric.toml", text)


def lux_backends(fleet: Fleet) -> list[str]:
    """The lanes phaze may choose: /etc/phaze/backends.toml on the control host."""
    control = fleet.container("lux")
    return [b["id"] for b in tomllib.loads(control.read_file("/etc/phaze/backends.toml")).get("backends", [])]


def phaze_queue_keys(fleet: Fleet) -> dict[str, list[str]]:
    """saq_jobs' keys on every phaze-agent-* queue."""
    with psycopg.connect(fleet.queue_url) as conn:
        rows = conn.execute("SELECT queue, key FROM saq_jobs WHERE queue LIKE %s ORDER BY queue, key", ("phaze-agent-%",)).fetchall()
    keys: dict[str, list[str]] = {}
    for queue, key in rows:
        keys.setdefault(queue, []).append(key)
    return keys


def refuses_without_its_role(fleet: Fleet, phaze: DesiredState, processed: Path) -> None:
    """One variable of the rendered environment missing: phaze's agent refuses to start."""
    with running_agent(fleet, phaze, "a1-arm64", processed, PHAZE_ROLE=None) as refused:
        refused.wait(timeout=60)
        assert refused.returncode != 0
    assert "agent_worker requires PHAZE_ROLE=agent" in (processed / "a1-arm64.log").read_text()


def test_phaze_shaped_agents_lanes_and_steering(fleet: Fleet, desired: DesiredState, tmp_path: Path) -> None:
    """issue 33's Done-when, phaze-shaped. The fleet becomes a phaze fleet:
    the stand-in agents (tests/e2e/agent_image, phaze's agent at its edges)
    start only with the rendered environment (one variable removed: they
    refuse), ask phaze's agent API (a stub) who they are and beat on their
    -analyze queues; the lane cards show them online with their real
    in_flight; phaze-format process_file jobs enqueued as phaze's control
    plane does are processed; a1-arm64's agent stopped takes its lane offline
    and, after the steering window, out of lux's backends.toml, and back in
    once the agent is back; the fabric wrote no job to any phaze-agent-* queue."""
    wait_converged(fleet, desired)
    server, api_url, asked = serve(AGENT_TOKENS, host="127.0.0.1")
    processed = tmp_path / "processed"
    processed.mkdir()
    try:
        with phaze_fleet(fleet, api_url) as phaze:
            queues = {lane.id: phaze.queue_for(lane) or "" for lane in phaze.lanes}
            assert queues["a1-arm64"] == "phaze-agent-a1-arm64-analyze", queues

            def rendered(host: str, lane_id: str) -> bool:
                return "PHAZE_ROLE=agent" in fleet.container(host).read_file(f"/etc/systemd/system/{agent_unit(lane_id)}")

            wait_for(
                lambda: rendered("a1-arm64", "a1-arm64") and rendered("x86-spill", "x86-spill"),
                timeout=2 * BEAT_S,
                what="complete agent units",
                interval=0.5,
            )

            refuses_without_its_role(fleet, phaze, processed)

            with running_agent(fleet, phaze, "a1-arm64", processed) as a1_agent, running_agent(fleet, phaze, "x86-spill", processed):

                def agents_online() -> dict | None:
                    cards = lane_cards(fleet)
                    return cards if all(cards[h]["online"] and cards[h]["workers"] for h in ("a1-arm64", "x86-spill")) else None

                cards = wait_for(agents_online, timeout=OFFLINE_S, what="both agents beating on their -analyze queues", interval=0.5)
                assert sorted(asked) == ["a1-arm64", "x86-spill"]
                assert (cards["a1-arm64"]["queue"], cards["a1-arm64"]["in_flight"]) == (queues["a1-arm64"], 0), cards

                # phaze's control plane enqueues a pushed file for a1-arm64's agent.
                payload = phaze_payload("0e2e0000-0000-4000-8000-000000000001", "a1-arm64")
                enqueue_as_phaze(fleet.queue_url, queues["a1-arm64"], [payload])
                wait_for(
                    lambda: (processed / payload["file_id"]).exists(), timeout=BEAT_S, what="a1-arm64's agent processing phaze's job", interval=0.2
                )
                assert (processed / payload["file_id"]).read_text().strip() == queues["a1-arm64"]

                # a1-arm64's agent stops: offline, then out of backends.toml after the window.
                stop_agent(a1_agent)
                card = wait_for(
                    lambda: (c := lane_cards(fleet)["a1-arm64"]) and (None if c["online"] else c),
                    timeout=OFFLINE_S,
                    what="lane a1-arm64 offline",
                    interval=0.5,
                )
                assert card["reason"].startswith(f"no SAQ worker on {queues['a1-arm64']}"), card
                steer_s = deadline_for(STEERING_WINDOW_S + LEADER_STEP_S) + BEAT_S
                # (x86-spill, dead until its agent started, is back in by now or within a window.)
                wait_for(
                    lambda: lux_backends(fleet) == ["x86-spill", "local"], timeout=steer_s, what="a1-arm64 out of lux's backends.toml", interval=0.5
                )

                with running_agent(fleet, phaze, "a1-arm64", processed):
                    wait_for(lambda: lane_cards(fleet)["a1-arm64"]["online"], timeout=OFFLINE_S, what="lane a1-arm64 online again", interval=0.5)
                    wait_for(
                        lambda: lux_backends(fleet) == ["a1-arm64", "x86-spill", "local"],
                        timeout=steer_s,
                        what="a1-arm64 back in lux's backends.toml",
                        interval=0.5,
                    )

            # The fabric wrote no job to any phaze-agent-* queue: only phaze's own (process_file:<file_id>).
            assert phaze_queue_keys(fleet) == {queues["a1-arm64"]: [f"process_file:{payload['file_id']}"]}
    finally:
        server.shutdown()
        server.server_close()
    wait_converged(fleet, desired)
