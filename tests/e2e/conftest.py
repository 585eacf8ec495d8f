"""The fleet the e2e scenario modules share: one fleet per module (module scope).

Moved here from test_fleet.py so test_fleet_live.py runs on the same harness;
its behaviour is unchanged (tests/e2e/fleet.py's running_fleet, torn down
when the module's last test ends). A module runs its fleet with the default
FleetSettings, or with its own `FLEET_SETTINGS` (test_fleet_react.py: the
production 30 s timer and every host's fabric-watch.service).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Generator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from tests.conftest import require, require_root
from tests.e2e.fleet import Fleet, FleetSettings, running_fleet
from tests.support.harness.saq_workers import LaneWorkers

SETTINGS = FleetSettings()
# What a failed e2e test's report shows of each running host's journal.
FAILURE_JOURNAL = ("-t", "fabric-watch", "-t", "fabric-reconcile", "-t", "fabric-leader", "-t", "systemd", "-o", "short-precise")
TEST_STARTED = pytest.StashKey[datetime]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    item.stash[TEST_STARTED] = datetime.now(UTC)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    """A failed test's report carries what the fleet's hosts said while it ran
    (their watchers', passes' and leaders' journals): the fleet is gone by
    the time anyone reads CI's output."""
    outcome = yield
    report = outcome.get_result()
    fleet = getattr(item, "funcargs", {}).get("fleet")
    if call.when != "call" or not report.failed or not isinstance(fleet, Fleet):
        return
    since = item.stash.get(TEST_STARTED, None)
    args = (*FAILURE_JOURNAL, "--since", f"@{since.timestamp():.0f}") if since is not None else FAILURE_JOURNAL
    for name, host in fleet.hosts.items():
        if not host.running:
            continue
        try:
            text = fleet.journal(name, *args)
        except Exception as exc:  # noqa: BLE001 - a report never fails for its extras
            text = f"(journal unreadable: {exc})"
        report.sections.append((f"journal of {name}", text))


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    settings = getattr(request.module, "FLEET_SETTINGS", SETTINGS)
    require_root()
    require("unshare", "nsenter", "chroot", "ip", "etcd", "caddy", "curl", "nft", "socat", "systemd-analyze")
    work = Path(tempfile.mkdtemp(prefix="fabric-e2e-"))
    try:
        with running_fleet(work, settings, progress=lambda message: print(f"[fleet] {message}", flush=True)) as running:
            yield running
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def desired(fleet: Fleet) -> DesiredState:
    return load_desired(fleet.desired_dir)


@pytest.fixture(scope="module")
def lane_workers(fleet: Fleet, desired: DesiredState) -> Iterator[LaneWorkers]:
    """Real SAQ workers on every lane's queue of the fleet's broker (as many
    jobs at once as the lane's cap), in this process: a lane is online only
    while its queue's workers beat. A test decides when each job ends
    (`lane_workers.finish(job)`); the next dispatch pass settles it."""
    workers = LaneWorkers(fleet.queue_url)
    try:
        for lane in desired.lanes:
            queue = desired.queue_for(lane)
            assert queue is not None, lane
            workers.start(queue, concurrency=lane.cap)
        yield workers
    finally:
        workers.close()
