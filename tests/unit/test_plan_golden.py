"""Golden tests of `fabric plan` over the example fleet (hosts/).

Each step runs the engine's `preview_pass` (what `fabric plan --no-activate`
prints) and `run_pass` (fabric reconcile) against a sandbox root, with the
probe replayed from tests/golden/probe/ and the fleet plan from
tests/golden/fleet-plan.json; the activation ports are FakeMachine
(tests/support/machine.py). The plan text must equal the file in tests/golden/plan/
exactly. --json, a format of the command line, runs the real `fabric plan`. After an intended change of the text, regenerate
them with `UPDATE_GOLDEN=1 pytest tests/unit/test_plan_golden.py` and review
the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.cli import fabric
from tests.support.fleet import GOLDEN, Fleet, cli_pass, fabric_plan

UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


def fabric_plan_asking_systemd(fleet: Fleet, **changes: object) -> str:
    """`fabric plan` on a host whose systemd answers (FakeMachine): which
    units it holds decides the daemon-reload."""
    report = fleet.preview(**changes)
    assert report.outcome == "planned", report.stderr
    return report.stdout


def fabric_plan_cli(fleet: Fleet, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    code, out, _ = fabric(capsys, *cli_pass(fleet, "--plan-file", str(GOLDEN / "fleet-plan.json"), *extra, command="plan"))
    assert code == 0
    return out


def assert_golden(text: str, name: str) -> None:
    path = GOLDEN / "plan" / name
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text(), f"plan text differs from {path}"


@pytest.mark.parametrize("host", ["racknerd", "qfox-1", "a1-arm64", "x86-spill", "lux"])
def test_first_pass_writes_and_starts_everything_then_second_is_a_noop(tmp_path: Path, host: str) -> None:
    fleet = Fleet(tmp_path, host)
    assert_golden(fabric_plan(fleet), f"{host}-first-pass.txt")
    assert fleet.reconcile().ok
    fleet.machine.forget_calls()
    assert fabric_plan(fleet) == "nothing to do\n"
    assert fleet.reconcile().ok
    assert fleet.machine.calls == []


@pytest.mark.parametrize("host", ["racknerd", "qfox-1"])
def test_first_pass_asking_systemd_starts_the_new_units_without_daemon_reload(tmp_path: Path, host: str) -> None:
    fleet = Fleet(tmp_path, host)
    assert_golden(fabric_plan_asking_systemd(fleet), f"{host}-first-pass-systemd-asked.txt")
    report = fleet.reconcile()
    assert report.ok
    assert ("daemon-reload", "") not in fleet.machine.calls and "daemon-reload" not in report.stdout


def test_changing_one_services_command_restarts_exactly_that_unit(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, "qfox-1")
    assert fleet.reconcile().ok
    fleet.machine.forget_calls()
    fleet.edit_fleet(
        'command = { x86_64 = ["/opt/researchstack/bin/lupine-server", "--port", "8701"] }',
        'command = { x86_64 = ["/opt/researchstack/bin/lupine-server", "--port", "8701", "--batch", "4"] }',
    )
    assert_golden(fabric_plan(fleet), "qfox-1-command-changed.txt")
    # systemd holds the running unit: asked, the plan reloads it all the same.
    assert fabric_plan_asking_systemd(fleet) == fabric_plan(fleet)
    assert fleet.reconcile().ok
    assert fleet.machine.calls == [("daemon-reload", ""), ("restart", "fabric-agent-lupine.service")]


def test_removing_a_port_map_stops_and_removes_exactly_that_unit(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, "racknerd")
    assert fleet.reconcile().ok
    fleet.machine.forget_calls()
    text = (fleet.desired / "fabric.toml").read_text()
    fleet.edit_fleet(text[text.index('[[port_maps]]\nname = "lux-smb"') :], "")
    assert_golden(fabric_plan(fleet), "racknerd-port-map-removed.txt")
    # Asked, systemd holds no unit whose file changes: stopped without a reload.
    assert_golden(fabric_plan_asking_systemd(fleet), "racknerd-port-map-removed-systemd-asked.txt")
    report = fleet.reconcile()
    assert report.ok
    units = [c for c in fleet.machine.calls if c[1]]
    assert units == [("stop", "fabric-socat-lux-smb.service")]
    assert ("daemon-reload", "") not in fleet.machine.calls and "daemon-reload" not in report.stdout


def test_description_only_change_rewrites_without_restarting(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, "qfox-1")
    assert fleet.reconcile().ok
    fleet.machine.forget_calls()
    fleet.edit_fleet('description = "FLAC audio FFT: any tier can do it"', 'description = "FLAC audio FFT"')
    assert_golden(fabric_plan(fleet), "qfox-1-description-changed.txt")
    assert fleet.reconcile().ok
    assert fleet.machine.calls == [("daemon-reload", "")]


def test_plan_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = Fleet(tmp_path, "racknerd")
    body = json.loads(fabric_plan_cli(fleet, capsys, "--json"))
    assert body["host"] == "racknerd"
    assert body["start"] == ["fabric-nftables.service", "fabric-socat-lux-smb.service", "fabric-socat-qfox-ssh.service"]
    assert body["caddy_reload"] is True and body["nft_load"] is True and body["daemon_reload"] is True
    assert body["restart"] == [] and body["stop"] == [] and body["remove"] == []
    assert "etc/caddy/fabric.caddy" in body["write"]
    assert body["unfinished_activation"] is False


def test_plan_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = Fleet(tmp_path, "racknerd")
    assert fabric_plan_cli(fleet, capsys) == fabric_plan(fleet)
    assert list(fleet.root.iterdir()) == []


PHAZE_UNITS = ["phaze-api.service", "phaze-worker.service"]
X86_CAP = 'push_host = "x86-spill"\nscratch_dir = "/var/lib/phaze/scratch"\nssh_user = "phaze"\n'


def phaze_control_plane(tmp_path: Path, *, worker_running: bool = True) -> Fleet:
    """lux after its first pass, with phaze's control plane (not rendered by
    the fabric) installed and running."""
    fleet = Fleet(tmp_path, "lux")
    fleet.machine.install_foreign("phaze-api.service", active=True)
    fleet.machine.install_foreign("phaze-worker.service", active=worker_running)
    assert fleet.reconcile().ok
    fleet.machine.forget_calls()
    return fleet


def test_changing_the_lanes_restarts_phazes_control_plane(tmp_path: Path) -> None:
    fleet = phaze_control_plane(tmp_path)
    # The first pass wrote backends.toml: phaze, started without it, was restarted then.
    first = (fleet.root / "etc/phaze/backends.toml").read_text()
    assert 'id = "x86-spill"\nrank = 20\ncap = 4\n' in first
    fleet.edit_fleet("rank = 20\ncap = 4\n", "rank = 20\ncap = 6\n")
    assert_golden(fabric_plan(fleet), "lux-lanes-changed.txt")
    assert fleet.reconcile().ok
    assert fleet.machine.calls == [("restart", unit) for unit in PHAZE_UNITS]
    assert 'id = "x86-spill"\nrank = 20\ncap = 6\n' in (fleet.root / "etc/phaze/backends.toml").read_text()
    restarted = [e for e in fleet.audit.records if e["action"] == "restart"]
    assert {e["unit"]: e["reason"] for e in restarted} == {unit: "etc/phaze/backends.toml changed" for unit in PHAZE_UNITS}
    # A change that leaves the file alone restarts nothing of phaze's.
    fleet.machine.forget_calls()
    fleet.edit_fleet('description = "FLAC audio FFT: any tier can do it"', 'description = "FLAC audio FFT"')
    assert fleet.reconcile().ok
    assert not [c for c in fleet.machine.calls if c[1].startswith("phaze-")]


def test_a_stopped_control_unit_is_not_started_by_a_change_of_the_lanes(tmp_path: Path) -> None:
    fleet = phaze_control_plane(tmp_path, worker_running=False)
    fleet.edit_fleet("rank = 20\ncap = 4\n", "rank = 20\ncap = 6\n")
    assert fleet.reconcile().ok
    assert fleet.machine.calls == [("restart", "phaze-api.service")]


def test_a_rolled_back_generation_restarts_phaze_with_its_own_lanes(tmp_path: Path) -> None:
    fleet = phaze_control_plane(tmp_path)
    before = (fleet.root / "etc/phaze/backends.toml").read_text()
    fleet.edit_fleet("rank = 20\ncap = 4\n", "rank = 20\ncap = 6\n")
    fleet.machine.fail["restart phaze-worker.service"] = "phaze-worker failed to start"
    report = fleet.reconcile()
    assert report.outcome == "rolled-back", report.stderr
    # The old file is back, and phaze read it again.
    assert (fleet.root / "etc/phaze/backends.toml").read_text() == before
    assert fleet.machine.calls == [("restart", unit) for unit in [*PHAZE_UNITS, *PHAZE_UNITS]]


def test_lanes_leaving_the_desired_state_remove_backends_toml_and_restart_phaze(tmp_path: Path) -> None:
    fleet = phaze_control_plane(tmp_path)
    text = (fleet.desired / "fabric.toml").read_text()
    fleet.edit_fleet(text[text.index("# --- Tier 1") : text.index("# Services exercising")], "")
    plan = fabric_plan(fleet)
    assert "would remove the following files:\n  etc/phaze/backends.toml\n" in plan
    assert "would restart the following units:\n  phaze-api.service\n  phaze-worker.service\n" in plan
    assert fleet.reconcile().ok
    assert not (fleet.root / "etc/phaze/backends.toml").exists()
    assert [c for c in fleet.machine.calls if c[1].startswith("phaze-")] == [("restart", unit) for unit in PHAZE_UNITS]
