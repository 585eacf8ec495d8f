"""The parts' memo (plan_parts.PartsMemo) changes no byte: over randomized
churn of a plan (nodes joining and leaving, replicas moving, deferred and
kept back, moves and hedges, undeclared nodes, the come-home memory), the
parts, the index, the signed form and the verification made with one memo
carried from plan to plan are those made from scratch, also once the memo
is full and drops its older half, and for plans made by copying another
(the leader's scoped, numbered and signed copies of one plan).
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from reconciler.core.desired.model import PlanKey
from reconciler.core.live.models import Deferred, FleetPlan, Placement
from reconciler.core.live.plan_parts import PartsMemo, plan_index, plan_parts, same_parts
from reconciler.core.live.signing import canonical_plan, verify_plan, with_signature
from tests.support.plan_keys import TestKey

T0 = datetime(2026, 12, 2, 12, 0, 0, 123456, tzinfo=UTC)
LUX = TestKey("lux", "lux-test")
KEYS = [PlanKey(host=LUX.host, id=LUX.id, public_key=LUX.public_b64)]
TIERS = ("gpu_cuda", "cpu_ffmpeg", "batch")


def churned(plan: FleetPlan, rng: random.Random, step: int) -> FleetPlan:
    """`plan` after a few random changes, as successive leader steps make them."""
    placements = list(plan.placements)
    deferred = list(plan.deferred)
    nodes = [f"n{i:03d}" for i in range(60)]
    for _ in range(rng.randint(0, 6)):
        kind = rng.choice(("move", "defer", "place", "tier", "hedge", "replace", "drop"))
        if kind == "move" and placements:
            i = rng.randrange(len(placements))
            placements[i] = placements[i].model_copy(update={"node": rng.choice(nodes)})
        elif kind == "defer" and placements:
            gone = placements.pop(rng.randrange(len(placements)))
            deferred.append(Deferred(service=gone.service, replica=gone.replica, reason=rng.choice(("no free slot", f"full at {step}"))))
        elif kind == "place" and deferred:
            back = deferred.pop(rng.randrange(len(deferred)))
            placements.append(Placement(service=back.service, replica=back.replica, node=rng.choice(nodes), tier=rng.choice(TIERS)))
        elif kind == "tier" and placements:
            i = rng.randrange(len(placements))
            placements[i] = placements[i].model_copy(update={"tier": rng.choice(TIERS), "fallback": rng.random() < 0.5})
        elif kind == "hedge" and placements:
            p = rng.choice(placements)
            placements.append(p.model_copy(update={"node": rng.choice(nodes), "hedge": p.node}))
        elif kind == "replace" and placements:
            p = rng.choice(placements)
            placements.append(p.model_copy(update={"node": rng.choice(nodes), "replaces": p.node}))
        elif kind == "drop" and placements:
            placements.pop(rng.randrange(len(placements)))
    rng.shuffle(placements)  # the registry's order is not the scheduler's
    return plan.model_copy(
        update={
            "epoch": plan.epoch + 1,
            "created": T0 + timedelta(seconds=step),
            "placements": placements,
            "deferred": deferred,
            "ignored_nodes": sorted(rng.sample(nodes, rng.randint(0, 3))),
            "room_since": {rng.choice(nodes): T0} if rng.random() < 0.3 else {},
        }
    )


def first_plan(rng: random.Random) -> FleetPlan:
    placements = [Placement(service=f"s{k}", replica=r, node=f"n{rng.randrange(60):03d}", tier="cpu_ffmpeg") for k in range(8) for r in range(12)]
    deferred = [Deferred(service="burst", replica=r, reason="no free slot") for r in range(30)]
    return FleetPlan(epoch=1, leader="lux", term=2, fleet="f", prefix="/fabric", created=T0, placements=placements, deferred=deferred)


def test_parts_made_with_the_memo_are_those_made_from_scratch_over_randomized_churn() -> None:
    for seed in range(4):
        rng = random.Random(seed)
        # A small limit: the memo drops its older half many times on the way.
        memo = PartsMemo(limit=40 + seed * 30)
        plan = first_plan(rng)
        for step in range(30):
            plan = churned(plan, rng, step)
            scratch = plan_parts(plan)
            assert plan_parts(plan, memo) == scratch, (seed, step)
            assert plan_parts(plan, memo) == scratch, "the same plan again: from the memo by identity"
            assert plan_index(plan, memo=memo) == plan_index(plan)
            # The leader's copies of one plan: scoped, numbered, signed.
            signed = with_signature(plan, LUX.id, LUX.private.sign(canonical_plan(plan)))
            assert canonical_plan(plan, memo) == canonical_plan(plan)
            assert verify_plan(signed, KEYS, memo) is None
            assert verify_plan(signed.model_copy(update={"term": 9}), KEYS, memo) == verify_plan(signed.model_copy(update={"term": 9}), KEYS)
            shuffled = plan.model_copy(update={"placements": rng.sample(plan.placements, len(plan.placements))})
            assert same_parts(plan, shuffled, memo) == same_parts(plan, shuffled), (seed, step)


def test_a_chunk_changed_in_any_field_is_made_again() -> None:
    memo = PartsMemo()
    base = FleetPlan(epoch=1, leader="lux", created=T0, placements=[Placement(service="s", replica=0, node="a", tier="cpu_ffmpeg")])
    plan_parts(base, memo)
    for change in ({"replica": 1}, {"tier": "batch"}, {"fallback": True}, {"replaces": "b"}, {"hedge": "b"}, {"service": "t"}):
        moved = base.model_copy(update={"placements": [base.placements[0].model_copy(update=change)]})
        assert plan_parts(moved, memo) == plan_parts(moved), change
        assert plan_parts(moved, memo) != plan_parts(base), change


def test_the_leader_verifies_each_plan_once_and_never_takes_one_plans_verdict_for_another() -> None:
    from reconciler.engine.leader import LeaderLoop

    loop = LeaderLoop(registry=None, host="lux", load_desired=lambda: None, schedule=None, lease_ttl_s=30)  # type: ignore[arg-type]
    plan = first_plan(random.Random(1))
    valid = with_signature(plan, LUX.id, LUX.private.sign(canonical_plan(plan)))
    forged = valid.model_copy(update={"placements": valid.placements[1:]})
    assert loop._verify(valid, KEYS) is None
    assert loop._verify(valid, KEYS) is None
    assert "does not match its content" in (loop._verify(forged, KEYS) or ""), "another plan (equal identity fields): verified on its own"
    assert loop._verify(valid, KEYS) is None
    assert loop._verify(valid, []) is not None, "other keys (none listed): verified again"


def test_the_memo_holds_at_most_two_generations_of_parts_however_long_the_leader_runs() -> None:
    """A large deferred part that changes at every step (its reasons name
    counts of nodes) is a new entry each time: the memo forgets the oldest
    once a generation holds `byte_limit` bytes, not only `limit` entries."""
    memo = PartsMemo(byte_limit=200_000)
    for step in range(60):
        waiting = [Deferred(service="burst", replica=r, reason=f"{step} nodes full, {r} waiting") for r in range(400)]
        plan = FleetPlan(epoch=step, leader="lux", created=T0, deferred=waiting)
        made = plan_parts(plan, memo)
    assert made == plan_parts(plan)
    assert 60 * len(made["deferred/0"]) > 4 * 200_000, "the parts made add up to far more than the memo may hold"
    assert memo.held_bytes() <= 2 * 200_000 + 2 * len(made["deferred/0"])
