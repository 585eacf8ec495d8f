"""`fabric status` end to end through the CLI: inputs, exit statuses, --json, --watch."""

from __future__ import annotations

import io
import json
import shutil
import time
from pathlib import Path

import pytest

from reconciler.cli import EXIT_INVALID, EXIT_OK, main
from reconciler.cli import status as status_cli
from tests.conftest import EXAMPLE_FLEET, REPO
from tests.support.cli import fabric

FIXTURES = REPO / "tests" / "fixtures" / "status"
SNAPSHOT = FIXTURES / "snapshot.json"
PLAN = FIXTURES / "plan.json"


def fabric_status(capsys, *args: str, desired: Path = EXAMPLE_FLEET) -> tuple[int, str, str]:
    return fabric(capsys, "status", "--desired", str(desired), *args)


def test_saved_snapshot_shows_cards_nodes_and_the_schedulers_plan(capsys):
    code, out, err = fabric_status(capsys, "--snapshot", str(SNAPSHOT))

    assert (code, err) == (EXIT_OK, "")
    assert (
        "● COMPUTE · a1-arm64  RANK 10  1/2  full: host a1-arm64 at capacity\n○ COMPUTE · x86-spill  RANK 20  0/4  offline: host x86-spill held off until 18:38:20 (flapping)\n○ LOCAL · local  RANK 99  0/1  offline: host lux drained\n"
        in out
    )
    # The scheduler ran over the snapshot: its deferrals are shown, split.
    assert "DEFERRED · waiting for capacity (1)\n  flac-fft#1  " in out
    assert "DEFERRED · inadmissible (1)\n  lupine#0  " in out
    # Not a terminal: no colour.
    assert "\x1b" not in out


def test_saved_plan_is_shown_instead_of_scheduling(capsys, tmp_path):
    plan = json.loads(PLAN.read_text())
    plan["epoch"] = 41
    plan["deferred"] = []
    saved = tmp_path / "plan.json"
    saved.write_text(json.dumps(plan))

    code, out, _ = fabric_status(capsys, "--snapshot", str(SNAPSHOT), "--plan", str(saved))

    assert code == EXIT_OK
    assert "plan epoch 41" in out
    assert "DEFERRED · inadmissible (0)\n  (none)" in out


def test_json_is_one_document_for_scripts(capsys):
    code, out, _ = fabric_status(capsys, "--snapshot", str(SNAPSHOT), "--plan", str(PLAN), "--json")

    doc = json.loads(out)
    assert code == EXIT_OK
    assert [lane["card"] for lane in doc["lanes"]] == [
        "COMPUTE · a1-arm64  RANK 10  1/2  full: host a1-arm64 at capacity",
        "COMPUTE · x86-spill  RANK 20  0/4  offline: host x86-spill held off until 18:38:20 (flapping)",
        "LOCAL · local  RANK 99  0/1  offline: host lux drained",
    ]
    assert (doc["leader"], doc["epoch"]) == ("lux", 7)


def test_a_bad_snapshot_names_file_key_path_and_reason(capsys, tmp_path):
    bad = tmp_path / "snap.json"
    bad.write_text(json.dumps({"nodes": [{"node_id": "lux", "tier": "quantum"}]}))

    code, out, err = fabric_status(capsys, "--snapshot", str(bad))

    assert (code, out) == (EXIT_INVALID, "")
    assert err.startswith(f"{bad}: nodes[0].tier: Input should be 'gpu_cuda'")


def test_a_missing_snapshot_file_is_bad_input(capsys, tmp_path):
    code, _, err = fabric_status(capsys, "--snapshot", str(tmp_path / "absent.json"))

    assert code == EXIT_INVALID
    assert err == f"{tmp_path / 'absent.json'}: (file): No such file or directory\n"


def test_invalid_desired_state_is_reported_and_exits_2(capsys, tmp_path):
    shutil.copytree(EXAMPLE_FLEET, tmp_path / "fleet")
    fleet = tmp_path / "fleet" / "fabric.toml"
    fleet.write_text(fleet.read_text().replace("cap = 4", "cap = 0"))

    code = main(["status", "--desired", str(tmp_path / "fleet"), "--snapshot", str(SNAPSHOT)])
    out, err = capsys.readouterr()

    assert (code, out) == (EXIT_INVALID, "")
    assert "fabric.toml: backends[1].cap:" in err


def test_plan_without_snapshot_is_refused(capsys):
    code, _, err = fabric_status(capsys, "--plan", str(PLAN))

    assert code == EXIT_INVALID
    assert "--plan needs --snapshot" in err


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_watch_interval_must_be_a_positive_number(capsys, value):
    with pytest.raises(SystemExit) as exit:
        main(["status", "--snapshot", str(SNAPSHOT), "--watch", value])
    assert exit.value.code == 2
    assert "--watch" in capsys.readouterr().err


# --------------------------------------------------------------------------
# --watch


class Interrupt:
    """A sleep that lets `frames` frames be drawn, then is Ctrl-C'd."""

    def __init__(self, frames: int, between=lambda: None) -> None:
        self.frames = frames
        self.between = between
        self.slept: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)
        if len(self.slept) >= self.frames:
            raise KeyboardInterrupt
        self.between()


def test_watch_redraws_in_place_and_ctrl_c_is_a_clean_exit():
    out = io.StringIO()
    frames = iter(["one\n", "two\n", "three\n"])
    sleep = Interrupt(frames=3)

    code = status_cli.watch(lambda: next(frames), interval=2.0, out=out, sleep=sleep, clear=True)

    assert code == EXIT_OK
    assert sleep.slept == [2.0, 2.0, 2.0]
    clear = status_cli.CLEAR_SCREEN
    assert out.getvalue() == f"{clear}one\n{clear}two\n{clear}three\n\n"


def test_watch_off_a_terminal_appends_frames_without_clearing():
    out = io.StringIO()
    frames = iter(["one\n", "two\n"])

    code = status_cli.watch(lambda: next(frames), interval=1.0, out=out, sleep=Interrupt(frames=2), clear=False, between="\n")

    assert code == EXIT_OK
    assert out.getvalue() == "one\n\ntwo\n"


def test_watch_json_rereads_the_snapshot_each_refresh(capsys, tmp_path, monkeypatch):
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_text(SNAPSHOT.read_text())

    def lux_undrained() -> None:
        doc = json.loads(snapshot.read_text())
        for node in doc["nodes"]:
            node["drained"] = False
        snapshot.write_text(json.dumps(doc))

    sleep = Interrupt(frames=2, between=lux_undrained)
    monkeypatch.setattr(time, "sleep", sleep)

    code, out, _ = fabric_status(capsys, "--snapshot", str(snapshot), "--plan", str(PLAN), "--json", "--watch", "5")

    # One JSON document per line, one line per refresh.
    first, second = (json.loads(line) for line in out.splitlines())
    assert code == EXIT_OK
    assert sleep.slept == [5.0, 5.0]
    assert [n["node"] for n in first["nodes"] if n["draining"]] == ["lux"]
    assert [n["node"] for n in second["nodes"] if n["draining"]] == []


def test_watch_without_plan_follows_the_snapshot(capsys, tmp_path, monkeypatch):
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_text(SNAPSHOT.read_text())

    def lane_comes_back() -> None:
        # x86-spill's hold-off is lifted: its lane is back.
        doc = json.loads(snapshot.read_text())
        for node in doc["nodes"]:
            node.pop("held_off_until", None)
        snapshot.write_text(json.dumps(doc))

    monkeypatch.setattr(time, "sleep", Interrupt(frames=2, between=lane_comes_back))

    code, out, _ = fabric_status(capsys, "--snapshot", str(snapshot), "--watch")

    first, second = out.split("\n\nresearchstack")
    assert code == EXIT_OK
    assert "○ COMPUTE · x86-spill  RANK 20  0/4  offline: host x86-spill held off until 18:38:20 (flapping)" in first
    assert "● COMPUTE · x86-spill  RANK 20  0/4\n" in second


def test_bad_input_mid_watch_is_shown_and_watching_goes_on(capsys, tmp_path, monkeypatch):
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_text(SNAPSHOT.read_text())
    monkeypatch.setattr(time, "sleep", Interrupt(frames=2, between=lambda: snapshot.write_text("{not json")))

    code, out, _ = fabric_status(capsys, "--snapshot", str(snapshot), "--watch", "1")

    assert code == EXIT_OK
    assert out.rstrip().splitlines()[-2:] == [
        "fabric status: cannot read the inputs:",
        f"{snapshot}: (top level): Invalid JSON: key must be a string at line 1 column 2",
    ]


# --------------------------------------------------------------------------
# The live registry (the embedded sqlite backend, a file in tmp)


def test_live_registry_nodes_lanes_leader_and_published_plan(capsys, tmp_path, signed_fleet):
    from reconciler.core.desired.load import load_desired
    from reconciler.core.live.models import FleetPlan
    from reconciler.core.live.records import NodeRecord
    from reconciler.core.scheduling.placement import schedule
    from reconciler.engine.leader import plan_in_term, sign_plan, signing_key
    from reconciler.wiring import open_registry

    # lux signs what it publishes (throwaway keys: tests.support.plan_keys).
    desired = load_desired(signed_fleet.desired)
    signer = signed_fleet.signer("lux")
    path = tmp_path / "registry.sqlite"
    registry = open_registry(desired.fleet, sqlite_path=path)
    try:
        registry.heartbeat(NodeRecord(node_id="a1-arm64", tier="cpu_ffmpeg", arch="aarch64", max_concurrent_tasks=2))
        registry.heartbeat(NodeRecord(node_id="lux", tier="cpu_ffmpeg", arch="x86_64", max_concurrent_tasks=2))
        leadership = registry.campaign("lux", ttl_s=60)
        assert leadership is not None
        plan = schedule(registry.snapshot([lane.id for lane in desired.lanes]), desired, leader="lux", epoch=registry.epoch() + 1)
        published: FleetPlan = registry.publish_plan(
            leadership, sign_plan(plan_in_term(plan, leadership, desired), signer, signing_key(signer, desired.fleet.plan_keys, "lux"))
        )
    finally:
        registry.close()

    code, out, err = fabric_status(capsys, "--registry-path", str(path), "--json", desired=signed_fleet.desired)

    doc = json.loads(out)
    assert (code, err) == (EXIT_OK, "")
    assert [lane["card"] for lane in doc["lanes"]] == [
        # The plan fills the free a1-arm64 (limit 2) with services first: no room left
        # for its lane; lux (owned) takes the rest and keeps room for the local lane.
        "COMPUTE · a1-arm64  RANK 10  0/2  full: host a1-arm64 at capacity",
        "COMPUTE · x86-spill  RANK 20  0/4  offline: host x86-spill not reporting",
        "LOCAL · local  RANK 99  0/1",
    ]
    offline = next(lane for lane in doc["lanes"] if lane["id"] == "x86-spill")
    assert (offline["available"], offline["reason"]) == (False, "host x86-spill not reporting")
    assert {n["node"]: n["status"] for n in doc["nodes"]} == {
        "a1-arm64": "active",
        "lux": "active",
        "qfox-1": "not_reporting",
        "racknerd": "not_reporting",
        "x86-spill": "not_reporting",
    }
    assert (doc["leader"], doc["epoch"], doc["plan_refused"]) == ("lux", published.epoch, None)
    assert [d["service"] for d in doc["deferred"]["inadmissible"]] == ["lupine"]


def test_a_missing_sqlite_registry_is_not_created_by_looking(capsys, tmp_path):
    path = tmp_path / "registry.sqlite"

    code, out, err = fabric_status(capsys, "--registry-path", str(path))

    assert (code, out) == (1, "")
    assert err == f"fabric status: registry: {path}: no such registry (has any host joined?)\n"
    assert not path.exists()


def test_registry_path_and_snapshot_exclude_each_other(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit:
        main(["status", "--registry-path", str(tmp_path / "r.sqlite"), "--snapshot", str(SNAPSHOT)])
    assert exit.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_offline_card_is_greyed(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    monkeypatch.delenv("NO_COLOR", raising=False)

    code = main(["status", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(SNAPSHOT)])

    assert code == EXIT_OK
    assert "\x1b[90m○ COMPUTE · x86-spill  RANK 20  0/4  offline: host x86-spill held off until 18:38:20 (flapping)\x1b[0m\n" in terminal.getvalue()
    assert "\x1b[90m○ LOCAL · local  RANK 99  0/1  offline: host lux drained\x1b[0m\n" in terminal.getvalue()
    assert terminal.getvalue().count("\x1b[90m") == 2


def test_no_color_keeps_a_terminal_plain(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    monkeypatch.setenv("NO_COLOR", "1")

    main(["status", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(SNAPSHOT)])

    assert "\x1b" not in terminal.getvalue()


def test_watch_on_a_terminal_clears_and_redraws(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    monkeypatch.setattr(time, "sleep", Interrupt(frames=2))

    code = main(["status", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(SNAPSHOT), "--watch"])

    assert code == EXIT_OK
    assert terminal.getvalue().count(status_cli.CLEAR_SCREEN) == 2
    assert terminal.getvalue().startswith(status_cli.CLEAR_SCREEN + "researchstack · leader lux")


def test_a_forged_plan_in_the_registry_shows_as_refused(capsys, tmp_path, signed_fleet):
    """An unsigned plan naming lux (what any registry client could write):
    `fabric status` leaves its placements out and says why, in text and JSON."""
    from reconciler.core.desired.load import load_desired
    from reconciler.core.live.records import NodeRecord
    from reconciler.core.scheduling.placement import schedule
    from reconciler.wiring import open_registry

    desired = load_desired(signed_fleet.desired)
    path = tmp_path / "registry.sqlite"
    registry = open_registry(desired.fleet, sqlite_path=path)
    try:
        registry.heartbeat(NodeRecord(node_id="lux", tier="cpu_ffmpeg", arch="x86_64", max_concurrent_tasks=2))
        leadership = registry.campaign("lux", ttl_s=60)
        assert leadership is not None
        forged = schedule(registry.snapshot([lane.id for lane in desired.lanes]), desired, leader="lux", epoch=registry.epoch() + 1)
        registry.publish_plan(leadership, forged)  # no signature
    finally:
        registry.close()

    code, out, err = fabric_status(capsys, "--registry-path", str(path), "--json", desired=signed_fleet.desired)
    doc = json.loads(out)
    assert (code, err) == (EXIT_OK, "")
    assert doc["plan_refused"] is not None and "not signed" in doc["plan_refused"]
    code, out, _ = fabric_status(capsys, "--registry-path", str(path), desired=signed_fleet.desired)
    assert code == EXIT_OK and "PLAN REFUSED" in out and "not signed" in out
