"""The package's templates kept compiled in the state directory between
passes (reconciler.adapters.compiled_templates), written only by a pass whose
inputs all checked out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from reconciler.adapters.compiled_templates import CompiledTemplates, cache_directory
from reconciler.core.templating import environment, keep_compiled_templates

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
STATE = "var/lib/fabric"


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    from reconciler.cli import main

    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


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
    code, _, err = run(capsys, argv)
    assert code == 0, err
    kept = entries(cache_directory(root, STATE))
    # racknerd's units, nftables, the Caddyfile, the status page (and what they include).
    assert len(kept) >= 5
    # A full pass again (memo dropped) compiles nothing: it loads every template kept, rewrites none.
    (root / STATE / "pass-memo.json").unlink()
    code, _, err = run(capsys, argv)
    assert code == 0, err
    assert entries(cache_directory(root, STATE)) == kept


def test_a_pass_refused_for_bad_input_at_render_keeps_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """x86-spill's lane and a service both named x86-spill: render refuses
    after it compiled some templates; the pass leaves nothing behind."""
    desired = tmp_path / "desired"
    shutil.copytree(REPO / "hosts", desired)
    fleet = desired / "fabric.toml"
    fleet.write_text(fleet.read_text().replace('id = "flac-fft"', 'id = "x86-spill"'))
    plan = tmp_path / "plan.json"
    plan.write_text((GOLDEN / "fleet-plan.json").read_text().replace('"flac-fft"', '"x86-spill"'))
    root = tmp_path / "root"
    code, out, err = run(capsys, pass_argv(desired, root, "x86-spill", plan))
    assert (code, out) == (2, "") and "would run both" in err, err
    assert not root.exists() or not any(root.rglob("*"))


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
    cache = CompiledTemplates(tmp_path / "compiled")
    keep_compiled_templates(cache)
    try:
        assert environment("text").bytecode_cache is cache
        assert environment("text", str(tmp_path)).bytecode_cache is None  # edited copies: never cached
    finally:
        keep_compiled_templates(None)
    assert environment("text").bytecode_cache is None
