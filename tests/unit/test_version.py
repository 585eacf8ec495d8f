"""reconciler.__version__: written in pyproject.toml only, read from the installed metadata or that file, cheaply.

The checkout's own package (an editable install's too: its metadata is
elsewhere) reads the version from the pyproject.toml beside it. An installed wheel's layout, the
package beside its dist-info as pip and Nix's Python builder leave it, is
made here: a site directory holding a link to the checkout's package and a
dist-info of a version of its own. The wheel that pip really installs is
tests/integration/test_wheel.py's.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import reconciler
from tests.conftest import REPO
from tests.support.memo_sandbox import Sandbox, memoized

INSTALLED = "9.8.7"


def installed_layout(tmp_path: Path, version: str = INSTALLED) -> Path:
    """site/reconciler (the checkout's package) beside site/fabric_reconciler-VERSION.dist-info."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "reconciler").symlink_to(REPO / "reconciler")
    dist_info = site / f"fabric_reconciler-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: fabric-reconciler\nVersion: {version}\nSummary: fabric\n\nVersion: not a header\n"
    )
    return site


def python(site: Path | None, code: str, cwd: Path) -> str:
    """`code` in a fresh interpreter whose `reconciler` is site's (None: the checkout's), run in `cwd`; its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_reconciler_reads_no_version() -> None:
    code = "import sys, reconciler; print('importlib.metadata' in sys.modules, '__version__' in vars(reconciler))"
    assert python(None, code, REPO) == "False False\n"


def test_an_installed_package_reads_the_version_beside_it_without_importlib_metadata(tmp_path: Path) -> None:
    site = installed_layout(tmp_path)
    code = "import sys, reconciler; print(reconciler.__file__); print(reconciler.__version__, 'importlib.metadata' in sys.modules)"
    assert python(site, code, tmp_path).splitlines() == [str(site / "reconciler" / "__init__.py"), f"{INSTALLED} False"]


PYPROJECT = """[build-system]
requires = ["setuptools>=68"]

[project]
name = "{name}"
version = "{version}"
dependencies = [
  "pydantic>=2.5",
  # version = "0.0.0" in a comment
]

[tool.other]
version = "7.7.7"
"""


def test_a_source_tree_reads_the_version_from_its_pyproject_without_importlib_metadata(tmp_path: Path) -> None:
    """The checkout as it runs (the bench, a development host): the file the version is written in."""
    import tomllib

    written = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    code = "import sys, reconciler; print(reconciler.__version__, 'importlib.metadata' in sys.modules)"
    assert python(None, code, REPO) == f"{written} False\n"
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "reconciler").symlink_to(REPO / "reconciler")
    (tree / "pyproject.toml").write_text(PYPROJECT.format(name="fabric-reconciler", version="4.5.6"))
    assert python(tree, code, tmp_path) == "4.5.6 False\n"


@pytest.mark.parametrize(
    "pyproject",
    [
        PYPROJECT.format(name="another-project", version="4.5.6"),  # not this distribution's
        PYPROJECT.format(name="fabric-reconciler", version="4.5.6").replace('version = "4.5.6"', "version = '4.5.6'  # odd"),  # a form not scanned
        PYPROJECT.format(name="fabric-reconciler", version="4.5.6").replace('version = "4.5.6"\n', ""),  # dynamic
    ],
)
def test_a_pyproject_of_another_distribution_or_form_leaves_the_version_to_importlib_metadata(tmp_path: Path, pyproject: str) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "reconciler").symlink_to(REPO / "reconciler")
    (tree / "pyproject.toml").write_text(pyproject)
    code = "import reconciler, importlib.metadata; print(reconciler.__version__ == importlib.metadata.version('fabric-reconciler'))"
    assert python(tree, code, tmp_path) == "True\n"


def test_without_one_dist_info_beside_the_package_the_version_is_importlib_metadatas(tmp_path: Path) -> None:
    """Two versions' metadata beside the package (and no pyproject.toml)."""
    assert reconciler.__version__ == importlib.metadata.version("fabric-reconciler")
    site = installed_layout(tmp_path)
    (site / "fabric_reconciler-0.0.1.dist-info").mkdir()
    code = "import reconciler, importlib.metadata; print(reconciler.__version__ == importlib.metadata.version('fabric-reconciler'))"
    assert python(site, code, tmp_path) == "True\n"


def test_a_memoized_pass_of_an_installed_package_imports_no_importlib_metadata(tmp_path: Path) -> None:
    """The memo's key holds the version (a new version: a full pass); an
    installed package reads it without importlib.metadata, so a memo hit
    imports none. (A full pass does: pydantic's plugin loader imports it with
    the first model.)"""
    site = installed_layout(tmp_path)
    s = Sandbox(tmp_path, host="racknerd")
    code = (
        "import sys\n"
        "from reconciler.cli import main\n"
        f"code = main({s.argv()!r})\n"
        "print('IMPORTED', 'importlib.metadata' in sys.modules)\n"
        "sys.exit(code)\n"
    )
    first = python(site, code, tmp_path)
    assert "generation 1 written" in first, first
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert second.returncode == 0 and memoized(second.stderr), second.stderr
    assert second.stdout == "nothing to do (generation 1)\nIMPORTED False\n"
    # Another version installed (pip's upgrade, a new Nix store path): the memo no longer stands for the pass.
    old = site / f"fabric_reconciler-{INSTALLED}.dist-info"
    new = old.rename(site / "fabric_reconciler-9.8.8.dist-info")
    (new / "METADATA").write_text((new / "METADATA").read_text().replace(INSTALLED, "9.8.8"))
    third = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert third.returncode == 0 and not memoized(third.stderr), third.stderr
