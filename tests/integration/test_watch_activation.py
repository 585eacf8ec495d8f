"""fabric-watch.service for real: systemd as PID 1 in a container runs the
unit as `fabric units` renders it (hardening and all), and a plan published
in the registry starts fabric-reconcile.service over D-Bus. No timer is
installed: only the watcher can have started the pass; and only a plan that
changes this host's part (the edge's: where each routed service runs) does.

The edge host "racknerd" of the example fleet with the embedded sqlite
registry in /var/lib/fabric; the test publishes plans into that file from
outside, as a leader would. The pass the watcher starts is the rendered
fabric-reconcile.service; whether it succeeds does not matter here, only
that systemd started it (a new InvocationID). The desired state comes from
a git [source] (a bare repository in the container), so each pass runs
`fabric pull` first, as a production host's does.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest

from reconciler.adapters.systemd_dbus import UnitPassStarter
from reconciler.core.install.nodeconfig import NodeConfig, NodeSection, parse_node_config
from reconciler.core.install.units import RECONCILE_SERVICE, WATCH_SERVICE, Install, host_units
from reconciler.core.live.watching import PASS_ASKED, WatchTimings
from reconciler.ports import ActivationError
from tests.conftest import REPO
from tests.support.edge_host import DESIRED, SITE, edge_container, invocation
from tests.support.harness.systemd import SystemdContainer
from tests.support.harness.waiting import deadline_for, wait_until

pytestmark = pytest.mark.integration

FABRIC = "/usr/local/bin/fabric"
REGISTRY = "/var/lib/fabric/registry.sqlite"
REMOTE = "/srv/fleet.git"
WORK = "/srv/fleet"
NODE_TOML = f"""[node]
host = "racknerd"
desired = "{DESIRED}"
registry_path = "{REGISTRY}"

[source]
remote = "{REMOTE}"
# This module is about the watcher: test_join.py pulls with signed commits.
require_signed_commits = false
"""
# The unit's own timings: fabric watch's defaults.
TIMINGS = WatchTimings()


@pytest.fixture(scope="module")
def edge() -> Iterator[SystemdContainer]:
    with edge_container("git") as container:
        # The `fabric` program as an installed one would be: the package
        # copied beside its dependencies (edge_container copies those). Not
        # run from the checkout: the rendered units have PrivateTmp=, and a
        # checkout under /tmp (CI's clone) is out of their sight.
        shutil.copytree(REPO / "reconciler", container.host_path(SITE) / "reconciler", ignore=shutil.ignore_patterns("__pycache__"))
        container.write_file(
            FABRIC,
            f'#!/bin/sh\nexport PYTHONPATH={SITE} PYTHONDONTWRITEBYTECODE=1\nexec python3 -m reconciler "$@"\n',
            mode=0o755,
        )
        # The fleet's remote: the example fleet committed to a bare repository.
        for argv in (("init", "--quiet", "--bare", "--initial-branch=main", REMOTE), ("clone", "--quiet", REMOTE, WORK)):
            assert container.run("git", *argv).returncode == 0
        for toml in container.host_path(DESIRED).glob("*.toml"):
            container.write_file(f"{WORK}/{toml.name}", toml.read_text())
        commit_and_push(container, "fleet")
        container.write_file("/etc/fabric/node.toml", NODE_TOML)
        node = parse_node_config(NODE_TOML)
        install = Install(fabric_bin=FABRIC, node=node, search_path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        for unit in host_units(install, leader_candidate=False):
            if unit.name in (WATCH_SERVICE, RECONCILE_SERVICE):
                container.write_file(f"/etc/systemd/system/{unit.name}", unit.text())
        assert container.systemctl("daemon-reload").returncode == 0
        started = container.systemctl("start", WATCH_SERVICE)
        assert started.returncode == 0, started.stderr
        yield container


def commit_and_push(container: SystemdContainer, message: str) -> str:
    """Commit all of WORK and push it to the remote, as an operator would; returns the commit."""
    for argv in (
        ("add", "--all"),
        ("-c", "user.name=op", "-c", "user.email=op@fleet", "commit", "--quiet", "-m", message),
        ("push", "--quiet", "origin", "HEAD:main"),
    ):
        done = container.run("git", "-C", WORK, *argv)
        assert done.returncode == 0, done.stderr
    return container.run("git", "-C", WORK, "rev-parse", "HEAD").stdout.strip()


# Run inside the container: sqlite resolves the symbolic link /proc/PID/root
# of a path from outside, so the file is written from within, as the leader
# of a single-host fleet would.
PUBLISH = f"""
import json, sys
from datetime import UTC, datetime
from reconciler.adapters.clock import SystemClock
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.model import FlapSettings, TimingSettings
from reconciler.core.live.models import FleetPlan

registry = SqliteRegistry("{REGISTRY}", timing=TimingSettings(), flap=FlapSettings(), clock=SystemClock())
term = registry.campaign("lux", 5)
assert term is not None, "someone leads"
plan = FleetPlan(epoch=0, leader="lux", created=datetime.now(UTC), placements=json.loads(sys.argv[1]))
print(registry.publish_plan(term, plan).epoch)
registry.resign(term)
"""


def publish_plan(container: SystemdContainer, *placed: tuple[str, str]) -> int:
    """A new plan in the host's registry file, as a leader publishes one,
    placing each (service, node) of `placed`."""
    placements = [{"service": service, "replica": 0, "node": node, "tier": "cpu_ffmpeg"} for service, node in placed]
    done = container.run("env", f"PYTHONPATH={SITE}:{REPO}", "PYTHONDONTWRITEBYTECODE=1", "python3", "-c", PUBLISH, json.dumps(placements))
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def started_for_the_plan(container: SystemdContainer) -> bool:
    return watcher_said(container, "started a pass of racknerd: this host's part of the plan (")


def watcher_state(container: SystemdContainer) -> str:
    return container.systemctl("show", WATCH_SERVICE, "-p", "ActiveState", "--value").stdout.strip()


def watcher_said(container: SystemdContainer, text: str) -> bool:
    return text in container.journal("-u", WATCH_SERVICE, "-o", "cat")


def test_a_plan_that_concerns_the_edge_starts_the_reconcile_service_one_that_does_not_starts_none(edge: SystemdContainer) -> None:
    """racknerd is the edge: its part of a plan is where each routed service
    runs. braid is routed, lupine is not."""
    # The watcher's first read of the registry is its baseline.
    # Bounded by the watcher's process starting in the container (its imports
    # on a busy machine), not by its poll: hence the longer floor.
    wait_until(
        lambda: watcher_said(edge, "fabric-watch: following this host's part of the plan"),
        timeout=deadline_for(TIMINGS.poll_s, at_least=120),
        what="the watcher's baseline",
    )
    assert watcher_state(edge) == "active"
    assert invocation(edge, RECONCILE_SERVICE) == ""

    publish_plan(edge, ("braid", "a1-arm64"))
    first = wait_until(
        lambda: invocation(edge, RECONCILE_SERVICE), timeout=deadline_for(TIMINGS.window_s + TIMINGS.poll_s), what="a pass started for the plan"
    )
    wait_until(lambda: started_for_the_plan(edge), timeout=deadline_for(TIMINGS.poll_s), what="the start in the journal")

    # Once that pass has ended: a plan that only adds an unrouted service
    # elsewhere is read, and starts nothing ...
    wait_until(
        lambda: edge.systemctl("show", RECONCILE_SERVICE, "-p", "ActiveState", "--value").stdout.strip() in ("inactive", "failed"),
        timeout=300,
        what="the first pass to end",
    )
    epoch = publish_plan(edge, ("braid", "a1-arm64"), ("lupine", "qfox-1"))
    wait_until(
        lambda: watcher_said(edge, f"plan epoch {epoch} leaves racknerd's part as it was: no pass"),
        timeout=deadline_for(TIMINGS.poll_s),
        what="the watcher reading the plan",
    )
    assert invocation(edge, RECONCILE_SERVICE) == first
    # ... and one that moves braid's upstream starts exactly one more pass.
    publish_plan(edge, ("braid", "x86-spill"), ("lupine", "qfox-1"))
    second = wait_until(
        lambda: (i := invocation(edge, RECONCILE_SERVICE)) != first and i,
        timeout=deadline_for(TIMINGS.window_s + TIMINGS.poll_s),
        what="a pass started for the new plan",
    )
    assert second != first
    journal = edge.journal("-u", WATCH_SERVICE, "-o", "cat")
    assert journal.count("started a pass of racknerd: this host's part of the plan (") == 2
    assert watcher_state(edge) == "active"


SLOW_PASS = "slow-pass.service"
RUNS = "/var/lib/slow-pass.runs"


def test_a_start_while_a_pass_runs_is_merged_into_it(edge: SystemdContainer) -> None:
    """Why the watcher waits for a running pass instead of starting one: of a
    oneshot whose start job runs, systemd merges a second StartUnit into that
    job (no second run follows), and that run may have read the registry
    before the change. The start port over real D-Bus sees the pass running."""
    edge.write_file(f"/etc/systemd/system/{SLOW_PASS}", f"[Service]\nType=oneshot\nExecStart=/bin/sh -c 'echo run >> {RUNS}; sleep 2'\n")
    assert edge.systemctl("daemon-reload").returncode == 0
    starter = UnitPassStarter(SLOW_PASS, edge.bus_address)
    try:
        assert not starter.pass_running()
        starter.start_pass()
        wait_until(starter.pass_running, what="the slow pass running")
        starter.start_pass()  # merged into the running job
        assert starter.pass_running()
        # No job left for the unit: nothing more will run without a new start.
        wait_until(lambda: SLOW_PASS not in edge.systemctl("list-jobs", "--no-legend").stdout, timeout=deadline_for(2), what="the job to end")
        assert not starter.pass_running()
        assert edge.read_file(RUNS).splitlines() == ["run"]
    finally:
        starter.close()


QUICK_PASS = "quick-pass.service"
QUICK_TIMER = "quick-pass.timer"
QUICK_RUNS = "/var/lib/quick-pass.runs"


def test_the_pass_unit_takes_a_start_after_every_pass_however_many_in_a_row(edge: SystemdContainer) -> None:
    """A watcher starts one pass per new plan that concerns its host, each
    once the last has ended. With systemd's default start limit (5 starts in
    10 s, counted while the timer keeps the unit loaded) the sixth start
    fails while StartUnit still returns a job: the watcher would log a start,
    nothing would run, and that plan would wait for the timer. Here: the pass
    unit's [Unit] section as rendered, a pass that ends at once, a timer
    that keeps it loaded (as fabric-reconcile.timer does) but does not fire,
    and the watcher's start port over D-Bus."""
    install = Install(fabric_bin=FABRIC, node=NodeConfig(node=NodeSection(host="racknerd", desired=DESIRED, registry_path=REGISTRY)))
    (rendered,) = (unit for unit in host_units(install, leader_candidate=False) if unit.name == RECONCILE_SERVICE)
    unit_section = "".join(f"{key}={value}\n" for key, value in rendered.sections["Unit"])
    edge.write_file(
        f"/etc/systemd/system/{QUICK_PASS}", f"[Unit]\n{unit_section}\n[Service]\nType=oneshot\nExecStart=/bin/sh -c 'echo run >> {QUICK_RUNS}'\n"
    )
    edge.write_file(f"/etc/systemd/system/{QUICK_TIMER}", f"[Timer]\nOnActiveSec=1h\nUnit={QUICK_PASS}\n")
    assert edge.systemctl("daemon-reload").returncode == 0
    assert edge.systemctl("start", QUICK_TIMER).returncode == 0
    starter = UnitPassStarter(QUICK_PASS, edge.bus_address)
    starts = 8

    def runs() -> int:
        path = edge.host_path(QUICK_RUNS)
        return len(path.read_text().splitlines()) if path.exists() else 0

    try:
        for n in range(1, starts + 1):
            starter.start_pass()
            wait_until(lambda n=n: not starter.pass_running() and runs() >= n, timeout=deadline_for(1), what=f"pass {n} of {starts} to run")
        assert runs() == starts
        assert edge.systemctl("show", QUICK_PASS, "-p", "Result", "--value").stdout.strip() == "success"
    finally:
        starter.close()
        edge.systemctl("stop", QUICK_TIMER)


LIMITED_PASS = "limited-pass.service"
LIMITED_TIMER = "limited-pass.timer"


def test_a_start_that_systemd_runs_nothing_for_is_refused_not_taken_for_a_pass(edge: SystemdContainer) -> None:
    """StartUnit returns a job even when systemd then runs nothing: here the
    unit's own start limit (one start an hour, counted while a timer keeps it
    loaded). The start port confirms that a run began (a new InvocationID) and
    raises ActivationError when the job ended without one, so the watcher
    keeps its change pending and tries again instead of logging a start."""
    edge.write_file(
        f"/etc/systemd/system/{LIMITED_PASS}",
        "[Unit]\nStartLimitIntervalSec=1h\nStartLimitBurst=1\n\n[Service]\nType=oneshot\nExecStart=/bin/true\n",
    )
    edge.write_file(f"/etc/systemd/system/{LIMITED_TIMER}", f"[Timer]\nOnActiveSec=1h\nUnit={LIMITED_PASS}\n")
    assert edge.systemctl("daemon-reload").returncode == 0
    assert edge.systemctl("start", LIMITED_TIMER).returncode == 0
    starter = UnitPassStarter(LIMITED_PASS, edge.bus_address)
    try:
        starter.start_pass()  # the one start the limit allows: a run began
        assert edge.systemctl("show", LIMITED_PASS, "-p", "InvocationID", "--value").stdout.strip()
        wait_until(lambda: not starter.pass_running(), timeout=deadline_for(1), what="the first run to end")
        with pytest.raises(ActivationError, match=f"systemd ran no {LIMITED_PASS}: .*start-limit-hit"):
            starter.start_pass()
    finally:
        starter.close()
        edge.systemctl("stop", LIMITED_TIMER)
        edge.systemctl("reset-failed", LIMITED_PASS)


def pulls(container: SystemdContainer) -> list[str]:
    """What `fabric pull` (the pass's ExecStartPre) said, one line per pass, oldest first
    (not its reminder that unsigned commits are accepted: this module's node.toml turns signing off)."""
    journal = container.journal("-u", RECONCILE_SERVICE, "-o", "cat").splitlines()
    return [line for line in journal if line.startswith("pull: ") and not line.startswith("pull: unsigned commits are accepted")]


def pass_idle(container: SystemdContainer) -> bool:
    return container.systemctl("show", RECONCILE_SERVICE, "-p", "ActiveState", "--value").stdout.strip() in ("inactive", "failed")


def next_pull(container: SystemdContainer, seen: int, what: str) -> str:
    """The line of the pass after the first `seen`, once that pass has ended."""
    said = wait_until(lambda: len(lines := pulls(container)) > seen and pass_idle(container) and lines, timeout=300, what=what)
    assert len(said) == seen + 1, said
    return said[-1]


def test_a_pass_the_watcher_starts_does_not_wait_for_git_the_timers_and_an_operators_fetch(edge: SystemdContainer) -> None:
    """With a git [source] every start of fabric-reconcile.service runs `fabric
    pull` first. The pass the watcher starts for a plan reacts to the
    registry: a fetch (ssh to the remote) would spend the second it has; the
    watcher's ask makes its pull skip the fetch while the last one tried is
    recent. A start without an ask (the timer's, an operator's) fetches."""
    wait_until(lambda: pass_idle(edge), timeout=300, what="the passes before to end")
    seen = len(pulls(edge))
    edge.systemctl("start", RECONCILE_SERVICE)  # waits for the oneshot; its outcome does not matter here
    assert next_pull(edge, seen, "the operator's pass").startswith(("pull: up to date at", "pull: now at"))

    (edge.host_path(WORK) / "NOTE").write_text("pushed after the last fetch\n")
    pushed = commit_and_push(edge, "a push the reacting pass does not wait for")
    publish_plan(edge, ("braid", "qfox-1"), ("lupine", "qfox-1"))
    said = next_pull(edge, seen + 1, "the pass the watcher started for the plan")
    assert said.startswith("pull: not fetching: fabric-watch asked for this pass (the registry changed, not git)"), said
    assert not edge.host_path(f"{DESIRED}/NOTE").exists()
    assert not edge.host_path(f"/var/lib/fabric/{PASS_ASKED}").exists(), "the ask counts for one pass only"

    edge.systemctl("start", RECONCILE_SERVICE)
    assert next_pull(edge, seen + 2, "the operator's second pass") == f"pull: now at {pushed[:12]}"
    assert edge.host_path(f"{DESIRED}/NOTE").read_text() == "pushed after the last fetch\n"
