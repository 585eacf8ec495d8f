"""The plan in parts (reconciler.core.live.plan_parts), pure, and as the sqlite backend stores it.

The parts put back together make the plan (in the scheduler's order); the
signature covers the index, so a part changed anywhere fails verification
and a part that is not the index's is refused by name; a part is a function
of its content alone, so unchanged parts keep their digest across epochs;
sqlite stores the same shape (an index row, parts by digest) and rewrites
only the parts that changed.
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from reconciler.adapters.clock import SystemClock
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.model import FlapSettings, PlanKey, TimingSettings
from reconciler.core.live.models import Deferred, FleetPlan, Placement
from reconciler.core.live.plan_parts import (
    PART_ITEMS,
    PlanPartsError,
    checked_part,
    join_plan,
    normalized,
    part_digest,
    plan_index,
    plan_parts,
    same_parts,
)
from reconciler.core.live.signing import canonical_plan, verify_index, verify_plan, with_signature
from reconciler.ports import RegistryError
from tests.support.plan_keys import TestKey

T0 = datetime(2026, 12, 2, 12, 0, 0, 123456, tzinfo=UTC)
LUX = TestKey("lux", "lux-test")
KEYS = [PlanKey(host=LUX.host, id=LUX.id, public_key=LUX.public_b64)]


def big_plan(nodes: int = 50, per_node: int = 3, deferred: int = 5000) -> FleetPlan:
    placements = [Placement(service=f"s{k}", replica=n, node=f"node-{n:03d}", tier="cpu_ffmpeg") for n in range(nodes) for k in range(per_node)]
    waiting = [Deferred(service="burst", replica=r, reason="no free slot") for r in range(deferred)]
    return FleetPlan(
        epoch=7,
        leader="lux",
        term=3,
        fleet="f",
        prefix="/fabric",
        created=T0,
        placements=placements,
        deferred=waiting,
        ignored_nodes=["stray-1", "stray-2"],
        room_since={"node-001": T0},
    )


def signed(plan: FleetPlan) -> FleetPlan:
    return with_signature(plan, LUX.id, LUX.private.sign(canonical_plan(plan)))


def test_the_parts_make_the_plan_back_in_the_schedulers_order() -> None:
    plan = big_plan()
    parts = plan_parts(plan)
    assert set(parts) == {"fleet", "ignored/0", "room/0", *(f"deferred/{i}" for i in range(3)), *(f"host/node-{n:03d}/0" for n in range(50))}
    joined = join_plan(plan_index(plan, parts), parts)
    assert (joined == normalized(plan)) is True, "the plan back, in the scheduler's order"
    assert sorted(joined.placements, key=str) == sorted(plan.placements, key=str)
    assert len(plan_parts(big_plan(deferred=PART_ITEMS))) == len(plan_parts(big_plan(deferred=PART_ITEMS - 1))), "a full chunk is one part"


def test_a_move_keeps_its_order_and_a_node_with_many_placements_is_chunked_in_order() -> None:
    many = [Placement(service="s", replica=r, node="big", tier="cpu_ffmpeg") for r in range(2 * PART_ITEMS + 5)]
    moves = [
        Placement(service="t", replica=0, node="b", tier="cpu_ffmpeg"),
        Placement(service="t", replica=0, node="a", tier="cpu_ffmpeg", replaces="b"),
    ]
    plan = FleetPlan(epoch=1, leader="lux", created=T0, placements=many + moves)
    parts = plan_parts(plan)
    assert [n for n in parts if n.startswith("host/big/")] == ["host/big/0", "host/big/1", "host/big/2"]
    assert plan_index(plan, parts).host_parts("big") == ["host/big/0", "host/big/1", "host/big/2"]
    assert (join_plan(plan_index(plan, parts), parts) == plan) is True


def test_a_part_depends_on_its_content_only_not_the_epoch_nor_the_time_zone() -> None:
    plan = big_plan()
    later = plan.model_copy(
        update={"epoch": 8, "created": T0 + timedelta(seconds=30), "room_since": {"node-001": T0.astimezone(timezone(timedelta(hours=2)))}}
    )
    assert plan_parts(later) == plan_parts(plan)
    assert same_parts(plan, later.model_copy(update={"placements": list(reversed(later.placements))}))
    one_moved = later.model_copy(
        update={"placements": [p.model_copy(update={"node": "node-049"}) if p.node == "node-000" else p for p in later.placements]}
    )
    changed = {n for n, d in plan_index(one_moved).parts.items() if plan_index(plan).parts.get(n) != d}
    assert changed == {"host/node-049/0"} and "host/node-000/0" not in plan_index(one_moved).parts


def test_the_signature_covers_every_part_through_the_index() -> None:
    plan = signed(big_plan())
    assert verify_plan(plan, KEYS) is None
    assert verify_index(plan_index(plan), KEYS) is None
    for tampered in (
        plan.model_copy(update={"deferred": plan.deferred[:-1]}),
        plan.model_copy(update={"placements": [*plan.placements[:-1], plan.placements[-1].model_copy(update={"node": "node-000"})]}),
        plan.model_copy(update={"ignored_nodes": []}),
        plan.model_copy(update={"room_since": {}}),
        plan.model_copy(update={"term": 4}),
    ):
        assert "does not match its content" in (verify_plan(tampered, KEYS) or ""), tampered


def test_a_part_not_the_indexs_is_refused_and_named() -> None:
    plan = signed(big_plan())
    parts = plan_parts(plan)
    index = plan_index(plan, parts)
    other = plan_parts(big_plan(deferred=4999))
    with pytest.raises(
        PlanPartsError, match=r"^plan part deferred/2: its digest is not the index's \(a part of another epoch, or tampered\): refused$"
    ):
        join_plan(index, {**parts, "deferred/2": other["deferred/2"]})
    with pytest.raises(PlanPartsError, match=r"^plan part host/node-007/0 of epoch 7 is missing$"):
        join_plan(index, {n: d for n, d in parts.items() if n != "host/node-007/0"})
    assert checked_part(index, "host/node-007/0", parts["host/node-007/0"])["placements"][0]["node"] == "node-007"
    with pytest.raises(PlanPartsError, match="not in the index"):
        checked_part(index, "host/nowhere/0", b"{}")
    odd = index.model_copy(update={"parts": {**index.parts, "future/0": part_digest(b"{}")}})
    with pytest.raises(PlanPartsError, match="plan part future/0: not a part this version knows"):
        join_plan(odd, {**parts, "future/0": b"{}"})


def sqlite_registry(path: Path) -> SqliteRegistry:
    return SqliteRegistry(path, timing=TimingSettings(), flap=FlapSettings(), clock=SystemClock())


def test_sqlite_stores_the_same_shape_and_rewrites_only_changed_parts(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
    registry = sqlite_registry(path)
    try:
        leadership = registry.campaign("lux", 600)
        assert leadership is not None
        plan = FleetPlan(
            epoch=0,
            leader="lux",
            created=T0,
            placements=[Placement(service=f"s{k}", replica=n, node=f"n{n:05d}", tier="cpu_ffmpeg") for k in range(4) for n in range(5000)],
        )
        first = registry.publish_plan(leadership, plan)
        assert registry.newest_plan() == first and len(first.placements) == 20_000
        with sqlite3.connect(path) as db:
            before = dict(db.execute("SELECT digest, rowid FROM plan_parts"))
        moved = [p.model_copy(update={"node": "n00001"}) if p.node == "n00000" else p for p in plan.placements]
        second = registry.publish_plan(leadership, plan.model_copy(update={"placements": moved}))
        assert registry.newest_plan() == second and registry.snapshot().placements == second.placements
        with sqlite3.connect(path) as db:
            after = dict(db.execute("SELECT digest, rowid FROM plan_parts"))
            (index_epoch,) = db.execute("SELECT epoch FROM plan_index").fetchone()
        assert index_epoch == second.epoch
        assert len(set(after) - set(before)) == 1 and len(set(before) - set(after)) == 2
        assert all(after[d] == before[d] for d in set(after) & set(before)), "unchanged parts not rewritten"
        # A part row of another plan under this digest: refused, named.
        digest = plan_index(second).parts["host/n00042/0"]
        with sqlite3.connect(path) as db:
            db.execute("UPDATE plan_parts SET part = ? WHERE digest = ?", (plan_parts(first)["host/n00001/0"], digest))
        with pytest.raises(RegistryError, match=r"plan part host/n00042/0: its digest is not the index's"):
            registry.newest_plan()
        assert any(p.what == "plan" for p in registry.snapshot().unreadable)
    finally:
        registry.close()


def test_a_hedge_and_the_leaders_suspects_travel_in_the_parts_and_are_signed() -> None:
    from reconciler.core.live.models import SuspectState

    plan = big_plan(nodes=3, deferred=0).model_copy(
        update={
            "placements": [
                Placement(service="vaapi", replica=0, node="node-001", tier="gpu_apu"),
                Placement(service="vaapi", replica=0, node="node-002", tier="cpu_ffmpeg", hedge="node-001"),
            ],
            "suspects": {"node-001": SuspectState(since=T0, reasons=["liveness lapsed"], suspicions=[T0])},
        }
    )
    parts = plan_parts(plan)
    assert "suspects/0" in parts
    joined = join_plan(plan_index(plan, parts), parts)
    assert joined.suspects == plan.suspects
    assert {p.node: p.hedge for p in joined.placements} == {"node-001": None, "node-002": "node-001"}
    # Changing the suspects changes the signed index.
    other = plan.model_copy(update={"suspects": {}})
    assert canonical_plan(other) != canonical_plan(plan)
    # Unset, the newer fields are in no part (a plan without hedges keeps its parts' bytes).
    assert b"hedge" not in b"".join(plan_parts(big_plan(nodes=3, deferred=0)).values())
