"""The leader never dies of a registry error (issue 34, item 3).

`LeaderLoop.run` over a registry stand-in that raises, at each call the loop
makes, every error the Registry port declares (each subclass of
`RegistryError` in reconciler.ports, found by walking the module, so a new
one is covered without editing this test) for a few attempts and then
answers again. The loop must: keep running (only `stop` ends it), say each
failure in the journal (its kind, the attempt, what it keeps), back off
doubling up to a third of the lease, keep its term (no new campaign) and
its last good plan, write the problem into the leader record at its next
renewal (where `fabric status`, the page and metrics read it) and clear it,
saying so, once a step succeeds. `NotLeader` ends the term, never the loop.
No real waits: the loop's stop event counts its waits.
"""

from __future__ import annotations

import inspect
from datetime import UTC, datetime
from pathlib import Path

import pytest

from reconciler import ports
from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import FleetPlan, LeaderProblem, Snapshot, SnapshotNode
from reconciler.core.live.records import LeaderInfo, Leadership
from reconciler.core.templating import PACKAGED
from reconciler.core.views.cards import fleet_status, render_text, status_document
from reconciler.core.views.metrics import exposition, fleet_families
from reconciler.core.views.page import render_status_html
from reconciler.engine.leader import RETRY_FIRST_S, LeaderLoop, PlanNotPublished
from reconciler.ports import LeaderView, NotLeader, PlanSigningError, RegistryError
from tests.support.clock import FakeClock
from tests.support.plan_keys import signed_example_fleet

LEASE_TTL_S = 12.0  # wait_s: 4 s

REGISTRY_ERRORS = sorted(
    (c for _, c in inspect.getmembers(ports, inspect.isclass) if issubclass(c, RegistryError) and c is not NotLeader),
    key=lambda c: c.__name__,
)
# Every call the loop makes on its registry while it leads.
CALLS = ("wait_for_change", "campaign", "renew", "lead", "liveness", "group_members", "epoch", "publish_plan")


def test_the_port_declares_the_error_kinds_this_test_drives():
    names = {c.__name__ for c in REGISTRY_ERRORS}
    assert {"RegistryError", "RegistryUnavailable", "PermissionDenied"} <= names, names


class FaultyRegistry:
    """Leads at once (one term, token "t1", then "t2"...); `fail(call, exc, times)`
    makes `call` raise `exc` that many times. Records each renewal's record."""

    def __init__(self) -> None:
        self.faults: dict[str, tuple[Exception, int]] = {}
        self.terms = 0
        self.renewed: list[LeaderInfo] = []
        self.published: list[FleetPlan] = []
        self.resigned: list[Leadership] = []
        self._epoch = 1

    def fail(self, call: str, exc: Exception, times: int) -> None:
        self.faults[call] = (exc, times)

    def _maybe_fail(self, call: str) -> None:
        exc, times = self.faults.get(call, (None, 0))
        if exc is not None and times > 0:
            self.faults[call] = (exc, times - 1)
            raise exc

    def wait_for_change(self, timeout_s: float) -> bool:
        self._maybe_fail("wait_for_change")
        return False

    def campaign(self, candidate: str, ttl_s: float) -> Leadership:
        self._maybe_fail("campaign")
        self.terms += 1
        self._epoch += 1
        info = LeaderInfo(candidate=candidate, epoch=self._epoch, since=datetime.now(UTC), token=f"t{self.terms}", term=self.terms)
        return Leadership(info, ttl_s)

    def renew(self, leadership: Leadership) -> bool:
        self._maybe_fail("renew")
        self.renewed.append(leadership.info)
        return True

    def resign(self, leadership: Leadership) -> None:
        self.resigned.append(leadership)

    def leader_term(self) -> None:
        return None

    def lead(self, leadership: Leadership, lanes=()) -> LeaderView:
        self._maybe_fail("lead")
        plan = self.published[-1] if self.published else None
        nodes = [SnapshotNode(node_id="lux", tier="cpu_ffmpeg", max_concurrent_tasks=2)]
        return LeaderView(events=[], snapshot=Snapshot(epoch=self._epoch, nodes=nodes), plan=plan)

    def liveness(self) -> list:
        self._maybe_fail("liveness")
        return []

    def edge_upstreams(self) -> dict[str, bytes]:
        self._maybe_fail("edge_upstreams")
        return {}

    def group_members(self) -> tuple[list, list[str]]:
        self._maybe_fail("group_members")
        return [], []

    def epoch(self) -> int:
        self._maybe_fail("epoch")
        return self._epoch

    def publish_plan(self, leadership: Leadership, plan: FleetPlan) -> FleetPlan:
        self._maybe_fail("publish_plan")
        self._epoch += 1
        stored = plan.model_copy(update={"epoch": self._epoch, "leader": leadership.candidate, "term": leadership.term})
        self.published.append(stored)
        return stored


class CountedStop:
    """The loop's stop event: set after `steps` waits of any kind; records each wait."""

    def __init__(self, waits: int) -> None:
        self.left = waits
        self.waits: list[float] = []

    def is_set(self) -> bool:
        return self.left <= 0

    def set(self) -> None:
        self.left = 0

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.left -= 1
        return self.is_set()


def a_loop(tmp_path: Path, registry: FaultyRegistry, waits: int) -> tuple[LeaderLoop, list[str], CountedStop]:
    signed = signed_example_fleet(tmp_path)
    desired = load_desired(signed.desired)
    lines: list[str] = []
    stop = CountedStop(waits)
    step = {"n": 0}

    def schedule(snapshot, desired, *, leader, epoch):
        # A new plan at every step, so each step publishes.
        step["n"] += 1
        return FleetPlan(epoch=epoch, leader=leader, created=snapshot.now, ignored_nodes=[f"n{step['n']}"])

    loop = LeaderLoop(
        registry=registry,  # type: ignore[arg-type]
        host="lux",
        load_desired=lambda: desired,
        schedule=schedule,
        lease_ttl_s=LEASE_TTL_S,
        log=lines.append,
        signer=signed.signer("lux"),
        clock=FakeClock(),
        _stop=stop,  # type: ignore[arg-type]
    )
    # The loop's waits between good steps go through the registry: count them as waits too.
    real_wait = registry.wait_for_change

    def counted(timeout_s: float) -> bool:
        real_wait(timeout_s)
        stop.wait(0)
        return False

    registry.wait_for_change = counted  # type: ignore[method-assign]
    return loop, lines, stop


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("error", REGISTRY_ERRORS, ids=lambda c: c.__name__)
def test_every_registry_error_at_every_call_is_said_retried_with_backoff_and_survived(tmp_path, error, call):
    registry = FaultyRegistry()
    loop, lines, stop = a_loop(tmp_path, registry, waits=40)
    if call in ("lead", "epoch", "publish_plan", "renew"):
        # Fail only once the loop leads and has published a good plan.
        loop.step()
        assert len(registry.published) == 1
    good = registry.published[-1] if registry.published else None
    registry.fail(call, error(f"etcd: {call} refused (test)"), times=3)
    loop.run()  # returns only because the stop event was set: no exception escaped
    said = [line for line in lines if line.startswith("registry error")]
    assert len(said) == 3, lines
    assert all(f"({error.__name__}, attempt" in line for line in said), said
    assert [line.split("attempt ")[1].split(" ")[0] for line in said] == ["1", "2", "3"]
    backoffs = [w for w in stop.waits if w > 0][:3]
    assert backoffs == [RETRY_FIRST_S, RETRY_FIRST_S * 2, RETRY_FIRST_S * 4], stop.waits
    assert any(line.startswith("the registry works again after 3 failed attempts") for line in lines), lines
    assert loop.problem is None
    if call in ("lead", "epoch", "publish_plan", "renew"):
        assert registry.terms == 1, "the term was kept: no new campaign"
        assert all("keeping term 1 and plan epoch" in line for line in said), said
        assert good is not None and registry.published[0] == good
    if call in ("lead", "epoch", "publish_plan"):
        # The renewal after a failure wrote the problem into the leader record; a later one cleared it.
        problems = [info.problem for info in registry.renewed if info.problem is not None]
        assert problems and problems[0].kind == error.__name__ and problems[-1].attempts >= 1
        assert problems[0].plan_epoch == good.epoch
        assert registry.renewed[-1].problem is None
    assert loop.leadership is None, "stopped: resigned"
    assert len(registry.resigned) == 1


def test_backoff_doubles_up_to_a_third_of_the_lease_and_the_term_is_renewed_meanwhile(tmp_path):
    registry = FaultyRegistry()
    loop, lines, stop = a_loop(tmp_path, registry, waits=12)
    loop.step()
    registry.fail("publish_plan", RegistryError("etcd: the plan is 2000000 bytes, over the budget"), times=100)
    loop.run()
    backoffs = [w for w in stop.waits if w > 0]
    assert backoffs[:5] == [0.5, 1.0, 2.0, 4.0, 4.0], backoffs
    assert max(backoffs) <= loop.wait_s()
    assert registry.terms == 1 and len(registry.renewed) >= 10, "renewed at every retry"
    assert registry.renewed[-1].problem is not None and registry.renewed[-1].problem.attempts >= 9
    assert "over the budget" in registry.renewed[-1].problem.what


def test_not_leader_ends_the_term_never_the_loop(tmp_path):
    registry = FaultyRegistry()
    loop, lines, _ = a_loop(tmp_path, registry, waits=30)
    loop.step()
    registry.fail("lead", NotLeader("lux's term of epoch 2 is over (qfox-1 leads)"), times=1)
    loop.run()
    assert "lux's term of epoch 2 is over (qfox-1 leads)" in lines
    assert registry.terms == 2, "campaigned again"
    assert not [line for line in lines if line.startswith("registry error")]


@pytest.mark.parametrize(
    "error", [PlanSigningError("the plan key file is unreadable"), PlanNotPublished("plan stored as epoch 9, signed for epoch 8")]
)
def test_a_plan_not_published_is_a_problem_too_and_clears(tmp_path, error):
    registry = FaultyRegistry()
    loop, lines, _ = a_loop(tmp_path, registry, waits=8)
    loop.step()
    registry.fail("publish_plan", error, times=2)
    loop.step()
    assert loop.problem is not None and loop.problem.kind == type(error).__name__
    loop.step()
    assert loop.problem.attempts == 2
    loop.step()
    assert loop.problem is None and registry.renewed[-1].problem is not None, "the renewal of this step still carried it"
    loop.step()
    assert registry.renewed[-1].problem is None


def test_status_page_and_metrics_show_the_leaders_problem(tmp_path):
    desired = load_desired(signed_example_fleet(tmp_path).desired)
    now = datetime(2026, 12, 2, 10, 30, tzinfo=UTC)
    problem = LeaderProblem(kind="RegistryError", what="etcd: the plan is 2000000 bytes", since=now, attempts=7, plan_epoch=41)
    snapshot = Snapshot(now=now, leader="lux", epoch=42, leader_problem=problem)
    status = fleet_status(desired, snapshot, None, now)
    text = render_text(status)
    assert "LEADER FAILING · it keeps its term and retries: RegistryError since 2026-12-02 10:30:00 UTC (7 attempts), plan epoch 41" in text
    assert status_document(status)["leader_problem"]["attempts"] == 7
    page = render_status_html(status, PACKAGED)
    assert 'id="leader-problem"' in page and "etcd: the plan is 2000000 bytes" in page
    metrics = exposition(fleet_families(status))
    assert 'fabric_leader_failing{node="lux"} 1.0' in metrics
    assert 'fabric_leader_failing_since_seconds{kind="RegistryError",node="lux"}' in metrics
    healthy = exposition(fleet_families(fleet_status(desired, snapshot.model_copy(update={"leader_problem": None}), None, now)))
    assert 'fabric_leader_failing{node="lux"} 0.0' in healthy
    assert "LEADER FAILING" not in render_text(fleet_status(desired, snapshot.model_copy(update={"leader_problem": None}), None, now))


@pytest.mark.parametrize("error", REGISTRY_ERRORS, ids=lambda c: c.__name__)
def test_an_unreadable_edge_source_is_said_and_the_step_goes_on_without_it(tmp_path, error):
    """The edge's upstream records are one optional source of suspicion: a
    registry error reading them costs that source, never the step."""
    registry = FaultyRegistry()
    loop, lines, stop = a_loop(tmp_path, registry, waits=40)
    registry.fail("edge_upstreams", error("etcd: edge_upstreams refused (test)"), times=3)
    loop.run()
    assert any("edge upstreams unreadable, suspecting without them" in line for line in lines), lines
    assert registry.published, "the leader published its plan all the same"
