"""The desired-state loader on the example fleet and on hand-made variations."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from reconciler.core.desired.load import DesiredStateError, load_desired, summary
from reconciler.core.desired.model import IMPLICIT_LOCAL_LANE, FleetConfig, Lane, tier_score
from tests.conftest import EXAMPLE_FLEET, fabric_validate

MINIMAL_FLEET = """
[fleet]
domain = "example.org"
leader_candidates = ["ctl"]
"""
MINIMAL_HOST = """
[host]
name = "ctl"
roles = ["control"]
address = "100.64.0.1"
"""


def _fleet_dir(tmp_path: Path, fleet: str = MINIMAL_FLEET, **hosts: str) -> Path:
    (tmp_path / "fabric.toml").write_text(fleet)
    for name, text in (hosts or {"ctl": MINIMAL_HOST}).items():
        (tmp_path / f"{name}.toml").write_text(text)
    return tmp_path


def test_example_fleet_is_valid_and_matches_the_seeds() -> None:
    state = load_desired(EXAMPLE_FLEET)
    assert sorted(state.hosts) == ["a1-arm64", "lux", "qfox-1", "racknerd", "x86-spill"]
    lanes = {b.id: (b.kind, b.rank, b.cap) for b in state.lanes}
    assert lanes == {"a1-arm64": ("compute", 10, 2), "x86-spill": ("compute", 20, 4), "local": ("local", 99, 1)}
    # A phaze fleet: each compute lane is phaze's agent lane queue (phaze-agent-<agent_ref>-analyze),
    # the local lane the file server agent's own (phaze's LocalBackend dispatches there; no phaze-local).
    assert [state.queue_for(b) for b in state.lanes] == ["phaze-agent-a1-arm64-analyze", "phaze-agent-x86-spill-analyze", "phaze-agent-lux-analyze"]
    timing, flap = state.fleet.timing, state.fleet.flap
    assert (timing.heartbeat_s, timing.node_timeout_s, timing.drain_grace_s) == (30, 90, 300)
    assert (flap.window_s, flap.toggles, flap.hold_off_s) == (300, 3, 600)
    assert timing.node_timeout_for(relayed=True) == 135
    assert state.fleet.registry.backend == "sqlite"
    lupine = state.service("lupine")
    assert lupine is not None and lupine.floor == lupine.min_tier  # hard fail: deferred, never degraded
    vaapi = state.service("vaapi-encode")
    assert vaapi is not None and (vaapi.min_tier, vaapi.floor) == ("gpu_vaapi", "cpu_ffmpeg")
    assert state.hosts_with_role("edge") == ["racknerd"]
    assert state.hosts_with_role("control") == ["lux"]


def test_validate_cli_on_example_fleet_prints_one_line_summary() -> None:
    proc = fabric_validate(EXAMPLE_FLEET)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1
    assert "valid: fleet 'researchstack', 5 hosts, 3 lanes, 4 services, 2 port maps, registry sqlite" in proc.stdout


def test_no_backends_means_one_implicit_local_lane(tmp_path: Path) -> None:
    state = load_desired(_fleet_dir(tmp_path))
    assert state.lanes == [IMPLICIT_LOCAL_LANE]
    assert (IMPLICIT_LOCAL_LANE.kind, IMPLICIT_LOCAL_LANE.rank, IMPLICIT_LOCAL_LANE.cap) == ("local", 99, 1)
    assert "1 lanes (implicit)" in summary(state)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    fleet = (
        MINIMAL_FLEET
        + """
[[backends]]
kind = "local"
id = "local"
rank = 1000
cap = 0
[[services]]
id = "Bad Name"
min_tier = "cpu_ffmpeg"
command = { any = ["/bin/true"] }
"""
    )
    host = MINIMAL_HOST + "bogus = 1\n"
    with pytest.raises(DesiredStateError) as info:
        load_desired(_fleet_dir(tmp_path, fleet, ctl=host))
    paths = [(Path(p.file).name, p.path) for p in info.value.problems]
    assert ("fabric.toml", "backends[0].rank") in paths
    assert ("fabric.toml", "backends[0].cap") in paths
    assert ("fabric.toml", "services[0].id") in paths
    assert ("ctl.toml", "host.bogus") in paths


def test_toml_syntax_error_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(DesiredStateError) as info:
        load_desired(_fleet_dir(tmp_path, MINIMAL_FLEET + "\n[fleet\n"))
    (problem,) = info.value.problems
    assert problem.path.startswith("line ")
    assert "TOML syntax error" in problem.reason


def test_missing_fabric_toml_is_reported(tmp_path: Path) -> None:
    with pytest.raises(DesiredStateError) as info:
        load_desired(tmp_path)
    assert str(info.value).endswith("fabric.toml: (file): not found: a desired-state directory needs fabric.toml")


def test_host_files_may_live_in_a_hosts_subfolder(tmp_path: Path) -> None:
    (tmp_path / "fabric.toml").write_text(MINIMAL_FLEET)
    (tmp_path / "hosts").mkdir()
    (tmp_path / "hosts" / "ctl.toml").write_text(MINIMAL_HOST)
    assert list(load_desired(tmp_path).hosts) == ["ctl"]


def test_validate_exit_2_and_nothing_on_stdout_for_a_bad_state(tmp_path: Path) -> None:
    desired = tmp_path / "d"
    shutil.copytree(EXAMPLE_FLEET, desired)
    (desired / "racknerd.toml").write_text("[host]\nname = 'racknerd'\n")
    proc = fabric_validate(desired)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip() == f"{desired}/racknerd.toml: host.address: required key is missing"


def test_a_host_file_declares_its_tailnet_name_and_the_old_key_still_reads(tmp_path: Path) -> None:
    old = MINIMAL_HOST + 'node_id = "ctl.tail-1.ts.net"\n'
    assert load_desired(_fleet_dir(tmp_path, ctl=old)).hosts["ctl"].host.tailnet_name == "ctl.tail-1.ts.net"
    both = MINIMAL_HOST + 'node_id = "ctl.tail-1.ts.net"\ntailnet_name = "ctl.tail-1.ts.net"\n'
    with pytest.raises(DesiredStateError) as info:
        load_desired(_fleet_dir(tmp_path, ctl=both))
    assert [str(p) for p in info.value.problems] == [f"{tmp_path}/ctl.toml: host.node_id: the old name of tailnet_name: give only tailnet_name"]


def test_tiers_are_ordered_as_in_the_seed() -> None:
    assert tier_score("gpu_cuda") == 10
    assert tier_score("cpu_ffmpeg") == 7
    assert tier_score("relay") == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "compute", "id": "a", "rank": 1, "cap": 1, "push_host": "h", "scratch_dir": "/s"},
        {"kind": "local", "id": "a", "rank": 1, "cap": 1, "ssh_user": "u"},
    ],
)
def test_backend_startup_validators(fields: dict) -> None:
    with pytest.raises(ValueError):
        Lane.model_validate(fields)


def test_models_are_frozen() -> None:
    config = FleetConfig.model_validate({"fleet": {"domain": "example.org", "leader_candidates": ["a"]}})
    with pytest.raises(ValueError):
        config.fleet.domain = "evil.example"  # type: ignore[misc]
