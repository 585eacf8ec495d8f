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
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from tests.conftest import require, require_root
from tests.e2e.fleet import Fleet, FleetSettings, running_fleet
from tests.harness.saq_workers import LaneWorkers

SETTINGS = FleetSettings()


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
