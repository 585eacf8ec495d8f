"""Signed fleet plans: the canonical form, verify_plan and the fence (pure), and the leader that signs.

The pure part builds plans and keys in memory. The leader part runs
LeaderLoop steps over the embedded sqlite registry (a file in tmp_path) with
the PlanSigner port faked by an in-memory key (tests.support.plan_keys).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from reconciler.adapters.clock import SystemClock
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import PlanKey
from reconciler.core.live.fencing import accept_plan
from reconciler.core.live.models import FleetPlan, Placement
from reconciler.core.live.records import LeaderInfo, NodeRecord
from reconciler.core.live.signing import canonical_plan, verify_plan, with_signature
from reconciler.core.scheduling.lanes import agent_unit
from reconciler.core.scheduling.placement import schedule
from reconciler.core.views.cards import fleet_status, render_text, status_document
from reconciler.engine.leader import LeaderLoop
from reconciler.engine.plan_fence import UNSIGNED_NOTE, PlanOffer, admit
from reconciler.engine.status import live_status
from tests.support.plan_keys import SignedFleet, TestKey, signed_example_fleet, with_plan_keys

T0 = datetime(2026, 11, 29, 12, 0, 0, 123456, tzinfo=UTC)
CANDIDATES = ["lux", "qfox-1"]


def plan(epoch: int = 7, leader: str = "lux", node: str = "qfox-1") -> FleetPlan:
    return FleetPlan(
        epoch=epoch,
        leader=leader,
        created=T0,
        placements=[Placement(service="lupine", replica=0, node=node, tier="gpu_cuda")],
    )


def listed(*keys: TestKey) -> list[PlanKey]:
    return [PlanKey(host=k.host, id=k.id, public_key=k.public_b64) for k in keys]


def signed(p: FleetPlan, key: TestKey) -> FleetPlan:
    return with_signature(p, key.id, key.private.sign(canonical_plan(p)))


LUX = TestKey("lux", "lux-2026-11")
LUX_NEXT = TestKey("lux", "lux-2027-05")
QFOX = TestKey("qfox-1", "qfox-1-2026-11")
STRANGER = TestKey("lux", "lux-stolen")  # never listed


# --------------------------------------------------------------------------
# The canonical form


def test_the_canonical_form_is_sorted_compact_json_without_the_signature() -> None:
    body = canonical_plan(signed(plan(), LUX))
    assert b" " not in body and b"signature" not in body
    decoded = json.loads(body)
    assert list(decoded) == sorted(decoded)
    assert decoded["created"] == "2026-11-29T12:00:00.123456Z"
    assert canonical_plan(signed(plan(), LUX)) == canonical_plan(plan())


def test_the_canonical_form_does_not_depend_on_field_order_or_time_zone() -> None:
    original = plan()
    as_json = json.loads(original.model_dump_json())
    reordered = FleetPlan.model_validate(dict(reversed(list(as_json.items()))))
    # The nested placement's keys reversed too.
    placement = as_json["placements"][0]
    as_json["placements"] = [dict(reversed(list(placement.items())))]
    shuffled = FleetPlan.model_validate(dict(reversed(list(as_json.items()))))
    plus_two = original.model_copy(update={"created": T0.astimezone(timezone(timedelta(hours=2)))})
    naive = original.model_copy(update={"created": T0.replace(tzinfo=None)})
    assert {canonical_plan(p) for p in (original, reordered, shuffled, plus_two, naive)} == {canonical_plan(original)}
    # And it survives the registry's JSON round trip, signature and all.
    stored = FleetPlan.model_validate_json(signed(original, LUX).model_dump_json())
    assert verify_plan(stored, listed(LUX)) is None


# --------------------------------------------------------------------------
# verify_plan and the fence


def test_a_plan_signed_by_a_listed_key_of_its_leader_verifies() -> None:
    assert verify_plan(signed(plan(), LUX), listed(LUX, QFOX)) is None
    assert accept_plan(3, signed(plan(), LUX), leader_candidates=CANDIDATES, plan_keys=listed(LUX, QFOX)).accepted


@pytest.mark.parametrize(
    "tamper",
    [
        {"epoch": 8},
        {"leader": "qfox-1"},
        {"placements": [Placement(service="lupine", replica=0, node="racknerd", tier="gpu_cuda")]},
        {"created": T0 + timedelta(seconds=1)},
        {"ignored_nodes": ["rogue"]},
    ],
    ids=["epoch", "leader", "placement-node", "created", "ignored-nodes"],
)
def test_tampering_with_any_field_breaks_the_signature(tamper: dict) -> None:
    forged = signed(plan(), LUX).model_copy(update=tamper)
    keys = listed(LUX, QFOX)
    problem = verify_plan(forged, keys)
    assert problem is not None
    verdict = accept_plan(3, forged, leader_candidates=CANDIDATES, plan_keys=keys)
    assert not verdict.accepted and verdict.reason.startswith("refused: ")


def test_a_key_listed_for_qfox_1_cannot_sign_a_plan_naming_lux() -> None:
    problem = verify_plan(signed(plan(leader="lux"), QFOX), listed(LUX, QFOX))
    assert problem == "plan epoch 7 names 'lux' as leader but is signed by 'qfox-1''s key 'qfox-1-2026-11'"


def test_a_key_fabric_toml_does_not_list_is_refused() -> None:
    problem = verify_plan(signed(plan(), STRANGER), listed(LUX, QFOX))
    assert problem == "plan epoch 7 is signed by key 'lux-stolen', which fabric.toml does not list (unknown or retired)"


def test_a_forged_signature_under_a_listed_key_id_is_refused() -> None:
    # The attacker names lux's key id but signs with a key of its own.
    forged = with_signature(plan(), LUX.id, STRANGER.private.sign(canonical_plan(plan())))
    assert "does not match its content" in (verify_plan(forged, listed(LUX)) or "")
    garbage = with_signature(plan(), LUX.id, b"\x00" * 10)
    assert "does not match its content" in (verify_plan(garbage, listed(LUX)) or "")


def test_rotation_any_listed_key_of_the_candidate_verifies_and_removing_one_retires_it() -> None:
    old, new = signed(plan(), LUX), signed(plan(), LUX_NEXT)
    both = listed(LUX, LUX_NEXT)
    assert verify_plan(old, both) is None and verify_plan(new, both) is None
    after = listed(LUX_NEXT)  # the old entry removed from fabric.toml
    assert verify_plan(new, after) is None
    assert verify_plan(old, after) == "plan epoch 7 is signed by key 'lux-2026-11', which fabric.toml does not list (unknown or retired)"


def test_an_unsigned_plan_is_refused_when_keys_are_listed_and_taken_when_none_are() -> None:
    verdict = accept_plan(3, plan(), leader_candidates=CANDIDATES, plan_keys=listed(LUX))
    assert not verdict.accepted
    assert verdict.reason == "refused: plan epoch 7 is not signed, and fabric.toml lists plan keys"
    assert accept_plan(3, plan(), leader_candidates=CANDIDATES, plan_keys=[]).accepted
    assert accept_plan(3, plan(), leader_candidates=CANDIDATES).accepted


def test_a_forged_plan_is_refused_whatever_epoch_it_claims() -> None:
    forged = plan(epoch=10**9)
    verdict = accept_plan(5, forged, leader_candidates=CANDIDATES, plan_keys=listed(LUX))
    assert not verdict.accepted and "not signed" in verdict.reason
    # The epoch fence still applies to a well-signed plan.
    stale = signed(plan(epoch=4), LUX)
    assert "older than the newest applied" in accept_plan(5, stale, leader_candidates=CANDIDATES, plan_keys=listed(LUX)).reason


# --------------------------------------------------------------------------
# admit: which origins are checked, and the note without keys


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> SignedFleet:
    return signed_example_fleet(tmp_path_factory.mktemp("fleet"))


@pytest.fixture(scope="module")
def desired(fleet):
    return load_desired(fleet.desired)


def test_admit_refuses_an_unsigned_registry_plan_and_keeps_the_generation(desired) -> None:
    source = admit(PlanOffer("registry", plan()), desired, applied_epoch=3, has_generation=True, now=T0)
    assert source.static == "refused: plan epoch 7 is not signed, and fabric.toml lists plan keys: running static"
    assert source.refused == "refused: plan epoch 7 is not signed, and fabric.toml lists plan keys"
    assert UNSIGNED_NOTE not in source.notes


# The registry's leader record of the plans below: lux, in the term the registry assigned it.
LUX_TERM = LeaderInfo(candidate="lux", epoch=1, since=T0, token="t", term=4)


def in_term(p: FleetPlan, desired) -> FleetPlan:
    """`p` as lux's leader step makes it: of LUX_TERM's term, for this fleet and registry."""
    return p.model_copy(update={"term": LUX_TERM.term, "fleet": desired.fleet.fleet.name, "prefix": desired.fleet.registry.prefix})


def test_a_merely_stale_plan_is_static_but_not_refused_as_forged(desired, fleet) -> None:
    """The status page's PLAN REFUSED is for plans that are not the leader's,
    not for a lagging registry serving an older genuine plan."""
    genuine = signed(in_term(plan(), desired), fleet.keys["lux"])
    source = admit(PlanOffer("registry", genuine, leader=LUX_TERM), desired, applied_epoch=9, has_generation=True, now=T0)
    assert source.static is not None and "older than the newest applied" in source.static
    assert source.refused is None


def test_admit_applies_a_plan_signed_by_the_named_candidate(desired, fleet) -> None:
    good = signed(in_term(plan(), desired), fleet.keys["lux"])
    source = admit(PlanOffer("registry", good, leader=LUX_TERM), desired, applied_epoch=3, has_generation=True, now=T0)
    assert source.static is None and source.plan == good


def test_plan_files_and_no_registry_plans_are_the_operators_choice(desired) -> None:
    for origin in ("file", "alone"):
        source = admit(PlanOffer(origin, plan()), desired, applied_epoch=3, has_generation=True, now=T0)  # type: ignore[arg-type]
        assert source.static is None, origin
        assert UNSIGNED_NOTE not in source.notes


def test_without_plan_keys_a_registry_plan_is_taken_with_a_note(tmp_path: Path) -> None:
    fleet = signed_example_fleet(tmp_path)
    fleet_toml = fleet.desired / "fabric.toml"
    fleet_toml.write_text(with_plan_keys(fleet_toml.read_text(), []))
    unsigned_fleet = load_desired(fleet.desired)
    assert unsigned_fleet.fleet.plan_keys == []
    source = admit(PlanOffer("registry", plan()), unsigned_fleet, applied_epoch=3, has_generation=True, now=T0)
    assert source.static is None
    assert source.notes.count(UNSIGNED_NOTE) == 1


# --------------------------------------------------------------------------
# The leader signs what it publishes


@pytest.fixture
def registry(tmp_path: Path, desired):
    reg = SqliteRegistry(tmp_path / "registry.sqlite", timing=desired.fleet.timing, flap=desired.fleet.flap, clock=SystemClock())
    yield reg
    reg.close()


def loop(registry, desired, host: str, signer, log: list[str]) -> LeaderLoop:
    return LeaderLoop(registry=registry, host=host, load_desired=lambda: desired, schedule=schedule, lease_ttl_s=30, log=log.append, signer=signer)


def test_the_leader_publishes_plans_signed_under_the_epoch_they_get(registry, desired, fleet) -> None:
    log: list[str] = []
    leader = loop(registry, desired, "lux", fleet.signer("lux"), log)
    leader.step()
    stored = registry.newest_plan()
    assert stored is not None and stored.signature is not None and stored.signature.key_id == "lux-test"
    assert verify_plan(stored, desired.fleet.plan_keys) is None
    assert accept_plan(0, stored, leader_candidates=CANDIDATES, plan_keys=desired.fleet.plan_keys).accepted
    leader.step_and_resign()


def test_a_candidate_without_a_listed_key_does_not_lead(registry, desired, fleet) -> None:
    log: list[str] = []
    # qfox-1 holding lux's key: fabric.toml does not list it for qfox-1.
    wrong = loop(registry, desired, "qfox-1", fleet.signer("lux"), log)
    wrong.step()
    assert registry.leader() is None and registry.newest_plan() is None
    assert log == [
        "qfox-1 cannot sign plans, so it does not lead: the test key lux-test is not one of qfox-1's plan keys in fabric.toml (listed: qfox-1-test)"
    ]
    wrong.step()
    assert len(log) == 1  # said once, not every step
    keyless = loop(registry, desired, "qfox-1", None, log)
    keyless.step()
    assert registry.leader() is None and "has no plan signing key" in log[-1]


def test_the_leader_replaces_a_forged_newest_plan_with_the_same_placements(registry, desired, fleet) -> None:
    log: list[str] = []
    leader = loop(registry, desired, "lux", fleet.signer("lux"), log)
    leader.step()
    genuine = registry.newest_plan()
    assert genuine is not None
    # A registry writer re-publishes the same placements, unsigned, under lux's term.
    assert leader.leadership is not None
    forged = registry.publish_plan(leader.leadership, genuine.model_copy(update={"signature": None}))
    assert verify_plan(forged, desired.fleet.plan_keys) is not None
    leader.step()
    healed = registry.newest_plan()
    assert healed is not None and healed.epoch > forged.epoch
    assert verify_plan(healed, desired.fleet.plan_keys) is None
    leader.step_and_resign()


def heartbeat_example_hosts(registry) -> None:
    for host, tier, arch, limit in (
        ("qfox-1", "gpu_cuda", "x86_64", 4),
        ("a1-arm64", "cpu_ffmpeg", "aarch64", 2),
        ("x86-spill", "cpu_ffmpeg", "x86_64", 4),
    ):
        registry.heartbeat(NodeRecord(node_id=host, tier=tier, arch=arch, max_concurrent_tasks=limit), ttl_s=300)


def test_a_forged_plan_does_not_choose_where_the_leader_keeps_work(registry, desired, fleet) -> None:
    heartbeat_example_hosts(registry)
    log: list[str] = []
    leader = loop(registry, desired, "lux", fleet.signer("lux"), log)
    leader.step()
    genuine = registry.newest_plan()
    assert genuine is not None
    braid = next(p for p in genuine.placements if p.service == "braid")
    assert braid.node == "qfox-1"
    # The forger moves braid to x86-spill (feasible, so the scheduler would keep it there).
    moved = [p.model_copy(update={"node": "x86-spill", "tier": "cpu_ffmpeg"}) if p is braid else p for p in genuine.placements]
    assert leader.leadership is not None
    registry.publish_plan(leader.leadership, genuine.model_copy(update={"placements": moved, "signature": None}))
    leader.step()
    healed = registry.newest_plan()
    assert healed is not None and verify_plan(healed, desired.fleet.plan_keys) is None
    assert {(p.service, p.replica, p.node) for p in healed.placements} == {(p.service, p.replica, p.node) for p in genuine.placements}
    leader.step_and_resign()


def test_fabric_status_leaves_out_a_plan_hosts_refuse_and_says_why(registry, desired, fleet) -> None:
    heartbeat_example_hosts(registry)
    leader = loop(registry, desired, "lux", fleet.signer("lux"), [])
    leader.step()
    genuine = registry.newest_plan()
    assert genuine is not None
    shown = live_status(desired, registry)
    assert shown.plan == genuine and shown.plan_refused is None
    assert leader.leadership is not None
    moved = [p.model_copy(update={"node": "a1-arm64"}) for p in genuine.placements]
    forged = registry.publish_plan(leader.leadership, genuine.model_copy(update={"placements": moved, "signature": None}))
    registry.resign(leader.leadership)  # no further step: the forged plan stays the newest
    shown = live_status(desired, registry)
    assert shown.plan is None and shown.snapshot.placements == []
    assert shown.plan_refused == f"refused: plan epoch {forged.epoch} is not signed, and fabric.toml lists plan keys"
    status = fleet_status(shown.desired, shown.snapshot, shown.plan, shown.now, plan_refused=shown.plan_refused)
    text = render_text(status)
    assert text.splitlines()[1] == f"PLAN REFUSED · hosts keep their generations: {shown.plan_refused}"
    assert "a1-arm64" not in {n.node_id for n in status.nodes if n.services}
    assert status_document(status)["plan_refused"] == shown.plan_refused


def test_a_forgery_that_changes_nothing_moves_nothing(registry, desired, fleet) -> None:
    """Hosts refuse the forgery and keep running the leader's last verified
    plan, so the leader reschedules from that plan's placements: work that
    stays where it is (stickiness) is not reshuffled onto nodes a fresh
    schedule would prefer."""
    registry.heartbeat(NodeRecord(node_id="x86-spill", tier="cpu_ffmpeg", arch="x86_64", max_concurrent_tasks=4), ttl_s=300)
    leader = loop(registry, desired, "lux", fleet.signer("lux"), [])
    leader.step()
    genuine = registry.newest_plan()
    assert genuine is not None and genuine.placements
    # The CUDA desktop joins: a fresh schedule would put work there (highest
    # tier first); the leader keeps what runs on x86-spill where it is.
    heartbeat_example_hosts(registry)
    leader.step()
    kept = registry.newest_plan()
    assert kept is not None
    where = {(p.service, p.replica): p.node for p in kept.placements}
    fresh = schedule(registry.snapshot([lane.id for lane in desired.lanes]).model_copy(update={"placements": []}), desired, leader="lux", epoch=0)
    assert {(p.service, p.replica): p.node for p in fresh.placements} != where, "the scenario needs a fresh schedule to differ"
    # Any registry client with write access republishes the same placements, unsigned.
    assert leader.leadership is not None
    registry.publish_plan(leader.leadership, kept.model_copy(update={"signature": None}))
    leader.step()
    healed = registry.newest_plan()
    assert healed is not None and verify_plan(healed, desired.fleet.plan_keys) is None
    assert {(p.service, p.replica): p.node for p in healed.placements} == where
    leader.step_and_resign()


def test_a_new_leader_facing_a_forgery_keeps_what_the_hosts_report_running(registry, desired, fleet) -> None:
    """A leader new to its term has no verified plan of its own: it keeps
    what the hosts' heartbeats say they run (their units), not what a fresh
    schedule would prefer, and not nothing (then every host's own services
    would look like foreign load and move)."""
    registry.heartbeat(NodeRecord(node_id="x86-spill", tier="cpu_ffmpeg", arch="x86_64", max_concurrent_tasks=4), ttl_s=300)
    first = loop(registry, desired, "lux", fleet.signer("lux"), [])
    first.step()
    genuine = registry.newest_plan()
    assert genuine is not None and genuine.placements
    where = {(p.service, p.replica): p.node for p in genuine.placements}
    # The hosts run it and say so; the CUDA desktop joins (a fresh schedule would prefer it).
    heartbeat_example_hosts(registry)
    running = {agent_unit(p.service): "active" for p in genuine.placements if p.node == "x86-spill"}
    registry.heartbeat(
        NodeRecord(
            node_id="x86-spill",
            tier="cpu_ffmpeg",
            arch="x86_64",
            max_concurrent_tasks=4,
            in_flight=len(running),
            services_running=len(running),
            units=running,
        ),
        ttl_s=300,
    )
    fresh = schedule(registry.snapshot([lane.id for lane in desired.lanes]).model_copy(update={"placements": []}), desired, leader="lux", epoch=0)
    assert {(p.service, p.replica): p.node for p in fresh.placements} != where, "the scenario needs a fresh schedule to differ"
    # A forgery, then a new leader (lux's loop restarted: nothing published of its own).
    assert first.leadership is not None
    registry.publish_plan(first.leadership, genuine.model_copy(update={"signature": None}))
    registry.resign(first.leadership)
    second = loop(registry, desired, "lux", fleet.signer("lux"), [])
    second.step()
    healed = registry.newest_plan()
    assert healed is not None and verify_plan(healed, desired.fleet.plan_keys) is None
    # Everything that ran stays where it runs (deferred work may take the new capacity).
    healed_where = {(p.service, p.replica): p.node for p in healed.placements}
    assert {key: healed_where.get(key) for key in where} == where
    second.step_and_resign()
