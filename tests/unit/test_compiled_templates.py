"""The package's templates kept compiled in the state directory between
passes (reconciler.adapters.compiled_templates), written only by a pass whose
inputs all checked out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from reconciler.adapters.compiled_templates import CompiledTemplates, cache_directory
from reconciler.core.templating import PACKAGED, Templates, environment
from tests.support.cli import fabric

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
STATE = "var/lib/fabric"


def pass_argv(desired: Path, root: Path, host: str, plan: Path) -> list[str]:
    return [
        "reconcile",
        "--desired",
        str(desired),
        "--host",
        host,
        "--root",
        str(root),
        "--replay",
        str(GOLDEN / "probe" / "x86_64"),
        "--plan-file",
        str(plan),
        "--no-activate",
    ]


def entries(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.iterdir()} if directory.is_dir() else {}


def test_a_pass_keeps_its_compiled_templates_and_the_next_loads_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    desired = tmp_path / "desired"
    shutil.copytree(REPO / "hosts", desired)
    root = tmp_path / "root"
    argv = pass_argv(desired, root, "racknerd", GOLDEN / "fleet-plan.json")
    code, _, err = fabric(capsys, *argv)
    assert code == 0, err
    kept = entries(cache_directory(root, STATE))
    # racknerd's units, nftables, the Caddyfile, the status page (and what they include).
    assert len(kept) >= 5
    # A full pass again (memo dropped) compiles nothing: it loads every template kept, rewrites none.
    (root / STATE / "pass-memo.json").unlink()
    code, _, err = fabric(capsys, *argv)
    assert code == 0, err
    assert entries(cache_directory(root, STATE)) == kept


def test_compiling_writes_nothing_until_the_pass_keeps_it(tmp_path: Path) -> None:
    """A pass refused after rendering began (bad input) must leave nothing
    behind: only keep(), which the pass calls once its inputs checked out, writes."""
    from jinja2 import DictLoader, Environment

    directory = tmp_path / "state" / "compiled"
    cache = CompiledTemplates(directory)
    env = Environment(loader=DictLoader({"t.j2": "one {{ x }}"}), bytecode_cache=cache)
    assert env.get_template("t.j2").render(x=1) == "one 1"
    assert not (tmp_path / "state").exists()
    cache.keep()
    assert len(list(directory.iterdir())) == 1


def test_an_edited_template_is_compiled_anew(tmp_path: Path) -> None:
    """Jinja keys an entry by the template's source: the cache never serves an old template."""
    from jinja2 import DictLoader, Environment

    cache = CompiledTemplates(tmp_path / "compiled")
    for source, expected in (("one {{ x }}", "one 1"), ("two {{ x }}", "two 1")):
        env = Environment(loader=DictLoader({"t.j2": source}), bytecode_cache=cache)
        assert env.get_template("t.j2").render(x=1) == expected
        cache.keep()
    assert len(list((tmp_path / "compiled").iterdir())) == 1  # one name, rewritten


def test_the_package_environment_uses_the_cache_it_is_given(tmp_path: Path) -> None:
    """The cache is a value the caller hands in (Templates), never state set from outside the core."""
    cache = CompiledTemplates(tmp_path / "compiled")
    kept = Templates(compiled=cache)
    assert kept.get("text", "socat.service.j2").environment.bytecode_cache is cache
    assert environment("text", str(tmp_path), cache).bytecode_cache is None  # edited copies: never cached
    assert PACKAGED.get("text", "socat.service.j2").environment.bytecode_cache is None
