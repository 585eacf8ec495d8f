"""`systemd-analyze security --offline=true` on every unit the fabric installs:
its own (fabric units) and the ones a pass renders (the example fleet's
golden renders, which tests/unit/test_render.py keeps equal to render()).

The figures are systemd's exposure scores (0 safest, 10 unsafe). Targets:
the watcher, the leader and fabric-nftables.service at 4.0 or below; the pass
as low as activation allows (PASS_HARDENING says what keeps it where it is);
every rendered service unit at 4.0 or below.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, require

pytestmark = pytest.mark.integration

GOLDEN_RENDER = REPO / "tests" / "golden" / "render"
DAEMON_TARGET = 4.0
PASS_TARGET = 3.0
RENDERED_TARGET = 4.0


def exposure(unit: Path) -> float:
    done = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)], capture_output=True, text=True, timeout=120)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d)", done.stdout)
    assert match, f"{unit}: {done.stdout[-500:]}\n{done.stderr}"
    return float(match.group(1))


@pytest.fixture(scope="module")
def own_units(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require("systemd-analyze")
    directory = tmp_path_factory.mktemp("units")
    node = directory / "node.toml"
    node.write_text('[node]\nhost = "lux"\n[source]\nremote = "/srv/fleet.git"\nallowed_signers_file = "/etc/fabric/allowed_signers"\n')
    out = directory / "written"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "reconciler",
            "units",
            "--config",
            str(node),
            "--fabric-bin",
            "/usr/bin/true",
            "--leader-candidate",
            "--write",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return {path.name: path for path in out.glob("*.service")}


@pytest.mark.parametrize("name", ["fabric-watch.service", "fabric-leader.service"])
def test_the_watcher_and_the_leader_expose_little(own_units: dict[str, Path], name: str) -> None:
    score = exposure(own_units[name])
    print(f"{name}: {score}")
    assert score <= DAEMON_TARGET


def test_the_pass_exposes_only_what_activation_needs(own_units: dict[str, Path]) -> None:
    score = exposure(own_units["fabric-reconcile.service"])
    print(f"fabric-reconcile.service: {score}")
    assert score <= PASS_TARGET


RENDERED = sorted(GOLDEN_RENDER.glob("*/etc/systemd/system/*.service"))


@pytest.mark.parametrize("unit", RENDERED, ids=[f"{u.parts[-5]}/{u.name}" for u in RENDERED])
def test_every_rendered_service_unit_exposes_little(unit: Path) -> None:
    require("systemd-analyze")
    score = exposure(unit)
    print(f"{unit.parts[-5]}/{unit.name}: {score}")
    assert score <= RENDERED_TARGET
