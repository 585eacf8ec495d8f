"""The leader's desired state is loaded again only when its directory changed
(reconciler.adapters.desired_memo): a host file added, removed, renamed over
or written in place (the last seen at the next full look), fabric.toml
changed, the directory's link moved; a failed load is tried again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from reconciler.adapters.desired_memo import DesiredMemo
from reconciler.core.desired.load import DesiredStateError, load_desired
from tests.conftest import EXAMPLE_FLEET


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    d = tmp_path / "fleet"
    shutil.copytree(EXAMPLE_FLEET, d)
    return d


def host_file(name: str) -> str:
    return f'[host]\nname = "{name}"\nroles = ["compute"]\naddress = "100.64.9.9"\n\n[limits]\nmax_concurrent_tasks = 1\n'


def memo_of(fleet: Path) -> DesiredMemo:
    return DesiredMemo(fleet, load_desired, recheck_s=None)


def test_an_unchanged_directory_is_loaded_once(fleet: Path) -> None:
    memo = memo_of(fleet)
    first = memo()
    assert not memo.recheck()
    assert memo() is first and memo() is first
    assert memo.loads == 1


def test_a_host_file_added_removed_or_renamed_over_is_seen_at_once(fleet: Path) -> None:
    memo = memo_of(fleet)
    assert "extra-1" not in memo().hosts
    (fleet / "extra-1.toml").write_text(host_file("extra-1"))
    assert "extra-1" in memo().hosts
    new = fleet / "extra-1.toml.new"
    new.write_text(host_file("extra-1").replace("100.64.9.9", "100.64.9.10"))
    os.replace(new, fleet / "extra-1.toml")
    assert str(memo().hosts["extra-1"].host.address) == "100.64.9.10"
    (fleet / "extra-1.toml").unlink()
    assert "extra-1" not in memo().hosts
    assert memo.loads == 4


def test_an_in_place_write_is_seen_at_the_next_full_look(fleet: Path) -> None:
    memo = memo_of(fleet)
    (fleet / "extra-1.toml").write_text(host_file("extra-1"))
    memo()
    target = fleet / "extra-1.toml"
    # Same size, same folder: only the file's own stat changes.
    with target.open("r+") as f:
        f.write(host_file("extra-1").replace("100.64.9.9", "100.64.9.8"))
    stat = target.stat()
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    assert str(memo().hosts["extra-1"].host.address) == "100.64.9.9", "between rechecks only the folders are looked at"
    assert memo.recheck()
    assert str(memo().hosts["extra-1"].host.address) == "100.64.9.8"


def test_a_moved_link_is_a_new_directory(fleet: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(fleet, other)
    (other / "extra-2.toml").write_text(host_file("extra-2"))
    link = tmp_path / "current"
    link.symlink_to(fleet)
    memo = DesiredMemo(link, load_desired, recheck_s=None)
    assert "extra-2" not in memo().hosts
    link.unlink()
    link.symlink_to(other)
    assert "extra-2" in memo().hosts


def test_a_failed_load_is_tried_again(fleet: Path) -> None:
    memo = memo_of(fleet)
    memo()
    (fleet / "extra-3.toml").write_text("[host\n")
    with pytest.raises(DesiredStateError):
        memo()
    with pytest.raises(DesiredStateError):
        memo()
    (fleet / "extra-3.toml").write_text(host_file("extra-3"))
    assert "extra-3" in memo().hosts
