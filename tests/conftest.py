"""Shared test configuration.

`require(program)` is how a test asks for a real component. A missing one
fails the test with the reason: `scripts/test` installs every component, so a
missing one is a broken machine, never something to skip past.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support.harness.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_FLEET = REPO / "hosts"
IN_CI = os.environ.get("CI", "").lower() == "true"

# Hypothesis: no test has the 200 ms default deadline (a loaded machine blows
# it and fails a correct test). Under CI every run tests the same examples
# (derandomize: each test's seed is a hash of the test, no example database)
# and a failure prints the @reproduce_failure blob that replays it.
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.load_profile("ci" if IN_CI else "dev")


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.getoption("hypothesis_seed", default=None)
    how = (
        f"--hypothesis-seed={seed}"
        if seed is not None
        else "derandomized: seed = hash of each test"
        if settings.default.derandomize
        else "random seed per run"
    )
    return (
        f"hypothesis profile {settings.get_current_profile_name()!r} (CI={'true' if IN_CI else 'unset'}): {how}, "
        f"deadline={settings.default.deadline}, print_blob={settings.default.print_blob}"
    )


def fabric_validate(desired: Path) -> subprocess.CompletedProcess[str]:
    """`fabric validate --desired DESIRED` as a user runs it: its own process."""
    return subprocess.run(
        [sys.executable, "-m", "reconciler", "validate", "--desired", str(desired)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def require(*programs: str) -> None:
    missing = [p for p in programs if shutil.which(p) is None]
    if not missing:
        return
    pytest.fail(f"real component missing: {', '.join(missing)} (scripts/test installs it when run as root)")


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("this test needs root (namespaces, nft, systemd); CI runs as root")


@pytest.fixture
def signed_fleet(tmp_path: Path):
    """A copy of the example fleet whose leader candidates sign plans with
    throwaway keys (tests.support.plan_keys): the private halves of hosts/fabric.toml's
    plan keys exist only on lux and qfox-1."""
    from tests.support.plan_keys import signed_example_fleet

    return signed_example_fleet(tmp_path / "signed-fleet")


def _registry_threads() -> set[int]:
    """The event-loop threads of the open etcd registries (EtcdRegistry names each `fabric-etcd`)."""
    return {t.ident for t in threading.enumerate() if t.name == "fabric-etcd" and t.ident is not None}


@pytest.fixture(autouse=True, scope="module")
def every_registry_closed(request: pytest.FixtureRequest):
    """A module closes every etcd registry it opens (by the end of the module:
    a module-scoped fixture may share one). An open one keeps its loop thread
    and gRPC channel alive into later modules: gRPC then aborts a child that
    Ray forks while those threads are inside it (why scripts/test runs
    test_ray_cluster alone), and the registry's lease lives on in etcd."""
    before = _registry_threads()
    yield
    try:
        wait_until(lambda: not (_registry_threads() - before), timeout=10, what="the module's etcd registries closed")
    except AssertionError:
        left = len(_registry_threads() - before)
        pytest.fail(f"{request.module.__name__} left {left} etcd registr{'y' if left == 1 else 'ies'} open: close every registry a test opens")
