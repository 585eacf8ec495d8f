"""The loader survives any file a commit can hold (issue "Confinement", item 4).

Anyone with push access writes the desired state, and every host reads it as
root. A file that is a link (to /etc/shadow, to /dev/zero), a FIFO, a
monster, thousands of '[' or a number of thousands of digits is a problem
with its file and reason, exit 2 and nothing changed: never a hang, a
traceback or another file's contents in a message. A name from a plan or
the registry becomes a path only when it is a host name.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.core.desired.load import MAX_FILE_BYTES, DesiredStateError, host_file, load_desired, load_hosts_of
from tests.conftest import EXAMPLE_FLEET, fabric_validate

SECRET = "root:$6$s3cr3t-hash-never-echoed:19000:0:99999:7:::"


@pytest.fixture
def desired(tmp_path: Path) -> Path:
    tree = tmp_path / "desired"
    shutil.copytree(EXAMPLE_FLEET, tree)
    return tree


def _problems(tree: Path) -> list[str]:
    with pytest.raises(DesiredStateError) as caught:
        load_desired(tree)
    return [str(problem).replace(f"{tree}/", "") for problem in caught.value.problems]


def _finishes(call, deadline_s: float = 20.0) -> object:
    """`call()` in a thread: what it returned or raised, failing the test if it
    is still running at the deadline (a FIFO opened for reading blocks for good)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), "the loader hung"
    return outcome[0]


def test_a_host_file_that_links_to_a_root_only_file_is_refused_without_its_contents(desired: Path, tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.write_text(f'[host]\nname = "{SECRET}"\n')
    shadow.chmod(0o600)
    (desired / "zz.toml").symlink_to(shadow)
    proc = fabric_validate(desired)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"{desired}/zz.toml: (file): is a symbolic link (to {shadow}): desired-state files must be regular files inside the tree" in proc.stderr
    assert SECRET not in proc.stderr and "s3cr3t" not in proc.stderr


def test_a_link_to_dev_zero_is_refused_before_any_read(desired: Path) -> None:
    (desired / "zz.toml").symlink_to("/dev/zero")
    assert "zz.toml: (file): is a symbolic link (to /dev/zero): desired-state files must be regular files inside the tree" in _problems(desired)


def test_a_fifo_is_refused_and_never_hangs_the_loader(desired: Path) -> None:
    os.mkfifo(desired / "zz.toml")
    outcome = _finishes(lambda: load_desired(desired))
    assert isinstance(outcome, DesiredStateError), outcome
    assert "zz.toml: (file): is not a regular file" in [str(p).replace(f"{desired}/", "") for p in outcome.problems]


def test_a_fabric_toml_that_is_a_link_is_refused(desired: Path, tmp_path: Path) -> None:
    real = tmp_path / "elsewhere.toml"
    shutil.move(desired / "fabric.toml", real)
    (desired / "fabric.toml").symlink_to(real)
    assert f"fabric.toml: (file): is a symbolic link (to {real}): desired-state files must be regular files inside the tree" in _problems(desired)


def test_a_hosts_directory_that_is_a_link_is_not_followed(desired: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "zz.toml").write_text("not toml at all [")
    (desired / "hosts").symlink_to(elsewhere)
    assert "zz" not in load_desired(desired).hosts  # nothing under the link was read


def test_a_file_over_the_cap_is_refused_unread(desired: Path) -> None:
    with (desired / "zz.toml").open("wb") as file:
        file.truncate(MAX_FILE_BYTES + 1)  # sparse: costs no disk
    assert f"zz.toml: (file): is {MAX_FILE_BYTES + 1} bytes, over the {MAX_FILE_BYTES} bytes a desired-state file may have" in _problems(desired)


def test_a_file_at_the_cap_is_read(desired: Path) -> None:
    text = (
        (EXAMPLE_FLEET / "racknerd.toml")
        .read_text()
        .replace('"racknerd"', '"zz"')
        .replace("100.101.7.2", "100.101.7.99")
        .replace("racknerd.tail", "zz.tail")
    )
    (desired / "zz.toml").write_text(text + "#" * (MAX_FILE_BYTES - len(text) - 1) + "\n")
    assert "zz" in load_desired(desired).hosts


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"x = " + b"[" * 100_000, "zz.toml: (syntax): TOML nested too deeply to parse"),
        (b"x = " + b"{a = " * 50_000, "zz.toml: (syntax): TOML nested too deeply to parse"),
        (b"x = " + b"9" * 5_000 + b"\n", "zz.toml: (syntax): TOML value out of range"),
        (b'[host]\nname = "\xff\xfe"\n', "zz.toml: (file): is not UTF-8 text (byte 15)"),
        (b"", "zz.toml: host: required"),
    ],
    ids=["nested-arrays", "nested-tables", "huge-integer", "not-utf8", "empty"],
)
def test_every_way_a_file_is_broken_is_a_problem_with_file_and_reason(desired: Path, content: bytes, expected: str) -> None:
    (desired / "zz.toml").write_bytes(content)
    outcome = _finishes(lambda: load_desired(desired))
    assert isinstance(outcome, DesiredStateError), outcome
    problems = [str(p).replace(f"{desired}/", "") for p in outcome.problems]
    assert any(p.startswith(expected) for p in problems), problems


def test_the_command_line_says_exit_2_for_a_hostile_file_and_changes_nothing(desired: Path) -> None:
    (desired / "zz.toml").write_bytes(b"x = " + b"[" * 100_000)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in desired.iterdir())
    proc = fabric_validate(desired)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{desired}/zz.toml: (syntax): TOML nested too deeply to parse" in proc.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in desired.iterdir()) == before


@pytest.mark.parametrize("name", ["../../etc/shadow", "..", "a/b", "/etc/passwd", "fabric", "", "x" * 64, "Qfox"])
def test_a_name_that_is_not_a_host_name_never_becomes_a_path(desired: Path, name: str) -> None:
    seen: list[Path] = []

    def exists(path: Path) -> bool:
        seen.append(path)
        return True

    assert host_file(desired, name, exists) is None
    assert seen == []
    # A plan naming such a node reads nothing more than fabric.toml.
    assert load_hosts_of(desired, [name]).hosts == {}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fleet=st.one_of(st.binary(max_size=400), st.text(max_size=400).map(str.encode)),
    host=st.one_of(
        st.binary(max_size=400),
        st.text(alphabet="[]{}=\"'.,# \nabcxyz0123456789-_", max_size=400).map(str.encode),
        st.integers(min_value=1, max_value=3000).map(lambda n: b"a = " + b"[" * n),
    ),
)
def test_any_bytes_in_any_file_are_problems_never_a_crash(desired: Path, fleet: bytes, host: bytes) -> None:
    (desired / "zz.toml").write_bytes(host)
    for target, content in ((desired / "zz.toml", host), (desired / "fabric.toml", fleet)):
        target.write_bytes(content)
        try:
            load_desired(desired)
        except DesiredStateError as exc:
            assert exc.problems, "refused without a problem"
    shutil.copy(EXAMPLE_FLEET / "fabric.toml", desired / "fabric.toml")
