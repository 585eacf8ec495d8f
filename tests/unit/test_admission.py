"""`fabric admit` (#31 item 3) in the pure core, its refusals through the
command line (exit 2, nothing written), and the pending machines in
`fabric nodes` and `fabric status` (item 2)."""

from __future__ import annotations

import json
import shutil
import time
import tomllib
from datetime import timedelta
from pathlib import Path

import pytest

from reconciler.adapters.probe_io import CaptureDirectory
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.cli import EXIT_INVALID, EXIT_OK
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import HostConfig, HostFacts
from reconciler.core.install.admission import AdmissionRefused, check_admission, host_file_text, with_leader_candidate
from reconciler.core.live.pending import PendingRecord
from reconciler.core.live.records import NodeRecord
from reconciler.core.probe import RawCapture, facts_from_capture
from reconciler.core.timestamps import from_epoch_seconds
from tests.conftest import REPO
from tests.support.cli import fabric

PROBES = REPO / "tests" / "fixtures" / "probe"
NEW = "newbox"


class WallClock:
    def now(self) -> float:
        return time.time()


def facts(host: str = NEW) -> HostFacts:
    outputs, errors = CaptureDirectory().load(str(PROBES / "radeon-desktop"))
    probed = facts_from_capture(RawCapture(outputs, errors), host=host)
    return probed.model_copy(update={"tailscale_ip": "100.101.9.9", "tailnet_name": f"{host}.tail-abc123.ts.net"})


def stored(host: str = NEW, *, at: float = 1_795_000_000.0, ttl: float = 90) -> PendingRecord:
    moment = from_epoch_seconds(at)
    return PendingRecord(node_id=host, facts=facts(host), first_seen=moment, reported_at=moment, timeout_s=ttl)


# -- the host file ------------------------------------------------------------------------


def test_the_host_file_sets_what_an_operator_declares_and_comments_the_probe() -> None:
    record = stored()
    text = host_file_text(record, ["compute"], admitted_at=record.reported_at)
    config = HostConfig.model_validate(tomllib.loads(text))
    assert (config.host.name, config.host.roles, config.host.address) == (NEW, ["compute"], "100.101.9.9")
    assert config.host.tailnet_name == "newbox.tail-abc123.ts.net"
    probed = record.facts.limitations
    assert config.limits.max_concurrent_tasks == probed.max_concurrent_tasks
    assert config.limits.max_concurrent_ceiling == probed.max_concurrent_ceiling
    assert config.overrides.tier is None, "the tier is probed every pass, never pinned by admission"
    for comment in ("# probed tier: gpu_vaapi", "# probed GPU: amd", "# probed encoders: h264_vaapi", "# probed storage:"):
        assert comment in text, text


def test_limits_are_never_above_the_probe() -> None:
    record = stored()
    for tasks, ceiling in ((1, 1), (3, 2), (7, 20)):
        limited = record.model_copy(
            update={
                "facts": record.facts.model_copy(
                    update={
                        "limitations": record.facts.limitations.model_copy(update={"max_concurrent_tasks": tasks, "max_concurrent_ceiling": ceiling})
                    }
                )
            }
        )
        config = HostConfig.model_validate(tomllib.loads(host_file_text(limited, [], admitted_at=record.reported_at)))
        assert config.limits.max_concurrent_tasks == tasks
        assert config.limits.max_concurrent_ceiling == max(tasks, ceiling)


@pytest.mark.parametrize(
    ("host", "record", "reason"),
    [
        ("New-Box", "live", "is not a valid host name"),
        ("qfox-1", "live", "collides with a declared host"),
        (NEW, None, "no pending report of 'newbox'"),
        (NEW, "expired", "expired"),
        (NEW, "same-address", "collides with host 'qfox-1'"),
    ],
)
def test_admission_is_refused_naming_why(host: str, record: str | None, reason: str) -> None:
    desired = load_desired(REPO / "hosts")
    report = stored(host) if host == NEW else stored(NEW).model_copy(update={"node_id": host}) if record else None
    now = from_epoch_seconds(1_795_000_010.0)
    if record == "expired":
        now = now + timedelta(seconds=200)
    if record == "same-address":
        address = desired.hosts["qfox-1"].host.address
        report = report.model_copy(update={"facts": report.facts.model_copy(update={"tailscale_ip": address})})
    with pytest.raises(AdmissionRefused, match=reason):
        check_admission(desired, host, report if record else None, now)


def test_a_leader_candidate_is_added_to_the_one_line_list() -> None:
    text = (REPO / "hosts" / "fabric.toml").read_text()
    changed = with_leader_candidate(text, NEW)
    assert NEW in tomllib.loads(changed)["fleet"]["leader_candidates"]
    assert changed.replace(f', "{NEW}"', "") == text
    with pytest.raises(AdmissionRefused, match="not a one-line list"):
        with_leader_candidate("[fleet]\nleader_candidates = [\n  'a',\n]\n", NEW)


# -- the command line ----------------------------------------------------------------------


@pytest.fixture
def desired(tmp_path: Path) -> Path:
    directory = tmp_path / "desired"
    shutil.copytree(REPO / "hosts", directory)
    return directory


@pytest.fixture
def registry_path(tmp_path: Path, desired: Path) -> Path:
    fleet = load_desired(desired).fleet
    path = tmp_path / "reg" / "registry.sqlite"
    registry = SqliteRegistry(path, timing=fleet.timing, flap=fleet.flap, clock=WallClock())
    try:
        registry.report_pending(PendingRecord(node_id=NEW, facts=facts()), ttl_s=3600)
        registry.heartbeat(NodeRecord.from_facts("qfox-1", facts("qfox-1").model_copy(update={"tailscale_ip": "100.101.7.21"})), ttl_s=3600)
    finally:
        registry.close()
    return path


def test_fabric_nodes_lists_the_pending_machine_with_its_admission_command(capsys, desired: Path, registry_path: Path) -> None:
    code, out, err = fabric(capsys, "nodes", "--desired", str(desired), "--registry-path", str(registry_path))
    assert code == EXIT_OK, err
    assert "PENDING" in out
    [line] = [line for line in out.splitlines() if line.strip().startswith(NEW)]
    assert "gpu_vaapi" in line and "GPU amd" in line and line.rstrip().endswith("fabric admit newbox")


def test_fabric_nodes_json_is_the_capabilities_document(capsys, desired: Path, registry_path: Path) -> None:
    code, out, err = fabric(capsys, "nodes", "--json", "--desired", str(desired), "--registry-path", str(registry_path))
    assert code == EXIT_OK, err
    nodes = {n["node_id"]: n for n in json.loads(out)["nodes"]}
    assert nodes[NEW]["status"] == "pending" and nodes[NEW]["admit"] == "fabric admit newbox"
    assert nodes["qfox-1"]["status"] == "active" and nodes["qfox-1"]["record"]["node_id"] == "qfox-1"
    for node in nodes.values():
        assert node["hardware"]["gpus"] and node["hardware"]["storage"] and node["hardware"]["ffmpeg"]


def test_fabric_status_lists_the_pending_machine(capsys, desired: Path, registry_path: Path) -> None:
    code, out, err = fabric(capsys, "status", "--desired", str(desired), "--registry-path", str(registry_path))
    assert code == EXIT_OK, err
    assert "PENDING" in out and "fabric admit newbox" in out
    code, out, err = fabric(capsys, "status", "--json", "--desired", str(desired), "--registry-path", str(registry_path))
    [pending] = json.loads(out)["pending"]
    assert (pending["node_id"], pending["tier"], pending["admit"]) == (NEW, "gpu_vaapi", "fabric admit newbox")


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["nobody"], "no pending report of 'nobody'"),
        (["Bad.Name"], "is not a valid host name"),
        (["qfox-1"], "collides with a declared host"),
    ],
)
def test_fabric_admit_refuses_with_exit_2_and_writes_nothing(capsys, desired: Path, registry_path: Path, argv: list[str], reason: str) -> None:
    before = {p: p.read_bytes() for p in desired.rglob("*") if p.is_file()}
    code, out, err = fabric(capsys, "admit", *argv, "--desired", str(desired), "--registry-path", str(registry_path), "--node-config", "/nonexistent")
    assert code == EXIT_INVALID and reason in err and "nothing written" in err, err
    assert {p: p.read_bytes() for p in desired.rglob("*") if p.is_file()} == before


def test_fabric_admit_refuses_a_tree_that_would_not_validate_with_the_new_file(capsys, monkeypatch, desired: Path, registry_path: Path) -> None:
    """The whole tree is validated with the file before it is written: a file
    the rules refuse (here one naming a role no host may have) changes nothing."""
    import reconciler.engine.admit as engine_admit

    before = {p: p.read_bytes() for p in desired.rglob("*") if p.is_file()}
    written = engine_admit.host_file_text
    monkeypatch.setattr(engine_admit, "host_file_text", lambda *a, **k: written(*a, **k).replace('roles = ["compute"]', 'roles = ["wizard"]'))
    code, out, err = fabric(capsys, "admit", NEW, "--desired", str(desired), "--registry-path", str(registry_path), "--node-config", "/nonexistent")
    assert code == EXIT_INVALID and "does not validate" in err and "host.roles" in err, err
    assert {p: p.read_bytes() for p in desired.rglob("*") if p.is_file()} == before


def test_fabric_admit_refuses_when_the_tree_does_not_validate_as_it_is(capsys, desired: Path, registry_path: Path) -> None:
    (desired / "lux.toml").write_text("[host]\nname = 'lux'\n")
    before = {p: p.read_bytes() for p in desired.rglob("*") if p.is_file()}
    code, out, err = fabric(capsys, "admit", NEW, "--desired", str(desired), "--registry-path", str(registry_path), "--node-config", "/nonexistent")
    assert code == EXIT_INVALID and "lux.toml" in err, err
    assert {p: p.read_bytes() for p in desired.rglob("*") if p.is_file()} == before


def test_fabric_status_on_a_pending_machine_says_what_it_waits_for(capsys, monkeypatch, tmp_path: Path, desired: Path, registry_path: Path) -> None:
    import reconciler.cli.status as status_cli

    node_toml = tmp_path / "node.toml"
    node_toml.write_text("[node]\n")
    monkeypatch.setattr(status_cli, "NODE_CONFIG_PATH", str(node_toml))
    monkeypatch.setattr(status_cli.socket, "gethostname", lambda: f"{NEW}.lan")
    code, out, err = fabric(capsys, "status", "--desired", str(desired), "--registry-path", str(registry_path))
    assert code == EXIT_OK, err
    assert f"this machine: {NEW} has no host file: reported pending (probed tier gpu_vaapi)" in out and "`fabric admit newbox`" in out
    # Not reported yet (or its report lapsed): it still says what it waits for.
    monkeypatch.setattr(status_cli.socket, "gethostname", lambda: "joiner")
    code, out, err = fabric(capsys, "status", "--desired", str(desired), "--registry-path", str(registry_path))
    assert "this machine (joiner) has no host file" in out and "`fabric admit joiner`" in out
    # An operator's laptop (no node.toml) is no pending machine.
    monkeypatch.setattr(status_cli, "NODE_CONFIG_PATH", str(tmp_path / "absent.toml"))
    code, out, err = fabric(capsys, "status", "--desired", str(desired), "--registry-path", str(registry_path))
    assert "this machine" not in out
