"""A plan published while a pass runs is taken by another round of that pass
(reconciler.engine.reconcile.run_pass, PASS_ROUNDS).

The edge (racknerd) passes against the embedded sqlite registry of the signed
example fleet, with FakeMachine for systemd, nft and Caddy. A leader step
(lux's or qfox-1's one-shot step, as a candidate's pass takes it) is made
from inside the pass, at its Caddy load (the pass's checkpoint before that
step), so the registry moves on while the pass activates the plan it read.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path

import pytest

from reconciler.adapters.clock import SystemClock
from reconciler.adapters.files import LocalTree
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.watching import PLAN_TAKEN, epoch_taken
from reconciler.engine import plan_fence, plan_source
from reconciler.engine.apply import GenerationStore
from reconciler.engine.pass_options import STATE_DIR, PassOptions, PlanFromRegistry
from reconciler.engine.reconcile import PASS_ROUNDS, PassPorts, run_pass
from reconciler.ports import LockBusy, RegistryUnavailable
from tests.conftest import REPO
from tests.support.audit import RecordingAudit
from tests.support.fleet import fake_pass_ports
from tests.support.machine import FakeMachine, FakeVerifier
from tests.support.memo_sandbox import new_term_without_a_plan
from tests.support.plan_keys import CANDIDATES, FakeSigner, SignedFleet
from tests.support.probe_fixtures import fixture_facts as facts

EDGE = "racknerd"
SERVICE = "vaapi-encode"
CADDY_LOAD = "caddy-load"


class Leading:
    """The registry file and the candidates' one-shot leader steps."""

    def __init__(self, path: Path, state: DesiredState, signers: dict[str, FakeSigner]) -> None:
        self.path, self.state, self.signers = path, state, signers

    def connect(self) -> SqliteRegistry:
        return SqliteRegistry(self.path, timing=self.state.fleet.timing, flap=self.state.fleet.flap, clock=SystemClock())

    def beat_and_lead(self, host: str) -> None:
        """`host`'s heartbeat and leader step, as its own pass makes them (nobody leads between steps)."""
        plan_source.read_registry(self.connect, self.state, host, facts(host), write=True, signer=self.signers[host])

    def newest_plan(self) -> FleetPlan:
        registry = self.connect()
        try:
            plan = registry.newest_plan()
        finally:
            registry.close()
        assert plan is not None
        return plan

    def serving(self) -> list[str]:
        return sorted(p.node for p in self.newest_plan().placements if p.service == SERVICE)

    def newest_epoch(self) -> int:
        return self.newest_plan().epoch

    def moving_once(self, host: str) -> tuple[Callable[[], None], list[int]]:
        """A hook that, the first time it is called, drains `host` and leads
        (the plan moves SERVICE off it), and the list of that plan's epoch."""
        published: list[int] = []

        def publish_once() -> None:
            if not published:
                self.drain(host)
                published.append(self.newest_epoch())

        return publish_once, published

    def drain(self, host: str, *, lift: str | None = None) -> None:
        """Drain `host` (and lift the drain of `lift`), then lead once: the plan moves SERVICE."""
        registry = self.connect()
        try:
            if lift is not None:
                registry.clear_drain(lift)
            registry.set_drain(host, 0, reason="test: move its work")
        finally:
            registry.close()
        self.beat_and_lead("lux")


@pytest.fixture
def fleet(signed_fleet: SignedFleet) -> SignedFleet:
    """The example fleet whose candidates sign with throwaway keys (tests/conftest.py)."""
    return signed_fleet


@pytest.fixture
def leading(tmp_path: Path, fleet: SignedFleet) -> Leading:
    leading = Leading(tmp_path / "registry.sqlite", load_desired(fleet.desired), {host: fleet.signer(host) for host in CANDIDATES})
    leading.beat_and_lead("lux")
    leading.beat_and_lead("qfox-1")  # both nodes in the plan: SERVICE on the better one
    return leading


class Edge:
    def __init__(self, tmp_path: Path, fleet: SignedFleet, leading: Leading) -> None:
        self.root = tmp_path / "root"
        self.root.mkdir()
        self.machine = FakeMachine(self.root, tmp_path / "machine.json")
        self.notes: list[str] = []
        self.leading = leading
        self.options = PassOptions(
            desired=fleet.desired, host=EDGE, root=self.root, replay=str(REPO / "tests/fixtures/probe" / EDGE), plan=PlanFromRegistry()
        )

    def ports(self, at_caddy_load=None) -> PassPorts:  # type: ignore[no-untyped-def]
        ports = fake_pass_ports(self.root, self.machine, FakeVerifier(), RecordingAudit(), notes=self.notes)
        ports.open_registry = lambda _fleet: self.leading.connect()
        if at_caddy_load is not None:
            ports.checkpoint = lambda step: at_caddy_load() if step.startswith(CADDY_LOAD) else None
        return ports

    def applied_epoch(self) -> int | None:
        store = GenerationStore(LocalTree(self.root))
        manifest = store.manifest(store.current())
        return manifest.epoch if manifest is not None else None

    def taken(self) -> int | None:
        """The epoch the pass recorded as taken (the watcher's PLAN_TAKEN)."""
        path = self.root / STATE_DIR / PLAN_TAKEN
        return epoch_taken(path.read_bytes() if path.exists() else None)

    def caddy_loads(self) -> int:
        return sum(1 for action, _ in self.machine.calls if action == CADDY_LOAD)

    def rounds_noted(self) -> list[str]:
        return [note for note in self.notes if "another round" in note]


def test_a_plan_published_while_the_pass_activates_is_applied_by_another_round_of_it(tmp_path, fleet, leading) -> None:
    (first,) = leading.serving()
    edge = Edge(tmp_path, fleet, leading)
    publish_once, published = leading.moving_once(first)
    report = run_pass(edge.options, edge.ports(at_caddy_load=publish_once))
    assert report.outcome == "applied", report
    (moved_to,) = leading.serving()
    assert moved_to != first
    # Two rounds: the first loaded Caddy with the plan it read, the second with the one published meanwhile.
    assert edge.caddy_loads() == 2
    assert edge.rounds_noted() == [f"registry epoch {published[0]} since this pass read plan epoch {published[0] - 2}: another round"]
    assert edge.applied_epoch() == edge.taken() == published[0]
    assert report.stdout.count("generation ") == 2 and report.stdout.rstrip().endswith("generation 2 is active"), report.stdout
    # Nothing is left for the next pass: it finds the newest plan applied.
    again = run_pass(edge.options, edge.ports())
    assert again.outcome == "noop", again
    assert again.memo_seed is not None and again.memo_seed.registry_epoch == published[0]


def test_a_pass_takes_at_most_pass_rounds_rounds_however_many_plans_come(tmp_path, fleet, leading) -> None:
    (first,) = leading.serving()
    other = next(host for host in CANDIDATES if host != first)
    edge = Edge(tmp_path, fleet, leading)
    moves: list[int] = []

    def publish_every_time() -> None:
        # Back and forth between the two candidates: every plan moves SERVICE.
        drained, lifted = (first, other) if len(moves) % 2 == 0 else (other, first)
        leading.drain(drained, lift=lifted if moves else None)
        moves.append(leading.newest_epoch())

    report = run_pass(edge.options, edge.ports(at_caddy_load=publish_every_time))
    assert report.outcome == "applied", report
    assert edge.caddy_loads() == PASS_ROUNDS
    assert len(edge.rounds_noted()) == PASS_ROUNDS - 1
    # The last round's plan is applied; the one published during it is the next pass's.
    assert edge.applied_epoch() == moves[-2] < moves[-1]
    # The watcher starts a pass for the last one: the record names the one before.
    assert edge.taken() == moves[-2]
    assert report.memo_seed is not None and report.memo_seed.registry_epoch == moves[-2]


def test_a_new_leader_term_without_a_new_plan_costs_a_round_that_changes_nothing(tmp_path, fleet, leading) -> None:
    edge = Edge(tmp_path, fleet, leading)
    stepped: list[bool] = []

    def new_term_once() -> None:
        if not stepped:
            with closing(leading.connect()) as registry:
                new_term_without_a_plan(registry, "qfox-1")
            stepped.append(True)

    before = leading.newest_epoch()
    report = run_pass(edge.options, edge.ports(at_caddy_load=new_term_once))
    assert leading.newest_epoch() == before, "no plan was published"
    assert len(edge.rounds_noted()) == 1
    assert edge.caddy_loads() == 1
    # The second round changes nothing: the newest plan is of a term that is
    # over (signed plans apply only in the registry's current term), so the
    # round keeps what the first applied, until the new term publishes.
    assert report.outcome == "static", report
    assert "not the registry's current term" in report.stdout, report.stdout
    assert report.stdout.rstrip().endswith("running static; generation 1 stays"), report.stdout


def test_a_pass_that_runs_static_records_no_plan_taken(tmp_path, fleet, leading) -> None:
    """Neither a plan it refused nor one it could not read: the watcher still starts a pass for what comes next."""
    edge = Edge(tmp_path, fleet, leading)
    assert run_pass(edge.options, edge.ports()).outcome == "applied"
    before = edge.taken()
    assert before is not None
    # An unsigned plan, published by a term of its own: refused, the host stays static.
    registry = leading.connect()
    try:
        newest = registry.newest_plan()
        term = registry.campaign("qfox-1", 30.0)
        assert newest is not None and term is not None
        forged = registry.publish_plan(term, newest.model_copy(update={"signature": None, "leader": "qfox-1"}))
        registry.resign(term)
    finally:
        registry.close()
    refused = run_pass(edge.options, edge.ports())
    assert refused.outcome == "static" and "running static" in refused.stdout, refused
    assert edge.taken() == before < forged.epoch

    def unreachable(_fleet):  # type: ignore[no-untyped-def]
        raise RegistryUnavailable("etcd: connection refused")

    ports = edge.ports()
    ports.open_registry = unreachable
    assert run_pass(edge.options, ports).outcome == "static"
    assert edge.taken() == before


class TakenAfterFirst:
    """The pass lock, taken by another pass once this pass's first round let go of it."""

    def __init__(self) -> None:
        self.acquired = 0

    def acquire(self) -> None:
        self.acquired += 1
        if self.acquired > 1:
            raise LockBusy("another pass holds var/lib/fabric/lock")

    def release(self) -> None:
        pass


def test_a_later_round_that_finds_the_lock_taken_leaves_the_new_plan_to_the_pass_that_holds_it(tmp_path, fleet, leading) -> None:
    (first,) = leading.serving()
    edge = Edge(tmp_path, fleet, leading)
    publish_once, published = leading.moving_once(first)
    ports = edge.ports(at_caddy_load=publish_once)
    ports.lock = TakenAfterFirst()
    report = run_pass(edge.options, ports)
    # What the first round applied stands; the pass that holds the lock takes the new plan.
    assert report.outcome == "applied", report
    assert report.stderr == ("fabric reconcile: another pass holds var/lib/fabric/lock",)
    assert edge.caddy_loads() == 1 and edge.applied_epoch() == published[0] - 2


class EpochOnly:
    def __init__(self, epoch: int | None) -> None:
        self._epoch = epoch
        self.closed = False

    def epoch(self) -> int:
        if self._epoch is None:
            raise RegistryUnavailable("etcd: connection refused")
        return self._epoch

    def close(self) -> None:
        self.closed = True


def _source(*, registry_epoch: int | None, plan_epoch: int, static: str | None = None) -> plan_fence.PassPlan:
    plan = FleetPlan(epoch=plan_epoch, leader="lux", created=datetime(2026, 12, 1, tzinfo=UTC))
    return plan_fence.PassPlan(plan, static=static, registry_epoch=registry_epoch)


@pytest.mark.parametrize(
    ("registry_epoch", "plan_epoch", "now", "static", "moved"),
    [
        (7, 7, 8, None, 8),  # a plan (or a term) since the pass read its own
        (7, 7, 7, None, None),  # nothing since
        # The plan was published between the pass's epoch read and its plan
        # read: newer than the epoch it kept, and the one it rendered.
        (7, 8, 8, None, None),
        (7, 7, 9, "registry refused this host: running static", None),  # static: no round renders
        (None, 0, 9, None, None),  # not from the registry
        (7, 7, None, None, None),  # the registry cannot be read now: the next pass sees it
    ],
)
def test_the_epoch_moved_past_the_plan_a_pass_read(registry_epoch, plan_epoch, now, static, moved) -> None:
    registry = EpochOnly(now)
    assert plan_source.epoch_moved_past(lambda: registry, _source(registry_epoch=registry_epoch, plan_epoch=plan_epoch, static=static)) == moved
    assert registry.closed or registry_epoch is None or static is not None
