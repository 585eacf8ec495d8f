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

import base64
import hashlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterable
from email.parser import Parser
from pathlib import Path

import pytest

from tests.conftest import REPO, require
from tests.support.plan_keys import signed_example_fleet

pytestmark = pytest.mark.integration

PROBES = REPO / "tests" / "fixtures" / "probe"
# The pass order of scripts/demo: a worker heartbeats, the leader schedules
# the fleet, the edge routes to where the services landed.
PASSES = ("qfox-1", "lux", "racknerd")


# --------------------------------------------------------------------------
# Helpers, also used by tests/integration/test_join.py.


def clean_tree(dest: Path) -> Path:
    """The checkout as git would commit it, copied from the work tree."""
    require("git")
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    for rel in sorted({name.decode() for name in listed.split(b"\0") if name}):
        source, target = REPO / rel, dest / rel
        if not source.is_symlink() and not source.exists():
            continue  # deleted in the work tree, not yet in the index
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return dest


def offline_env(**extra: str) -> dict[str, str]:
    """An environment for pip and the installed program: no index, no
    machine pip configuration, nothing of the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", **extra)
    return env


def run(argv: list[str | Path], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=offline_env(**env), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, argv))}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def build_wheel(work: Path) -> Path:
    """fabric_reconciler-*.whl in `work`, built by pip from a clean copy of the checkout, offline."""
    try:
        import setuptools  # noqa: F401
    except ImportError:
        pytest.fail("setuptools missing from the test venv (the test extra of pyproject.toml installs it)")
    source = clean_tree(work / "source")
    out = work / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", out, source], cwd=work)
    (wheel,) = out.glob("fabric_reconciler-*.whl")
    return wheel


def _distribution_key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements(requires: Iterable[str]) -> list[str]:
    """Distribution names of requirement strings, leaving out extras' ones."""
    names = []
    for req in requires:
        if ";" in req and "extra ==" in req.split(";", 1)[1]:
            continue
        names.append(re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0])
    return names


def wheel_requirements(wheel: Path) -> list[str]:
    """The runtime requirements a wheel declares (its METADATA's Requires-Dist)."""
    with zipfile.ZipFile(wheel) as whl:
        (name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(whl.read(name).decode())
    return runtime_requirements(metadata.get_all("Requires-Dist") or [])


def installed_closure(roots: Iterable[str]) -> dict[str, md.Distribution]:
    """These distributions as installed in the test venv, and what they need."""
    seen: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if _distribution_key(name) in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            pytest.fail(f"{name} is a declared dependency but is not installed in the test venv")
        seen[_distribution_key(name)] = dist
        todo += runtime_requirements(dist.requires or [])
    return seen


def repack(dist: md.Distribution, out_dir: Path) -> Path:
    """A wheel of an installed distribution: its files from RECORD and a fresh RECORD."""
    wheel_meta = dist.read_text("WHEEL") or ""
    # Every Tag line, compressed as a wheel's file name carries them
    # (tzdata is py2-none-any and py3-none-any: py2.py3-none-any).
    tags = [line.split(":", 1)[1].strip().split("-") for line in wheel_meta.splitlines() if line.startswith("Tag:")]
    tag = "-".join(".".join(dict.fromkeys(part[i] for part in tags)) for i in range(3))
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    dist_info = f"{name}-{dist.version}.dist-info"
    target = out_dir / f"{name}-{dist.version}-{tag}.whl"
    records = []
    # Stored, not deflated: it is read once, a few directories away.
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as whl:
        for file in dist.files or []:
            rel = str(file)
            if rel.startswith("..") or "__pycache__" in rel or rel.endswith((".pyc", "/RECORD", "/INSTALLER", "/REQUESTED", "/direct_url.json")):
                continue
            data = Path(file.locate()).read_bytes()
            arcname = rel if not rel.split("/", 1)[0].endswith(".dist-info") else f"{dist_info}/{rel.split('/', 1)[1]}"
            whl.writestr(arcname, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{arcname},sha256={digest},{len(data)}")
        records.append(f"{dist_info}/RECORD,,")
        whl.writestr(f"{dist_info}/RECORD", "\n".join(records) + "\n")
    return target


def wheelhouse(requirements: Iterable[str], out_dir: Path) -> Path:
    """Wheels of `requirements` and everything they need, from the test venv, offline."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for dist in installed_closure(requirements).values():
        repack(dist, out_dir)
    return out_dir


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
