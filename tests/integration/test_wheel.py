"""The package as a user gets it: a wheel built from a clean copy of the
checkout, installed with pip into a fresh virtual environment, runs passes.

A copy of the checkout as git would commit it (tracked files and new ones not
ignored: no .venv, no egg-info, no build/) is built with `pip wheel`, offline:
the build backend is the test venv's own setuptools (`--no-build-isolation`;
the test extra of pyproject.toml installs it). The wheel's declared
dependencies are the test venv's installed distributions repacked as wheels,
so pip resolves them from a local directory (`--no-index`) and a dependency
missing from pyproject.toml would be missing here too. The `reconciler`
package comes only from the wheel: the fresh venv sees nothing of the checkout
or of the test venv, and every command runs from outside the checkout.

Then the example fleet, with an embedded registry: qfox-1 and lux (the
leader, which schedules) and racknerd (the edge) each run one pass from their
recorded probes into a sandbox root, with the wheel's `fabric`. Every
artifact a pass renders must be there (units, nftables, Caddy snippet, k3s
drop-in, status page), and the files under etc/ must be byte for byte what
the checkout's own code renders for the same passes.
"""

from __future__ import annotations

import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support.plan_keys import signed_example_fleet
from tests.support.wheel import build_wheel, run, wheel_requirements, wheelhouse

pytestmark = pytest.mark.integration

PROBES = REPO / "tests" / "fixtures" / "probe"
# The pass order of scripts/demo: a worker heartbeats, the leader schedules
# the fleet, the edge routes to where the services landed.
PASSES = ("qfox-1", "lux", "racknerd")


# --------------------------------------------------------------------------
# The wheel, installed.


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the fresh venv, the wheel it was installed from)."""
    work = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(work)
    deps = wheelhouse(wheel_requirements(wheel), work / "wheelhouse")
    venv = work / "fresh"
    run([sys.executable, "-m", "venv", venv], cwd=work)
    run([venv / "bin" / "python", "-m", "pip", "install", "--no-index", "--find-links", deps, wheel], cwd=work)
    return venv, wheel


def test_the_wheel_carries_the_templates_and_one_version(installed: tuple[Path, Path]) -> None:
    venv, wheel = installed
    with zipfile.ZipFile(wheel) as whl:
        shipped = {n.removeprefix("reconciler/templates/") for n in whl.namelist() if n.startswith("reconciler/templates/")}
    assert {p.name for p in (REPO / "reconciler" / "templates").glob("*.j2")} <= shipped
    # Nothing beside the package: the templates are package data.
    assert not any(n.startswith("templates/") for n in zipfile.ZipFile(wheel).namelist())

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    where = run(
        [
            venv / "bin" / "python",
            "-c",
            "import reconciler, reconciler.core.templating as t; print(reconciler.__file__); print(t.TEMPLATES_DIR); print(reconciler.__version__)",
        ],
        cwd=venv.parent,
    ).stdout.split()
    site = venv.resolve() / "lib"
    assert all(Path(p).is_relative_to(site) for p in where[:2]), where
    assert where[2] == version


def test_the_installed_wheel_reads_its_version_beside_it_without_importlib_metadata(installed: tuple[Path, Path]) -> None:
    """pip puts the package beside its dist-info (as Nix's Python builder
    does): reconciler.__version__ reads that METADATA directly, so a memoized
    pass, whose key holds the version, imports no importlib.metadata."""
    venv, _ = installed
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    code = "import sys, reconciler; print(reconciler.__version__, 'importlib.metadata' in sys.modules)"
    assert run([venv / "bin" / "python", "-c", code], cwd=venv.parent).stdout.split() == [version, "False"]


def _pass(fabric: list[str | Path], host: str, desired: Path, root: Path, registry: Path, plan_key: Path) -> None:
    run(
        [
            *fabric,
            "reconcile",
            "--desired",
            desired,
            "--host",
            host,
            "--root",
            root / host,
            "--no-activate",
            "--registry-path",
            registry,
            "--replay",
            PROBES / host,
            "--plan-key-file",
            plan_key,
        ],
        cwd=root,
    )


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_passes_of_the_example_fleet_render_every_artifact(installed: tuple[Path, Path], tmp_path: Path) -> None:
    venv, _ = installed
    # Throwaway plan keys: the passes of lux and qfox-1 lead, and sign.
    signed = signed_example_fleet(tmp_path)
    desired = signed.desired
    wheel_root, checkout_root = tmp_path / "wheel", tmp_path / "checkout"
    for root in (wheel_root, checkout_root):
        root.mkdir()
    # The same passes with the checkout's own code (the test venv's).
    checkout_fabric: list[str | Path] = [sys.executable, "-m", "reconciler"]
    for host in PASSES:
        key = signed.key_file(host) if host in signed.keys else tmp_path / "no.key"
        _pass([venv / "bin" / "fabric"], host, desired, wheel_root, wheel_root / "registry.sqlite", key)
        _pass(checkout_fabric, host, desired, checkout_root, checkout_root / "registry.sqlite", key)

    racknerd = _files(wheel_root / "racknerd" / "etc")
    for path in (
        "systemd/system/fabric-nftables.service",
        "systemd/system/fabric-socat-qfox-ssh.service",
        "systemd/system/fabric-socat-lux-smb.service",
        "fabric/fabric.nft",
        "caddy/fabric.caddy",
        "rancher/k3s/config.yaml.d/50-fabric-labels.yaml",
    ):
        assert path in racknerd, f"racknerd: {path} not rendered (has {sorted(racknerd)})"
    # The shared includes of the socat unit were found and filled in.
    socat = racknerd["systemd/system/fabric-socat-qfox-ssh.service"].decode()
    assert socat.startswith("# Written by fabric-reconcile") and "\nStartLimitBurst=5\n\n[Service]\n" in socat
    assert "\nRestrictAddressFamilies=AF_INET AF_INET6\n" in socat and "\nUMask=0077\n" in socat
    assert "status." in racknerd["caddy/fabric.caddy"].decode()
    page = (wheel_root / "racknerd" / "var" / "lib" / "fabric" / "status" / "index.html").read_text()
    assert page.startswith("<!doctype html>") and "fabric status" in page

    # phaze's lanes on the control host (a template of their own).
    backends = _files(wheel_root / "lux" / "etc")["phaze/backends.toml"].decode()
    assert backends.startswith("# Written by fabric-reconcile") and 'id = "x86-spill"' in backends
    # The agent template on qfox-1, where services are placed (lux runs no agent:
    # its local lane is phaze's own).
    units = [p for p in _files(wheel_root / "qfox-1" / "etc") if p.startswith("systemd/system/fabric-agent-")]
    assert units, "qfox-1: no agent unit rendered"
    agent = (wheel_root / "qfox-1" / "etc" / units[0]).read_text()
    assert "\n[Service]\n" in agent and "\n[Install]\nWantedBy=multi-user.target\n" in agent

    for host in PASSES:
        assert _files(wheel_root / host / "etc") == _files(checkout_root / host / "etc"), host
