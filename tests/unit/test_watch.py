"""`fabric watch`: the pure decision (reconciler.core.live.watching) and the
loop (reconciler.engine.watch) with fakes of the registry, systemd and the clock."""

from __future__ import annotations

from collections import deque

import pytest

from reconciler.core.live.watching import (
    DRAIN,
    PLAN,
    STATE,
    EntryVersion,
    WatchState,
    WatchTimings,
    concerns,
    decide,
    observe,
    retry_delay,
    started,
)
from reconciler.engine.watch import Watcher
from reconciler.ports import ActivationError, RegistryUnavailable
from tests.fakes import T0, FakeClock

HOST = "lux"
TIMINGS = WatchTimings(window_s=0.2, poll_s=0.5, retry_min_s=0.5, retry_max_s=30.0)


def baseline(plan: str = "7", drain: str = "", state: str = "s1", host: str = HOST) -> list[EntryVersion]:
    return [EntryVersion(PLAN, "", plan), EntryVersion(DRAIN, host, drain), EntryVersion(STATE, host, state)]


# -- what concerns this host -------------------------------------------------------------


def test_the_plan_concerns_every_host_a_drain_or_state_only_its_node() -> None:
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


def test_a_burst_within_the_window_starts_one_pass_at_the_windows_end() -> None:
    state = pending_at(T0 + 1)
    assert decide(state, T0 + 1, False, TIMINGS).start is False
    # More changes inside the window join the burst and do not move its end.
    state = observe(state, [EntryVersion(STATE, HOST, "s2")], HOST, T0 + 1.1)
    state = observe(state, [EntryVersion(PLAN, "", "9")], HOST, T0 + 1.15)
    assert state.pending_since == T0 + 1
    wait = decide(state, T0 + 1.15, False, TIMINGS)
    assert wait.start is False and wait.wake_in_s == pytest.approx(0.05)
    assert decide(state, T0 + 1.2, False, TIMINGS).start is True
    after = started(state)
    assert after.pending_since is None and after.pending == ()
    assert decide(after, T0 + 5, False, TIMINGS).start is False
    # What was seen stays seen: the same versions again start nothing.
    assert observe(after, [EntryVersion(PLAN, "", "9"), EntryVersion(STATE, HOST, "s2")], HOST, T0 + 6).pending_since is None


def test_no_pass_is_started_while_one_runs_and_the_change_waits_for_it() -> None:
    state = pending_at(T0 + 1)
    running = decide(state, T0 + 60, True, TIMINGS)
    assert running.start is False and running.wake_in_s == TIMINGS.poll_s
    # The pass that ran may have read the registry before the change: once
    # it has ended, the pending change still starts one.
    assert decide(state, T0 + 61, False, TIMINGS).start is True


def test_a_clock_that_went_back_does_not_hold_a_start() -> None:
    assert decide(pending_at(T0 + 100), T0 + 50, False, TIMINGS).start is True


def test_retries_double_up_to_the_most() -> None:
    assert [retry_delay(n, TIMINGS) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert retry_delay(7, TIMINGS) == 30.0
    assert retry_delay(10_000, TIMINGS) == 30.0


# -- the loop over fakes -----------------------------------------------------------------


class FakeWatchRegistry:
    """`Registry.watch_host` replaying scripted answers: a list of entries
    (the clock moved by the timeout asked for when it is empty, as if the
    wait ran out) or an exception to raise."""

    def __init__(self, clock: FakeClock, answers: list[list[EntryVersion] | Exception]) -> None:
        self.clock = clock
        self.answers = deque(answers)
        self.timeouts: list[float] = []

    def watch_host(self, host: str, timeout_s: float) -> list[EntryVersion]:
        assert host == HOST
        self.timeouts.append(timeout_s)
        answer = self.answers.popleft() if self.answers else []
        if isinstance(answer, Exception):
            raise answer
        if not answer:
            self.clock.advance(timeout_s)
        return answer


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
    answers: list[list[EntryVersion] | Exception], starter: FakeStarter | None = None
) -> tuple[Watcher, FakeWatchRegistry, FakeStarter, list[str]]:
    clock = FakeClock()
    registry = FakeWatchRegistry(clock, answers)
    starter = starter or FakeStarter()
    starter.clock = clock
    log: list[str] = []
    return Watcher(registry, starter, clock, HOST, timings=TIMINGS, log=log.append), registry, starter, log  # type: ignore[arg-type]


def test_the_loop_starts_one_pass_for_a_burst_at_the_end_of_its_window() -> None:
    w, registry, starter, log = watcher([baseline(), [EntryVersion(STATE, HOST, "s2")], [EntryVersion(PLAN, "", "8")], [], [], []])
    for _ in range(6):
        assert w.step() == 0.0
    assert starter.starts == [T0 + 0.2]
    # While the burst is pending the registry is waited on only until the window ends.
    assert registry.timeouts[:4] == [0.5, 0.5, pytest.approx(0.2), pytest.approx(0.2)]
    assert log == [
        "following the plan (7), lux's drain request (absent), lux's node state (s1)",
        "started a pass of lux: lux's node state (s2), the plan (8) changed",
    ]


def test_the_loop_waits_for_a_running_pass_then_starts_one() -> None:
    starter = FakeStarter(running=[True, True, False])
    w, _, starter, _ = watcher([baseline(), [EntryVersion(PLAN, "", "8")], [], [], []], starter)
    for _ in range(5):
        w.step()
    assert len(starter.starts) == 1
    # Started only once the pass had ended: two polls of 0.5 s after the change.
    assert starter.starts == [T0 + 1.0]


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
