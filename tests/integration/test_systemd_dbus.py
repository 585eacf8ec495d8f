"""SystemdDbus against a real systemd running as PID 1 in a container.

One container serves the whole module; each test uses its own unit names.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator

import pytest

from reconciler.adapters.files import FlockLock, LocalTree
from reconciler.adapters.systemd_dbus import SystemdDbus
from reconciler.core.render.artifacts import Artifact
from reconciler.engine.apply import STATE_DIR, Activators, Applier
from reconciler.ports import ActivationError, JobOutcome
from tests.conftest import require, require_root
from tests.support.audit import RecordingAudit
from tests.support.clock import T_PASS, FakeClock
from tests.support.harness.systemd import ManagerReloads, SystemdContainer, run_job, systemd_container
from tests.support.harness.waiting import deadline_for, wait_until

pytestmark = pytest.mark.integration

UNIT_DIR = "/etc/systemd/system"

# A long-running service that survives SIGHUP and counts the HUPs it got, so a
# test can tell a reload (same process, one more HUP) from a restart (new PID).
# It writes "PID COUNT" once its handler is in place: only then is a HUP safe.
HUP_COUNTER = """\
import os, pathlib, signal, sys, time
count_file = pathlib.Path(sys.argv[1])
hups = 0
def on_hup(signum, frame):
    global hups
    hups += 1
    count_file.write_text(f"{os.getpid()} {hups}")
signal.signal(signal.SIGHUP, on_hup)
count_file.write_text(f"{os.getpid()} 0")
while True:
    time.sleep(3600)
"""


@pytest.fixture(scope="module")
def container() -> Iterator[SystemdContainer]:
    require_root()
    require("unshare", "nsenter", "chroot", "python3")
    with systemd_container() as booted:
        booted.write_file("/opt/fabric-test/hup_counter.py", HUP_COUNTER)
        yield booted


@pytest.fixture
def systemd(container: SystemdContainer) -> Iterator[SystemdDbus]:
    with SystemdDbus(container.bus_address) as adapter:
        yield adapter


def install_unit(container: SystemdContainer, systemd: SystemdDbus, name: str, text: str) -> None:
    container.write_file(f"{UNIT_DIR}/{name}", text)
    systemd.daemon_reload()


def counter(container: SystemdContainer, count_file: str) -> str:
    path = container.host_path(count_file)
    return path.read_text() if path.exists() else ""


def hup_counter_unit(count_file: str) -> str:
    return f"""\
[Service]
ExecStart=/usr/bin/python3 /opt/fabric-test/hup_counter.py {count_file}
ExecReload=/bin/kill -HUP $MAINPID
"""


def test_start_restart_reload_stop_through_dbus(container: SystemdContainer, systemd: SystemdDbus) -> None:
    unit = "fabric-test-lifecycle.service"
    count_file = "/run/lifecycle-hups"
    install_unit(container, systemd, unit, hup_counter_unit(count_file))

    run_job(systemd, "start", unit)
    started = systemd.unit_properties(unit)
    assert started["ActiveState"] == "active"
    assert started["MainPID"] > 0
    wait_until(lambda: counter(container, count_file) == f"{started['MainPID']} 0", what="the service to be ready")

    run_job(systemd, "restart", unit)
    restarted = systemd.unit_properties(unit)
    assert restarted["ActiveState"] == "active"
    assert restarted["MainPID"] not in (0, started["MainPID"])
    wait_until(lambda: counter(container, count_file) == f"{restarted['MainPID']} 0", what="the restarted service to be ready")

    run_job(systemd, "reload", unit)
    reloaded = systemd.unit_properties(unit)
    assert reloaded["ActiveState"] == "active"
    assert reloaded["MainPID"] == restarted["MainPID"]
    wait_until(lambda: counter(container, count_file) == f"{restarted['MainPID']} 1", what="the service to count the reload's SIGHUP")

    run_job(systemd, "stop", unit)
    assert systemd.active_state(unit) == "inactive"
    # systemd's own view agrees with what the adapter reported.
    assert container.systemctl("is-active", unit).stdout.strip() == "inactive"


def test_daemon_reload_makes_a_changed_unit_file_take_effect(container: SystemdContainer, systemd: SystemdDbus) -> None:
    unit = "fabric-test-edited.service"
    install_unit(container, systemd, unit, "[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/sh -c 'echo first > /run/edited'\n")
    run_job(systemd, "start", unit)
    assert container.read_file("/run/edited") == "first\n"

    install_unit(container, systemd, unit, "[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/sh -c 'echo second > /run/edited'\n")
    run_job(systemd, "restart", unit)
    assert container.read_file("/run/edited") == "second\n"
    run_job(systemd, "stop", unit)


def test_oneshot_that_exits_is_a_success(container: SystemdContainer, systemd: SystemdDbus) -> None:
    unit = "fabric-test-oneshot.service"
    install_unit(container, systemd, unit, "[Service]\nType=oneshot\nExecStart=/bin/true\n")
    run_job(systemd, "start", unit)
    assert systemd.active_state(unit) == "inactive"
    assert systemd.unit_properties(unit)["Result"] in ("success", "")


def test_unit_that_fails_to_start_raises_with_unit_and_result(container: SystemdContainer, systemd: SystemdDbus) -> None:
    unit = "fabric-test-fails.service"
    install_unit(container, systemd, unit, "[Service]\nType=oneshot\nExecStart=/bin/sh -c 'exit 3'\n")
    with pytest.raises(ActivationError) as failure:
        run_job(systemd, "start", unit)
    message = str(failure.value)
    assert unit in message
    assert "job failed" in message
    assert "exit-code" in message
    assert "exit status 3" in message
    assert systemd.active_state(unit) == "failed"


def test_missing_program_fails_the_start(container: SystemdContainer, systemd: SystemdDbus) -> None:
    unit = "fabric-test-noexec.service"
    install_unit(container, systemd, unit, "[Service]\nType=exec\nExecStart=/nonexistent/fabric-agent\n")
    with pytest.raises(ActivationError, match=r"fabric-test-noexec\.service.*result exit-code"):
        run_job(systemd, "start", unit)


def test_simple_service_that_dies_at_once_fails_within_the_startup_grace(container: SystemdContainer) -> None:
    unit = "fabric-test-crashes.service"
    # Restart= keeps it cycling, as an agent unit would: the grace period sees the
    # restart even when it never catches the unit in "failed".
    container.write_file(f"{UNIT_DIR}/{unit}", "[Service]\nExecStart=/bin/sh -c 'exit 7'\nRestart=on-failure\nRestartSec=100ms\n")
    with SystemdDbus(container.bus_address, startup_grace=2.0) as watchful:
        watchful.daemon_reload()
        # Caught in the grace period, or (on a busy machine, read late: five
        # restarts in 100 ms steps reach systemd's start limit) already failed
        # when its job's result is read. Either way the start fails, naming the unit.
        with pytest.raises(ActivationError, match=r"fabric-test-crashes\.service: unit (did not stay up|failed after its job finished)"):
            run_job(watchful, "start", unit)
        run_job(watchful, "stop", unit)


def test_service_that_stays_up_passes_the_startup_grace(container: SystemdContainer) -> None:
    unit = "fabric-test-steady.service"
    container.write_file(f"{UNIT_DIR}/{unit}", "[Service]\nExecStart=/bin/sleep infinity\nRestart=on-failure\n")
    with SystemdDbus(container.bus_address, startup_grace=0.5) as watchful:
        watchful.daemon_reload()
        run_job(watchful, "start", unit)
        assert watchful.active_state(unit) == "active"
        run_job(watchful, "stop", unit)


def test_unknown_unit(systemd: SystemdDbus) -> None:
    with pytest.raises(ActivationError, match=r"start fabric-test-absent\.service: Unit fabric-test-absent\.service not found"):
        run_job(systemd, "start", "fabric-test-absent.service")
    run_job(systemd, "stop", "fabric-test-absent.service")  # nothing to stop is not an error
    assert systemd.active_state("fabric-test-absent.service") == "inactive"


def test_reload_of_a_unit_without_exec_reload_is_refused(container: SystemdContainer, systemd: SystemdDbus) -> None:
    unit = "fabric-test-noreload.service"
    install_unit(container, systemd, unit, "[Service]\nExecStart=/bin/sleep infinity\n")
    run_job(systemd, "start", unit)
    with pytest.raises(ActivationError, match=r"reload fabric-test-noreload\.service"):
        run_job(systemd, "reload", unit)
    assert systemd.active_state(unit) == "active"  # a refused reload leaves it running
    run_job(systemd, "stop", unit)


def test_unreachable_bus_raises_activation_error(tmp_path) -> None:
    adapter = SystemdDbus(f"unix:path={tmp_path}/no-such-socket")
    try:
        with pytest.raises(ActivationError, match="cannot connect to systemd"):
            adapter.daemon_reload()
    finally:
        adapter.close()


def test_reload_that_kills_the_service_raises(container: SystemdContainer, systemd: SystemdDbus) -> None:
    # sleep dies of SIGHUP; ExecReload waits for that, so the outcome is settled
    # by the time the reload job ends.
    unit = "fabric-test-dies-on-reload.service"
    install_unit(
        container,
        systemd,
        unit,
        "[Service]\nExecStart=/bin/sleep infinity\n"
        "ExecReload=/bin/sh -c 'kill -HUP $MAINPID; while kill -0 $MAINPID 2>/dev/null; do sleep 0.02; done'\n",
    )
    run_job(systemd, "start", unit)
    with pytest.raises(
        ActivationError, match=r"reload fabric-test-dies-on-reload\.service: unit is no longer running after the reload; unit is inactive"
    ):
        run_job(systemd, "reload", unit)


def test_job_timeout_raises_naming_the_unit(container: SystemdContainer, systemd: SystemdDbus) -> None:
    # The start job of this oneshot lasts as long as its ExecStart: it cannot finish in 0.3 s.
    unit = "fabric-test-slow.service"
    install_unit(container, systemd, unit, "[Service]\nType=oneshot\nExecStart=/bin/sleep 30\n")
    with SystemdDbus(container.bus_address, job_timeout=0.3) as impatient:
        with pytest.raises(ActivationError, match=r"start fabric-test-slow\.service: job did not finish within"):
            run_job(impatient, "start", unit)
        assert impatient.active_state(unit) == "activating"
    # Only the start is impatient: stopping (which cancels the start job; the
    # interrupted oneshot ends "failed") may take longer than 0.3 s on a loaded machine.
    run_job(systemd, "stop", unit)
    assert systemd.active_state(unit) in ("inactive", "failed")


# Two oneshot services that each finish starting only once the other has begun
# (each creates its own file, then waits for the other's): started one after
# the other, the first one's start job waits for a unit nobody started until
# its TimeoutStartSec= ends it, failed. Only jobs systemd runs together succeed.
MUTUAL_START = """\
[Service]
Type=oneshot
RemainAfterExit=yes
TimeoutStartSec={timeout:.0f}s
ExecStart=/bin/sh -c 'touch /run/{name}.began; while [ ! -e /run/{other}.began ]; do sleep 0.02; done'
"""


def test_the_jobs_of_a_batch_run_together(container: SystemdContainer, systemd: SystemdDbus) -> None:
    first, second = "fabric-test-mutual-a", "fabric-test-mutual-b"
    # Long enough for both shells to start on a loaded machine; a sequential
    # start fails after this long.
    timeout = deadline_for(1.0)
    container.write_file(f"{UNIT_DIR}/{first}.service", MUTUAL_START.format(timeout=timeout, name=first, other=second))
    container.write_file(f"{UNIT_DIR}/{second}.service", MUTUAL_START.format(timeout=timeout, name=second, other=first))
    systemd.daemon_reload()
    units = [f"{first}.service", f"{second}.service"]
    try:
        assert systemd.run_jobs("start", units) == [JobOutcome(units[0]), JobOutcome(units[1])]
        assert [systemd.active_state(u) for u in units] == ["active", "active"]
    finally:
        systemd.run_jobs("stop", units)


FLEETING_UNIT = "[Service]\nExecStart=/bin/sh -c 'exit 7'\nRestart=on-failure\nRestartSec=100ms\n"
STEADY_UNIT = "[Service]\nExecStart=/bin/sleep infinity\nRestart=on-failure\n"


def test_a_service_that_exits_at_once_fails_the_batch_and_the_others_are_reported_ok(container: SystemdContainer) -> None:
    units = ["fabric-test-batch-steady-1.service", "fabric-test-batch-fleeting.service", "fabric-test-batch-steady-2.service"]
    container.write_file(f"{UNIT_DIR}/{units[0]}", STEADY_UNIT)
    container.write_file(f"{UNIT_DIR}/{units[1]}", FLEETING_UNIT)
    container.write_file(f"{UNIT_DIR}/{units[2]}", STEADY_UNIT)
    with SystemdDbus(container.bus_address, startup_grace=deadline_for(0.5, at_least=2.0)) as watchful:
        watchful.daemon_reload()
        try:
            outcomes = watchful.run_jobs("start", units)
            assert [o.unit for o in outcomes] == units
            assert outcomes[0].ok and outcomes[2].ok, outcomes
            # Caught in the grace period, or (read late on a busy machine: its
            # restarts reached systemd's start limit) already failed when its
            # job's result is read.
            assert re.match(r"unit (did not stay up|failed after its job finished)", outcomes[1].failure or ""), outcomes[1]
            assert [watchful.active_state(u) for u in (units[0], units[2])] == ["active", "active"]
        finally:
            watchful.run_jobs("stop", units)


def test_the_applier_rolls_back_a_batch_with_a_service_that_exits_at_once(container: SystemdContainer) -> None:
    """Through the Applier: the exiting service named in the ActivationError
    the pass reports, each of the three audited, and the two that stayed up
    stopped again by the rollback."""
    names = ["fabric-test-applied-steady-1.service", "fabric-test-applied-fleeting.service", "fabric-test-applied-steady-2.service"]
    texts = [STEADY_UNIT, FLEETING_UNIT, STEADY_UNIT]
    artifacts = [Artifact(f"etc/systemd/system/{name}", text, 0o644, "unit") for name, text in zip(names, texts, strict=True)]
    audit = RecordingAudit()
    with SystemdDbus(container.bus_address, startup_grace=deadline_for(0.5, at_least=2.0)) as watchful:
        applier = applier_on(container, watchful, audit, STATE_DIR)
        result = applier.run(artifacts, host="batch", epoch=None)
        assert result.outcome == "rolled-back" and result.generation is None, result
        assert re.fullmatch(
            r"activation of generation 1 failed: start fabric-test-applied-fleeting\.service: unit (did not stay up|failed after its job finished).*",
            result.messages[0],
        ), result.messages
        # In the plan's order (by name), whatever order their jobs ended in.
        starts = [(r["unit"], r["outcome"]) for r in audit.records if r["action"] == "start"]
        assert starts == [(names[1], "failed"), (names[0], "ok"), (names[2], "ok")]
        assert [watchful.active_state(name) for name in names[::2]] == ["inactive", "inactive"]
        assert watchful.active_state(names[1]) != "active"
        watchful.run_jobs("stop", names)


# --------------------------------------------------------------------------
# daemon-reload only when systemd holds a unit whose file changed


def noting_unit(name: str, note: str) -> str:
    """A service that says which file it was started from: `note` in /run/NAME.note."""
    return f"[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/sh -c 'echo {note} > /run/{name}.note'\n"


def unit_artifact(name: str, text: str) -> Artifact:
    return Artifact(f"etc/systemd/system/{name}", text, 0o644, "unit")


def applier_on(container: SystemdContainer, systemd: SystemdDbus, audit: RecordingAudit, state_dir: str, **options: object) -> Applier:
    """The Applier of one test's passes: their own state directory, so no
    other test's generations are tracked (and removed) by them."""
    return Applier(
        LocalTree(container.root),
        FlockLock(container.host_path("/var/lib/fabric/lock")),
        audit,
        FakeClock(T_PASS),
        validators=None,
        activators=Activators(systemd, NO_NFT_OR_CADDY, NO_NFT_OR_CADDY),  # type: ignore[arg-type]
        state_dir=state_dir,
        **options,  # type: ignore[arg-type]
    )


def test_units_held_is_what_systemd_has_in_memory(container: SystemdContainer, systemd: SystemdDbus) -> None:
    new, loaded = "fabric-test-held-new.service", "fabric-test-held-loaded.service"
    install_unit(container, systemd, loaded, "[Service]\nExecStart=/bin/sleep infinity\n")
    assert systemd.units_held([new, loaded]) == {new: False, loaded: True}
    # Asking left a not-found stub of the new one; its file, written now, is read at its start.
    assert systemd.unit_properties(new)["LoadState"] == "not-found"
    container.write_file(f"{UNIT_DIR}/{new}", "[Service]\nExecStart=/bin/sleep infinity\n")
    assert systemd.run_jobs("start", [new]) == [JobOutcome(new)]
    assert systemd.units_held([new]) == {new: True}
    systemd.run_jobs("stop", [new])
    container.remove_file(f"{UNIT_DIR}/{new}")


def test_passes_reload_only_for_a_changed_unit_systemd_holds(container: SystemdContainer, systemd: SystemdDbus) -> None:
    """Through the Applier: new units start without a daemon-reload (systemd's
    own Reloading signal counted), a changed unit that runs is reloaded and
    runs its new file, a removed unit is stopped without one and is gone."""
    kept, other, gone = "fabric-test-held-kept.service", "fabric-test-held-other.service", "fabric-test-held-gone.service"
    audit = RecordingAudit()
    applier = applier_on(container, systemd, audit, "var/lib/fabric-test-held")
    with ManagerReloads(container.bus_address) as reloads:
        first = [
            unit_artifact(kept, noting_unit(kept, "first")),
            unit_artifact(other, noting_unit(other, "first")),
            unit_artifact(gone, noting_unit(gone, "first")),
        ]
        before = reloads.count()
        result = applier.run(first, host="held", epoch=None)
        assert result.outcome == "applied", result.messages
        assert not result.actions.daemon_reload and result.actions.start == tuple(sorted((kept, other, gone)))
        assert reloads.count() == before, "starting new units reloaded systemd"
        assert [container.read_file(f"/run/{unit}.note") for unit in (kept, other, gone)] == ["first\n"] * 3
        assert not [r for r in audit.records if r["action"] == "daemon-reload"]

        # The held unit changes: reloaded, restarted, running the new file.
        second = [unit_artifact(kept, noting_unit(kept, "second")), *first[1:]]
        result = applier.run(second, host="held", epoch=None)
        assert result.outcome == "applied", result.messages
        assert result.actions.daemon_reload and result.actions.restart == (kept,)
        assert reloads.count() == before + 1
        assert container.read_file(f"/run/{kept}.note") == "second\n"

        # One leaves the plan: stopped, its file removed, no reload; systemd forgets it.
        result = applier.run(second[:2], host="held", epoch=None)
        assert result.outcome == "applied", result.messages
        assert not result.actions.daemon_reload and result.actions.stop == (gone,)
        assert reloads.count() == before + 1
        assert not container.host_path(f"{UNIT_DIR}/{gone}").exists()
        wait_until(lambda: systemd.unit_properties(gone)["LoadState"] == "not-found", what=f"systemd to drop {gone}")
        assert [systemd.active_state(unit) for unit in (kept, other)] == ["active", "active"]
    systemd.run_jobs("stop", [kept, other])


def test_a_start_whose_new_file_systemd_missed_is_retried_after_one_daemon_reload(container: SystemdContainer, systemd: SystemdDbus) -> None:
    """The race, made to happen: the unit directory's mtime is set back to
    what it was when systemd last scanned it (at the pass's LoadUnit), as if
    the pass's rename had landed in the same tick of the kernel's coarse
    clock. systemd then answers the start with "not found"; the adapter
    reloads once, starts it again, and the pass audits it."""
    unit = "fabric-test-held-missed.service"
    unit_dir = container.host_path(UNIT_DIR)
    scanned: list[os.stat_result] = []

    def checkpoint(step: str) -> None:
        if step.startswith("write ") and not scanned:
            scanned.append(unit_dir.stat())  # as systemd saw it at the LoadUnit of compute_actions
        elif step == f"start {unit}":
            os.utime(unit_dir, ns=(scanned[0].st_atime_ns, scanned[0].st_mtime_ns))

    audit = RecordingAudit()
    applier = applier_on(container, systemd, audit, "var/lib/fabric-test-held-missed", checkpoint=checkpoint)
    with ManagerReloads(container.bus_address) as reloads:
        before = reloads.count()
        result = applier.run([unit_artifact(unit, noting_unit(unit, "missed"))], host="held-missed", epoch=None)
        assert result.outcome == "applied", result.messages
        assert not result.actions.daemon_reload, "a new unit: no reload planned"
        assert reloads.count() == before + 1
    assert container.read_file(f"/run/{unit}.note") == "missed\n"
    [reloaded] = [r for r in audit.records if r["action"] == "daemon-reload"]
    assert reloaded["reason"] == f"systemd found no file for {unit} at its start; start queued again"
    [started] = [r for r in audit.records if r["action"] == "start"]
    assert started["outcome"] == "ok" and started["reason"] == "new unit (after a daemon-reload: systemd had not seen its file)"
    systemd.run_jobs("stop", [unit])


def test_the_retry_runs_together_with_the_jobs_of_its_batch(container: SystemdContainer, systemd: SystemdDbus) -> None:
    """Two units that each finish starting only once the other has begun: the
    one systemd finds is running its start job while the other is refused,
    systemd reloads and the other is queued; both start."""
    found, missed = "fabric-test-held-mutual-a", "fabric-test-held-mutual-b"
    units = [f"{found}.service", f"{missed}.service"]
    unit_dir = container.host_path(UNIT_DIR)
    timeout = deadline_for(1.0)
    assert systemd.units_held(units) == dict.fromkeys(units, False)
    container.write_file(f"{UNIT_DIR}/{units[0]}", MUTUAL_START.format(timeout=timeout, name=found, other=missed))
    assert systemd.units_held(units[:1]) == {units[0]: True}  # systemd looked again: the directory changed
    scanned = unit_dir.stat()
    container.write_file(f"{UNIT_DIR}/{units[1]}", MUTUAL_START.format(timeout=timeout, name=missed, other=found))
    os.utime(unit_dir, ns=(scanned.st_atime_ns, scanned.st_mtime_ns))
    try:
        with ManagerReloads(container.bus_address) as reloads:
            before = reloads.count()
            assert systemd.run_jobs("start", units) == [JobOutcome(units[0]), JobOutcome(units[1], retried_after_reload=True)]
            assert reloads.count() == before + 1
        assert [systemd.active_state(u) for u in units] == ["active", "active"]
    finally:
        systemd.run_jobs("stop", units)


class NoNftOrCaddy:
    """The Nftables and Caddy ports of a host whose plan has neither: the
    table counts as loaded, so nothing is asked of them."""

    def table_loaded(self) -> bool:
        return True

    def apply(self, ruleset: str) -> None:
        raise AssertionError("no ruleset in this plan")

    def load(self, caddyfile: str) -> None:
        raise AssertionError("no Caddy config in this plan")


NO_NFT_OR_CADDY = NoNftOrCaddy()


def test_a_lost_connection_is_reopened_once_by_a_batchs_concurrent_reads(container: SystemdContainer) -> None:
    """The settle and grace reads of a batch's units run together: after the
    bus connection dropped, one of them reconnects and the others use it
    (each opening its own would leave all but one connection open)."""
    units = [f"fabric-test-reconnect-{i}.service" for i in range(3)]
    for unit in units:
        container.write_file(f"{UNIT_DIR}/{unit}", STEADY_UNIT)
    with SystemdDbus(container.bus_address, startup_grace=0.2) as systemd:
        systemd.daemon_reload()
        assert all(o.ok for o in systemd.run_jobs("start", units))
        connects = []
        connect = systemd._connect

        async def counted_connect():  # noqa: ANN202
            connects.append(1)
            return await connect()

        systemd._connect = counted_connect  # type: ignore[method-assign]
        lost = systemd._bus
        assert lost is not None
        lost.disconnect()
        systemd._run(lost.wait_for_disconnect())

        # What a batch does once its jobs are done: read every unit together.
        async def read_together() -> list[dict[str, object]]:
            return await asyncio.gather(*(systemd._settled_properties(unit) for unit in units))

        settled = systemd._run(read_together())
        assert [p["ActiveState"] for p in settled] == ["active"] * 3
        assert len(connects) == 1
        assert all(o.ok for o in systemd.run_jobs("stop", units))
