"""Cost-aware placement (issue 32) through `fabric dispatch --min-tier` and
`fabric schedule --snapshot`, over small fleets written to tmp_path.

A host's cost class (`[host] cost`: free, owned, paid) reaches the leader in
its heartbeat record and the snapshot (`SnapshotNode.cost`); the last test
follows it from the host file to a placement through a real sqlite registry.
"""

from __future__ import annotations

import json
from pathlib import Path

from reconciler.adapters.clock import SystemClock
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.cli import main
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import HostFacts
from reconciler.core.live.models import FleetPlan
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.heartbeat import node_record
from tests.conftest import EXAMPLE_FLEET

PROBES = Path(__file__).resolve().parent.parent / "fixtures" / "probe"

HOSTS = {
    # name: (cost, address)
    "free-a": ("free", "100.64.0.1"),
    "free-b": ("free", "100.64.0.2"),
    "owned-c": ("owned", "100.64.0.3"),
    "paid-d": ("paid", "100.64.0.4"),
    "paid-e": ("paid", "100.64.0.5"),
}


def write_fleet(root: Path, *, scheduler: str = "", services: str = "") -> Path:
    """A fleet of HOSTS, each host file saying its cost."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "fabric.toml").write_text(f'[fleet]\ndomain = "example.test"\nleader_candidates = ["owned-c"]\n\n[scheduler]\n{scheduler}\n{services}')
    for name, (cost, address) in HOSTS.items():
        roles = '["control", "compute"]' if name == "owned-c" else '["compute"]'
        (root / f"{name}.toml").write_text(f'[host]\nname = "{name}"\nroles = {roles}\naddress = "{address}"\ncost = "{cost}"\n')
    return root


def node(name: str, tier: str, in_flight: int = 0, limit: int = 4, **extra) -> dict:
    """A node as the snapshot shows it: its cost comes from its record (the host file's)."""
    return {"node_id": name, "tier": tier, "status": "active", "in_flight": in_flight, "max_concurrent_tasks": limit, "cost": HOSTS[name][0], **extra}


def snapshot(tmp_path: Path, nodes: list[dict], **extra) -> Path:
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps({"now": "2026-11-29T18:00:00Z", "nodes": nodes, **extra}))
    return path


def fabric(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def dispatch(capsys, desired: Path, snap: Path, *flags: str) -> dict:
    code, out, err = fabric(capsys, "dispatch", "--desired", str(desired), "--snapshot", str(snap), "--json", *flags)
    assert (code, err) == (0, ""), err
    return json.loads(out)


# --------------------------------------------------------------------------
# Tier first (the default): within one tier, the cheaper host wins


def test_same_tier_free_host_with_room_beats_paid_host_with_less_load(tmp_path, capsys):
    desired = write_fleet(tmp_path / "fleet")
    snap = snapshot(tmp_path, [node("free-a", "cpu_ffmpeg", in_flight=3), node("paid-d", "cpu_ffmpeg", in_flight=0)])
    assert dispatch(capsys, desired, snap, "--min-tier", "cpu_ffmpeg") == {"node": "free-a", "tier": "cpu_ffmpeg", "fallback": False}


def test_owned_host_beats_paid_host_and_free_beats_owned(tmp_path, capsys):
    desired = write_fleet(tmp_path / "fleet")
    snap = snapshot(tmp_path, [node("owned-c", "batch", in_flight=2), node("paid-d", "batch")])
    assert dispatch(capsys, desired, snap, "--min-tier", "batch")["node"] == "owned-c"
    snap = snapshot(tmp_path, [node("owned-c", "batch"), node("free-b", "batch", in_flight=3)])
    assert dispatch(capsys, desired, snap, "--min-tier", "batch")["node"] == "free-b"


def test_paid_host_is_used_only_when_free_hosts_are_full(tmp_path, capsys):
    desired = write_fleet(tmp_path / "fleet")
    nodes = [node("free-a", "cpu_ffmpeg", in_flight=4), node("free-b", "cpu_ffmpeg", in_flight=2, limit=2), node("paid-d", "cpu_ffmpeg")]
    assert dispatch(capsys, desired, snapshot(tmp_path, nodes), "--min-tier", "cpu_ffmpeg")["node"] == "paid-d"
    nodes[1] = node("free-b", "cpu_ffmpeg", in_flight=1, limit=2)
    assert dispatch(capsys, desired, snapshot(tmp_path, nodes), "--min-tier", "cpu_ffmpeg")["node"] == "free-b"


def test_among_paid_hosts_utilization_then_id_still_decide(tmp_path, capsys):
    desired = write_fleet(tmp_path / "fleet")
    nodes = [node("paid-e", "batch", in_flight=1), node("paid-d", "batch", in_flight=2)]
    assert dispatch(capsys, desired, snapshot(tmp_path, nodes), "--min-tier", "batch")["node"] == "paid-e"
    nodes = [node("paid-e", "batch", in_flight=1), node("paid-d", "batch", in_flight=1)]
    assert dispatch(capsys, desired, snapshot(tmp_path, nodes), "--min-tier", "batch")["node"] == "paid-d"


def test_tier_stays_first_a_paid_higher_tier_beats_a_free_lower_one(tmp_path, capsys):
    """highest_tier: the service prefers its highest satisfying tier, whatever it costs."""
    desired = write_fleet(tmp_path / "fleet")
    nodes = [node("free-a", "cpu_ffmpeg"), node("paid-d", "gpu_cuda", in_flight=3)]
    assert dispatch(capsys, desired, snapshot(tmp_path, nodes), "--min-tier", "cpu_ffmpeg")["node"] == "paid-d"
    # Below min_tier is a fallback: a paid host at min_tier first.
    nodes = [node("free-a", "batch"), node("paid-d", "cpu_ffmpeg", in_flight=3)]
    assert dispatch(capsys, desired, snapshot(tmp_path, nodes), "--min-tier", "cpu_ffmpeg")["node"] == "paid-d"


def test_a_floor_still_refuses_a_cheaper_lower_tier_host(tmp_path, capsys):
    desired = write_fleet(tmp_path / "fleet")
    nodes = [node("free-a", "batch"), node("paid-d", "cpu_ffmpeg", in_flight=4)]
    decision = dispatch(capsys, desired, snapshot(tmp_path, nodes), "--min-tier", "cpu_ffmpeg", "--floor", "cpu_ffmpeg")
    assert decision["node"] is None
    assert "paid-d full 4/4" in decision["reason"]
    # Cost before tier does not lower a floor either.
    desired = write_fleet(tmp_path / "cost-first", scheduler='cost_order = "before_tier"')
    decision = dispatch(capsys, desired, snapshot(tmp_path, nodes), "--min-tier", "cpu_ffmpeg", "--floor", "cpu_ffmpeg")
    assert decision["node"] is None


# --------------------------------------------------------------------------
# Cost before tier ([scheduler] cost_order = "before_tier", or a service's own)


def test_cost_order_before_tier_puts_the_cheaper_host_before_the_better_tier(tmp_path, capsys):
    desired = write_fleet(tmp_path / "fleet", scheduler='cost_order = "before_tier"')
    # The tier-first case above, reversed: the free lower tier wins over the paid higher one ...
    nodes = [node("free-a", "cpu_ffmpeg"), node("paid-d", "gpu_cuda", in_flight=3)]
    assert dispatch(capsys, desired, snapshot(tmp_path, nodes), "--min-tier", "cpu_ffmpeg") == {
        "node": "free-a",
        "tier": "cpu_ffmpeg",
        "fallback": False,
    }
    # ... and a free host below min_tier (above the floor) before a paid one at it.
    nodes = [node("free-a", "batch"), node("paid-d", "cpu_ffmpeg")]
    assert dispatch(capsys, desired, snapshot(tmp_path, nodes), "--min-tier", "cpu_ffmpeg") == {"node": "free-a", "tier": "batch", "fallback": True}
    # Within one class the tier order still decides.
    nodes = [node("free-a", "batch"), node("free-b", "cpu_ffmpeg", in_flight=3)]
    assert dispatch(capsys, desired, snapshot(tmp_path, nodes), "--min-tier", "cpu_ffmpeg")["node"] == "free-b"


SERVICES = """
[[services]]
id = "fast"
min_tier = "cpu_ffmpeg"
floor = "batch"
command = { any = ["/bin/fast"] }

[[services]]
id = "thrifty"
min_tier = "cpu_ffmpeg"
floor = "batch"
cost_order = "before_tier"
command = { any = ["/bin/thrifty"] }
"""


def test_a_service_that_does_not_care_for_speed_says_cost_order_itself(tmp_path, capsys):
    desired = write_fleet(tmp_path / "fleet", services=SERVICES)
    snap = snapshot(tmp_path, [node("free-a", "batch"), node("paid-d", "cpu_ffmpeg")])
    code, out, err = fabric(capsys, "schedule", "--desired", str(desired), "--snapshot", str(snap), "--json")
    assert (code, err) == (0, "")
    placed = {p.service: (p.node, p.fallback) for p in FleetPlan.model_validate_json(out).placements}
    assert placed == {"fast": ("paid-d", False), "thrifty": ("free-a", True)}


def test_cost_order_is_validated_like_every_key(tmp_path, capsys):
    desired = write_fleet(tmp_path / "fleet", scheduler='cost_order = "cheapest"')
    code, out, err = fabric(capsys, "validate", "--desired", str(desired))
    assert (code, out) == (2, "")
    assert f"{desired}/fabric.toml: scheduler.cost_order: 'cheapest' is not one of 'within_tier' or 'before_tier'" in err


# --------------------------------------------------------------------------
# The example fleet (issue 32's report)


def test_example_fleet_keeps_the_paid_spill_box_for_overflow(tmp_path, capsys):
    """lux (owned) at 1 of 4 slots, x86-spill (paid) idle: the services that
    fall back to cpu_ffmpeg go to lux while it has room; x86-spill takes only
    the flac-fft replica that may not share lux with its sibling."""
    nodes = [
        {"node_id": "lux", "tier": "cpu_ffmpeg", "in_flight": 1, "max_concurrent_tasks": 4, "arch": "x86_64", "cost": "owned"},
        {"node_id": "x86-spill", "tier": "cpu_ffmpeg", "in_flight": 0, "max_concurrent_tasks": 4, "arch": "x86_64", "cost": "paid"},
    ]
    snap = snapshot(tmp_path, nodes)
    code, out, err = fabric(capsys, "schedule", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(snap), "--json")
    assert (code, err) == (0, "")
    placed = {(p.service, p.replica): p.node for p in FleetPlan.model_validate_json(out).placements}
    assert placed == {("vaapi-encode", 0): "lux", ("braid", 0): "lux", ("flac-fft", 0): "lux", ("flac-fft", 1): "x86-spill"}


def test_cost_travels_from_the_host_file_through_the_heartbeat_and_snapshot_to_placement(tmp_path):
    desired = load_desired(EXAMPLE_FLEET)
    assert {h: c.host.cost for h, c in desired.hosts.items()} == {
        "a1-arm64": "free",
        "lux": "owned",
        "qfox-1": "owned",
        "racknerd": "owned",
        "x86-spill": "paid",
    }
    registry = SqliteRegistry(tmp_path / "registry.sqlite", timing=desired.fleet.timing, flap=desired.fleet.flap, clock=SystemClock())
    try:
        for host in ("a1-arm64", "x86-spill"):
            facts = HostFacts.model_validate_json((PROBES / host / "expected.json").read_bytes())
            record = node_record(desired, host, facts)
            assert record.cost == desired.hosts[host].host.cost
            registry.heartbeat(record, 86_400)
        snap = registry.snapshot()
    finally:
        registry.close()
    assert {n.node_id: n.cost for n in snap.nodes} == {"a1-arm64": "free", "x86-spill": "paid"}
    assert {n.node_id: n.tier for n in snap.nodes} == {"a1-arm64": "cpu_ffmpeg", "x86-spill": "cpu_ffmpeg"}
    plan = schedule(snap, desired)
    # The most demanding service takes the free box's one slot (its probe bounds the host file's 2);
    # the paid one takes the overflow.
    assert {n.node_id: n.max_concurrent_tasks for n in snap.nodes}["a1-arm64"] == 1
    assert {(p.service, p.replica): p.node for p in plan.placements} == {
        ("vaapi-encode", 0): "a1-arm64",
        ("braid", 0): "x86-spill",
        ("flac-fft", 0): "x86-spill",
    }


def test_a_record_claiming_a_cheaper_class_than_its_host_file_is_placed_as_the_host_file_says(tmp_path, capsys):
    """The leader takes a host's cost from git: a paid host whose own record
    says "free" (a lying or old host) does not draw work off a free one."""
    desired = write_fleet(tmp_path / "fleet")
    lying = {**node("paid-d", "cpu_ffmpeg", in_flight=0), "cost": "free"}
    snap = snapshot(tmp_path, [node("free-a", "cpu_ffmpeg", in_flight=3), lying])
    assert dispatch(capsys, desired, snap, "--min-tier", "cpu_ffmpeg")["node"] == "free-a"


def test_schedule_text_says_which_replica_is_coming_home(tmp_path, capsys):
    desired = write_fleet(tmp_path / "fleet", services='[[services]]\nid = "web"\nmin_tier = "batch"\ncommand = { any = ["/bin/web"] }\n')
    placements = [{"service": "web", "replica": 0, "node": "paid-d", "tier": "batch"}]
    snap = snapshot(
        tmp_path, [node("free-a", "batch"), node("paid-d", "batch")], placements=placements, room_since={"free-a": "2026-11-29T17:00:00Z"}
    )
    code, out, err = fabric(capsys, "schedule", "--desired", str(desired), "--snapshot", str(snap))
    assert (code, err) == (0, "")
    assert "  web[0]  paid-d  batch\n  web[0]  free-a  batch  coming home from paid-d (both run until it starts here)\n" in out
