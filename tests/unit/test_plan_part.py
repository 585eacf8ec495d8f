"""A host's part of the fleet plan (reconciler.core.render.plan_part): what
render takes from the plan, and what makes `fabric watch` start a pass.

The example fleet (hosts/): racknerd is the edge; vaapi-encode, flac-fft and
braid are routed, lupine is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState, Hardware, HostFacts
from reconciler.core.live.models import Deferred, FleetPlan, Placement
from reconciler.core.render.artifacts import render
from reconciler.core.render.plan_part import hosts_the_part_reads, plan_part

REPO = Path(__file__).resolve().parents[2]
HOSTS = ["racknerd", "qfox-1", "a1-arm64", "x86-spill", "lux"]
EDGE = "racknerd"


def example() -> DesiredState:
    return load_desired(REPO / "hosts")


def golden_plan() -> FleetPlan:
    return FleetPlan.model_validate_json((REPO / "tests" / "golden" / "fleet-plan.json").read_text())


def moved(plan: FleetPlan, service: str, replica: int, node: str, **changes: object) -> FleetPlan:
    """`plan` with one replica placed on `node` instead, and `changes` (a new epoch ...)."""
    placements = [p.model_copy(update={"node": node}) if (p.service, p.replica) == (service, replica) else p for p in plan.placements]
    return plan.model_copy(update={"placements": placements, **changes})


def added(plan: FleetPlan, service: str, node: str, replica: int = 5) -> FleetPlan:
    extra = Placement(service=service, replica=replica, node=node, tier="cpu_ffmpeg")
    return plan.model_copy(update={"placements": [*plan.placements, extra], "epoch": plan.epoch + 1})


def digest(plan: FleetPlan, host: str, desired: DesiredState | None = None) -> str:
    return plan_part(desired or example(), plan, host).digest


def artifacts(plan: FleetPlan, host: str) -> dict[str, str]:
    facts = HostFacts(node_id=host, k3s_hostname=host, hardware=Hardware(arch="aarch64" if host == "a1-arm64" else "x86_64"), tier="cpu_ffmpeg")
    return {a.path: a.content for a in render(example(), host, facts, plan).artifacts}


def test_the_part_is_the_services_here_and_on_the_edge_each_routed_services_nodes() -> None:
    plan = golden_plan()
    assert plan_part(example(), plan, "qfox-1").services_here == ("flac-fft", "lupine", "vaapi-encode")
    assert plan_part(example(), plan, "qfox-1").upstreams == ()
    edge = plan_part(example(), plan, EDGE)
    assert edge.services_here == ()
    # lupine has no route: the edge does not care where it runs.
    assert edge.upstreams == (("braid", ("a1-arm64",)), ("flac-fft", ("qfox-1", "x86-spill")), ("vaapi-encode", ("qfox-1",)))


def test_an_epoch_bump_with_the_same_placements_changes_no_part() -> None:
    plan = golden_plan()
    later = plan.model_copy(
        update={
            "epoch": plan.epoch + 1,
            "leader": "qfox-1",
            "deferred": [Deferred(service="lupine", replica=1, reason="no gpu_cuda host has room")],
            "lanes": plan.lanes[:1],
            "ignored_nodes": ["intruder"],
            "placements": list(reversed(plan.placements)),
        }
    )
    for host in HOSTS:
        assert digest(later, host) == digest(plan, host), host


def test_a_placement_moving_between_two_other_hosts_changes_neither_third_hosts_part() -> None:
    # lupine (unrouted) moves qfox-1 -> x86-spill: lux, a1-arm64 and the edge are not concerned.
    plan = golden_plan()
    later = moved(plan, "lupine", 0, "x86-spill", epoch=plan.epoch + 1)
    for host in ("lux", "a1-arm64", EDGE):
        assert digest(later, host) == digest(plan, host), host
    for host in ("qfox-1", "x86-spill"):
        assert digest(later, host) != digest(plan, host), host


def test_a_placement_moving_onto_or_off_a_host_changes_its_part() -> None:
    plan = golden_plan()
    onto = moved(plan, "braid", 0, "lux", epoch=plan.epoch + 1)
    assert digest(onto, "lux") != digest(plan, "lux")
    assert digest(onto, "a1-arm64") != digest(plan, "a1-arm64")  # moved off
    assert plan_part(example(), onto, "lux").services_here == ("braid",)
    assert plan_part(example(), onto, "a1-arm64").services_here == ()


def test_on_the_edge_a_routed_services_node_set_changing_changes_its_part_an_unrouted_ones_does_not() -> None:
    plan = golden_plan()
    assert digest(moved(plan, "flac-fft", 1, "lux"), EDGE) != digest(plan, EDGE)
    assert digest(added(plan, "braid", "x86-spill"), EDGE) != digest(plan, EDGE)
    assert digest(plan.model_copy(update={"placements": [p for p in plan.placements if p.service != "braid"]}), EDGE) != digest(plan, EDGE)
    # A second replica on a node the service already runs on: the same upstreams.
    assert digest(added(plan, "flac-fft", "qfox-1"), EDGE) == digest(plan, EDGE)
    assert digest(moved(plan, "lupine", 0, "lux"), EDGE) == digest(plan, EDGE)
    assert digest(added(plan, "lupine", "a1-arm64"), EDGE) == digest(plan, EDGE)


def test_placements_the_desired_state_does_not_know_are_no_part_and_are_noted() -> None:
    plan = golden_plan()
    raw = plan.model_dump()
    raw["placements"] += [
        {"service": "evil", "replica": 0, "node": "lux", "tier": "relay"},
        {"service": "braid", "replica": 1, "node": "intruder", "tier": "relay"},
    ]
    notes: list[str] = []
    forged = FleetPlan.model_validate(raw)
    assert plan_part(example(), forged, "lux", notes) == plan_part(example(), plan, "lux")
    assert plan_part(example(), forged, EDGE).digest == digest(plan, EDGE)
    assert notes == ["plan epoch 7: unknown service 'evil' ignored", "plan epoch 7: service 'braid' placed on unknown host 'intruder'; ignored"]


def test_a_route_added_to_the_desired_state_enters_the_edges_part(tmp_path: Path) -> None:
    import shutil

    desired = tmp_path / "desired"
    shutil.copytree(REPO / "hosts", desired)
    fleet = desired / "fabric.toml"
    text = fleet.read_text()
    anchor = 'id = "vaapi-encode"'
    assert anchor in text and "lupine" in text
    lupine = text.index('id = "lupine"')
    end = text.index("[[services]]", lupine + 1)
    fleet.write_text(text[:end] + '[services.route]\nhost = "lupine.researchstack.info"\n\n' + text[end:])
    routed = load_desired(desired)
    plan = golden_plan()
    assert ("lupine", ("qfox-1",)) in plan_part(routed, plan, EDGE).upstreams
    assert digest(moved(plan, "lupine", 0, "lux"), EDGE, routed) != digest(plan, EDGE, routed)


def test_the_digest_is_sha256_of_canonical_json() -> None:
    import hashlib

    part = plan_part(example(), golden_plan(), "qfox-1")
    assert part.canonical() == '{"host":"qfox-1","services_here":["flac-fft","lupine","vaapi-encode"],"upstreams":{}}'
    assert part.digest == hashlib.sha256(part.canonical().encode()).hexdigest()
    # Another host with the same services is another part.
    assert plan_part(example(), moved(golden_plan(), "lupine", 0, "x86-spill"), "x86-spill").digest != part.digest


def test_the_files_of_the_hosts_the_part_reads() -> None:
    plan = golden_plan()
    assert hosts_the_part_reads(example(), plan, "lux") == {"lux"}
    assert hosts_the_part_reads(example(), added(plan, "lupine", "lux"), EDGE) == {EDGE, "a1-arm64", "qfox-1", "x86-spill"}


# -- render reads the plan only through the part -------------------------------------------


def plans_with_the_same_parts() -> list[FleetPlan]:
    plan = golden_plan()
    return [
        plan.model_copy(update={"epoch": 99, "leader": "x86-spill", "deferred": [Deferred(service="braid", replica=3, reason="full")], "lanes": []}),
        added(plan, "flac-fft", "qfox-1"),
        plan.model_copy(update={"placements": [p.model_copy(update={"tier": "relay", "fallback": not p.fallback}) for p in plan.placements]}),
    ]


@pytest.mark.parametrize("host", HOSTS)
def test_plans_whose_part_of_a_host_is_the_same_render_the_same_artifacts_there(host: str) -> None:
    """What render installs depends on the plan only through the part: were it
    to read anything else of the plan (the epoch, tiers, deferred replicas,
    lanes), one of these plans would render differently."""
    plan = golden_plan()
    for other in plans_with_the_same_parts():
        assert digest(other, host) == digest(plan, host)
        assert artifacts(other, host) == artifacts(plan, host)


@pytest.mark.parametrize(
    ("host", "changed"),
    [
        ("lux", lambda plan: moved(plan, "braid", 0, "lux")),
        ("a1-arm64", lambda plan: moved(plan, "braid", 0, "lux")),
        (EDGE, lambda plan: moved(plan, "flac-fft", 1, "lux")),
        (EDGE, lambda plan: added(plan, "braid", "x86-spill")),
    ],
    ids=["moved onto", "moved off", "edge: upstream moved", "edge: upstream added"],
)
def test_a_changed_part_renders_other_artifacts(host: str, changed) -> None:
    plan = golden_plan()
    assert digest(changed(plan), host) != digest(plan, host)
    assert artifacts(changed(plan), host) != artifacts(plan, host)
