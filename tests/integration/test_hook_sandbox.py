"""Cloud hooks run sandboxed: each a transient unit of a real systemd (PID 1 in a container).

The leader's HookRunner (adapters.hook_units.SystemdRunHooks) runs the argv
the core builds (core.render.hook_unit) with `systemd-run` inside the
container, and reads the unit's output back from the container's journald.
Through the leader's scaling step, a hook

- runs as a dynamic user, not root, with no capabilities, and cannot write /etc;
- finds its credential as a file ($GH_TOKEN_FILE, $CREDENTIALS_DIRECTORY/GH_TOKEN)
  with the secret's bytes (checked by digest, never printed), in its working directory;
- is stopped by systemd at its own budget;
- has its exit status and output in the scaling record, and its output in
  its unit's journal;

and the secret's value is in no property of the unit while it runs and in no
file the run leaves (the journal included).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta

import pytest

from reconciler.adapters.hook_units import SystemdRunHooks
from reconciler.core.command_result import CommandResult
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import CloudHook, DesiredState
from reconciler.core.install.units import DAEMON_HARDENING
from reconciler.core.live.models import FleetPlan, Snapshot, SnapshotNode
from reconciler.core.live.records import LeaderInfo, Leadership, ScalingRecord
from reconciler.core.render.hook_unit import HookRun, hook_unit
from reconciler.engine.scaling_step import ScalingStep
from tests.conftest import EXAMPLE_FLEET, require, require_root
from tests.support.harness.systemd import CHECKOUT, SystemdContainer, systemd_container
from tests.support.harness.waiting import wait_until

pytestmark = pytest.mark.integration

SECRET = "hook-secret-6f1d2a9c-not-for-anyone"
SECRET_FILE = "/run/secrets/gh-token"
WORKDIR = "/srv/hooks"
T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)

# What the hook tells about itself: who it is, whether it can write /etc, its
# credential (by digest: the value is never printed), where it runs; exit 3.
# One line: an argv element holds no newline.
PROBE = "; ".join(
    [
        'echo "uid=$(id -u) user=$(id -un)"',
        "grep CapEff /proc/self/status",
        'if touch /etc/hook-was-here 2>/dev/null; then echo "etc: written"; else echo "etc: refused"; fi',
        'echo "file=$GH_TOKEN_FILE dir=$CREDENTIALS_DIRECTORY"',
        'echo "digest=$(sha256sum < "$GH_TOKEN_FILE" | cut -c1-12) same=$(cmp -s "$GH_TOKEN_FILE" "$CREDENTIALS_DIRECTORY/GH_TOKEN" && echo yes)"',
        'echo "cwd=$(pwd)"',
        "exit 3",
    ]
)


class ContainerRunner:
    """The CommandRunner port, inside the container (its systemd, its journal)."""

    def __init__(self, container: SystemdContainer) -> None:
        self.container = container

    def run(self, argv: Sequence[str], *, timeout: float = 10.0, stdin: str | None = None) -> CommandResult:
        try:
            done = self.container.run(*argv, input=stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            return CommandResult(tuple(argv), None, timed_out=True)
        return CommandResult(tuple(argv), done.returncode, done.stdout, done.stderr, missing=done.returncode == 127)


@pytest.fixture(scope="module")
def container() -> Iterator[SystemdContainer]:
    require_root()
    require("unshare", "nsenter", "systemd-run", "journalctl")
    # pivot_root and a shared / (user_namespaces=True): LoadCredential= mounts the credentials in a child namespace.
    with systemd_container(user_namespaces=True) as c:
        started = c.systemctl("start", "systemd-journald.socket", "systemd-journald.service")
        assert started.returncode == 0, started.stderr
        c.write_file(SECRET_FILE, SECRET + "\n", 0o600)
        assert c.run("mkdir", "-p", WORKDIR).returncode == 0
        yield c


def _desired(hook: CloudHook) -> DesiredState:
    base = load_desired(EXAMPLE_FLEET)
    scaling = base.fleet.scaling.model_copy(update={"cloud_hooks": {"batch": hook}})
    return base.model_copy(update={"fleet": base.fleet.model_copy(update={"scaling": scaling})})


class OneRecordRegistry:
    def __init__(self) -> None:
        self.record = ScalingRecord()

    def scaling_record(self) -> ScalingRecord:
        return self.record

    def store_scaling(self, leadership: Leadership, record: ScalingRecord) -> None:
        self.record = record


def _burst(container: SystemdContainer, hook: CloudHook) -> tuple[ScalingRecord, list[str]]:
    """Two leader steps 31 s apart with a queue over the high mark: the batch hook runs once."""
    registry, logs = OneRecordRegistry(), []
    step = ScalingStep(registry=registry, hooks=SystemdRunHooks(ContainerRunner(container)), log=logs.append)  # type: ignore[arg-type]
    leadership = Leadership(info=LeaderInfo(candidate="lux", epoch=1, since=T0, token="t", term=1), ttl_s=30)
    busy = [SnapshotNode(node_id=h, tier="cpu_ffmpeg", in_flight=2, max_concurrent_tasks=2) for h in ("lux", "qfox-1")]
    plan = FleetPlan.model_validate(
        {
            "epoch": 1,
            "leader": "lux",
            "created": T0.isoformat(),
            "deferred": [{"service": f"s{i}", "replica": 0, "reason": "full"} for i in range(11)],
        }
    )
    desired = _desired(hook)
    for seconds in (0, 31):
        step.run(leadership, desired, Snapshot(now=T0 + timedelta(seconds=seconds), nodes=busy), plan)
    return registry.record, logs


def test_a_hook_runs_as_a_dynamic_user_without_capabilities_with_its_credential_file_and_its_status_reaches_the_record(container):
    hook = CloudHook(command=["sh", "-c", PROBE], credentials={"GH_TOKEN": SECRET_FILE}, working_directory=WORKDIR, timeout_s=30)
    record, logs = _burst(container, hook)

    outcome = record.hooks["batch"]
    assert (outcome.ok, outcome.end, outcome.returncode) == (False, "exit", 3), outcome
    unit = outcome.unit
    assert unit is not None and unit.startswith("fabric-hook-batch-")
    said = dict(part.split("=", 1) for line in outcome.output for part in line.split() if "=" in part)
    assert said["uid"] != "0" and said["user"] != "root", outcome.output
    assert said["dir"] == f"/run/credentials/{unit}" and said["file"] == f"/run/credentials/{unit}/GH_TOKEN"
    # 12 hex digits: a whole digest would look like a key, and the record withholds such a line.
    assert said["digest"] == hashlib.sha256((SECRET + "\n").encode()).hexdigest()[:12] and said["same"] == "yes"
    assert said["cwd"] == WORKDIR
    assert "etc: refused" in outcome.output
    assert not container.host_path("/etc/hook-was-here").exists()
    assert any(line.startswith("CapEff:") and line.removeprefix("CapEff:").strip().strip("0") == "" for line in outcome.output), outcome.output
    [audit] = [a for a in record.recent if a.kind == "run_cloud_hook"]
    assert audit.outcome == f"failed: exit 3 ({unit})" and audit.output == outcome.output
    assert any("scaling run_cloud_hook batch: failed: exit 3" in line for line in logs), logs

    journal = container.journal("--output=cat", f"_SYSTEMD_UNIT={unit}")
    assert "etc: refused" in journal and said["digest"] in journal
    assert container.systemctl("is-active", unit).stdout.strip() in ("inactive", "unknown"), "collected: nothing left loaded"


def test_systemd_stops_a_hook_at_its_own_budget(container):
    hooks = SystemdRunHooks(ContainerRunner(container))
    run = hooks.run(hook_unit("batch", CloudHook(command=["sleep", "300"], timeout_s=2), datetime.now(UTC)))
    assert run.end == "timeout", run
    assert "budget of 2 s" in run.detail
    assert container.systemctl("is-active", run.unit).stdout.strip() != "active"


def test_a_program_not_on_the_leader_s_path_is_missing_and_nothing_runs(container):
    run = SystemdRunHooks(ContainerRunner(container)).run(hook_unit("batch", CloudHook(command=["no-such-hook-program"]), datetime.now(UTC)))
    assert run.end == "missing" and "no-such-hook-program" in run.detail


def test_the_secret_is_in_no_property_of_the_running_unit_and_in_no_file_the_run_leaves(container):
    hooks = SystemdRunHooks(ContainerRunner(container))
    unit = hook_unit(
        "batch",
        CloudHook(command=["sh", "-c", 'cat "$GH_TOKEN_FILE" > /dev/null; sleep 30'], credentials={"GH_TOKEN": SECRET_FILE}, timeout_s=60),
        datetime.now(UTC),
    )
    done: list[HookRun] = []
    runner = threading.Thread(target=lambda: done.append(hooks.run(unit)))
    runner.start()
    try:
        wait_until(lambda: container.systemctl("is-active", unit.unit).stdout.strip() == "active", what="the hook's unit running")
        shown = container.systemctl("show", "--all", unit.unit)
        assert shown.returncode == 0 and "DynamicUser=yes" in shown.stdout
        assert SECRET not in shown.stdout
        # The transient unit's file (/run/systemd/transient/<unit>) names the credential's path only.
        catted = container.systemctl("cat", unit.unit).stdout
        assert f"LoadCredential=GH_TOKEN:{SECRET_FILE}" in catted and SECRET not in catted
        environ = container.run("systemctl", "show", "-p", "Environment", unit.unit).stdout
        assert f"GH_TOKEN_FILE=/run/credentials/{unit.unit}/GH_TOKEN" in environ and SECRET not in environ
    finally:
        container.systemctl("stop", unit.unit)
        runner.join(timeout=90)
    assert done and SECRET not in repr(done[0])
    container.run("journalctl", "--sync")
    leaks = container.run("grep", "-rlsF", "--", SECRET, "/run", "/etc", "/var", "/tmp", "/srv")
    assert [path for path in leaks.stdout.splitlines() if path != SECRET_FILE] == []


# Inside fabric-leader's own hardening: the adapter runs a hook and reads its output back.
LEADER_SIDE = """
import dataclasses, json, sys
from datetime import UTC, datetime
from reconciler.adapters.commands import SubprocessRunner
from reconciler.adapters.hook_units import SystemdRunHooks
from reconciler.core.desired.model import CloudHook
from reconciler.core.render.hook_unit import hook_unit
hook = CloudHook(command=["sh", "-c", "echo from-the-hook uid=$(id -u); exit 4"], credentials={"GH_TOKEN": sys.argv[1]}, timeout_s=30)
run = SystemdRunHooks(SubprocessRunner()).run(hook_unit("batch", hook, datetime.now(UTC)))
print(json.dumps(dataclasses.asdict(run)))
"""


def test_fabric_leader_under_its_own_hardening_starts_the_hook_unit_and_reads_its_journal(container):
    """fabric-leader.service runs as root with no capabilities and a system-call
    filter (core.install.units.DAEMON_HARDENING): systemd-run and journalctl still work from there."""
    # ProtectHome read-only rather than hidden: this test's Python lives under /root (pyenv), an installed fabric does not.
    hardening = {**DAEMON_HARDENING, "ProtectHome": "read-only"}
    properties = [f"--property={key}={value}" for key, values in hardening.items() for value in (values if isinstance(values, tuple) else (values,))]
    leader = container.run(
        "systemd-run",
        "--pipe",
        "--wait",
        "--collect",
        "--quiet",
        *properties,
        f"--setenv=PYTHONPATH={CHECKOUT}",
        "--setenv=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--",
        sys.executable,
        "-c",
        LEADER_SIDE,
        SECRET_FILE,
        timeout=120,
    )
    assert leader.returncode == 0, leader.stderr
    run = json.loads(leader.stdout.strip().splitlines()[-1])
    assert (run["end"], run["returncode"]) == ("exit", 4), run
    [line] = [line for line in run["output"] if line.startswith("from-the-hook")]
    assert line != "from-the-hook uid=0"
