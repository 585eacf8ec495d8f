"""Which active runs of the fabric's own lanes count as crashed (core.scheduling.lanes.crashed_reason), as a table.

Timing of every row: workers beat every 10 s (their stats row lives 11 s),
grace 2 s: a lapse is 13 s. The broker has been up since t=0 unless a row
says otherwise; now is t=1000.
"""

from __future__ import annotations

import pytest

from reconciler.core.desired.model import SchedulerSettings
from reconciler.core.scheduling.lanes import (
    ActiveRun,
    BrokerRuns,
    CrashTiming,
    crash_due_s,
    crash_timing,
    crashed_reason,
    crashed_runs,
    next_crash_check_s,
)
from reconciler.engine.dispatch import CRASH_WAKE_MARGIN_S, DispatchOutcome

TIMING = CrashTiming(worker_beat_s=10, grace_s=2)
NOW = 1000.0


def run(**fields) -> ActiveRun:
    return ActiveRun(job_id="job-1", lane="a1-arm64", key="job-1.1", **fields)


# (case, run, broker up since, crashed reason or None)
CASES = [
    ("fresh worker", run(worker="w1", touched_s=990, worker_expires_s=1005), 0.0, None),
    ("worker's stats expired, within the grace", run(worker="w1", touched_s=900, worker_expires_s=999), 0.0, None),
    # saq's expire_at is rounded to the whole second: the true expiry may be 0.5 s earlier.
    ("grace exactly spent from the earliest true expiry: not yet", run(worker="w1", touched_s=900, worker_expires_s=998.5), 0.0, None),
    (
        "grace spent from the earliest true expiry (the row says 998, rounded from as early as 997.5)",
        run(worker="w1", touched_s=900, worker_expires_s=998),
        0.0,
        "its worker w1 stopped beating (2 s past its stats' expiry)",
    ),
    (
        "worker's stats expired past the grace",
        run(worker="w1", touched_s=900, worker_expires_s=997),
        0.0,
        "its worker w1 stopped beating (3 s past its stats' expiry)",
    ),
    ("worker's stats gone, run touched long ago", run(worker="w1", touched_s=900), 0.0, "its worker w1 is gone (no stats)"),
    ("worker's stats gone, run touched just now (its first beat may be on its way)", run(worker="w1", touched_s=995), 0.0, None),
    ("worker's stats gone, no touch time", run(worker="w1"), 0.0, "its worker w1 is gone (no stats)"),
    ("dequeued, not begun, just now", run(touched_s=999), 0.0, None),
    ("dequeued, not begun, a lapse ago", run(touched_s=980), 0.0, "dequeued but never begun: its worker is gone"),
    ("unreadable record", run(readable=False), 0.0, "its SAQ job record is unreadable"),
    (
        "own heartbeat lapsed while the worker beats",
        run(worker="w1", touched_s=900, heartbeat_s=60, worker_expires_s=1005),
        0.0,
        "its SAQ heartbeat lapsed: untouched for 100 s (heartbeat 60 s)",
    ),
    ("own heartbeat within heartbeat + grace", run(worker="w1", touched_s=939, heartbeat_s=60, worker_expires_s=1005), 0.0, None),
    ("no heartbeat: an old touch is fine while the worker beats", run(worker="w1", touched_s=1, worker_expires_s=1005), 0.0, None),
    ("broker restarted less than a lapse ago: nothing is crashed", run(worker="w1", touched_s=900, worker_expires_s=950), 990.0, None),
    ("broker restarted exactly a lapse ago: still nothing", run(worker="w1", touched_s=900, worker_expires_s=950), 987.0, None),
    (
        "broker up longer than a lapse: the silent worker is gone",
        run(worker="w1", touched_s=900, worker_expires_s=950),
        986.0,
        "its worker w1 stopped beating (50 s past its stats' expiry)",
    ),
    (
        "heartbeat counted from the broker's restart, not the touch before it",
        run(worker="w1", touched_s=100, heartbeat_s=60, worker_expires_s=1005),
        970.0,
        None,
    ),
    ("unreadable, broker just restarted: not yet", run(readable=False), 995.0, None),
]


@pytest.mark.parametrize(("case", "active", "up", "expected"), CASES, ids=[c[0] for c in CASES])
def test_crashed_reason(case: str, active: ActiveRun, up: float, expected: str | None) -> None:
    assert crashed_reason(active, now_s=NOW, broker_up_s=up, timing=TIMING) == expected


def test_the_lapse_is_the_beat_its_row_ttl_and_the_grace() -> None:
    assert TIMING.lapse_s == 13
    assert crash_timing(SchedulerSettings()) == CrashTiming(worker_beat_s=10, grace_s=2)
    assert SchedulerSettings().lane_job_heartbeat_s == 0, "no job heartbeat unless the fleet asks (workers must touch their jobs)"


def test_crashed_runs_keeps_the_order_and_names_each_reason() -> None:
    alive = run(worker="w1", touched_s=990, worker_expires_s=1005)
    gone = ActiveRun(job_id="job-2", lane="x86-spill", key="job-2.3", worker="w2", touched_s=900, worker_expires_s=900)
    begun_never = ActiveRun(job_id="job-3", lane="local", key="job-3.1", touched_s=1)
    out = crashed_runs(BrokerRuns(now_s=NOW, broker_up_s=0.0, runs=(gone, alive, begun_never)), TIMING)
    assert [(c.run.key, c.reason) for c in out] == [
        ("job-2.3", "its worker w2 stopped beating (100 s past its stats' expiry)"),
        ("job-3.1", "dequeued but never begun: its worker is gone"),
    ]


def test_a_pass_that_fails_after_settling_has_already_told_what_it_settled(tmp_path) -> None:
    """A job settled complete is gone from the broker: a pass that fails
    afterwards (the registry or the broker gone) must have told it already,
    or the job system never hears that the job completed."""
    from reconciler.engine.dispatch import dispatch_pass
    from reconciler.engine.lane_states import lane_targets
    from reconciler.ports import DispatchFence, RegistryUnavailable
    from tests.support.fakes import FakeLaneBroker
    from tests.support.lane_crash_fleet import own_lanes_fleet

    class DownRegistry:
        def snapshot(self, **_: object) -> None:
            raise RegistryUnavailable("registry down")

    desired = own_lanes_fleet(tmp_path / "fleet")
    broker = FakeLaneBroker()
    broker.enqueue([("done-job", None)])
    assert broker.dispatch("done-job", lane_targets(desired)["a1-arm64"], DispatchFence.fixed(1)) is not None
    broker.finish("done-job")
    heard = []
    with pytest.raises(RegistryUnavailable):
        dispatch_pass(DownRegistry(), broker, desired, fence=DispatchFence.fixed(1), emit=heard.append)  # type: ignore[arg-type]
    assert [(e.job, e.outcome) for e in heard] == [("done-job", "complete")]


@pytest.mark.parametrize(("case", "active", "up", "expected"), CASES, ids=[c[0] for c in CASES])
def test_crash_due_is_the_moment_crashed_reason_starts_to_hold(case: str, active: ActiveRun, up: float, expected: str | None) -> None:
    """The dispatcher wakes at `crash_due_s` (gap: a pass a whole interval
    after the lapse): just before it no reason, just after it one, for every
    row of the table."""
    due = crash_due_s(active, broker_up_s=up, timing=TIMING)
    assert crashed_reason(active, now_s=due + 1e-6, broker_up_s=up, timing=TIMING) is not None
    if due > up + TIMING.lapse_s:
        assert crashed_reason(active, now_s=due - 1e-6, broker_up_s=up, timing=TIMING) is None
    assert (expected is not None) == (due < NOW)


def test_the_next_crash_check_is_the_first_run_not_yet_due() -> None:
    alive = run(worker="w1", touched_s=990, worker_expires_s=1005)  # due at 1005 - 0.5 + 2
    later = ActiveRun(job_id="job-2", lane="x86-spill", key="job-2.1", worker="w2", touched_s=990, worker_expires_s=1009)
    gone = ActiveRun(job_id="job-3", lane="x86-spill", key="job-3.1", worker="w3", touched_s=900, worker_expires_s=900)
    seen = BrokerRuns(now_s=NOW, broker_up_s=0.0, runs=(later, gone, alive))
    assert next_crash_check_s(seen, TIMING) == pytest.approx(6.5), "the settled-now run is not waited for"
    assert next_crash_check_s(BrokerRuns(now_s=NOW, broker_up_s=0.0, runs=(gone,)), TIMING) is None
    assert next_crash_check_s(BrokerRuns(now_s=NOW, broker_up_s=0.0), TIMING) is None
    restarted = BrokerRuns(now_s=NOW, broker_up_s=995.0, runs=(gone,))
    assert next_crash_check_s(restarted, TIMING) == pytest.approx(8.0), "nothing is crashed within a lapse of the broker's start"


def test_a_loop_wakes_at_the_crash_moment_when_it_comes_before_the_interval() -> None:
    assert DispatchOutcome([], None).wake_in_s(1.0) == 1.0
    assert DispatchOutcome([], 0.3).wake_in_s(1.0) == pytest.approx(0.3 + CRASH_WAKE_MARGIN_S)
    assert DispatchOutcome([], 30.0).wake_in_s(1.0) == 1.0


def test_the_dispatcher_wakes_at_the_crash_moment_counted_from_its_read(tmp_path) -> None:
    """`fabric lane dispatch`'s loop (run_dispatcher): a run due to count as
    crashed 2 s after the pass read the runs, a pass that then took 0.5 s:
    the loop waits 1.5 s (+ the margin), not 2 s, nor its 10 s interval."""
    from reconciler.engine.dispatch import run_dispatcher
    from tests.support.clock import FakeClock
    from tests.support.fakes import FakeLaneBroker
    from tests.support.lane_crash_fleet import own_lanes_fleet
    from tests.support.registry_store import beat_example_fleet

    desired = own_lanes_fleet(tmp_path / "fleet", beat_s=1, grace_s=1)
    clock = FakeClock()

    class SlowPass(FakeLaneBroker):
        def active_runs(self):  # type: ignore[no-untyped-def]
            now = clock.now()
            silent = ActiveRun(job_id="j", lane="a1-arm64", key="j.1", worker="w", touched_s=now, worker_expires_s=now + 1.5)
            return BrokerRuns(now_s=now, broker_up_s=0.0, runs=(silent,))  # due at expiry - 0.5 + grace 1 = now + 2

        def jobs(self):  # type: ignore[no-untyped-def]
            clock.advance(0.5)  # the rest of the pass takes 0.5 s
            return super().jobs()

    class Stop:
        waited: list[float] = []

        def wait(self, seconds: float) -> bool:
            self.waited.append(seconds)
            return True

    from reconciler.adapters.registry_sqlite import SqliteRegistry

    registry = SqliteRegistry(str(tmp_path / "r.sqlite"), timing=desired.fleet.timing, flap=desired.fleet.flap, clock=clock)
    beat_example_fleet(registry)
    stop = Stop()
    try:
        run_dispatcher(registry, SlowPass(clock), desired, emit=lambda e: None, stop=stop, interval_s=10.0, clock=clock)  # type: ignore[arg-type]
    finally:
        registry.close()
    assert stop.waited == [pytest.approx(1.5 + CRASH_WAKE_MARGIN_S)]
