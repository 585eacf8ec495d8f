"""A host reads only its part of the plan (issue 34, item 2), with fakes.

- the pure read: `join_plan(..., only=...)` of a host's parts gives that
  host's `plan_part` exactly as the whole plan does, for every host that
  does not read the whole plan, in the example fleet and in a plan of
  thousands of placements (the integration tests read 20,000);
- the fence: a host's read (`PlanRead`) is accepted only when its index is
  validly signed and the plan is the index's to the byte: a placement
  changed, a chunk of its own placements left out, another host's parts
  given as its own, an identity not the index's, a forged index: refused;
- the pass (`plan_source.read_registry`): a host other than the edge asks
  the registry for its own parts (and a phaze control host for the fleet
  part) and never for the whole plan; the edge reads the whole plan; a
  part missing, garbled or not the index's keeps the last good generation
  with a reason naming the part;
- the watcher (`engine.watch`): a host other than the edge follows its
  parts' digests in the index alone (no part read, no desired state), so a
  plan that moves work between two other hosts starts no pass here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState, PlanKey
from reconciler.core.live.fencing import AppliedFence, accept_plan
from reconciler.core.live.models import FleetPlan, Placement
from reconciler.core.live.plan_parts import (
    PART_ITEMS,
    PlanIndex,
    PlanRead,
    glance_digests,
    host_part_names,
    join_plan,
    own_digests,
    parts_version,
    plan_index,
    plan_parts,
)
from reconciler.core.live.records import LeaderInfo
from reconciler.core.live.signing import canonical_plan, with_signature
from reconciler.core.live.watching import DRAIN, PLAN, STATE, EntryVersion, WatchTimings
from reconciler.core.render.plan_part import plan_part, reads_fleet_part, reads_whole_plan
from reconciler.engine import plan_source
from reconciler.engine.plan_fence import PlanOffer, admit
from reconciler.engine.watch import Watcher
from reconciler.ports import RegistryError
from tests.conftest import EXAMPLE_FLEET
from tests.support.clock import FakeClock
from tests.support.plan_keys import TestKey
from tests.support.plan_reads import read_of

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
LUX = TestKey("lux", "lux-a")
KEYS = [PlanKey(host=LUX.host, id=LUX.id, public_key=LUX.public_b64)]
FLEET, PREFIX = "researchstack", "/fabric"


def example() -> DesiredState:
    return load_desired(EXAMPLE_FLEET)


def signed(plan: FleetPlan) -> FleetPlan:
    body = plan.model_copy(update={"leader": "lux", "term": 7, "fleet": FLEET, "prefix": PREFIX})
    return with_signature(body, LUX.id, LUX.private.sign(canonical_plan(body)))


def example_plan(desired: DesiredState, epoch: int = 20) -> FleetPlan:
    """Every service on every declared host, one replica each."""
    placements = [
        Placement(service=s.id, replica=i, node=h, tier="cpu_ffmpeg") for s in desired.fleet.services for i, h in enumerate(sorted(desired.hosts))
    ]
    return signed(FleetPlan(epoch=epoch, leader="lux", created=T0, placements=placements))


@functools.cache
def big_plan(extra: int = 6_000) -> FleetPlan:
    """The example's services on its hosts, and `extra` placements on 5,000 other nodes."""
    desired = example()
    mine = example_plan(desired).placements
    others = [Placement(service="svc-big", replica=i, node=f"node-{i % 5000:05d}", tier="cpu_ffmpeg") for i in range(extra)]
    return signed(FleetPlan(epoch=21, leader="lux", created=T0, placements=[*mine, *others]))


def own_read(plan: FleetPlan, desired: DesiredState, host: str) -> PlanRead:
    read = read_of(plan, lambda index: host_part_names(index, host, fleet=reads_fleet_part(desired, host)))
    assert read is not None
    return read


# -- the pure read ----------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: example_plan(example()), big_plan], ids=["example", "big"])
def test_a_hosts_parts_give_its_plan_part_as_the_whole_plan_does(make: Callable[[], FleetPlan]) -> None:
    desired = example()
    plan = make()
    readers = [h for h in sorted(desired.hosts) if not reads_whole_plan(desired, h)]
    assert readers and "racknerd" not in readers  # the edge reads the whole plan
    for host in readers:
        read = own_read(plan, desired, host)
        assert set(read.parts) <= {n for n in read.index.parts if n.startswith(f"host/{host}/") or n == "fleet"}
        assert plan_part(desired, read.plan, host) == plan_part(desired, plan, host), host
        assert accept_plan(None, read.plan, plan_keys=KEYS, read=read, host=host).accepted, host


def test_a_host_with_many_placements_reads_every_chunk_of_its_own() -> None:
    placements = [Placement(service="svc-big", replica=i, node="qfox-1", tier="cpu_ffmpeg") for i in range(PART_ITEMS + 5)]
    plan = signed(FleetPlan(epoch=3, leader="lux", created=T0, placements=placements))
    read = own_read(plan, example(), "qfox-1")
    assert read.parts == ("host/qfox-1/0", "host/qfox-1/1")
    assert len(read.plan.placements) == PART_ITEMS + 5


def test_the_watchers_version_moves_with_the_hosts_parts_only() -> None:
    desired = example()
    plan = example_plan(desired)
    moved = [p.model_copy(update={"node": "x86-spill"}) if p.node == "a1-arm64" else p for p in plan.placements]
    other = signed(plan.model_copy(update={"epoch": 21, "placements": moved}))
    before, after = plan_index(plan), plan_index(other)
    assert parts_version(own_digests(before, "qfox-1")) == parts_version(own_digests(after, "qfox-1"))
    assert parts_version(own_digests(before, "a1-arm64")) != parts_version(own_digests(after, "a1-arm64"))


def test_a_glance_at_the_index_finds_the_hosts_digests_as_parsing_it_does() -> None:
    plan = big_plan()
    index = plan_index(plan)
    stored = index.model_dump_json().encode()  # as both backends store it
    for host in ("qfox-1", "node-00042", "node-0004", "x86-spill", "nobody"):
        assert glance_digests(stored, host) == (index.epoch, own_digests(index, host)), host
    # Not an index this version stores: the caller parses it.
    assert glance_digests(b'{"leader":"lux","epoch":3}', "qfox-1") is None


# -- the fence --------------------------------------------------------------------


def refused(read: PlanRead, host: str = "qfox-1", plan: FleetPlan | None = None) -> str:
    verdict = accept_plan(None, plan or read.plan, plan_keys=KEYS, read=read, host=host)
    assert not verdict.accepted and verdict.untrusted
    return verdict.reason


def test_a_read_whose_plan_is_not_its_index_is_refused() -> None:
    desired = example()
    read = own_read(example_plan(desired), desired, "qfox-1")
    changed = [p.model_copy(update={"service": "lupine"}) for p in read.plan.placements]
    tampered = read.plan.model_copy(update={"placements": changed})
    assert "part host/qfox-1/0 is not the index's" in refused(PlanRead(read.index, tampered, read.parts), plan=tampered)
    newer = read.plan.model_copy(update={"epoch": 99})
    assert "its identity is not its index's" in refused(PlanRead(read.index, newer, read.parts), plan=newer)


def test_a_read_that_left_out_a_part_of_the_host_is_refused() -> None:
    placements = [Placement(service="svc-big", replica=i, node="qfox-1", tier="cpu_ffmpeg") for i in range(PART_ITEMS + 5)]
    plan = signed(FleetPlan(epoch=3, leader="lux", created=T0, placements=placements))
    full = own_read(plan, example(), "qfox-1")
    first = join_plan(full.index, plan_parts(plan), only=["host/qfox-1/0"])
    assert "part host/qfox-1/1 of qfox-1 was not read" in refused(PlanRead(full.index, first, ("host/qfox-1/0",)), plan=first)
    # Another host's parts passed off as this host's read: its own are missing.
    other = own_read(example_plan(example()), example(), "a1-arm64")
    assert "of qfox-1 was not read" in refused(other)


def test_a_read_of_a_forged_index_is_refused() -> None:
    desired = example()
    read = own_read(example_plan(desired), desired, "qfox-1")
    forger = TestKey("lux", "lux-a")  # the same id, another key
    body = read.plan.model_copy(update={"signature": None, "epoch": 500})
    forged_plan = with_signature(body, forger.id, forger.private.sign(canonical_plan(body)))
    forged = read_of(forged_plan, lambda index: host_part_names(index, "qfox-1"))
    assert forged is not None
    assert "does not match its content" in refused(forged)


# -- the pass -----------------------------------------------------------------------


class PartsRegistry:
    """The pass's registry: one plan, the reads recorded."""

    def __init__(self, plan: FleetPlan | None, fail: Exception | None = None) -> None:
        self.plan, self.fail = plan, fail
        self.whole_reads = 0
        self.parts_read: list[tuple[str, ...]] = []

    def leader_term(self) -> LeaderInfo:
        return LeaderInfo(candidate="lux", epoch=20, since=T0, token="t", term=7)

    def epoch(self) -> int:
        return self.plan.epoch if self.plan else 0

    def newest_plan(self) -> FleetPlan | None:
        self.whole_reads += 1
        return self.plan

    def plan_read(self, choose: Callable[[PlanIndex], Collection[str]]) -> PlanRead | None:
        if self.fail is not None:
            raise self.fail
        read = read_of(self.plan, choose)
        self.parts_read.append(read.parts if read else ())
        return read

    def node_states(self) -> list:  # type: ignore[type-arg]
        return []

    def close(self) -> None:
        pass


def signed_example(tmp_path: Path) -> DesiredState:
    desired = example()
    fleet = desired.fleet.model_copy(update={"plan_keys": KEYS})
    return desired.model_copy(update={"fleet": fleet})


def offer(desired: DesiredState, host: str, registry: PartsRegistry) -> PlanOffer:
    # write=False (as `fabric plan` reads): no heartbeat, so no facts are needed.
    return plan_source.read_registry(lambda: registry, desired, host, None, write=False)  # type: ignore[arg-type]


def test_a_hosts_pass_reads_its_own_parts_and_never_the_whole_plan(tmp_path: Path) -> None:
    desired = signed_example(tmp_path)
    plan = big_plan()
    for host in ("qfox-1", "a1-arm64", "x86-spill", "lux"):
        registry = PartsRegistry(plan)
        got = offer(desired, host, registry)
        assert registry.whole_reads == 0, host
        fleet = ("fleet",) if reads_fleet_part(desired, host) else ()
        assert registry.parts_read == [tuple(sorted((*(n for n in plan_index(plan).parts if n.startswith(f"host/{host}/")), *fleet)))], host
        admitted = admit(got, desired, applied_epoch=AppliedFence(20, 7, LUX.id), has_generation=True, now=T0)
        assert admitted.static is None, admitted.notes
        assert plan_part(desired, admitted.plan, host) == plan_part(desired, plan, host)
    edge = PartsRegistry(plan)
    offer(desired, "racknerd", edge)
    assert edge.whole_reads == 1 and edge.parts_read == []


@pytest.mark.parametrize(
    "problem",
    [
        "plan part host/qfox-1/0 of epoch 20 is missing",
        "plan part host/qfox-1/0: its digest is not the index's (a part of another epoch, or tampered): refused",
        "unreadable plan: not JSON",
    ],
)
def test_a_part_that_cannot_be_taken_keeps_the_last_good_generation(tmp_path: Path, problem: str) -> None:
    desired = signed_example(tmp_path)
    registry = PartsRegistry(example_plan(desired), fail=RegistryError(f"etcd /fabric/plan-index: {problem}"))
    admitted = admit(offer(desired, "qfox-1", registry), desired, applied_epoch=AppliedFence(20, 7, LUX.id), has_generation=True, now=T0)
    assert admitted.static is not None and "the newest plan cannot be taken" in admitted.static and problem in admitted.static
    assert admitted.static.endswith("running static")


# -- the watcher ------------------------------------------------------------------


class IndexRegistry:
    """The watcher's registry: the plan of each registry version, every read recorded."""

    def __init__(self, plans: dict[str, FleetPlan], answers: list[list[EntryVersion]]) -> None:
        self.plans, self.answers = plans, answers
        self.version = ""
        self.whole_reads = 0
        self.glances = 0
        self.parts_read: list[tuple[str, ...]] = []

    def watch_host(self, host: str, timeout_s: float) -> list[EntryVersion]:
        answer = self.answers.pop(0) if self.answers else []
        for entry in answer:
            if entry.entry == PLAN:
                self.version = entry.version
        return answer

    def newest_plan(self) -> FleetPlan | None:
        self.whole_reads += 1
        return self.plans.get(self.version)

    def plan_read(self, choose: Callable[[PlanIndex], Collection[str]]) -> PlanRead | None:
        read = read_of(self.plans.get(self.version), choose)
        self.parts_read.append(read.parts if read else ())
        return read

    def plan_glance(self, host: str) -> tuple[int, dict[str, str]] | None:
        plan = self.plans.get(self.version)
        self.glances += 1
        return None if plan is None else glance_digests(plan_index(plan).model_dump_json().encode(), host)


class Starter:
    def __init__(self) -> None:
        self.starts = 0

    def pass_running(self) -> bool:
        return False

    def start_pass(self) -> None:
        self.starts += 1


def test_the_watcher_follows_its_parts_from_the_index_alone() -> None:
    desired = example()
    first = example_plan(desired)
    # Epoch 21 moves a1-arm64's work to x86-spill; epoch 22 changes qfox-1's.
    moved = signed(
        first.model_copy(
            update={"epoch": 21, "placements": [p.model_copy(update={"node": "x86-spill"}) if p.node == "a1-arm64" else p for p in first.placements]}
        )
    )
    mine = signed(moved.model_copy(update={"epoch": 22, "placements": [p for p in moved.placements if p.node != "qfox-1"]}))
    plans = {"1": first, "2": moved, "3": mine}
    answers = [
        [EntryVersion(PLAN, "", "1"), EntryVersion(DRAIN, "qfox-1", ""), EntryVersion(STATE, "qfox-1", "s")],
        [EntryVersion(PLAN, "", "2")],
        [EntryVersion(PLAN, "", "3")],
    ]
    registry = IndexRegistry(plans, answers)
    starter = Starter()
    loads: list[int] = []

    def desired_for(plan: FleetPlan) -> DesiredState:
        loads.append(plan.epoch)
        return desired

    log: list[str] = []
    w = Watcher(registry, starter, FakeClock(), "qfox-1", desired_for, own_desired=lambda: desired, timings=WatchTimings(), log=log.append)  # type: ignore[arg-type]
    for _ in range(2):
        w.step()
    assert starter.starts == 0 and "plan epoch 21 leaves qfox-1's part as it was: no pass" in log
    w.step()
    assert starter.starts == 1
    # A glance at the index for each plan: no part was read, no desired state for a part, the whole plan never.
    assert registry.glances == 3 and registry.parts_read == [] and registry.whole_reads == 0 and loads == []


def test_the_edges_watcher_still_reads_the_plan_its_routes_come_from() -> None:
    desired = example()
    plan = example_plan(desired)
    registry = IndexRegistry({"1": plan}, [[EntryVersion(PLAN, "", "1")]])
    w = Watcher(
        registry, Starter(), FakeClock(), "racknerd", lambda p: desired, own_desired=lambda: desired, timings=WatchTimings(), log=lambda s: None
    )  # type: ignore[arg-type]
    w.step()
    assert registry.whole_reads == 1 and registry.parts_read == []
