"""apply: each kind of unit job of one activation goes to systemd as one batch
(stop, reload, restart, start, in that order), and every unit of a batch is
audited with its own outcome, in the plan's order.

The Applier runs on real files (LocalTree under tmp_path) with hand-written
units; systemd is test_apply's FakeMachine, which records each batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from reconciler.adapters.files import FlockLock, LocalTree
from reconciler.core.render.artifacts import Artifact
from reconciler.engine.apply import Activators, Applier, ApplyResult, Validators
from reconciler.ports import ActivationError, JobOutcome
from tests.support.audit import RecordingAudit
from tests.support.clock import T_PASS, FakeClock
from tests.support.machine import UNIT_DIR, FakeMachine, FakeVerifier


def unit(name: str, exec_start: str = "/bin/sleep infinity", *, reload_trigger: str | None = None) -> Artifact:
    lines = ["[Unit]", f"Description={name}"]
    if reload_trigger is not None:
        lines.append(f"X-Reload-Triggers={reload_trigger}")
    lines += ["[Service]", f"ExecStart={exec_start}"]
    if reload_trigger is not None:
        lines.append("ExecReload=/bin/kill -HUP $MAINPID")
    return Artifact(f"{UNIT_DIR}/fabric-{name}.service", "\n".join(lines) + "\n", 0o644, "unit")


class Host:
    def __init__(self, tmp_path: Path, machine: FakeMachine | None = None) -> None:
        self.root = tmp_path / "root"
        self.root.mkdir()
        self.machine = machine or FakeMachine(self.root, tmp_path / "machine.json")
        self.audit = RecordingAudit()
        self.applier = Applier(
            LocalTree(self.root),
            FlockLock(self.root / "var/lib/fabric/lock"),
            self.audit,
            FakeClock(T_PASS),
            validators=Validators(FakeVerifier(), self.machine, self.machine),
            activators=Activators(self.machine, self.machine, self.machine),
        )

    def apply(self, artifacts: Sequence[Artifact]) -> ApplyResult:
        self.machine.forget_calls()
        self.audit.records.clear()
        return self.applier.run(artifacts, host="racknerd", epoch=None)

    def unit_records(self, job: str) -> list[tuple[str, str, str]]:
        return [(r["unit"], r["outcome"], r.get("reason", "")) for r in self.audit.records if r["action"] == job]


def test_each_kind_of_job_is_one_batch_in_the_order_stop_reload_restart_start(tmp_path: Path) -> None:
    host = Host(tmp_path)
    first = [
        unit("gone-1"),
        unit("gone-2"),
        unit("hup-1", reload_trigger="v1"),
        unit("hup-2", reload_trigger="v1"),
        unit("edit-1"),
        unit("edit-2"),
    ]
    assert host.apply(first).outcome == "applied"
    second = [
        unit("hup-1", reload_trigger="v2"),
        unit("hup-2", reload_trigger="v2"),
        unit("edit-1", "/bin/sleep 1000"),
        unit("edit-2", "/bin/sleep 1000"),
        unit("new-1"),
        unit("new-2"),
    ]
    result = host.apply(second)
    assert result.outcome == "applied", result.messages
    assert host.machine.batches == [
        ("stop", ["fabric-gone-1.service", "fabric-gone-2.service"]),
        ("reload", ["fabric-hup-1.service", "fabric-hup-2.service"]),
        ("restart", ["fabric-edit-1.service", "fabric-edit-2.service"]),
        ("start", ["fabric-new-1.service", "fabric-new-2.service"]),
    ]
    # One audit record per unit, batch after batch, each unit in its batch's order.
    audited = [(r["action"], r["unit"]) for r in host.audit.records if r.get("unit")]
    assert audited == [(job, u) for job, units in host.machine.batches for u in units]
    assert all(r["outcome"] == "ok" and r["generation"] == "2" for r in host.audit.records if r.get("unit"))


def test_one_failed_start_of_three_audits_all_three_and_rolls_back(tmp_path: Path) -> None:
    host = Host(tmp_path)
    assert host.apply([unit("base")]).outcome == "applied"
    host.machine.fail["start fabric-b.service"] = "job failed; unit is failed (failed), result exit-code, exit status 3"
    result = host.apply([unit("base"), unit("a"), unit("b"), unit("c")])
    assert result.outcome == "rolled-back" and result.generation == 1
    assert host.machine.batches[0] == ("start", ["fabric-a.service", "fabric-b.service", "fabric-c.service"])
    assert host.unit_records("start") == [
        ("fabric-a.service", "ok", "new unit"),
        ("fabric-b.service", "failed", "job failed; unit is failed (failed), result exit-code, exit status 3"),
        ("fabric-c.service", "ok", "new unit"),
    ]
    activation = next(r for r in host.audit.records if r["action"] == "activate")
    assert activation["outcome"] == "failed"
    assert activation["reason"] == "start fabric-b.service: job failed; unit is failed (failed), result exit-code, exit status 3"
    # The rollback stops the two that did start (and the failed one) in one batch.
    assert host.machine.batches[1:] == [("stop", ["fabric-a.service", "fabric-b.service", "fabric-c.service"])]
    assert host.machine.state["active"] == ["fabric-base.service"]
    assert any(r["action"] == "rollback" and r["outcome"] == "ok" for r in host.audit.records)


def test_several_failed_units_are_each_audited_and_named(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.machine.fail["start fabric-a.service"] = "reason a"
    host.machine.fail["start fabric-c.service"] = "reason c"
    result = host.apply([unit("a"), unit("b"), unit("c")])
    assert result.outcome == "rolled-back"
    assert host.unit_records("start") == [
        ("fabric-a.service", "failed", "reason a"),
        ("fabric-b.service", "ok", "new unit"),
        ("fabric-c.service", "failed", "reason c"),
    ]
    assert "start fabric-a.service: reason a | start fabric-c.service: reason c" in result.messages[0]
    assert host.machine.state["active"] == []


class UnreachableOnce(FakeMachine):
    """systemd cannot be reached for the first batch of jobs."""

    reached = False

    def run_jobs(self, job: str, units: list[str]) -> list[JobOutcome]:
        if not self.reached:
            self.reached = True
            raise ActivationError("cannot connect to systemd on the system bus: [Errno 2] No such file or directory")
        return super().run_jobs(job, units)


def test_a_batch_systemd_never_took_fails_every_unit_of_it(tmp_path: Path) -> None:
    host = Host(tmp_path, UnreachableOnce(tmp_path / "root", tmp_path / "machine.json"))
    result = host.apply([unit("a"), unit("b")])
    assert result.outcome == "rolled-back"
    reason = "cannot connect to systemd on the system bus: [Errno 2] No such file or directory"
    assert host.unit_records("start") == [("fabric-a.service", "failed", reason), ("fabric-b.service", "failed", reason)]
