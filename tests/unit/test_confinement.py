"""Paths a commit hands to units are confined by the host, not by the commit
(reconciler.core.desired.confinement): a host's node.toml names the prefixes
its units' paths may lie under; `fabric validate` and every pass check them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from reconciler.core.desired.confinement import DEFAULT_ALLOWED_PREFIXES, confinement_problems, unit_paths
from reconciler.core.desired.load import load_desired
from tests.conftest import EXAMPLE_FLEET, fabric_validate
from tests.support.cli import fabric


@pytest.fixture
def desired(tmp_path: Path) -> Path:
    tree = tmp_path / "desired"
    shutil.copytree(EXAMPLE_FLEET, tree)
    return tree


def _moved(tree: Path, old: str, new: str) -> None:
    fleet = tree / "fabric.toml"
    text = fleet.read_text()
    assert old in text
    fleet.write_text(text.replace(old, new))


def test_the_example_fleet_hands_units_only_paths_under_the_default_prefixes() -> None:
    desired = load_desired(EXAMPLE_FLEET)
    paths = dict(unit_paths(desired))
    assert paths["backends[0].scratch_dir"] == "/var/lib/phaze/scratch"
    assert paths["services[3].credentials.api_token"] == "/run/secrets/braid/api_token"
    assert confinement_problems(desired, DEFAULT_ALLOWED_PREFIXES) == []


def test_a_scratch_dir_outside_the_allowed_prefixes_is_refused_by_validate(desired: Path) -> None:
    _moved(desired, 'scratch_dir = "/var/lib/phaze/scratch"', 'scratch_dir = "/home/phaze/scratch"')
    proc = fabric_validate(desired)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"{desired}/fabric.toml: backends[0].scratch_dir: '/home/phaze/scratch' is outside the prefixes a host allows" in proc.stderr


def test_a_node_toml_may_widen_the_prefixes_for_its_host(desired: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _moved(desired, 'credentials = { api_token = "/run/secrets/braid/api_token" }', 'credentials = { api_token = "/opt/braid/token" }')
    code, _, err = fabric(capsys, "validate", "--desired", str(desired))
    assert code == 2 and "services[3].credentials.api_token: '/opt/braid/token' is outside" in err
    node = tmp_path / "node.toml"
    node.write_text(
        '[node]\nallowed_path_prefixes = ["/run/secrets", "/var/lib/phaze", "/srv", "/opt/braid"]\n'
    )  # /srv: the wasm hook's working directory
    code, out, err = fabric(capsys, "validate", "--desired", str(desired), "--config", str(node))
    assert (code, err) == (0, ""), err
    assert "valid" in out


def test_a_pass_checks_against_its_own_node_toml_and_changes_nothing(desired: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    (root / "etc" / "fabric").mkdir(parents=True)
    (root / "etc" / "fabric" / "node.toml").write_text('[node]\nallowed_path_prefixes = ["/srv"]\n')
    golden = Path(__file__).resolve().parents[1] / "golden"
    argv = ["reconcile", "--desired", str(desired), "--host", "a1-arm64", "--root", str(root), "--no-activate"]
    argv += ["--replay", str(golden / "probe" / "x86_64"), "--plan-file", str(golden / "fleet-plan.json")]
    code, _, err = fabric(capsys, *argv)
    assert code == 2
    assert f"{desired}/fabric.toml: backends[0].scratch_dir: '/var/lib/phaze/scratch' is outside the prefixes a host allows" in err
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == ["etc", "etc/fabric", "etc/fabric/node.toml"]
    # The defaults (no node.toml) allow the example fleet's paths.
    (root / "etc" / "fabric" / "node.toml").unlink()
    code, _, err = fabric(capsys, *argv)
    assert code == 0, err


def test_another_hosts_lanes_are_not_this_hosts_concern(desired: Path) -> None:
    """A pass checks the paths of the units it may render: its own lanes' agents and every service."""
    state = load_desired(desired)
    keys = {key for key, _ in unit_paths(state, "lux")}
    assert not any(key.startswith("backends[") for key in keys)
    assert any(key.startswith("backends[0]") for key, _ in unit_paths(state, "a1-arm64"))
