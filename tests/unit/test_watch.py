"""`fabric watch`: the pure decision (reconciler.core.live.watching) and the
loop (reconciler.engine.watch) with fakes of the registry, systemd and the clock."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest

from reconciler.core.desired.load import DesiredStateError, load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.desired.problems import Problem
from reconciler.core.install.nodeconfig import TimerSection
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.watching import (
    DRAIN,
    PLAN,
    STATE,
    Decision,
    EntryVersion,
    WatchState,
    WatchTimings,
    concerns,
    decide,
    epoch_taken,
    observe,
    plan_taken_record,
    retry_delay,
    started,
    taken,
)
from reconciler.core.render.plan_part import plan_part
from reconciler.engine.watch import Watcher
from reconciler.ports import ActivationError, RegistryUnavailable
from tests.support.clock import T0, FakeClock

HOST = "lux"
TIMINGS = WatchTimings(window_s=0.2, poll_s=0.5, running_poll_s=0.1, retry_min_s=0.5, retry_max_s=30.0)


def baseline(plan: str = "7", drain: str = "", state: str = "s1", host: str = HOST) -> list[EntryVersion]:
    return [EntryVersion(PLAN, "", plan), EntryVersion(DRAIN, host, drain), EntryVersion(STATE, host, state)]


# -- what concerns this host -------------------------------------------------------------


def test_the_plan_part_concerns_its_host_a_drain_or_state_only_its_node() -> None:
    assert concerns(EntryVersion(PLAN, "", "8"), HOST)
    assert concerns(EntryVersion(DRAIN, HOST, "r"), HOST)
    assert concerns(EntryVersion(STATE, HOST, "s"), HOST)
    assert not concerns(EntryVersion(DRAIN, "qfox-1", "r"), HOST)
    assert not concerns(EntryVersion(STATE, "qfox-1", "s"), HOST)


def test_the_first_versions_are_the_baseline_not_a_change() -> None:
    state = observe(WatchState(), baseline(), HOST, T0)
    assert state.pending_since is None and state.pending == ()
    assert decide(state, T0 + 10, False, TIMINGS).start is False


@pytest.mark.parametrize(
    "change",
    [EntryVersion(PLAN, "", "8"), EntryVersion(DRAIN, HOST, "drained at 04:00"), EntryVersion(STATE, HOST, "s2"), EntryVersion(DRAIN, HOST, "")],
    ids=["new plan epoch", "drain requested", "node state", "drain lifted"],
)
def test_a_changed_entry_of_this_host_is_pending(change: EntryVersion) -> None:
    state = observe(observe(WatchState(), baseline(drain="old"), HOST, T0), [change], HOST, T0 + 1)
    assert state.pending == (change,)
    assert state.pending_since == T0 + 1


def test_the_same_version_again_or_another_hosts_entry_is_no_change() -> None:
    seen = observe(WatchState(), baseline(), HOST, T0)
    again = observe(seen, [*baseline(), EntryVersion(STATE, "qfox-1", "s9"), EntryVersion(DRAIN, "qfox-1", "r")], HOST, T0 + 1)
    assert again.pending_since is None and again.pending == ()


# -- when to start -----------------------------------------------------------------------


def pending_at(t: float) -> WatchState:
    return observe(observe(WatchState(), baseline(), HOST, T0), [EntryVersion(PLAN, "", "8")], HOST, t)


def test_a_new_part_of_the_plan_starts_a_pass_at_once() -> None:
    """The plan is what a pass renders and the last write of a leader's step: no window to wait."""
    state = pending_at(T0 + 1)
    assert decide(state, T0 + 1, False, TIMINGS).start is True
    after = started(state)
    assert after.pending_since is None and after.pending == ()
    assert decide(after, T0 + 5, False, TIMINGS).start is False
    # What was seen stays seen: the same version again starts nothing.
    assert observe(after, [EntryVersion(PLAN, "", "8")], HOST, T0 + 6).pending_since is None


def test_a_drain_or_node_state_alone_waits_the_window_then_starts_one_pass() -> None:
    base = observe(WatchState(), baseline(), HOST, T0)
    state = observe(base, [EntryVersion(STATE, HOST, "s2")], HOST, T0 + 1)
    assert decide(state, T0 + 1, False, TIMINGS) == Decision(start=False, wake_in_s=pytest.approx(TIMINGS.window_s))
    # More changes inside the window join the burst and do not move its end.
    state = observe(state, [EntryVersion(DRAIN, HOST, "drained at 04:00")], HOST, T0 + 1.15)
    assert state.pending_since == T0 + 1
    wait = decide(state, T0 + 1.15, False, TIMINGS)
    assert wait.start is False and wait.wake_in_s == pytest.approx(0.05)
    # No plan came: the window's end starts one pass for both.
    assert decide(state, T0 + 1.2, False, TIMINGS).start is True
    assert [change.entry for change in state.pending] == [STATE, DRAIN]


def test_the_plan_that_follows_a_node_state_within_the_window_starts_the_pass_for_both() -> None:
    """A leader's step: this host's node state, then the plan; one pass, at the plan."""
    base = observe(WatchState(), baseline(), HOST, T0)
    state = observe(base, [EntryVersion(STATE, HOST, "s2")], HOST, T0 + 1)
    assert decide(state, T0 + 1.05, False, TIMINGS).start is False
    state = observe(state, [EntryVersion(PLAN, "", "8")], HOST, T0 + 1.05)
    assert decide(state, T0 + 1.05, False, TIMINGS).start is True
    assert [change.entry for change in state.pending] == [STATE, PLAN]


def test_no_pass_is_started_while_one_runs_and_the_change_waits_for_it() -> None:
    state = pending_at(T0 + 1)
    running = decide(state, T0 + 60, True, TIMINGS)
    assert running.start is False and running.wake_in_s == TIMINGS.running_poll_s
    # The pass that ran may have read the registry before the change: once
    # it has ended, the pending change still starts one.
    assert decide(state, T0 + 61, False, TIMINGS).start is True


def test_a_part_of_the_plan_the_last_pass_took_needs_no_pass() -> None:
    """A pass that ran when the plan came took it in another round (or read it
    anyway) and says so in its record: no pass follows for it."""
    state = observe(observe(WatchState(), baseline(), HOST, T0), [EntryVersion(PLAN, "", "8", epoch=12)], HOST, T0 + 1)
    assert taken(state, 12) == WatchState(seen=state.seen)
    assert taken(state, 13).pending_since is None
    # An older record, or none, leaves it pending.
    assert taken(state, 11) == state
    assert taken(state, None) == state


def test_a_drain_a_node_state_or_a_plan_that_could_not_be_read_stays_pending_whatever_the_record() -> None:
    base = observe(WatchState(), baseline(), HOST, T0)
    state = observe(base, [EntryVersion(STATE, HOST, "s2"), EntryVersion(PLAN, "", "8", epoch=12)], HOST, T0 + 1)
    left = taken(state, 12)
    assert left.pending == (EntryVersion(STATE, HOST, "s2"),) and left.pending_since == T0 + 1
    unread = observe(base, [EntryVersion(PLAN, "", "unread 8")], HOST, T0 + 1)
    assert taken(unread, 99) == unread


@pytest.mark.parametrize(
    ("record", "epoch"),
    [
        (plan_taken_record(12), 12),
        (None, None),
        (b"", None),
        (b"{not json", None),
        (b'{"epoch": "12"}', None),
        (b'{"epoch": true}', None),
        (b"[12]", None),
    ],
    ids=["written", "none", "empty", "not json", "a string", "a bool", "not an object"],
)
def test_the_pass_records_the_epoch_it_took_and_anything_else_reads_as_no_record(record: bytes | None, epoch: int | None) -> None:
    assert epoch_taken(record) == epoch


def test_a_clock_that_went_back_does_not_hold_a_start() -> None:
    assert decide(pending_at(T0 + 100), T0 + 50, False, TIMINGS).start is True


def test_retries_double_up_to_the_most() -> None:
    assert [retry_delay(n, TIMINGS) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert retry_delay(7, TIMINGS) == 30.0
    assert retry_delay(10_000, TIMINGS) == 30.0


def test_after_an_outage_a_watcher_follows_again_well_within_the_timers_interval() -> None:
    """The default backoff's cap: a plan published as the registry comes back
    is acted on by the watchers, not left to the timer's next tick."""
    default_interval = TimerSection().interval
    assert default_interval.endswith("s") and default_interval[:-1].isdigit(), default_interval
    interval = float(default_interval[:-1])
    longest_blind = WatchTimings().retry_max_s
    assert longest_blind <= interval / 4, f"a watcher may stay blind {longest_blind:g} s after an outage, against a {interval:g} s timer"


# -- the loop over fakes -----------------------------------------------------------------


REPO = Path(__file__).resolve().parents[2]


def example() -> DesiredState:
    """The example fleet (hosts/): lux is a control host, racknerd the edge."""
    return load_desired(REPO / "hosts")


def golden_plan() -> FleetPlan:
    return FleetPlan.model_validate_json((REPO / "tests" / "golden" / "fleet-plan.json").read_text())


def moved(plan: FleetPlan, service: str, node: str) -> FleetPlan:
    """The next epoch of `plan`, with replica 0 of `service` placed on `node`."""
    placements = [p.model_copy(update={"node": node}) if (p.service, p.replica) == (service, 0) else p for p in plan.placements]
    return plan.model_copy(update={"placements": placements, "epoch": plan.epoch + 1})


# The registry's plans by version: 7 the golden plan, 8 moves braid onto lux
# (this host), 9 moves lupine from qfox-1 to x86-spill (none of lux's business).
PLANS: dict[str, FleetPlan | Exception] = {
    "7": golden_plan(),
    "8": moved(golden_plan(), "braid", HOST),
    "9": moved(moved(golden_plan(), "braid", HOST), "lupine", "x86-spill"),
}


class FakeWatchRegistry:
    """`Registry.watch_host` replaying scripted answers: a list of entries
    (the clock moved by the timeout asked for when it is empty, as if the
    wait ran out) or an exception to raise. `newest_plan` answers the plan
    (or raises the exception) `plans` holds for the last plan version reported."""

    def __init__(
        self, clock: FakeClock, answers: list[list[EntryVersion] | Exception], plans: dict[str, FleetPlan | Exception] | None = None
    ) -> None:
        self.clock = clock
        self.answers = deque(answers)
        self.plans = PLANS if plans is None else plans
        self.timeouts: list[float] = []
        self.plan_version = ""
        self.plan_reads = 0

    def watch_host(self, host: str, timeout_s: float) -> list[EntryVersion]:
        assert all(entry.node_id in ("", host) for answer in self.answers if isinstance(answer, list) for entry in answer)
        self.timeouts.append(timeout_s)
        answer = self.answers.popleft() if self.answers else []
        if isinstance(answer, Exception):
            raise answer
        if not answer:
            self.clock.advance(timeout_s)
        for entry in answer:
            if entry.entry == PLAN:
                self.plan_version = entry.version
        return answer

    def newest_plan(self) -> FleetPlan | None:
        self.plan_reads += 1
        plan = self.plans.get(self.plan_version)
        if isinstance(plan, Exception):
            raise plan
        return plan


class FakeStarter:
    def __init__(self, running: list[bool] | None = None, fail: int = 0) -> None:
        self.running = deque(running or [])
        self.fail = fail
        self.starts: list[float] = []
        self.clock: FakeClock | None = None

    def pass_running(self) -> bool:
        if self.fail:
            self.fail -= 1
            raise ActivationError("cannot connect to systemd on the system bus: no socket")
        return self.running.popleft() if self.running else False

    def start_pass(self) -> None:
        assert self.clock is not None
        self.starts.append(self.clock.now())


def watcher(
    answers: list[list[EntryVersion] | Exception],
    starter: FakeStarter | None = None,
    plans: dict[str, FleetPlan | Exception] | None = None,
    desired_for: Callable[[FleetPlan], DesiredState] | None = None,
    host: str = HOST,
) -> tuple[Watcher, FakeWatchRegistry, FakeStarter, list[str]]:
    clock = FakeClock()
    registry = FakeWatchRegistry(clock, answers, plans)
    starter = starter or FakeStarter()
    starter.clock = clock
    log: list[str] = []
    desired = example()
    w = Watcher(registry, starter, clock, host, desired_for or (lambda plan: desired), timings=TIMINGS, log=log.append)  # type: ignore[arg-type]
    return w, registry, starter, log


def part_digest(version: str, host: str = HOST) -> str:
    plan = PLANS[version]
    assert isinstance(plan, FleetPlan)
    return plan_part(example(), plan, host).digest


def test_the_loop_starts_one_pass_for_a_burst_when_its_plan_comes() -> None:
    w, registry, starter, log = watcher([baseline(), [EntryVersion(STATE, HOST, "s2")], [EntryVersion(PLAN, "", "8")], [], []])
    for _ in range(5):
        assert w.step() == 0.0
    # The node state waited for the plan, which came before the window's end
    # and started the pass for both, at once.
    assert starter.starts == [T0]
    # While the node state waited, the registry was waited on only until the window's end.
    assert registry.timeouts[:3] == [0.5, 0.5, pytest.approx(TIMINGS.window_s)]
    assert log == [
        f"following this host's part of the plan ({part_digest('7')[:12]}), lux's drain request (absent), lux's node state (s1)",
        f"started a pass of lux: lux's node state (s2), this host's part of the plan ({part_digest('8')[:12]}) changed",
    ]


def test_the_loop_waits_for_a_running_pass_then_starts_one() -> None:
    starter = FakeStarter(running=[True, True, False])
    w, _, starter, _ = watcher([baseline(), [EntryVersion(PLAN, "", "8")], [], [], []], starter)
    for _ in range(5):
        w.step()
    assert len(starter.starts) == 1
    # Started only once the pass had ended, looked at every running_poll_s
    # (not every poll_s: a pass the timer started just before the plan must
    # not hold it back by a whole registry poll).
    assert [start - T0 for start in starter.starts] == [pytest.approx(2 * TIMINGS.running_poll_s)]


def test_the_loop_starts_no_pass_after_a_running_one_that_took_the_plan() -> None:
    starter = FakeStarter(running=[True, True, False])
    w, _, starter, log = watcher([baseline(), [EntryVersion(PLAN, "", "8")], [], [], []], starter)
    reads: list[int] = []

    def record() -> int:
        # That pass's record: the epoch of plan version 8 (the golden plan's next).
        reads.append(1)
        return 8

    w.epoch_taken = record
    for _ in range(5):
        w.step()
    assert starter.starts == [] and w.state.pending == ()
    assert len(reads) == 1, "read once the pass had ended, not while it ran"
    assert log[-1] == f"the last pass took plan epoch 8: this host's part of the plan ({part_digest('8')[:12]}) needs no pass"


def test_the_loop_records_its_ask_just_before_each_start() -> None:
    # Plan 8 moves braid here, plan 7 back: two starts.
    w, _, starter, _ = watcher([baseline(), [EntryVersion(PLAN, "", "8")], [], [EntryVersion(PLAN, "", "7")], []])
    events: list[str] = []
    w.record_ask = lambda: events.append(f"ask before start {len(starter.starts) + 1}")
    for _ in range(5):
        w.step()
    assert len(starter.starts) == 2
    assert events == ["ask before start 1", "ask before start 2"]


def test_an_ask_that_cannot_be_recorded_still_starts_the_pass() -> None:
    w, _, starter, log = watcher([baseline(), [EntryVersion(PLAN, "", "8")], []])

    def read_only() -> None:
        raise PermissionError(13, "Permission denied", "/var/lib/fabric/pass-asked.json")

    w.record_ask = read_only
    for _ in range(3):
        w.step()
    assert starter.starts == [T0]
    assert (
        "cannot record the ask for a pass ([Errno 13] Permission denied: '/var/lib/fabric/pass-asked.json'): with a git source it fetches first"
        in log
    )


def test_the_loop_starts_a_pass_after_a_running_one_that_took_an_older_plan() -> None:
    starter = FakeStarter(running=[True, True, False])
    w, _, starter, _ = watcher([baseline(), [EntryVersion(PLAN, "", "8")], [], [], []], starter)
    w.epoch_taken = lambda: 7
    for _ in range(5):
        w.step()
    assert [start - T0 for start in starter.starts] == [pytest.approx(2 * TIMINGS.running_poll_s)]


def test_an_unreachable_registry_is_retried_with_backoff_then_followed_again() -> None:
    down = RegistryUnavailable("no etcd endpoint answers (http://127.0.0.1:2379): refused")
    w, _, starter, log = watcher([baseline(), down, down, down, [EntryVersion(PLAN, "", "8")], []])
    assert w.step() == 0.0
    assert [w.step() for _ in range(3)] == [0.5, 1.0, 2.0]
    assert w.failures == 3
    w.step()
    w.step()
    assert w.failures == 0 and len(starter.starts) == 1
    assert log[1].startswith("registry unreachable: no etcd endpoint answers") and log[2] == "working again after 3 failed tries"
    assert len(log) == 4  # the outage said once, not at every try


def test_systemd_unreachable_keeps_the_change_pending_and_retries() -> None:
    w, _, starter, log = watcher([baseline(), [EntryVersion(PLAN, "", "8")], [], [], []], FakeStarter(fail=2))
    w.step()
    w.step()  # within the window: systemd is asked whether a pass runs
    assert w.step() == 1.0  # second failure in a row
    assert w.state.pending_since is not None
    w.step()
    assert len(starter.starts) == 1 and w.state.pending_since is None
    assert log[1].startswith("cannot start a pass: cannot connect to systemd")


def test_a_plan_that_moves_work_between_two_other_hosts_starts_no_pass() -> None:
    # 9 moves lupine qfox-1 -> x86-spill: lux's part is 8's.
    w, registry, starter, log = watcher([baseline("8"), [EntryVersion(PLAN, "", "9")], [], [], []])
    for _ in range(5):
        w.step()
    assert starter.starts == [] and w.state.pending == ()
    assert registry.plan_reads == 2  # the baseline's, then 9's once
    assert log[-1] == "plan epoch 9 leaves lux's part as it was: no pass"


def test_a_plan_that_moves_work_here_starts_a_pass() -> None:
    w, _, starter, log = watcher([baseline("7"), [EntryVersion(PLAN, "", "8")], [], [], []])
    for _ in range(5):
        w.step()
    assert starter.starts == [T0]
    assert log[-1] == f"started a pass of lux: this host's part of the plan ({part_digest('8')[:12]}) changed"


def test_the_edge_starts_a_pass_when_a_routed_services_nodes_change_not_otherwise() -> None:
    # 8 moves braid (routed) a1-arm64 -> lux: the edge's upstreams; 9 moves lupine (unrouted) too.
    w, _, starter, _ = watcher([baseline("8", host="racknerd"), [EntryVersion(PLAN, "", "9")], [], [], []], host="racknerd")
    for _ in range(5):
        w.step()
    assert starter.starts == []
    w, _, starter, _ = watcher([baseline("7", host="racknerd"), [EntryVersion(PLAN, "", "8")], [], [], []], host="racknerd")
    for _ in range(5):
        w.step()
    assert len(starter.starts) == 1


def test_the_same_plan_version_reported_again_is_not_read_again() -> None:
    # A backend that reconnects reports every entry again.
    w, registry, starter, _ = watcher([baseline("7"), [], baseline("7"), [], baseline("7")])
    for _ in range(5):
        w.step()
    assert registry.plan_reads == 1 and starter.starts == []


@pytest.mark.parametrize(
    "unreadable",
    [RegistryUnavailable("no etcd endpoint answers"), ValueError("1 validation error for FleetPlan: placements.0.node: field required")],
    ids=["registry gone", "does not parse"],
)
def test_a_plan_that_cannot_be_read_starts_a_pass_which_says_why(unreadable: Exception) -> None:
    w, _, starter, log = watcher([baseline("7"), [EntryVersion(PLAN, "", "10")], [], [], []], plans={**PLANS, "10": unreadable})
    for _ in range(5):
        w.step()
    assert len(starter.starts) == 1
    assert log[1] == f"cannot tell lux's part of the plan (10): {unreadable}"
    # Each new version that cannot be read is a change again.
    w.registry.answers.extend([[EntryVersion(PLAN, "", "11")], [], [], []])  # type: ignore[attr-defined]
    w.registry.plans["11"] = unreadable  # type: ignore[attr-defined]
    for _ in range(4):
        w.step()
    assert len(starter.starts) == 2


def test_a_desired_state_that_cannot_be_read_counts_as_a_change() -> None:
    def broken(plan: FleetPlan) -> DesiredState:
        raise DesiredStateError([Problem("/desired/fabric.toml", "fleet.domain", "expected a string")])

    w, _, starter, log = watcher([baseline("8"), [EntryVersion(PLAN, "", "9")], [], [], []])
    w.step()  # the baseline, read under a good desired state
    w.desired_for = broken
    for _ in range(4):
        w.step()
    assert len(starter.starts) == 1
    assert log[1] == "cannot tell lux's part of the plan (9): /desired/fabric.toml: fleet.domain: expected a string"


def test_the_desired_state_is_read_again_for_each_new_plan() -> None:
    # A route added to lupine after the watcher started: the edge's part now follows lupine's nodes.
    desired = example()
    routed = desired.model_copy(
        update={
            "fleet": desired.fleet.model_copy(
                update={
                    "services": [
                        s.model_copy(update={"route": desired.service("braid").route.model_copy(update={"host": "lupine.example"})})  # type: ignore[union-attr]
                        if s.id == "lupine"
                        else s
                        for s in desired.fleet.services
                    ]
                }
            )
        }
    )
    reads: list[int] = []

    def desired_for(plan: FleetPlan) -> DesiredState:
        reads.append(plan.epoch)
        return desired if len(reads) == 1 else routed

    # Baseline 8 under the old desired state; 9 moves lupine, routed now: a pass.
    w, _, starter, _ = watcher([baseline("8", host="racknerd"), [EntryVersion(PLAN, "", "9")], [], [], []], desired_for=desired_for, host="racknerd")
    for _ in range(5):
        w.step()
    assert reads == [8, 9] and len(starter.starts) == 1


def test_run_pauses_after_a_failure_and_ends_on_stop() -> None:
    down = RegistryUnavailable("refused")
    w, registry, _, _ = watcher([baseline(), down, down])
    pauses: list[float] = []

    def pause(delay: float) -> None:
        pauses.append(delay)
        if len(pauses) == 2:
            w.stop()

    w.pause = pause
    w.run()
    assert w.stopped and pauses == [0.5, 1.0] and len(registry.timeouts) == 3


# -- the command line ----------------------------------------------------------------------


def test_watch_refuses_a_bad_host_name_or_desired_state_with_exit_2(tmp_path, capsys) -> None:
    from reconciler.cli import main
    from tests.conftest import EXAMPLE_FLEET

    assert main(["watch", "--desired", str(EXAMPLE_FLEET), "--host", "Not A Host"]) == 2
    assert "fabric watch: --host: 'Not A Host' is not a fabric host name" in capsys.readouterr().err
    (tmp_path / "fabric.toml").write_text("[fleet]\ndomain = 3\n")
    assert main(["watch", "--desired", str(tmp_path), "--host", "lux"]) == 2
    assert f"{tmp_path / 'fabric.toml'}: fleet.domain:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["watch", "--window", "0"])
    assert exited.value.code == 2
