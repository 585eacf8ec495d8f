"""The edge's Caddy as a source of suspicion (issue 30, item 2): the pure
rules of core.scheduling.edge_upstreams, then the leader over a real sqlite
registry: an edge that sees every upstream of a host failing, with tailscale
agreeing, makes the host suspected and its service hedged; alone it does
not; a garbage record is skipped and named, never breaking the step."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.records import NodeRecord
from reconciler.core.scheduling.edge_upstreams import EdgeUpstreams, Upstream, caddy_upstreams, edge_failing, edge_records
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import LeaderLoop
from tests.support.clock import FakeClock
from tests.support.enc_fleet import enc_fleet

NOW = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
ADDRESSES = {"gpu-a": "100.64.0.2", "gpu-b": "100.64.0.3"}


def record(edge: str, *upstreams: tuple[str, int], at: datetime = NOW) -> EdgeUpstreams:
    return EdgeUpstreams(edge=edge, at=at, upstreams=[Upstream(address=a, fails=f) for a, f in upstreams])


def raw(r: EdgeUpstreams) -> bytes:
    return r.model_dump_json().encode()


# --- the admin API's answer -------------------------------------------------


def test_caddy_upstreams_reads_the_admin_apis_answer():
    payload = [{"address": "100.64.0.2:8702", "num_requests": 1, "fails": 2}, {"address": "[fd7a::1]:80", "num_requests": 0, "fails": 0}]
    ups = caddy_upstreams(payload)
    assert [(u.host, u.fails, u.num_requests) for u in ups] == [("100.64.0.2", 2, 1), ("fd7a::1", 0, 0)]
    assert caddy_upstreams(None) == []


@pytest.mark.parametrize(
    ("payload", "words"),
    [({"address": "x"}, "expected a list"), ([{"fails": 1}], "[0].address"), ([{"address": "a:1", "fails": -1}], "[0].fails")],
)
def test_caddy_upstreams_names_what_is_wrong_in_an_answer_of_another_shape(payload: object, words: str):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        caddy_upstreams(payload)


# --- which hosts the edge says fail -------------------------------------------


def test_a_host_whose_every_upstream_fails_is_reported():
    r = record("edge", ("100.64.0.2:8702", 3), ("100.64.0.2:8703", 1), ("100.64.0.3:8703", 0))
    assert edge_failing([r], ADDRESSES, NOW, 30) == {"gpu-a": "edge sees all 2 upstream(s) failing"}


def test_one_upstream_of_a_host_still_answering_keeps_it_unreported():
    r = record("edge", ("100.64.0.2:8702", 3), ("100.64.0.2:8703", 0))
    assert edge_failing([r], ADDRESSES, NOW, 30) == {}


def test_a_stale_record_says_nothing():
    r = record("edge", ("100.64.0.2:8702", 3), at=NOW - timedelta(seconds=31))
    assert edge_failing([r], ADDRESSES, NOW, 30) == {}


def test_an_upstream_at_no_declared_address_is_no_ones():
    assert edge_failing([record("edge", ("100.64.9.9:8702", 3))], ADDRESSES, NOW, 30) == {}


# --- records parsed one by one ---------------------------------------------------


def test_a_garbage_record_is_skipped_and_named_and_the_others_still_count():
    good = record("edge", ("100.64.0.2:8702", 3))
    stored = {
        "edge": raw(good),
        "edge-2": b"{not json",
        "edge-3": json.dumps({"edge": "edge-3", "at": "yesterday", "upstreams": []}).encode(),
        "edge-4": raw(record("edge")),
        "gpu-b": raw(record("gpu-b", ("100.64.0.2:8702", 9))),
    }
    records, problems = edge_records(stored, ["edge", "edge-2", "edge-3", "edge-4"])
    assert records == [good]
    reasons = {p.key: p.reason for p in problems}
    assert reasons["edge-2"].startswith("not JSON")
    assert reasons["edge-3"].startswith("at:")
    assert reasons["edge-4"] == "names edge 'edge', stored under 'edge-4'"
    assert reasons["gpu-b"] == "not written by an edge host"


# --- the leader -------------------------------------------------------------------

TIERS = {"lead": "cpu_ffmpeg", "gpu-a": "gpu_vaapi", "gpu-b": "gpu_vaapi"}


def desired() -> DesiredState:
    return enc_fleet(TIERS, candidates=("lead",), liveness_s=2, liveness_ttl_s=6, roles={"lead": ("compute", "edge")})


def tailscale(offline: tuple[str, ...]) -> str:
    peers = {f"k{i}": {"DNSName": f"{h}.tail.ts.net.", "HostName": h, "Online": False} for i, h in enumerate(offline)}
    return json.dumps({"BackendState": "Running", "Peer": peers})


class Leader:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = FakeClock()
        state = desired()
        self.registry = SqliteRegistry(tmp_path / "r.sqlite", timing=state.fleet.timing, flap=state.fleet.flap, clock=self.clock)
        self.offline: tuple[str, ...] = ()
        self.log: list[str] = []
        self.loop = LeaderLoop(
            registry=self.registry,
            host="lead",
            load_desired=lambda: state,
            schedule=schedule,
            lease_ttl_s=30,
            log=self.log.append,
            clock=self.clock,
            tailscale_status=lambda: tailscale(self.offline),
        )
        for host in TIERS:
            self.registry.heartbeat(NodeRecord(node_id=host, tier=TIERS[host], arch="x86_64", max_concurrent_tasks=4, units={}))
            self.registry.keep_alive(host, 6)
        self.loop.step()

    def report(self, value: bytes) -> None:
        self.registry.report_edge_upstreams("lead", value)

    def failing(self, host: str) -> bytes:
        now = datetime.fromtimestamp(self.clock.now(), UTC)
        return raw(record("lead", (f"{ADDRESSES[host]}:8702", 2), at=now))

    def keep_alive(self) -> None:
        for host in TIERS:
            self.registry.keep_alive(host, 6)

    def hedges(self) -> list[tuple[str, str]]:
        plan = self.registry.newest_plan()
        assert plan is not None
        return [(p.node, p.hedge) for p in plan.placements if p.hedge is not None]


def test_the_edge_and_tailscale_agreeing_make_a_node_suspected_and_its_service_hedged(tmp_path: Path):
    leader = Leader(tmp_path)
    try:
        plan = leader.registry.newest_plan()
        assert plan is not None
        (serving,) = [p.node for p in plan.placements]
        leader.clock.advance(1)
        leader.keep_alive()
        leader.report(leader.failing(serving))
        leader.offline = (serving,)
        leader.loop.step()
        plan = leader.registry.newest_plan()
        assert plan is not None and plan.suspects[serving].since is not None
        assert any(r.startswith("edge: lead sees all 1 upstream(s) failing") for r in plan.suspects[serving].reasons), plan.suspects
        assert [h for _, h in leader.hedges()] == [serving]
    finally:
        leader.registry.close()


def test_the_edge_alone_suspects_no_one(tmp_path: Path):
    leader = Leader(tmp_path)
    try:
        plan = leader.registry.newest_plan()
        assert plan is not None
        (serving,) = [p.node for p in plan.placements]
        leader.clock.advance(1)
        leader.keep_alive()
        leader.report(leader.failing(serving))
        leader.loop.step()
        plan = leader.registry.newest_plan()
        assert plan is not None and not plan.suspects and leader.hedges() == []
    finally:
        leader.registry.close()


def test_a_garbage_edge_record_is_named_once_and_the_step_goes_on(tmp_path: Path):
    leader = Leader(tmp_path)
    try:
        leader.report(b"\xff garbage")
        for _ in range(2):
            leader.clock.advance(1)
            leader.keep_alive()
            leader.loop.step()
        said = [line for line in leader.log if "edge upstreams record of lead skipped" in line]
        assert len(said) == 1 and "not JSON" in said[0], leader.log
        assert leader.registry.newest_plan() is not None
    finally:
        leader.registry.close()
