"""The pass memo's key for a desired state that is not a git checkout (issue 34, item 5).

`memo_io.tree_stamp` costs a few stats whatever the number of host files: a
Nix store path is its own identity; a plain directory is the stat of the
directory, its hosts/, fabric.toml, this host's file and the files the last
full pass depended on (`MemoSeed.desired_files`). An edit must still be
noticed: this host's file or fabric.toml edited in place, a file the pass
depended on edited in place, any file added, removed or renamed; a file
changed since a pass started makes no stamp (racy). Then whole passes over
a sandbox: an edit of a host file racknerd's artifacts depend on makes a
full pass, a new store path too, and an unchanged store path is memoized.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reconciler.adapters import memo_io
from reconciler.adapters.memo_io import tree_stamp
from reconciler.engine.pass_memo import PassMemo
from tests.support.cli import fabric
from tests.support.memo_sandbox import Sandbox, audit_on_stderr, memoized

__all__ = ["audit_on_stderr"]  # its autouse fixture applies here

OWN = ["fabric.toml", "lux.toml", "hosts/lux.toml"]


def fleet(tmp_path: Path, hosts: int = 50) -> Path:
    desired = tmp_path / "desired"
    (desired / "hosts").mkdir(parents=True)
    (desired / "fabric.toml").write_text("[fleet]\n")
    for i in range(hosts):
        (desired / "hosts" / f"node-{i:04d}.toml").write_text(f"# node {i}\n")
    (desired / "hosts" / "lux.toml").write_text("# lux\n")
    # The directories' mtimes in the past: a change now moves them, whatever the clock's tick.
    for directory in (desired, desired / "hosts"):
        past = directory.stat().st_mtime - 100
        os.utime(directory, (past, past))
    return desired


def later(path: Path, text: str) -> None:
    """Edit in place (same inode), with a later mtime whatever the clock's tick."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_a_plain_directory_is_stamped_from_a_few_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    desired = fleet(tmp_path, hosts=2000)
    calls: list[str] = []
    real_stat = os.stat
    monkeypatch.setattr(memo_io.os, "stat", lambda p, *a, **k: calls.append(str(p)) or real_stat(p, *a, **k))
    monkeypatch.setattr(memo_io.os, "scandir", lambda *a: pytest.fail("the tree is walked"))
    stamp = tree_stamp(desired, [*OWN, "hosts/node-0007.toml"])
    assert stamp is not None and stamp.startswith("dirs ")
    # The directory, hosts/, fabric.toml, lux's two places, one listed file: not 2,000.
    assert len(calls) == 6, calls


@pytest.mark.parametrize(
    "change",
    [
        lambda d: later(d / "hosts" / "lux.toml", "# lux, edited\n"),
        lambda d: later(d / "fabric.toml", "[fleet]\n# edited\n"),
        lambda d: later(d / "hosts" / "node-0007.toml", "# listed, edited in place\n"),
        lambda d: (d / "hosts" / "node-9999.toml").write_text("# a new host\n"),
        lambda d: (d / "hosts" / "node-0003.toml").unlink(),
        lambda d: (d / "hosts" / "node-0003.toml").rename(d / "hosts" / "node-0004.toml"),
        lambda d: (d / "new.toml").write_text("# a new host at the top\n"),
    ],
    ids=["own-edited", "fabric-toml-edited", "listed-edited", "added", "removed", "renamed-over", "added-at-top"],
)
def test_an_edit_that_matters_changes_the_stamp(tmp_path: Path, change) -> None:  # type: ignore[no-untyped-def]
    desired = fleet(tmp_path)
    files = [*OWN, "hosts/node-0007.toml"]
    before = tree_stamp(desired, files)
    change(desired)
    assert tree_stamp(desired, files) != before


def test_an_unlisted_host_file_edited_in_place_is_left_to_the_next_full_pass(tmp_path: Path) -> None:
    desired = fleet(tmp_path)
    files = [*OWN, "hosts/node-0007.toml"]
    before = tree_stamp(desired, files)
    later(desired / "hosts" / "node-0008.toml", "# not this host's business\n")
    assert tree_stamp(desired, files) == before


def test_a_file_changed_since_the_pass_started_makes_no_stamp(tmp_path: Path) -> None:
    desired = fleet(tmp_path)
    listed = desired / "hosts" / "node-0007.toml"
    started = listed.stat().st_mtime + 5
    assert tree_stamp(desired, [*OWN, "hosts/node-0007.toml"], since=started) is not None
    later(listed, "# edited while the pass ran\n")
    os.utime(listed, (started + 1, started + 1))
    assert tree_stamp(desired, [*OWN, "hosts/node-0007.toml"], since=started) is None


def test_a_nix_store_path_is_its_own_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "nix" / "store"
    monkeypatch.setattr(memo_io, "NIX_STORE", f"{store}/")
    first = fleet(store / "aaaa-desired")
    second = fleet(store / "bbbb-desired")
    link = tmp_path / "desired"
    link.symlink_to(first)
    assert tree_stamp(link, OWN) == f"store {first.resolve()}"
    link.unlink()
    link.symlink_to(second)
    assert tree_stamp(link, OWN) == f"store {second.resolve()}"


# -- whole passes ------------------------------------------------------------------


def test_the_memo_lists_the_host_files_the_edges_artifacts_depend_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sandbox = Sandbox(tmp_path)
    fabric(capsys, *sandbox.argv())
    memo = PassMemo.from_json(sandbox.memo_file.read_bytes())
    listed = set(memo.seed.desired_files)
    # The edge names the control host and the leader candidates; never its own file.
    assert {"lux.toml", "hosts/lux.toml", "qfox-1.toml"} <= listed and "racknerd.toml" not in listed
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and memoized(err), err
    later(sandbox.desired / "lux.toml", (sandbox.desired / "lux.toml").read_text() + "\n# edited in place\n")
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and not memoized(err), err


def test_a_desired_state_in_the_nix_store_is_memoized_until_its_path_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "nix" / "store"
    monkeypatch.setattr(memo_io, "NIX_STORE", f"{store}/")
    sandbox = Sandbox(tmp_path)
    first = store / "aaaa-fleet"
    first.parent.mkdir(parents=True)
    sandbox.desired.rename(first)
    sandbox.desired.symlink_to(first)
    fabric(capsys, *sandbox.argv())
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and memoized(err), err
    second = store / "bbbb-fleet"
    second.mkdir()
    for f in first.iterdir():
        (second / f.name).write_bytes(f.read_bytes())
    sandbox.desired.unlink()
    sandbox.desired.symlink_to(second)
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and not memoized(err), err
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and memoized(err), err
