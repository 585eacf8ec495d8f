"""The package as a wheel, built offline from a clean copy of the checkout, and
a wheelhouse of its dependencies repacked from the test venv's installed
distributions (tests/integration/test_wheel.py installs them into a fresh
virtual environment; tests/integration/test_join.py serves them to join.sh)."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from email.parser import Parser
from pathlib import Path

import pytest

from tests.conftest import REPO, require


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
