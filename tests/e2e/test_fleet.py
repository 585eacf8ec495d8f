"""The example fleet end to end: the scenarios of the seed's "Verification".

One fleet for the whole module (tests/e2e/fleet.py: five systemd containers on
a bridge, etcd over TLS with auth on, a real Caddy on the edge, every host's own
fabric-reconcile.timer and, on lux and qfox-1, fabric-leader.service). Signed
plans and per-host identities are on: lux and qfox-1 sign with throwaway plan
keys (only they hold theirs), every host talks to etcd with its own client
certificate, and this test client acts as fabric-admin (reads), lux (lane
jobs) or root (a forger). The scenarios run in file order and each leaves the
fleet converged for the next:

    converge -> forged plan (refused everywhere, replaced by the leader) ->
    a host's identity (cannot write the plan or another's heartbeat) ->
    node loss (qfox-1 off) -> node join (qfox-1 back) -> burst
    (lane slots) -> flapping (x86-spill) -> registry outage (etcd off/on) ->
    leader failure (the leader's host killed) -> audit (the journal) ->
    a new machine joins (pending, `fabric admit`, given work and routed to)

Every wait is a bounded poll of what the fleet shows (the registry, systemd
in the containers, HTTP through the edge); the bounds only stop a broken run.
What is asserted is behaviour: where work runs, which units were restarted,
who leads, what the edge answers.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from reconciler.core.desired.model import TIER_SCORE, DesiredState
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.signing import verify_plan
from reconciler.core.render.status_site import status_site_address
from tests.conftest import require
from tests.e2e.conftest import SETTINGS
from tests.e2e.fleet import (
    DESIRED_DIR,
    ETCD_CERT_FILE,
    ETCD_KEY_FILE,
    FABRIC_BIN,
    PLAN_KEY_FILE,
    PROBE_FIXTURES,
    ROOT,
    Fleet,
    converged,
    e2e_host_file,
    edge_reaches,
    expected_units,
    in_container,
    newest_plan,
    node_status,
    placed,
    routed_services,
    running_agents,
    span_seconds,
    wait_for,
)
from tests.support.e2e import CONVERGE_S, HOSTS, dispatched, drain_lanes, lane, wait_converged
from tests.support.harness.saq_workers import LaneWorkers
from tests.support.harness.waiting import deadline_for
from tests.support.raw_plans import put_plan

pytestmark = pytest.mark.e2e

# Bounds of the polls (a broken run fails after these; a working one is far faster).
REACT_S = 60.0
# The leader steps three times per lease TTL (timing.heartbeat_s) and a step
# that finds a plan it cannot verify publishes at once: a few TTLs at most,
# scaled for a loaded machine (five containers and two leaders on two cores).
LEADER_STEP_S = deadline_for(3.0 * SETTINGS.heartbeat_s)
IDENTITY_PROBE = Path(__file__).resolve().parent / "identity_probe.py"
UNSIGNED = "is not signed, and fabric.toml lists plan keys: running static"


# --------------------------------------------------------------------------
# Fixtures and what the tests read


def invocations(fleet: Fleet, hosts: tuple[str, ...]) -> dict[tuple[str, str], str]:
    return {(host, unit): inv for host in hosts for unit, inv in running_agents(fleet, host).items()}


def assert_not_restarted(before: dict[tuple[str, str], str], after: dict[tuple[str, str], str]) -> None:
    """Every agent that ran before and still runs kept its InvocationID: it was not restarted."""
    restarted = sorted(f"{host}:{unit}" for (host, unit), inv in before.items() if (host, unit) in after and after[(host, unit)] != inv)
    assert not restarted, f"restarted without need: {restarted}"


def assert_each_placed_once(plan: FleetPlan, fleet: Fleet, hosts: tuple[str, ...]) -> None:
    """No work placed twice: one placement per (service, replica), and a
    service's agent runs on exactly the hosts it is placed on."""
    keys = [(p.service, p.replica) for p in plan.placements]
    assert len(keys) == len(set(keys)), f"a replica placed twice: {keys}"
    for service, nodes in placed(plan).items():
        running_on = sorted(h for h in hosts if f"fabric-agent-{service}.service" in running_agents(fleet, h))
        assert running_on == sorted(set(nodes)), f"{service}: placed on {nodes}, running on {running_on}"


def assert_replicas_on_distinct_nodes(plan: FleetPlan) -> None:
    """A host runs one agent unit per service (one port): two replicas of a
    service on one node would be one replica running."""
    for service, nodes in placed(plan).items():
        assert len(nodes) == len(set(nodes)), f"{service}: two replicas on one node: {nodes}"


# --------------------------------------------------------------------------
# 0. The fleet itself


def test_topology(fleet: Fleet, desired: DesiredState) -> None:
    """Every host is a booted systemd with the fabric's own units running, the
    candidates elect one leader over etcd on the bridge, every host's passes
    succeed, and the edge's Caddy answers for every route with the fabric's config."""
    for host in HOSTS:
        container = fleet.container(host)
        assert container.run("hostname").stdout.strip() == host
        assert container.systemctl("is-active", "fabric-reconcile.timer").stdout.strip() == "active", host
        leader_unit = container.systemctl("is-active", "fabric-leader.service").stdout.strip()
        assert leader_unit == ("active" if host in desired.fleet.fleet.leader_candidates else "inactive"), host
        assert container.run("ip", "-4", "-o", "addr", "show", "eth0").stdout.split()[3] == f"{fleet.settings.host_address(host)}/24"
        # Its own etcd identity at the fleet-wide paths (CN = its name, key
        # 0600); a plan signing key only on a candidate, and only its own.
        cert = x509.load_pem_x509_certificate(container.host_path(ETCD_CERT_FILE).read_bytes())
        assert [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)] == [host]
        assert container.host_path(ETCD_KEY_FILE).stat().st_mode & 0o777 == 0o600, host
        plan_key = container.host_path(PLAN_KEY_FILE)
        if host in desired.fleet.fleet.leader_candidates:
            assert plan_key.stat().st_mode & 0o777 == 0o600, host
            assert plan_key.read_bytes() == (fleet.keys_dir / f"{host}.key").read_bytes(), host
        else:
            assert not plan_key.exists(), host

    def passes_succeeded() -> bool:
        return all(
            "Finished fabric-reconcile.service" in fleet.journal(h, "-u", "fabric-reconcile.service", "-o", "cat")
            or "Deactivated successfully" in fleet.journal(h, "-u", "fabric-reconcile.service", "-o", "cat")
            for h in HOSTS
        )

    wait_for(passes_succeeded, timeout=CONVERGE_S, what="a successful pass on every host", interval=0.5)

    def one_leader():
        with fleet.registry() as registry:
            return registry.leader()

    leader = wait_for(one_leader, timeout=CONVERGE_S, what="a leader", interval=0.5)
    assert leader.candidate in desired.fleet.fleet.leader_candidates
    # The edge loaded the fabric's sites: every route answers over HTTPS (a
    # certificate from local_certs), from the service, with the fabric's "not
    # running anywhere" page, or 502/503 while its upstream is not up yet.
    for service, host_name in routed_services(desired).items():
        status, body = wait_for(
            lambda h=host_name: (lambda r: r if r[0] in (200, 502, 503) else None)(fleet.request(h)),
            timeout=CONVERGE_S,
            what=f"the edge to answer for {host_name}",
        )
        assert status != 200 or body.startswith(service), (status, body)


# --------------------------------------------------------------------------
# 1. Converge


def test_converge(fleet: Fleet, desired: DesiredState) -> None:
    plan = wait_converged(fleet, desired)
    with fleet.registry() as registry:
        leader = registry.leader()
        states = {s.node_id: s for s in registry.node_states()}
    assert leader is not None and leader.candidate in desired.fleet.fleet.leader_candidates
    # The plan the fleet runs is signed by its leader's (throwaway) key.
    assert verify_plan(plan, desired.fleet.plan_keys) is None, plan.signature
    assert plan.signature is not None and plan.signature.key_id == f"{plan.leader}-e2e", plan.signature
    assert set(states) == set(HOSTS)
    # The tiers come from the replayed probes (lux's gpu_apu pinned to
    # cpu_ffmpeg by its host file).
    tiers = {h: states[h].record.tier for h in HOSTS if states[h].record is not None}
    assert tiers == {"qfox-1": "gpu_cuda", "lux": "cpu_ffmpeg", "a1-arm64": "cpu_ffmpeg", "x86-spill": "cpu_ffmpeg", "racknerd": "relay"}
    # Services on the tiers the rules demand: at or above min_tier, else a
    # fallback no lower than the floor; CUDA-only lupine on the CUDA box.
    for p in plan.placements:
        service = desired.service(p.service)
        assert service is not None
        assert TIER_SCORE[p.tier] >= TIER_SCORE[service.floor], p
        assert p.fallback == (TIER_SCORE[p.tier] < TIER_SCORE[service.min_tier]), p
        assert p.tier == tiers[p.node], p
    assert placed(plan)["lupine"] == ["qfox-1"]
    assert len(placed(plan)["flac-fft"]) == 2
    assert not plan.deferred, plan.deferred
    assert_each_placed_once(plan, fleet, HOSTS)
    # A request through the edge reaches each routed service where it runs.
    assert set(edge_reaches(fleet, desired, plan)) == set(routed_services(desired))


def test_replicas_of_a_service_run_on_distinct_nodes(fleet: Fleet, desired: DesiredState) -> None:
    assert_replicas_on_distinct_nodes(wait_converged(fleet, desired))


# --------------------------------------------------------------------------
# 1b. Signed plans: a forged plan


def pass_journal(fleet: Fleet, host: str, since: str, *matches: str) -> str:
    return fleet.journal(host, "-t", "fabric-reconcile", *matches, "--since", since, "-o", "cat")


def container_now(fleet: Fleet, host: str) -> str:
    return fleet.container(host).run("date", "+%Y-%m-%d %H:%M:%S").stdout.strip()


def put_raw_plan(fleet: Fleet, desired: DesiredState, plan: FleetPlan) -> FleetPlan:
    """What a plain etcd client can do: put JSON under the plan key, numbered
    above the registry's epoch. As root: a host's identity cannot write the
    plan (test_a_hosts_identity_writes_only_its_own_keys)."""
    prefix = desired.fleet.registry.prefix.rstrip("/")
    with fleet.registry(ROOT) as registry:
        forged = plan.model_copy(update={"epoch": registry.epoch() + 1})

        async def put(client) -> None:
            await client.put(f"{prefix}/epoch".encode(), str(forged.epoch).encode())
            await put_plan(client, prefix, forged)

        registry._call(put, f"a put of {prefix}/plan-index")
    return forged


def test_a_forged_plan_is_refused_everywhere_and_the_leader_replaces_it(fleet: Fleet, desired: DesiredState) -> None:
    """A plan with the leader's name and a higher epoch but no signature:
    every host refuses it, keeps its generation and says why; the work it
    moves never moves; the leader's next step publishes a signed plan over it.

    The leader replaces a forged plan within a step (a fraction of a second),
    faster than a pass comes round, so the forger keeps putting it back until
    every host has met it; each put is a new plan (a higher epoch)."""
    keys = desired.fleet.plan_keys
    before = wait_converged(fleet, desired)
    since = {h: container_now(fleet, h) for h in HOSTS}
    # Work where the scheduler never puts it: VA-API encoding on the
    # relay-tier edge, below the service's floor.
    edge = fleet.edge
    moved = [p.model_copy(update={"node": edge, "tier": "relay"}) if p.service == "vaapi-encode" else p for p in before.placements]
    template = before.model_copy(update={"placements": moved, "signature": None})
    encode_host = routed_services(desired)["vaapi-encode"]
    forged: list[FleetPlan] = []
    violations: list[str] = []
    refused: dict[str, str] = {}

    def every_host_refused() -> bool:
        with fleet.registry() as registry:
            newest = registry.newest_plan()
        if newest is None or newest.signature is not None:  # the leader replaced it (or none yet)
            forged.append(put_raw_plan(fleet, desired, template))
        # The forged placement never runs, and the edge never sends there.
        if "fabric-agent-vaapi-encode.service" in running_agents(fleet, edge):
            violations.append(f"{edge} runs fabric-agent-vaapi-encode.service")
        status, body = fleet.request(encode_host)
        if body.strip() == f"vaapi-encode on {edge}":
            violations.append(f"the edge answered {body.strip()!r}")
        for host in set(HOSTS) - set(refused):
            text = pass_journal(fleet, host, since[host], "FABRIC_ACTION=static")
            if UNSIGNED in text:
                refused[host] = text
        return set(refused) == set(HOSTS)

    wait_for(every_host_refused, timeout=REACT_S, what="every host to refuse the unsigned plan", interval=0.2)
    assert not violations, violations
    # Each host said why, in its journal's static record, and kept its
    # generation (the record names the generation that stays running).
    for host, text in refused.items():
        (line,) = [line for line in text.splitlines() if UNSIGNED in line][:1]
        assert re.match(r"static: ok \(generation \d+\): refused: plan epoch \d+ is not signed", line), (host, line)
        assert int(line.split("refused: plan epoch ")[1].split()[0]) in {p.epoch for p in forged}, (host, line)

    # The forger stops; the leader's next step publishes a signed plan over the last forgery.
    last = forged[-1].epoch

    def signed_over_forgery() -> FleetPlan | None:
        with fleet.registry() as registry:
            newest = registry.newest_plan()
        return newest if newest is not None and newest.epoch > last and verify_plan(newest, keys) is None else None

    healed = wait_for(signed_over_forgery, timeout=LEADER_STEP_S, what=f"the leader to publish a signed plan over epoch {last}", interval=0.1)
    assert healed.leader in desired.fleet.fleet.leader_candidates and healed.signature is not None
    after = wait_converged(fleet, desired)
    assert verify_plan(after, keys) is None
    assert edge not in placed(after).get("vaapi-encode", []), placed(after)
    # The leader rescheduled from its own last plan, not from the forgery's
    # or from none: nothing moved.
    assert placed(after) == placed(before), (placed(before), placed(after))
    assert set(edge_reaches(fleet, desired, after)) == set(routed_services(desired))


def test_a_hosts_identity_writes_only_its_own_keys(fleet: Fleet, desired: DesiredState) -> None:
    """x86-spill, with the certificate installed in its container, can write
    neither the plan nor lux's heartbeat (nor a drain): etcd refuses, and
    the fleet is as it was."""
    wait_converged(fleet, desired)
    spill = fleet.container("x86-spill")
    done = spill.run("/usr/bin/python3", in_container(IDENTITY_PROBE), DESIRED_DIR, "lux")
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    for attempt in ("heartbeat of lux", "plan"):
        assert results[attempt].startswith("PermissionDenied: ") and "permission denied" in results[attempt], (attempt, results)
        assert ETCD_CERT_FILE in results[attempt], results[attempt]  # the host's own identity
    drain = spill.run(FABRIC_BIN, "drain", "lux", "--desired", DESIRED_DIR)
    assert drain.returncode == 1 and "permission denied" in drain.stderr, (drain.returncode, drain.stderr)
    # Nothing of it landed: lux is active with its own record, the plan is signed.
    with fleet.registry() as registry:
        states = {s.node_id: s for s in registry.node_states()}
        plan = registry.newest_plan()
        (lux_node,) = [n for n in registry.snapshot().nodes if n.node_id == "lux"]
    lux = states["lux"]
    assert lux.status == "active" and lux.record is not None and lux.record.tier == "cpu_ffmpeg", lux
    assert not lux_node.drained and lux_node.tier == "cpu_ffmpeg", lux_node
    assert plan is not None and verify_plan(plan, desired.fleet.plan_keys) is None, plan
    wait_converged(fleet, desired)


# --------------------------------------------------------------------------
# 2. Node loss


def test_node_loss_replaces_work_and_the_edge_follows(fleet: Fleet, desired: DesiredState) -> None:
    before_plan = wait_converged(fleet, desired)
    survivors = tuple(h for h in HOSTS if h != "qfox-1")
    before = invocations(fleet, survivors)

    fleet.stop_host("qfox-1")

    after_plan = wait_converged(fleet, desired, survivors, timeout=REACT_S)
    assert node_status(fleet)["qfox-1"] == "offline"
    assert after_plan.epoch > before_plan.epoch
    # VA-API falls back to cpu_ffmpeg (no gpu_vaapi or gpu_apu node is left:
    # lux pins its iGPU away), never below that floor.
    (vaapi,) = [p for p in after_plan.placements if p.service == "vaapi-encode"]
    assert vaapi.fallback and vaapi.tier == "cpu_ffmpeg", vaapi
    # CUDA-only lupine is deferred, with its reason.
    (lupine,) = [d for d in after_plan.deferred if d.service == "lupine"]
    assert "gpu_cuda" in lupine.reason
    assert "lupine" not in placed(after_plan)
    # The edge follows (checked by wait_converged) and nothing that kept its
    # place was restarted.
    assert_not_restarted(before, invocations(fleet, survivors))
    assert_each_placed_once(after_plan, fleet, survivors)
    # Audit: the host that took VA-API over says so in its journal.
    assert "fabric-agent-vaapi-encode.service" in fleet.journal(vaapi.node, "-t", "fabric-reconcile", "-o", "cat")


# --------------------------------------------------------------------------
# 3. Node join


def test_node_join_absorbs_capacity_and_moves_nothing(fleet: Fleet, desired: DesiredState) -> None:
    survivors = tuple(h for h in HOSTS if h != "qfox-1")
    before_plan = wait_converged(fleet, desired, survivors)
    before = invocations(fleet, survivors)

    fleet.start_host("qfox-1")

    def lupine_placed() -> FleetPlan | None:
        plan = converged(fleet, desired, HOSTS)
        return plan if plan is not None and "lupine" in placed(plan) else None

    after_plan = wait_for(lupine_placed, timeout=CONVERGE_S, what="qfox-1 to rejoin and take lupine", interval=0.5)
    # The deferred CUDA work goes to the new capacity ...
    assert placed(after_plan)["lupine"] == ["qfox-1"]
    assert not after_plan.deferred
    # ... and nothing already running moves.
    kept = {(p.service, p.replica): p.node for p in before_plan.placements}
    now = {(p.service, p.replica): p.node for p in after_plan.placements}
    assert {k: now.get(k) for k in kept} == kept
    assert_not_restarted(before, invocations(fleet, survivors))


# --------------------------------------------------------------------------
# 4. Burst: lane jobs faster than the lanes drain


def test_burst_fills_lanes_by_rank_and_holds_with_reasons(fleet: Fleet, desired: DesiredState, lane_workers: LaneWorkers) -> None:
    # A lane takes jobs while its cap and its host's capacity beside the
    # services placed there both have room (one account per host). Each
    # lane's queue has its SAQ worker (lane_workers), so every lane is online.
    def all_online() -> dict | None:
        views = {v["id"]: v for v in lane(fleet, "status")[0]["lanes"]}
        return views if all(v["online"] for v in views.values()) else None

    views = wait_for(all_online, timeout=REACT_S, what="every lane online (its host active, its SAQ worker beating)", interval=0.5)
    room = {i: min(v["cap"] - v["in_flight"], v["cap"] if v["host_free"] is None else v["host_free"]) for i, v in views.items()}
    said = {i: (v["online"], v["reason"], v["in_flight"], v["host_free"]) for i, v in views.items()}
    # a1-arm64's probe bounds it to one task: when a service placed there
    # holds it, its lane has no room and says its host is full, and the
    # burst starts on x86-spill (the next rank) at once.
    if room["a1-arm64"] == 0:
        assert views["a1-arm64"]["full"] == "host", said
    caps = {i: views[i]["in_flight"] + room[i] for i in views}
    gate = desired.fleet.scheduler.local_spill_after_s
    cloud = room["a1-arm64"] + room["x86-spill"]
    jobs = [f"burst-{n}" for n in range(cloud + room["local"] + 1)]
    # The job system enqueues a burst at once; nothing finishes meanwhile.
    lane(fleet, "enqueue", *jobs)
    events = {e["job"]: e for e in dispatched(fleet)}
    started = [(job, events[job]["lane"]) for job in jobs if events[job]["lane"]]
    # Rank first: a1-arm64 fills to its room, then x86-spill spills over ...
    a1 = room["a1-arm64"]
    assert started == [(j, "a1-arm64") for j in jobs[:a1]] + [(j, "x86-spill") for j in jobs[a1:cloud]], events
    # ... and local is not reached yet: the rest wait, each with its reason
    # (the spill gate, or no slot at all when lux's services fill its limit).
    wait = "local_spill_not_reached" if room["local"] else "no_free_slots"
    assert {events[j]["hold"] for j in jobs[cloud:]} == {wait}, (said, events)

    # Local takes one job (its cap) once that job has waited past the gate.
    def local_started() -> dict | None:
        for event in dispatched(fleet):
            if event["lane"] == "local":
                return event
        return None

    if room["local"]:
        spilled = wait_for(local_started, timeout=gate + REACT_S, what="a job spilling to local", interval=0.5)
        assert spilled["job"] == jobs[cloud] and spilled["waited_s"] >= gate, spilled
    # Every lane full now: the last job holds for a free slot.
    (last,) = [e for e in dispatched(fleet) if e["job"] == jobs[-1]]
    assert last["lane"] is None and last["hold"] == "no_free_slots", last
    status = lane(fleet, "status")[0]
    assert {v["id"]: v["in_flight"] for v in status["lanes"]} == caps, status["lanes"]
    assert all(v["full"] is not None for v in status["lanes"]), status["lanes"]
    # Each started job runs on the SAQ worker of the lane the rules chose.
    queues = {v["id"]: v["queue"] for v in status["lanes"]}
    if room["local"]:
        started.append((spilled["job"], "local"))
    wait_for(
        lambda: all(lane_workers.running().get(j) == queues[b] for j, b in started),
        timeout=REACT_S,
        what="the started jobs running on their lanes' workers",
        interval=0.2,
    )

    # A job that finishes on its worker frees its slot (a1-arm64's, or
    # x86-spill's when a1-arm64 had no room); the next dispatch settles it and
    # the held one takes it: the only free slot.
    lane_workers.finish(jobs[0])

    def held_one_moved() -> dict | None:
        return next((e for e in dispatched(fleet) if e["job"] == jobs[-1] and e["lane"]), None)

    moved = wait_for(held_one_moved, timeout=REACT_S, what=f"{jobs[-1]} to take the freed slot", interval=0.2)
    assert moved["lane"] == started[0][1], (moved, started)

    drain_lanes(fleet, lane_workers, REACT_S)
    status = lane(fleet, "status")[0]
    assert not any(v["in_flight"] for v in status["lanes"]), status["lanes"]


# --------------------------------------------------------------------------
# 5. Flapping


def test_flapping_node_is_held_off(fleet: Fleet, desired: DesiredState) -> None:
    wait_converged(fleet, desired)
    flaky = "x86-spill"
    container = fleet.container(flaky)
    toggles = desired.fleet.flap.toggles
    # A node whose passes stop and start: its heartbeats come and go (its
    # agents keep running, as on a machine with a flaky uplink).
    for toggle in range(toggles):
        going_down = toggle % 2 == 0
        container.systemctl("stop" if going_down else "start", "fabric-reconcile.timer")
        want = "offline" if going_down else "active"
        wait_for(lambda want=want: node_status(fleet).get(flaky) == want, timeout=REACT_S, what=f"{flaky} {want} (toggle {toggle + 1})", interval=0.2)
    container.systemctl("start", "fabric-reconcile.timer")
    wait_for(lambda: node_status(fleet).get(flaky) == "active", timeout=REACT_S, what=f"{flaky} back", interval=0.2)
    with fleet.registry() as registry:
        snapshot = registry.snapshot()
        state = {s.node_id: s for s in registry.node_states()}[flaky]
    assert state.held_off(snapshot.now), state
    # Held off for the hold-off time, counted from the toggle that tipped it.
    hold = [t for t in state.transitions if t.status == "held_off"][-1]
    assert state.held_off_until is not None
    assert abs((state.held_off_until - hold.at).total_seconds() - desired.fleet.flap.hold_off_s) < 1, (hold, state.held_off_until)
    nodes = fleet.fabric("nodes")
    assert nodes.returncode == 0, nodes.stderr
    (row,) = [line for line in nodes.stdout.splitlines() if line.startswith(flaky)]
    assert row.split()[-1] != "-", row  # the HELD OFF UNTIL column
    # No new work while the hold lasts: a task only this node's label matches
    # is deferred, and the reason names the hold.
    (node,) = [n for n in snapshot.nodes if n.node_id == flaky]
    role = "topology.researchstack.io/role"
    done = fleet.fabric("dispatch", "--min-tier", "cpu_ffmpeg", "--label", f"{role}={node.labels[role]}", "--json")
    decision = json.loads(done.stdout)
    assert decision["node"] is None and f"{flaky} held off" in decision["reason"], decision


# --------------------------------------------------------------------------
# 6. Registry outage


def test_registry_outage_fails_static_and_recovers(fleet: Fleet, desired: DesiredState) -> None:
    plan = wait_converged(fleet, desired)
    before = invocations(fleet, HOSTS)
    since = {h: container_now(fleet, h) for h in HOSTS}

    fleet.stop_etcd()
    try:
        # Every host says it runs static (its last generation) ...
        for host in HOSTS:
            wait_for(
                lambda h=host: "static" in pass_journal(fleet, h, since[h]).lower(),
                timeout=REACT_S,
                what=f"{host} to say it runs static",
                interval=0.5,
            )
        # ... and keeps serving it: nothing stopped or restarted, the edge answers.
        assert invocations(fleet, HOSTS) == before
        assert set(edge_reaches(fleet, desired, plan)) == set(routed_services(desired))
    finally:
        fleet.start_etcd()
    after = wait_converged(fleet, desired)
    assert placed(after) == placed(plan)
    assert_not_restarted(before, invocations(fleet, HOSTS))


# --------------------------------------------------------------------------
# 7. Leader failure


def test_leader_failure_another_candidate_leads(fleet: Fleet, desired: DesiredState) -> None:
    wait_converged(fleet, desired)
    with fleet.registry() as registry:
        old = registry.leader()
        old_epoch = registry.epoch()
    assert old is not None
    successor = next(c for c in desired.fleet.fleet.leader_candidates if c != old.candidate)

    fleet.kill_host(old.candidate)  # SIGKILL: no resignation, the lease must lapse

    def new_leader():
        with fleet.registry() as registry:
            info = registry.leader()
        return info if info is not None and info.candidate == successor else None

    info = wait_for(new_leader, timeout=REACT_S, what=f"{successor} to lead", interval=0.1)
    assert info.epoch > old_epoch
    rest = tuple(h for h in HOSTS if h != old.candidate)
    plan = wait_converged(fleet, desired, rest, timeout=REACT_S)
    assert plan.leader == successor and plan.epoch > old_epoch
    assert_each_placed_once(plan, fleet, rest)
    fleet.start_host(old.candidate)
    wait_converged(fleet, desired)


# --------------------------------------------------------------------------
# 8. Audit


def test_audit_journal_shows_the_actions(fleet: Fleet, desired: DesiredState) -> None:
    """`journalctl -t fabric-reconcile` on each host shows what its passes did:
    every agent it runs was started by an audited action, the edge loaded Caddy,
    and the registry outage's static passes were recorded (hosts that were not
    restarted since)."""
    plan = wait_converged(fleet, desired)

    def missing_entries() -> list[str]:
        missing = []
        for host in HOSTS:
            text = fleet.journal(host, "-t", "fabric-reconcile", "-o", "cat")
            for unit in sorted(expected_units(desired, plan, host)):
                if not re.search(rf"^start {re.escape(unit)}: ok \(generation \d+\)", text, re.M):
                    missing.append(f"{host}: start {unit}")
            if not re.search(r"^(generation \d+ is active|nothing to do)", text, re.M):
                missing.append(f"{host}: a pass outcome")
        edge = fleet.journal("racknerd", "-t", "fabric-reconcile", "-o", "cat")
        if not re.search(r"^caddy-load etc/caddy/fabric.caddy: ok", edge, re.M):
            missing.append("racknerd: caddy-load")
        a1 = fleet.journal("a1-arm64", "-t", "fabric-reconcile", "-o", "cat")
        if "static" not in a1:
            missing.append("a1-arm64: the registry outage's static pass")
        if UNSIGNED not in a1:
            missing.append("a1-arm64: the forged plan's refusal")
        return missing

    # journald takes entries in asynchronously: poll until they are all there.
    missing: list[str] = []

    def complete() -> bool:
        missing[:] = missing_entries()
        return not missing

    try:
        wait_for(complete, timeout=REACT_S, what="the audit entries", interval=0.5)
    except AssertionError:
        pytest.fail(f"audit entries missing from the journals: {missing}")


# --------------------------------------------------------------------------
# 9. A new machine joins (issue 31): pending, admitted, given work.
#
# pending    a sixth container with the fabric installed (node.toml, the
#            units `fabric units` renders, its timer) and no host file:
#            the probe capture of a CUDA server (multi-gpu-server) with its
#            tailnet address on the bridge, and only the joining identity.
#            Its first pass reports it pending with its probed tier; it is
#            never a node: no placement, no route, no rendered unit, no
#            nft table
# admit      `fabric admit` in the operator's checkout (this client's
#            desired state, a git repository) commits its host file;
#            the tree validates
# pulled     the operator gives it its own etcd identity and runs
#            `fabric registry init-auth`; the file reaches every host's
#            checkout (as `fabric pull` would); its next pass is a normal
#            one and it is an active node. A node joining moves nothing,
#            so a host running a replica of a routed service is powered
#            off: the leader places that replica on the new node (the
#            highest tier, the least loaded), which runs it, and the
#            edge's Caddy answers from it
# api        the capabilities API through the edge's Caddy (a GET from the
#            client namespace, as `curl | jq` would): the pending machine
#            with status pending and its probed hardware, then every node
#            as `fabric nodes --json` lists it; from an address outside the
#            tailnet, 403

MACHINE = "gpu-srv-01"  # the capture's own host name
OCTET = 30
CAPTURE = PROBE_FIXTURES / "multi-gpu-server"
FIGURES: dict[str, float] = {}


def join_capture(address: str) -> dict[str, str]:
    """multi-gpu-server's capture with its tailnet address on the bridge
    (the bridge plays the tailnet: the edge reaches the machine there)."""
    files = {p.name: p.read_text() for p in CAPTURE.iterdir() if p.is_file() and p.name not in ("expected.json", "errors.json")}
    status = json.loads(files["tailscale.json"])
    old = status["Self"]["TailscaleIPs"][0]
    files["tailscale.json"] = json.dumps(status).replace(f'"{old}"', f'"{address}"').replace(f'"{old}/32"', f'"{address}/32"')
    return files


API_NODES = "/api/capabilities/nodes"


def capabilities(fleet: Fleet, desired: DesiredState) -> dict[str, dict[str, Any]]:
    """node_id -> its object, from GET /api/capabilities/nodes through the edge's
    Caddy ({} until it answers 200); `.nodes | length` (jq) must count them all."""
    status, body = fleet.request(status_site_address(desired), API_NODES)
    if status != 200:
        return {}
    length = subprocess.run(["jq", ".nodes | length"], input=body, capture_output=True, text=True, check=True, timeout=30).stdout
    nodes = {node["node_id"]: node for node in json.loads(body)["nodes"]}
    assert int(length) == len(nodes), (length, sorted(nodes))
    return nodes


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


def test_join_a_machine_without_a_host_file_is_pending_after_its_first_pass(fleet: Fleet, desired: DesiredState) -> None:
    wait_converged(fleet, desired)
    began = time.monotonic()
    fleet.add_machine(MACHINE, OCTET, join_capture(fleet.settings.address(OCTET)))
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
    # The edge's Caddy serves its probe record too, marked pending.
    listed = wait_for(lambda: capabilities(fleet, desired).get(MACHINE), timeout=CONVERGE_S, what=f"{MACHINE} in the capabilities API", interval=0.2)
    assert listed["status"] == "pending" and listed["tier"] == "gpu_cuda", listed
    assert listed["hardware"]["gpus"] and listed["hardware"]["storage"], listed
    print(
        f"[figures] {MACHINE}: booted and installed in {FIGURES['boot_and_install_s']:.1f} s, pending {FIGURES['pending_after_timer_start_s']:.1f} s after its timer started"
    )


def test_join_admission_commits_a_host_file_that_validates(fleet: Fleet) -> None:
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


def test_join_once_pulled_the_leader_places_work_there_and_the_edge_routes_to_it(fleet: Fleet, desired: DesiredState) -> None:
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


def test_the_capabilities_api_through_the_edge_lists_every_node_and_refuses_outside_the_tailnet(fleet: Fleet, desired: DesiredState) -> None:
    """The seed's verification (`curl .../api/capabilities/nodes | jq '.nodes |
    length'`) through the edge's Caddy: one object per node with its GPUs,
    storage and encoders, the same nodes as `fabric nodes --json`; refused to
    a source outside the tailnet."""
    require("jq", "curl")

    def agreed() -> dict[str, dict[str, Any]] | None:
        served, listed = capabilities(fleet, desired), fabric_nodes(fleet)
        same = served.keys() == listed.keys() and all(served[n]["status"] == listed[n]["status"] for n in listed)
        return served if same and MACHINE in served else None

    served = wait_for(agreed, timeout=CONVERGE_S, what="the capabilities API agreeing with fabric nodes --json", interval=0.5)
    assert len(served) == len(node_status(fleet)), (sorted(served), node_status(fleet))
    for node_id, node in served.items():
        assert {"tailscale_ip", "hardware", "tier", "limitations", "last_seen", "status"} <= node.keys(), node_id
        assert {"gpus", "storage", "ffmpeg"} <= node["hardware"].keys(), node_id
    admitted = served[MACHINE]
    assert admitted["status"] == "active" and admitted["tier"] == "gpu_cuda", admitted
    assert admitted["hardware"]["gpus"] and admitted["hardware"]["storage"] and admitted["hardware"]["ffmpeg"], admitted
    one, body = fleet.request(status_site_address(desired), f"{API_NODES}/{MACHINE}")
    assert one == 200 and json.loads(body)["node_id"] == MACHINE, (one, body)

    host = status_site_address(desired)
    for path in (API_NODES, f"{API_NODES}/{MACHINE}", "/"):
        code, body = fleet.request(host, path, outside=True)
        assert code == 403 and "tailnet only" in body, (path, code, body)
