"""apply: generations, validation before anything is touched, phased activation
and rollback, against a model of systemd, nft and Caddy (`FakeMachine`,
tests/support/machine.py, which says how it behaves like the real programs).

The files are real (LocalTree under tmp_path); only the activation ports are
fakes. A machine has converged when every desired unit is active and runs
the desired content, nothing else the fabric wrote is active, and nft and
Caddy hold the desired texts (`assert_converged`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
from pathlib import Path

import pytest

from reconciler.adapters.files import FlockLock, LocalTree
from reconciler.core.render.artifacts import Artifact
from reconciler.engine.apply import Activators, Applier, list_generations
from reconciler.engine.pass_options import PlanFile
from reconciler.engine.reconcile import run_pass
from reconciler.ports import ActivationError, LockBusy
from tests.conftest import REPO
from tests.support.cli import fabric
from tests.support.clock import T_PASS, FakeClock
from tests.support.fleet import GOLDEN, Fleet, cli_pass
from tests.support.machine import UNIT_DIR, FakeMachine, assert_converged, sha

# --------------------------------------------------------------------------
# Tests


def test_first_pass_installs_validates_and_starts_everything(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    report = fleet.reconcile()
    assert report.outcome == "applied" and report.exit_status == 0
    assert report.stdout.endswith("generation 1 is active\n")
    assert_converged(fleet.machine, fleet.root)
    # The real checks saw the staged units before anything was activated.
    assert len(fleet.verifier.verified) == 1
    assert all("/var/lib/fabric/generations/.new-1/files/" in p for p in fleet.verifier.verified[0])
    calls = fleet.machine.calls
    # Phases in order: nft, starts, caddy. No daemon-reload: systemd holds
    # none of the new units, so each start reads its file.
    assert calls[0] == ("nft-load", "")
    assert [c[0] for c in calls[1:-1]] == ["start"] * (len(calls) - 2)
    assert calls[-1] == ("caddy-load", "")
    assert {c[1] for c in calls if c[0] == "start"} == {
        "fabric-nftables.service",
        "fabric-socat-lux-smb.service",
        "fabric-socat-qfox-ssh.service",
    }
    # Every action is audited with its generation and content hash.
    writes = [r for r in fleet.audit.records if r["action"] == "write"]
    assert len(writes) == 6 and all(r["generation"] == "1" and len(r["hash"]) == 64 for r in writes)
    starts = [r for r in fleet.audit.records if r["action"] == "start"]
    assert [r["unit"] for r in starts] == [c[1] for c in calls if c[0] == "start"]
    unit_files = {p.name: sha(p.read_bytes()) for p in (fleet.root / UNIT_DIR).iterdir()}
    assert all(r["hash"] == unit_files[r["unit"]] and r["generation"] == "1" and r["reason"] == "new unit" for r in starts)


# Rewritten by every pass by design (reconciler.engine.pass_records): the pass's
# metrics and counters, the probe's damping history. Everything else must stay.
PASS_RECORDS = {"fabric.prom", "pass-counters.json", "probe-history.json", "index.html"}


def installed_mtimes(root: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and p.name != "lock" and p.name not in PASS_RECORDS}


def installed_contents(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != "lock" and p.name not in PASS_RECORDS}


def test_second_pass_is_a_noop(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    before = installed_mtimes(fleet.root)
    fleet.machine.forget_calls()
    report = fleet.reconcile()
    assert (report.outcome, report.stdout, report.stderr) == ("noop", "nothing to do (generation 1)\n", ())
    assert fleet.machine.calls == [], "a no-op pass restarts, reloads and loads nothing"
    assert installed_mtimes(fleet.root) == before, "a no-op pass writes nothing"
    assert [g.number for g in list_generations(fleet.store)] == [1]


def test_changing_a_port_map_restarts_exactly_that_unit(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    fleet.machine.forget_calls()
    fleet.edit_fleet("target_port = 22\n", "target_port = 2022\n")
    assert fleet.reconcile().ok
    assert fleet.machine.calls == [("daemon-reload", ""), ("restart", "fabric-socat-qfox-ssh.service")]
    assert fleet.store.current() == fleet.store.good() == 2
    assert_converged(fleet.machine, fleet.root)


def rename_lux_smb_to_a_failing_lux_nfs(fleet: Fleet) -> None:
    """The next generation renames port map lux-smb to lux-nfs (stop one unit,
    start another), and starting lux-nfs fails."""
    text = (fleet.desired / "fabric.toml").read_text()
    block = text[text.index('[[port_maps]]\nname = "lux-smb"') :]
    fleet.edit_fleet(block, block.replace("lux-smb", "lux-nfs").replace("4445", "2049").replace("445", "2049"))
    fleet.machine.fail["start fabric-socat-lux-nfs.service"] = "Job for fabric-socat-lux-nfs.service failed"


def test_removed_port_map_is_stopped_and_removed(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    fleet.machine.forget_calls()
    text = (fleet.desired / "fabric.toml").read_text()
    block = text[text.index('[[port_maps]]\nname = "lux-smb"') :]
    fleet.edit_fleet(block, "")
    assert fleet.reconcile().ok
    # The ruleset loses port 4445 too; the only unit touched is the socat one,
    # stopped without a daemon-reload (its removed file concerns no unit that stays).
    assert fleet.machine.calls == [("nft-load", ""), ("stop", "fabric-socat-lux-smb.service")]
    assert not (fleet.root / UNIT_DIR / "fabric-socat-lux-smb.service").exists()
    assert_converged(fleet.machine, fleet.root)


def add_port_map(fleet: Fleet, name: str, listen_port: int) -> str:
    """A new port map on racknerd (a new unit); its unit's name."""
    lux_smb = '[[port_maps]]\nname = "lux-smb"\nhost = "racknerd"\nlisten_port = 4445\ntarget_host = "lux"\ntarget_port = 445\n'
    fleet.edit_fleet(lux_smb, lux_smb + "\n" + lux_smb.replace("lux-smb", name).replace("4445", str(listen_port)))
    return f"fabric-socat-{name}.service"


def assert_reloaded_first(fleet: Fleet) -> None:
    """A pass that reloads systemd before any job, says so, and converges."""
    report = fleet.reconcile()
    assert report.ok
    assert fleet.machine.calls[0] == ("daemon-reload", "")
    assert "reloaded the systemd manager configuration (daemon-reload)\n" in report.stdout
    assert_converged(fleet.machine, fleet.root)


def test_a_new_unit_is_started_without_daemon_reload_and_a_changed_held_one_with(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    fleet.machine.forget_calls()
    unit = add_port_map(fleet, "lux-nfs", 2049)
    report = fleet.reconcile()
    assert report.ok
    assert fleet.machine.calls == [("nft-load", ""), ("start", unit)]
    assert "daemon-reload" not in report.stdout and not any(r["action"] == "daemon-reload" for r in fleet.audit.records)
    assert_converged(fleet.machine, fleet.root)
    # Both at once: the held unit's change needs the reload, the new one rides along.
    fleet.machine.forget_calls()
    fleet.edit_fleet("target_port = 22\n", "target_port = 2022\n")
    add_port_map(fleet, "lux-afp", 5548)
    assert_reloaded_first(fleet)


def test_on_a_systemd_older_than_246_a_new_unit_is_reloaded_before_its_start(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.machine = FakeMachine(fleet.root, tmp_path / "machine-245.json", version=245)
    assert fleet.reconcile().ok
    # Reading the units' states left not-found stubs that this systemd does not load again by itself.
    calls = fleet.machine.calls
    assert calls[0] == ("daemon-reload", "") and calls.count(("daemon-reload", "")) == 1
    assert not any("queued again" in r.get("reason", "") for r in fleet.audit.records)
    assert_converged(fleet.machine, fleet.root)


def test_a_start_systemd_finds_no_file_for_is_retried_after_a_daemon_reload_and_audited(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    ports = fleet.ports()

    def freeze_the_scan(step: str) -> None:
        # The files are written within the tick of systemd's last scan of the unit directory.
        if step.startswith("write "):
            fleet.machine.state["frozen_scan"] = True

    ports.checkpoint = freeze_the_scan
    report = run_pass(fleet.options(), ports)
    assert report.ok, report.stderr
    assert "daemon-reload" not in report.stdout  # not planned
    assert fleet.machine.calls.count(("daemon-reload", "")) == 1
    [reloaded] = [r for r in fleet.audit.records if r["action"] == "daemon-reload"]
    units = ["fabric-nftables.service", "fabric-socat-lux-smb.service", "fabric-socat-qfox-ssh.service"]
    assert reloaded["reason"] == f"systemd found no file for {', '.join(units)} at its start; start queued again"
    starts = {r["unit"]: r["reason"] for r in fleet.audit.records if r["action"] == "start"}
    assert starts == {unit: "new unit (after a daemon-reload: systemd had not seen its file)" for unit in units}
    assert_converged(fleet.machine, fleet.root)


class HeldUnknown(FakeMachine):
    """systemd answers everything but which units it holds."""

    def units_held(self, units: list[str]) -> dict[str, bool]:
        raise ActivationError("systemd's version: org.freedesktop.DBus.Error.NoReply: no reply")


def test_when_systemd_cannot_say_what_it_holds_every_unit_change_reloads(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.machine = HeldUnknown(fleet.root, tmp_path / "machine-unknown.json")
    assert_reloaded_first(fleet)


def test_a_rollback_goes_through_the_same_rule(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    fleet.machine.forget_calls()
    # Generation 2 only adds a unit, whose start fails: undoing it stops and
    # removes that unit, which needs no daemon-reload either.
    unit = add_port_map(fleet, "lux-nfs", 2049)
    fleet.machine.fail[f"start {unit}"] = f"Job for {unit} failed"
    report = fleet.reconcile()
    assert report.outcome == "rolled-back", report.stderr
    assert ("daemon-reload", "") not in fleet.machine.calls
    assert fleet.machine.calls[-1] == ("stop", unit)
    assert not (fleet.root / UNIT_DIR / unit).exists()
    assert_converged(fleet.machine, fleet.root)


def test_units_the_fabric_did_not_write_are_left_alone(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    foreign = fleet.root / UNIT_DIR / "fabric-handmade.service"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("[Service]\nExecStart=/bin/true\n")
    other = fleet.root / UNIT_DIR / "sshd.service"
    other.write_text("[Service]\nExecStart=/usr/sbin/sshd\n")
    assert fleet.reconcile().ok
    fleet.edit_fleet('name = "qfox-ssh"', 'name = "qfox-ssh2"')
    assert fleet.reconcile().ok
    assert foreign.read_text() == "[Service]\nExecStart=/bin/true\n"
    assert other.exists()
    touched = {c[1] for c in fleet.machine.calls if c[1]}
    assert "fabric-handmade.service" not in touched and "sshd.service" not in touched
    assert ("stop", "fabric-socat-qfox-ssh.service") in fleet.machine.calls


def test_failed_validation_writes_nothing(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    before = installed_contents(fleet.root)
    fleet.machine.forget_calls()
    fleet.verifier.fail = "fabric-socat-qfox-ssh.service: Unknown key name 'ExecStrat'"
    fleet.edit_fleet("target_port = 22\n", "target_port = 2022\n")
    report = fleet.reconcile()
    assert report.outcome == "invalid" and report.exit_status == 1
    assert "ExecStrat" in report.stderr[0] and report.stderr[-1] == "pass stopped before installing anything"
    assert installed_contents(fleet.root) == before, "nothing installed, no generation published, no staging left"
    # ...and the failure is what monitoring sees.
    assert "\nfabric_reconcile_success 0.0\n" in (fleet.root / "var/lib/node_exporter/textfile/fabric.prom").read_text()
    assert fleet.machine.calls == []
    assert any(r["action"] == "validate" and r["outcome"] == "failed" for r in fleet.audit.records)


def checked_kinds(machine: FakeMachine) -> list[str]:
    """What the ruleset and Caddy checks were given (nft, caddy), sorted."""
    return sorted(kind for kind, _ in machine.state.get("checked", []))


def test_a_pass_checks_only_what_the_last_good_generation_does_not_have(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    assert checked_kinds(fleet.machine) == ["caddy", "nft"]
    (first,) = fleet.verifier.verified
    assert sorted(Path(p).name for p in first) == ["fabric-nftables.service", "fabric-socat-lux-smb.service", "fabric-socat-qfox-ssh.service"]
    # One port map's target changes: its unit alone is new; the ruleset and Caddy's config are the good generation's.
    fleet.edit_fleet("target_port = 22\n", "target_port = 2022\n")
    fleet.machine.state["checked"] = []
    assert fleet.reconcile().outcome == "applied"
    assert [[Path(p).name for p in units] for units in fleet.verifier.verified[1:]] == [["fabric-socat-qfox-ssh.service"]]
    assert checked_kinds(fleet.machine) == []
    # A port map leaves: no unit to verify (the ruleset changed: it is checked).
    text = (fleet.desired / "fabric.toml").read_text()
    fleet.edit_fleet(text[text.index('[[port_maps]]\nname = "lux-smb"') :], "")
    assert fleet.reconcile().outcome == "applied"
    assert len(fleet.verifier.verified) == 2, "nothing new to verify"
    assert checked_kinds(fleet.machine) == ["nft"]
    assert_converged(fleet.machine, fleet.root)


def test_a_unit_back_to_the_content_of_an_older_generation_is_checked_again(tmp_path: Path) -> None:
    """Only the last good generation stands for what passed the checks."""
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    fleet.edit_fleet("target_port = 22\n", "target_port = 2022\n")
    assert fleet.reconcile().ok
    fleet.edit_fleet("target_port = 2022\n", "target_port = 22\n")
    fleet.verifier.fail = "fabric-socat-qfox-ssh.service: Unknown key name 'ExecStrat'"
    report = fleet.reconcile()
    assert report.outcome == "invalid", report
    assert fleet.store.good() == fleet.store.current() == 2


@pytest.mark.parametrize("check", ["nft-check", "caddy-validate"])
def test_a_ruleset_or_caddy_config_that_does_not_check_stops_the_pass(tmp_path: Path, check: str) -> None:
    fleet = Fleet(tmp_path)
    fleet.machine.fail[check] = f"{check}: syntax error"
    assert fleet.reconcile().outcome == "invalid"
    assert fleet.store.current() is None
    assert not (fleet.root / "etc").exists()


def test_failed_activation_rolls_back_to_the_previous_generation(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    gen1 = {a.path: a.data for a in fleet.store.artifacts(1)}
    fleet.machine.forget_calls()
    # Generation 2 changes one port map, removes another and adds a third;
    # starting the new one fails.
    fleet.edit_fleet("target_port = 22\n", "target_port = 2022\n")
    rename_lux_smb_to_a_failing_lux_nfs(fleet)
    report = fleet.reconcile()
    assert report.outcome == "rolled-back" and report.exit_status == 1
    err = "\n".join(report.stderr)
    assert "fabric-socat-lux-nfs.service" in err and err.endswith("pass failed; generation 1 is active again")
    # Back on generation 1: its files, its units running its settings.
    assert fleet.store.current() == fleet.store.good() == 1
    for path, data in gen1.items():
        assert (fleet.root / path).read_bytes() == data
    assert not (fleet.root / UNIT_DIR / "fabric-socat-lux-nfs.service").exists()
    assert_converged(fleet.machine, fleet.root)
    rollback = [c for c in fleet.machine.calls[fleet.machine.calls.index(("start", "fabric-socat-lux-nfs.service")) + 1 :]]
    assert ("restart", "fabric-socat-qfox-ssh.service") in rollback
    assert ("start", "fabric-socat-lux-smb.service") in rollback
    assert any(r["action"] == "rollback" and r["outcome"] == "ok" for r in fleet.audit.records)
    # Generation 2 stays on disk for inspection, not current.
    assert [g.number for g in list_generations(fleet.store)] == [1, 2]


def test_failed_first_activation_rolls_back_to_nothing(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.machine.fail["caddy-load"] = "caddy: loading config: bad upstream"
    assert fleet.reconcile().outcome == "rolled-back"
    assert fleet.store.current() is None and fleet.store.good() is None
    assert fleet.machine.state["active"] == []
    assert not list((fleet.root / UNIT_DIR).glob("fabric-*"))
    # The table inet fabric was loaded, then replaced by the empty one.
    assert fleet.machine.state["nft"] == sha("table inet fabric\ndelete table inet fabric\n")


def test_rollback_by_hand_and_forward_again(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    fleet.edit_fleet("target_port = 22\n", "target_port = 2022\n")
    assert fleet.reconcile().ok
    assert fleet.store.good() == 2
    applier = Applier(
        LocalTree(fleet.root),
        FlockLock(fleet.root / "var/lib/fabric/lock"),
        fleet.audit,
        FakeClock(T_PASS),
        validators=None,
        activators=Activators(fleet.machine, fleet.machine, fleet.machine),
    )
    fleet.machine.forget_calls()
    number, plan = applier.rollback()
    assert number == 1
    assert plan.restart == ("fabric-socat-qfox-ssh.service",)
    assert fleet.store.current() == fleet.store.good() == 1
    assert_converged(fleet.machine, fleet.root)
    with pytest.raises(ActivationError, match="no generation 9"):
        applier.rollback(9)
    # The next pass renders the desired state again: generation 2's content.
    assert fleet.reconcile().ok
    assert fleet.store.current() == 3
    assert fleet.store.manifest(3).digest == fleet.store.manifest(2).digest  # type: ignore[union-attr]
    assert_converged(fleet.machine, fleet.root)


def test_no_activate_then_activate_starts_what_was_written(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile(no_activate=True).outcome == "written"
    assert fleet.machine.calls == []
    assert fleet.store.current() == 1 and fleet.store.good() is None
    # A second --no-activate pass has nothing to write.
    assert fleet.reconcile(no_activate=True).outcome == "noop"
    assert fleet.store.numbers() == [1]
    # The first activating pass activates generation 1 (no new generation).
    assert fleet.reconcile().ok
    assert fleet.store.numbers() == [1] and fleet.store.good() == 1
    assert_converged(fleet.machine, fleet.root)


def test_units_not_running_after_a_reboot_are_started(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    fleet.machine.reboot()
    fleet.machine.forget_calls()
    assert fleet.reconcile().ok
    started = sorted(c[1] for c in fleet.machine.calls if c[0] == "start")
    assert started == ["fabric-nftables.service", "fabric-socat-lux-smb.service", "fabric-socat-qfox-ssh.service"]
    assert fleet.store.numbers() == [1], "starting units writes no generation"


def test_a_table_flushed_behind_the_fabrics_back_is_loaded_again(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    fleet.machine.state["nft"] = None  # a distro's `flush ruleset`; every unit still runs
    fleet.machine.forget_calls()
    assert fleet.reconcile().ok
    assert fleet.machine.calls == [("nft-load", "")]
    assert fleet.store.numbers() == [1], "reloading the table writes no generation"


def test_a_directory_that_cannot_be_written_fails_the_pass_cleanly(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    (fleet.root / "etc").mkdir(parents=True)
    (fleet.root / "etc" / "rancher").write_text("a file where the k3s directory goes\n")
    report = fleet.reconcile()
    assert report.outcome == "rolled-back"
    err = "\n".join(report.stderr)
    assert "installing the files failed" in err and "Traceback" not in err
    # Rolled back to nothing: no unit of this pass is left installed or started.
    assert not (fleet.root / UNIT_DIR).exists() or not any((fleet.root / UNIT_DIR).iterdir())
    assert not fleet.machine.state["active"]
    assert any(r["action"] == "activate" and r["outcome"] == "failed" for r in fleet.audit.records)


def test_one_pass_at_a_time(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    held = FlockLock(fleet.root / "var/lib/fabric/lock")
    held.acquire()
    try:
        report = fleet.reconcile()
        assert report.outcome == "busy" and report.stderr[0].startswith("fabric reconcile: ")
        assert fleet.store.current() is None
        with pytest.raises(LockBusy, match=f"pid {os.getpid()}"):
            FlockLock(fleet.root / "var/lib/fabric/lock").acquire()
    finally:
        held.release()
    assert fleet.reconcile().ok


def test_old_generations_are_pruned_but_current_and_good_kept(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    for port in range(2100, 2113):
        fleet.edit_fleet(f"listen_port = {2222 if port == 2100 else port - 1}\n", f"listen_port = {port}\n")
        assert fleet.reconcile().ok
    numbers = fleet.store.numbers()
    assert len(numbers) == 10 and numbers[-1] == 13 and fleet.store.good() == 13


def test_bad_desired_state_is_bad_input_and_writes_nothing(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.edit_fleet("listen_port = 2222", "listen_port = 99999")
    report = fleet.reconcile()
    assert report.outcome == "bad-input" and report.exit_status == 2
    assert any("port_maps[0].listen_port" in line for line in report.stderr)
    assert list(fleet.root.iterdir()) == []
    fleet.edit_fleet("listen_port = 99999", "listen_port = 2222")
    report = fleet.reconcile(host="nosuchhost")
    assert report.outcome == "bad-input" and "host 'nosuchhost' is not declared" in report.stderr[0]
    assert list(fleet.root.iterdir()) == []


def test_staging_and_temp_files_of_a_killed_pass_are_swept(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    staging = fleet.root / "var/lib/fabric/generations/.new-2/files"
    staging.mkdir(parents=True)
    temp = fleet.root / UNIT_DIR / ".fabric-socat-qfox-ssh.service.fabric-tmp-12345"
    temp.write_text("half")
    assert fleet.reconcile().ok
    assert not staging.parent.exists() and not temp.exists()
    assert {r["reason"] for r in fleet.audit.records if r["action"] == "sweep"} == {
        "left by a killed pass",
        "temp file left by a killed pass",
    }


def test_local_tree_refuses_paths_outside_the_root(tmp_path: Path) -> None:
    tree = LocalTree(tmp_path)
    for bad in ("/etc/passwd", "../x", "a/../../x", ""):
        with pytest.raises(ValueError):
            tree.write(bad, b"x")
    tree.write("a/b/c", b"data", 0o600)
    assert (tmp_path / "a/b/c").read_bytes() == b"data"
    assert (tmp_path / "a/b/c").stat().st_mode & 0o777 == 0o600


def test_manifest_round_trips(tmp_path: Path) -> None:
    a = Artifact("etc/x.service", "[Service]\n", 0o644, "unit")
    from reconciler.engine.apply import Manifest, manifest_for

    m = manifest_for(4, "2026-11-29T00:00:00+00:00", "racknerd", 7, [a])
    again = Manifest.from_json(m.to_json())
    assert again == m and again.digest == m.digest
    assert json.loads(m.to_json())["artifacts"][0] == {"path": "etc/x.service", "kind": "unit", "mode": "0644", "sha256": a.sha256}


def test_a_plan_file_older_than_the_applied_plan_is_fenced_off(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok  # the golden plan: epoch 7
    old_plan = tmp_path / "old-plan.json"
    old_plan.write_text((GOLDEN / "fleet-plan.json").read_text().replace('"epoch": 7', '"epoch": 6').replace('"node": "x86-spill"', '"node": "lux"'))
    fleet.machine.forget_calls()
    report = fleet.reconcile(plan=PlanFile(old_plan))
    assert report.outcome == "static" and report.exit_status == 0
    assert report.stdout.startswith("plan epoch 6 is older than the newest applied (7): the plan file is older than the plan this host runs")
    assert report.stdout.endswith(": running static; generation 1 stays\n")
    assert fleet.machine.calls == [] and fleet.store.numbers() == [1]
    assert any(r["action"] == "static" for r in fleet.audit.records)
    # fabric plan says the same and shows no actions.
    assert fleet.preview(plan=PlanFile(old_plan)).stdout == report.stdout.replace("; generation 1 stays", "")


def test_caddy_gets_the_main_caddyfile_with_the_snippet_inlined(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    loaded: list[str] = []
    validated: list[str] = []
    fleet.machine.load = lambda text: (loaded.append(text), FakeMachine.load(fleet.machine, text))  # type: ignore[method-assign]
    fleet.machine.validate = validated.append  # type: ignore[method-assign]
    main = fleet.root / "etc/caddy/Caddyfile"
    main.parent.mkdir(parents=True)
    main.write_text("{\n\tadmin localhost:2019\n}\nown.example {\n\trespond ok\n}\nimport /etc/caddy/fabric.caddy  # the fabric's sites\n")
    assert fleet.reconcile().ok
    snippet = (fleet.root / "etc/caddy/fabric.caddy").read_text()
    assert validated == loaded == ["{\n\tadmin localhost:2019\n}\nown.example {\n\trespond ok\n}\n" + snippet]
    assert main.read_text().endswith("import /etc/caddy/fabric.caddy  # the fabric's sites\n"), "the main file is not the fabric's"
    # Without an import of the snippet, the snippet alone is the config.
    main.write_text("own.example {\n\trespond ok\n}\n")
    fleet.edit_fleet('host = "fft.researchstack.info"', 'host = "fft2.researchstack.info"')
    assert fleet.reconcile().ok
    assert loaded[-1] == (fleet.root / "etc/caddy/fabric.caddy").read_text()


def test_generations_and_rollback_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from reconciler.cli import main

    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    fleet.edit_fleet("target_port = 22\n", "target_port = 2022\n")
    assert fleet.reconcile().ok
    capsys.readouterr()
    assert main(["generations", "--root", str(fleet.root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NUMBER", "CREATED", "DIGEST", "FILES", "STATE"]
    assert lines[1].split()[:2] == ["1", "2026-11-18T11:06:40+00:00"] and lines[1].split()[3:] == ["6"]
    assert lines[2].endswith("current, good")
    # By hand, files only: back to generation 1's port map.
    assert main(["rollback", "--root", str(fleet.root), "--no-activate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("wrote the following files:\n  etc/systemd/system/fabric-socat-qfox-ssh.service\n")
    assert out.endswith("generation 1 is installed again\n")
    assert 'TCP4:100.88.57.96:22"' in (fleet.root / UNIT_DIR / "fabric-socat-qfox-ssh.service").read_text()
    assert main(["rollback", "--root", str(fleet.root), "--no-activate", "--to", "7"]) == 1
    assert "no generation 7" in capsys.readouterr().err


def test_a_generation_written_without_checks_is_validated_before_activation(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile(no_activate=True).outcome == "written"
    fleet.verifier.fail = "fabric-socat-qfox-ssh.service: bad setting"
    assert fleet.reconcile().outcome == "invalid"
    assert fleet.machine.calls == [] and fleet.store.good() is None
    assert all("/var/lib/fabric/generations/1/files/" in p for p in fleet.verifier.verified[-1])
    fleet.verifier.fail = None
    assert fleet.reconcile().ok
    assert_converged(fleet.machine, fleet.root)


def test_bad_replay_or_plan_file_is_bad_input_and_writes_nothing(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    report = fleet.reconcile(replay=str(tmp_path / "no-such-capture"))
    assert report.outcome == "bad-input" and report.stderr[0].startswith("fabric: probe: ") and "no-such-capture" in report.stderr[0]
    bad_plan = tmp_path / "plan.json"
    bad_plan.write_text('{"epoch": -1, "leader": "lux", "created": "2026-11-01T00:00:00Z"}')
    report = fleet.reconcile(plan=PlanFile(bad_plan))
    assert report.outcome == "bad-input" and report.stderr[0].startswith(f"fabric: plan: {bad_plan}: epoch:")
    assert list(fleet.root.iterdir()) == []


# --------------------------------------------------------------------------
# The command line end to end: arguments in, exit status and text out (the
# real ports; --no-activate, so nothing outside the sandbox root is touched).


def test_fabric_reconcile_writes_then_does_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = Fleet(tmp_path)
    plan = ["--plan-file", str(GOLDEN / "fleet-plan.json")]
    code, out, _ = fabric(capsys, *cli_pass(fleet, *plan))
    assert code == 0 and out.startswith("wrote the following files:\n")
    assert out.endswith("generation 1 written, not activated (--no-activate)\n")
    assert fabric(capsys, *cli_pass(fleet, *plan))[:2] == (0, "nothing to do (generation 1)\n")
    # The plan of this host alone (--no-registry, epoch 0) passes the same fence
    # as any plan: older than the applied epoch 7, so the generation stays.
    code, out, _ = fabric(capsys, *cli_pass(fleet, "--no-registry"))
    assert (code, out) == (
        0,
        "plan epoch 0 is older than the newest applied (7): this host's own plan does not replace the fleet's: running static; generation 1 stays\n",
    )


def test_fabric_reconcile_runs_its_pass_without_the_cyclic_collector(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """A pass is a short process; the collector would only cost it CPU (reconciler.cli.reconcile)."""
    from reconciler.engine import memoized_pass

    seen: list[bool] = []
    real = memoized_pass.run_memoized_pass

    def noting(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(memoized_pass, "run_memoized_pass", noting)
    fleet = Fleet(tmp_path)
    assert gc.isenabled()
    code, _, _ = fabric(capsys, *cli_pass(fleet, "--plan-file", str(GOLDEN / "fleet-plan.json")))
    assert code == 0 and seen == [False]
    assert gc.isenabled(), "on again for the caller once the pass is over"


def test_fabric_reconcile_exits_2_on_bad_input_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = Fleet(tmp_path)
    bad_plan = tmp_path / "plan.json"
    bad_plan.write_text('{"epoch": -1, "leader": "lux", "created": "2026-11-01T00:00:00Z"}')
    code, out, err = fabric(capsys, *cli_pass(fleet, "--plan-file", str(bad_plan)))
    assert (code, out) == (2, "") and err.startswith(f"fabric: plan: {bad_plan}: epoch:")
    fleet.edit_fleet("listen_port = 2222", "listen_port = 99999")
    code, out, err = fabric(capsys, *cli_pass(fleet, "--plan-file", str(GOLDEN / "fleet-plan.json")))
    assert (code, out) == (2, "") and "port_maps[0].listen_port" in err
    assert list(fleet.root.iterdir()) == []
    # A plan file and --no-registry are two plan sources: argparse refuses both at once.
    with pytest.raises(SystemExit) as exit:
        fabric(capsys, *cli_pass(fleet, "--plan-file", str(bad_plan), "--no-registry"))
    assert exit.value.code == 2


def test_fabric_reconcile_exits_1_when_the_pass_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = Fleet(tmp_path)
    held = FlockLock(fleet.root / "var/lib/fabric/lock")
    held.acquire()
    try:
        code, out, err = fabric(capsys, *cli_pass(fleet, "--plan-file", str(GOLDEN / "fleet-plan.json")))
    finally:
        held.release()
    assert (code, out) == (1, "") and err.splitlines()[-1].startswith("fabric reconcile: ")


def test_a_pass_notes_a_machine_whose_tailnet_name_is_not_the_host_files(tmp_path: Path) -> None:
    """racknerd's pass on lux's hardware (a copied host file, a wrong --host):
    the pass still runs, and says which machine it found."""
    fleet = Fleet(tmp_path)
    report = fleet.reconcile(replay=str(REPO / "tests/fixtures/probe/lux"), no_activate=True)
    assert report.ok
    assert any("'lux.tail-abc123.ts.net'" in note and "tailnet_name 'racknerd.tail-abc123.ts.net'" in note for note in fleet.notes), fleet.notes
    # Its own capture: no such note.
    fleet.notes.clear()
    assert fleet.reconcile(replay=str(REPO / "tests/fixtures/probe/racknerd"), no_activate=True).ok
    assert not any("tailnet name" in note for note in fleet.notes), fleet.notes


def test_a_rollback_whose_own_activation_fails_is_reported_failed_not_rolled_back(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    # Generation 2 renames lux-smb to lux-nfs: lux-smb is stopped, starting
    # lux-nfs fails, and the rollback's start of lux-smb fails as well.
    rename_lux_smb_to_a_failing_lux_nfs(fleet)
    fleet.machine.fail["start fabric-socat-lux-smb.service"] = "Job for fabric-socat-lux-smb.service failed"
    report = fleet.reconcile()
    assert report.outcome == "failed" and report.exit_status == 1
    err = "\n".join(report.stderr)
    assert "activation of generation 2 failed" in err
    assert "rollback to generation 1 failed too" in err and "fabric-socat-lux-smb.service" in err
    assert "active again" not in err and "rolled back" not in err
    assert fleet.store.good() == 1, "generation 2 never became good"
    rollbacks = [r["outcome"] for r in fleet.audit.records if r["action"] == "rollback"]
    assert rollbacks == ["started", "failed"]
    # The failures were one-shot: the next pass converges on what is desired.
    assert fleet.reconcile().ok
    assert_converged(fleet.machine, fleet.root)


def test_a_rollback_that_cannot_write_its_files_is_reported_failed(tmp_path: Path) -> None:
    """The disk fills up between a failed activation and its rollback: the
    pass reports failed (exit 1) with both reasons instead of crashing."""
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    rename_lux_smb_to_a_failing_lux_nfs(fleet)
    full = {"disk": False}

    def checkpoint(step: str) -> None:
        if step == "start fabric-socat-lux-nfs.service":
            full["disk"] = True
        elif full["disk"] and step.startswith(("write ", "remove ")):
            raise OSError(28, "No space left on device")

    ports = dataclasses.replace(fleet.ports(), checkpoint=checkpoint)
    report = run_pass(fleet.options(), ports)
    assert report.outcome == "failed" and report.exit_status == 1
    err = "\n".join(report.stderr)
    assert "activation of generation 2 failed" in err and "rollback to generation 1 failed too" in err and "No space left on device" in err
    assert fleet.store.good() == 1
    # Space again: the next pass converges.
    assert fleet.reconcile().ok
    assert_converged(fleet.machine, fleet.root)
