"""A cloud hook as a transient systemd unit: the systemd-run argv the core
builds (a value, nothing run), how a run's report is read, and the leader's
scaling step running its hooks through the HookRunner port only.

The real thing (systemd as PID 1, a dynamic user, the credential, the budget,
the journal) is tests/integration/test_hook_sandbox.py."""

from __future__ import annotations

from datetime import UTC, datetime

from reconciler.core.command_result import CommandResult
from reconciler.core.desired.confinement import DEFAULT_ALLOWED_PREFIXES, confinement_problems
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import CloudHook, hook_program
from reconciler.core.live.models import FleetPlan, Snapshot, SnapshotNode
from reconciler.core.live.records import LeaderInfo, Leadership, ScalingRecord
from reconciler.core.render.hook_unit import SANDBOX, HookRun, HookUnit, hook_run, hook_unit, output_tail
from reconciler.core.views.timeline import FleetHistory, timeline
from reconciler.engine.scaling_step import ScalingStep
from tests.conftest import EXAMPLE_FLEET

AT = datetime(2026, 12, 2, 10, 15, 0, 123456, tzinfo=UTC)
UNIT = "fabric-hook-batch-20261202T101500123456.service"
GH = ["sh", "-c", 'read -r GH_TOKEN < "$GH_TOKEN_FILE"; export GH_TOKEN; exec gh "$@"', "gh", "workflow", "run", "adaptive-compute.yml"]


def test_the_argv_runs_the_hook_as_its_own_sandboxed_unit_with_its_budget_credentials_and_directory():
    hook = CloudHook(command=GH, credentials={"GH_TOKEN": "/run/secrets/gh-token"}, working_directory="/srv/hooks", timeout_s=45)
    unit = hook_unit("batch", hook, AT)
    assert unit.unit == UNIT and unit.timeout_s == 45 and unit.wait_s == 55
    assert list(unit.argv) == [
        "systemd-run",
        "--wait",
        "--collect",
        "--service-type=exec",
        f"--unit={UNIT}",
        "--description=fabric cloud hook (batch)",
        "--property=DynamicUser=yes",
        "--property=CapabilityBoundingSet=",
        "--property=AmbientCapabilities=",
        "--property=NoNewPrivileges=yes",
        "--property=PrivateTmp=yes",
        "--property=ProtectSystem=strict",
        "--property=ProtectHome=yes",
        "--property=RuntimeMaxSec=45",
        "--property=WorkingDirectory=/srv/hooks",
        "--property=LoadCredential=GH_TOKEN:/run/secrets/gh-token",
        "--setenv=HOME=/tmp",
        f"--setenv=GH_TOKEN_FILE=/run/credentials/{UNIT}/GH_TOKEN",
        "--",
        *GH,
    ]


def test_a_minimal_hook_still_gets_the_whole_sandbox_and_the_default_budget():
    unit = hook_unit("gpu_cuda", CloudHook(command=["gh", "workflow", "run"]), AT)
    assert unit.unit == "fabric-hook-gpu-cuda-20261202T101500123456.service"
    for prop in SANDBOX:
        assert f"--property={prop}" in unit.argv
    assert "--property=RuntimeMaxSec=60" in unit.argv
    assert not [a for a in unit.argv if "WorkingDirectory" in a or "LoadCredential" in a]
    # The command follows "--" untouched: systemd-run reads no option of it.
    assert unit.argv[unit.argv.index("--") + 1 :] == ("gh", "workflow", "run")


def test_the_argv_carries_a_credential_s_path_never_anything_read_from_it():
    hook = CloudHook(command=["gh"], credentials={"GH_TOKEN": "/run/secrets/gh-token", "B": "/run/secrets/b"})
    unit = hook_unit("batch", hook, AT)
    loads = [a for a in unit.argv if "LoadCredential" in a]
    assert loads == ["--property=LoadCredential=B:/run/secrets/b", "--property=LoadCredential=GH_TOKEN:/run/secrets/gh-token"]
    assert not [a for a in unit.argv if a.startswith("--property=SetCredential") or a.startswith("--setenv=GH_TOKEN=")]


def test_a_hook_s_program_is_a_path_name_or_an_absolute_path_no_user_or_unit_can_write():
    assert hook_program("gh") == "gh"
    assert hook_program("/usr/bin/gh") == "/usr/bin/gh"
    assert hook_program("/opt/wrangler/bin/wrangler") == "/opt/wrangler/bin/wrangler"
    for bad in ("/run/current-system/sw/bin/gh", "/tmp/gh", "/home/ops/bin/gh", "/srv/x/gh", "/var/lib/phaze/gh", "gh;rm", "../gh"):
        try:
            hook_program(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")


def test_a_leader_candidate_s_pass_checks_the_hooks_paths_against_its_prefixes_other_hosts_do_not():
    desired = load_desired(EXAMPLE_FLEET)
    keys = {p.path for p in confinement_problems(desired, ["/run/secrets"], "lux")}
    assert "scaling.cloud_hooks.batch.credentials.GH_TOKEN" not in keys
    assert "scaling.cloud_hooks.wasm.working_directory" in keys, "/srv is not among this host's prefixes"
    assert not [p for p in confinement_problems(desired, ["/run/secrets"], "a1-arm64") if p.path.startswith("scaling.")]
    assert not confinement_problems(desired, DEFAULT_ALLOWED_PREFIXES)


def _ran(stderr: str, returncode: int | None = 1, **kw) -> CommandResult:
    return CommandResult(("systemd-run",), returncode, stderr=stderr, **kw)


UNIT_VALUE = HookUnit(tier="batch", unit=UNIT, argv=("systemd-run",), timeout_s=5, wait_s=15)
FINISHED = "Running as unit: {u}\nFinished with result: {r}\nMain processes terminated with: code={c}\nService runtime: 17ms\n"


def test_systemd_run_s_report_says_how_the_hook_ended():
    ok = hook_run(UNIT_VALUE, _ran(FINISHED.format(u=UNIT, r="success", c="exited/status=0"), 0), ["✓ Created workflow_dispatch event"])
    assert (ok.end, ok.returncode, ok.output, ok.ok) == ("ok", 0, ("✓ Created workflow_dispatch event",), True)
    assert ok.summary() == f"ran, exit 0 ({UNIT})"
    failed = hook_run(UNIT_VALUE, _ran(FINISHED.format(u=UNIT, r="exit-code", c="exited/status=3"), 3), ["HTTP 401: Bad credentials"])
    assert (failed.end, failed.returncode, failed.summary()) == ("exit", 3, f"failed: exit 3 ({UNIT})")
    timed = hook_run(UNIT_VALUE, _ran(FINISHED.format(u=UNIT, r="timeout", c="killed/status=TERM")), [])
    assert (timed.end, timed.returncode) == ("timeout", None) and "budget of 5 s" in timed.detail
    missing = hook_run(UNIT_VALUE, _ran("Failed to find executable gh: No such file or directory\n"), [])
    assert missing.end == "missing" and missing.detail.startswith("Failed to find executable gh")
    start = hook_run(UNIT_VALUE, _ran(f"Job for {UNIT} failed because the control process exited with error code.\n"), [])
    assert start.end == "start_failed"
    detached = hook_run(UNIT_VALUE, CommandResult(("systemd-run",), None, timed_out=True), [])
    assert detached.end == "detached" and "15 s" in detached.detail
    assert hook_run(UNIT_VALUE, CommandResult(("systemd-run",), None, missing=True), []).end == "missing"


def test_the_output_kept_is_its_last_lines_short_and_never_a_secret():
    token = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    lines = ["one", "", "two\x1b[31m", f"token {token}", "x" * 500, "three", "four"]
    tail = output_tail(lines)
    assert len(tail) == 6 and tail[-1] == "four" and tail[0] == "one" and tail[1] == "two[31m"
    assert tail[2] == "(a line withheld: it looks like a GitHub token)"
    assert len(tail[3]) == 200
    assert not [line for line in tail if token in line]


class FakeHooks:
    """The HookRunner port: records the units it was asked to run, answers with a prepared run."""

    def __init__(self, answer: HookRun | None = None) -> None:
        self.ran: list[HookUnit] = []
        self.answer = answer

    def run(self, hook: HookUnit) -> HookRun:
        self.ran.append(hook)
        return self.answer or HookRun(hook.unit, "exit", returncode=3, output=("HTTP 401: Bad credentials",))


class OneRecordRegistry:
    """The two LeaderRegistry calls a scaling step makes."""

    def __init__(self) -> None:
        self.record = ScalingRecord()

    def scaling_record(self) -> ScalingRecord:
        return self.record

    def store_scaling(self, leadership: Leadership, record: ScalingRecord) -> None:
        self.record = record


def _burst_step(
    hooks: FakeHooks, budget_s: float = 120.0, prefixes: tuple[str, ...] = DEFAULT_ALLOWED_PREFIXES
) -> tuple[OneRecordRegistry, list[str]]:
    desired = load_desired(EXAMPLE_FLEET)
    registry, logs = OneRecordRegistry(), []
    step = ScalingStep(registry=registry, hooks=hooks, log=logs.append, hook_budget_s=budget_s, allowed_prefixes=prefixes)  # type: ignore[arg-type]
    leadership = Leadership(info=LeaderInfo(candidate="lux", epoch=1, since=AT, token="t", term=1), ttl_s=30)
    busy = [SnapshotNode(node_id=h, tier="cpu_ffmpeg", in_flight=2, max_concurrent_tasks=2) for h in ("lux", "qfox-1")]
    deferred = [{"service": f"s{i}", "replica": 0, "reason": "every candidate full"} for i in range(11)]
    plan = {"epoch": 1, "leader": "lux", "created": AT.isoformat(), "deferred": deferred}
    for seconds in (0, 31):
        snapshot = Snapshot(now=AT.replace(second=seconds), nodes=busy)
        step.run(leadership, desired, snapshot, FleetPlan.model_validate(plan))
    return registry, logs


def test_the_leader_runs_each_hook_as_its_unit_through_the_port_and_keeps_how_it_ended():
    hooks = FakeHooks()
    registry, logs = _burst_step(hooks)
    assert [u.tier for u in hooks.ran] == ["batch", "wasm"], "best tier first, each hook once"
    batch = hooks.ran[0]
    desired = load_desired(EXAMPLE_FLEET)
    expected = hook_unit("batch", desired.fleet.scaling.cloud_hooks["batch"], AT.replace(second=31))
    assert batch.argv == expected.argv and batch.argv[0] == "systemd-run"
    assert batch.wait_s == 60, "each hook waited for at most its share of the leader's budget (120 s / 2)"
    outcome = registry.record.hooks["batch"]
    assert (outcome.ok, outcome.returncode, outcome.end, outcome.unit) == (False, 3, "exit", batch.unit)
    assert outcome.output == ("HTTP 401: Bad credentials",)
    stored = registry.record.model_dump_json()
    assert "adaptive-compute.yml" not in stored and "/run/secrets/gh-token" not in stored, "the registry holds no command and no path"
    [audit] = [a for a in registry.record.recent if a.tier == "batch"]
    assert audit.outcome == f"failed: exit 3 ({batch.unit})"
    [event] = [e for e in timeline(FleetHistory(scaling=registry.record), None) if e.subject == "batch"]
    assert event.title == f"batch cloud hook failed: exit 3 ({batch.unit})"
    assert event.detail.endswith("; output: HTTP 401: Bad credentials")
    assert any("scaling run_cloud_hook batch: failed: exit 3" in line and "output: HTTP 401" in line for line in logs)


def test_a_short_leader_budget_shortens_the_wait_not_the_hook_s_own_budget():
    hooks = FakeHooks(HookRun("x", "ok", returncode=0))
    _burst_step(hooks, budget_s=10.0)
    assert [u.wait_s for u in hooks.ran] == [5.0, 5.0]
    assert all("--property=RuntimeMaxSec=60" in u.argv or "--property=RuntimeMaxSec=120" in u.argv for u in hooks.ran)


def test_the_leader_runs_no_hook_that_names_a_path_outside_its_host_s_prefixes():
    hooks = FakeHooks(HookRun("x", "ok", returncode=0))
    registry, logs = _burst_step(hooks, prefixes=("/run/secrets",))
    assert [u.tier for u in hooks.ran] == ["batch"], "wasm works in /srv, which this host does not allow"
    refused = registry.record.hooks["wasm"]
    assert (refused.ok, refused.end) == (False, "refused")
    assert refused.detail.startswith("scaling.cloud_hooks.wasm.working_directory '/srv/fabric-wasm-worker' outside /run/secrets")
    assert any("scaling run_cloud_hook wasm: refused: a path outside this host's allowed prefixes" in line for line in logs), logs
