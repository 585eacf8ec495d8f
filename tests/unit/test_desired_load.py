"""The whole desired-state tree validated once per commit; then a host that
neither leads nor serves the edge reads only the files its pass needs
(reconciler.engine.desired_load)."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

import reconciler
from reconciler.core.desired.load import DesiredStateError, load_desired
from reconciler.core.live.models import Snapshot, SnapshotNode
from reconciler.core.probe import facts_from_capture
from reconciler.core.render.artifacts import render
from reconciler.core.render.plan_part import plan_part
from reconciler.engine.desired_load import VERDICT_FILE, LoadedDesired, load_for_part, load_for_pass, with_plan_hosts
from reconciler.engine.plan_source import plan_from_file
from tests.support.cli import fabric
from tests.support.probe_fixtures import load_capture

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
STATE = "var/lib/fabric"
BROKEN = "\n[this is not = valid\n"


def git(directory: Path, *argv: str) -> None:
    subprocess.run(["git", "-C", str(directory), "-c", "user.name=t", "-c", "user.email=t@localhost", *argv], check=True, capture_output=True)


def commit_all(directory: Path, message: str) -> None:
    git(directory, "add", "-A")
    git(directory, "commit", "-q", "-m", message)


@pytest.fixture
def desired(tmp_path: Path) -> Path:
    """The example fleet as a git checkout, as `fabric pull` keeps it."""
    directory = tmp_path / "desired"
    shutil.copytree(REPO / "hosts", directory)
    git(directory, "init", "-q")
    commit_all(directory, "fleet")
    return directory


def break_file(path: Path) -> None:
    path.write_text(path.read_text() + BROKEN)


def verdict_at(directory: Path, commit: str, version: str = reconciler.__version__) -> bytes:
    return json.dumps({"directory": str(directory.absolute()), "commit": commit, "version": version, "control": ["lux"]}).encode()


# --------------------------------------------------------------------------
# fabric reconcile, end to end


def pass_argv(desired: Path, root: Path, host: str) -> list[str]:
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
        "--no-activate",
    ]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def drop_memo(root: Path) -> None:
    """So that the next pass is a full one: it loads and renders."""
    (root / STATE / "pass-memo.json").unlink(missing_ok=True)


def full_pass(capsys: pytest.CaptureFixture[str], argv: list[str], root: Path) -> tuple[int, str, str]:
    drop_memo(root)
    return fabric(capsys, *argv)


def test_a_host_that_does_not_lead_converges_at_a_seen_commit_despite_a_broken_unrelated_file_and_a_new_commit_is_refused(
    desired: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    argv = pass_argv(desired, root, "x86-spill")
    code, out, err = fabric(capsys, *argv)
    assert code == 0, err
    assert (root / STATE / VERDICT_FILE).exists()
    # qfox-1's file breaks in the checkout: x86-spill's pass does not read it at this commit.
    broken = desired / "qfox-1.toml"
    break_file(broken)
    code, out, err = full_pass(capsys, argv, root)
    assert (code, out) == (0, "nothing to do (generation 1)\n"), err
    # The broken file committed: a new commit, the whole tree validated, refused, nothing changed.
    commit_all(desired, "qfox-1: broken")
    drop_memo(root)
    before = tree(root)
    code, out, err = fabric(capsys, *argv)
    assert (code, out) == (2, "") and str(broken) in err, err
    assert tree(root) == before


def test_a_leader_candidate_refuses_a_broken_file_at_a_seen_commit_and_the_edge_one_it_shows(
    desired: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A candidate loads every file on every pass (the leader step schedules
    over every host); the edge reads the files of the hosts its page shows
    (x86-spill runs a lane), not those of a host nobody names that never reported."""
    extra = desired / "hosts" / "extra-1.toml"
    extra.parent.mkdir()
    extra.write_text('[host]\nname = "extra-1"\nroles = ["compute"]\naddress = "100.64.9.1"\n')
    commit_all(desired, "extra-1")
    roots = {host: tmp_path / f"root-{host}" for host in ("lux", "racknerd")}
    for host, root in roots.items():
        code, _, err = fabric(capsys, *pass_argv(desired, root, host))
        assert code == 0, err
        assert (root / STATE / VERDICT_FILE).exists()
    break_file(extra)
    drop_memo(roots["racknerd"])
    code, out, err = fabric(capsys, *pass_argv(desired, roots["racknerd"], "racknerd"))
    assert (code, out) == (0, "nothing to do (generation 1)\n"), err
    broken = desired / "x86-spill.toml"
    break_file(broken)
    for host, root in roots.items():
        drop_memo(root)
        before = tree(root)
        code, out, err = fabric(capsys, *pass_argv(desired, root, host))
        assert (code, out) == (2, "") and str(broken if host == "racknerd" else extra) in err, (host, err)
        assert tree(root) == before


def test_the_verdict_is_recorded_under_the_commit_and_a_new_commit_records_its_own(
    desired: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from reconciler.adapters.memo_io import git_commit

    root = tmp_path / "root"
    argv = pass_argv(desired, root, "x86-spill")
    assert fabric(capsys, *argv)[0] == 0
    first = json.loads((root / STATE / VERDICT_FILE).read_text())
    assert first == {"directory": str(desired.absolute()), "commit": git_commit(desired), "version": reconciler.__version__, "control": ["lux"]}
    (desired / "qfox-1.toml").write_text((desired / "qfox-1.toml").read_text() + "# a comment\n")
    commit_all(desired, "qfox-1: a comment")
    assert fabric(capsys, *argv)[0] == 0
    second = json.loads((root / STATE / VERDICT_FILE).read_text())
    assert second["commit"] == git_commit(desired) != first["commit"]


def test_bad_input_at_a_new_commit_records_no_verdict(desired: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    break_file(desired / "qfox-1.toml")
    commit_all(desired, "qfox-1: broken")
    code, _, err = fabric(capsys, *pass_argv(desired, root, "x86-spill"))
    assert code == 2 and str(desired / "qfox-1.toml") in err
    assert not (root / STATE / VERDICT_FILE).exists()
    # And the next pass is refused again: no verdict stands for the broken commit.
    assert fabric(capsys, *pass_argv(desired, root, "x86-spill"))[0] == 2


# --------------------------------------------------------------------------
# load_for_pass


def test_a_verdict_at_the_commit_reads_only_the_files_the_pass_needs(desired: Path) -> None:
    break_file(desired / "qfox-1.toml")
    loaded = load_for_pass(desired, "x86-spill", commit="c1", verdict=verdict_at(desired, "c1"), may_lead=True)
    assert loaded.partial and loaded.validated is None
    # Its own file and its Ray head's (lux: its worker joins lux's address);
    # x86-spill has no port maps, and no plan was read yet.
    assert sorted(loaded.desired.hosts) == ["lux", "x86-spill"]


def test_another_commit_or_directory_or_no_commit_validates_the_whole_tree(desired: Path, tmp_path: Path) -> None:
    broken = desired / "qfox-1.toml"
    break_file(broken)
    for commit, verdict in [
        ("c2", verdict_at(desired, "c1")),  # another commit
        ("c1", verdict_at(tmp_path / "elsewhere", "c1")),  # another directory
        (None, verdict_at(desired, "c1")),  # not a git checkout: every pass
        ("c1", verdict_at(desired, "c1", version="0.0.1-older")),  # another version of the rules
        ("c1", None),
        ("c1", b"{not json"),
        ("c1", json.dumps({"directory": str(desired.absolute()), "commit": "c1", "version": reconciler.__version__}).encode()),  # no index
    ]:
        with pytest.raises(DesiredStateError) as caught:
            load_for_pass(desired, "x86-spill", commit=commit, verdict=verdict, may_lead=False)
        assert any(p.file == str(broken) for p in caught.value.problems), (commit, verdict)


def test_a_leader_candidate_that_may_lead_loads_every_file(desired: Path) -> None:
    everyone = sorted(load_desired(desired).hosts)
    verdict = verdict_at(desired, "c1")
    for host in ("lux", "qfox-1"):
        loaded = load_for_pass(desired, host, commit="c1", verdict=verdict, may_lead=True)
        assert not loaded.partial and sorted(loaded.desired.hosts) == everyone, host
    # A candidate with a plan file cannot lead: it reads what it needs.
    assert load_for_pass(desired, "qfox-1", commit="c1", verdict=verdict, may_lead=False).partial


def test_the_edge_reads_the_hosts_its_page_shows_and_the_registrys_nodes(desired: Path) -> None:
    """racknerd: its port maps' targets (qfox-1, lux), the control host (lux),
    the lanes' hosts (a1-arm64, x86-spill), the candidates (lux, qfox-1); then
    the snapshot's nodes that are declared (an undeclared node has no file)."""
    for n in range(3):
        (desired / f"extra-{n}.toml").write_text(f'[host]\nname = "extra-{n}"\nroles = ["compute"]\naddress = "100.64.9.{n + 1}"\n')
    loaded = load_for_pass(desired, "racknerd", commit="c1", verdict=verdict_at(desired, "c1"), may_lead=True)
    assert loaded.partial
    assert sorted(loaded.desired.hosts) == ["a1-arm64", "lux", "qfox-1", "racknerd", "x86-spill"]
    snapshot = Snapshot(now=datetime.now(UTC), nodes=[SnapshotNode(node_id=n, tier="relay") for n in ("extra-1", "stranger")])
    plan = plan_from_file(GOLDEN / "fleet-plan.json")
    assert sorted(with_plan_hosts(loaded, plan, snapshot).hosts) == ["a1-arm64", "extra-1", "lux", "qfox-1", "racknerd", "x86-spill"]


def test_the_edge_reads_the_control_hosts_the_verdict_names_and_another_host_does_not(desired: Path) -> None:
    """The local lane's card on the edge's page names the first control host: the verdict's index says which."""
    (desired / "ctl-2.toml").write_text('[host]\nname = "ctl-2"\nroles = ["control"]\naddress = "100.64.9.9"\n')
    verdict = json.dumps({"directory": str(desired.absolute()), "commit": "c1", "version": reconciler.__version__, "control": ["ctl-2", "lux"]})
    edge = load_for_pass(desired, "racknerd", commit="c1", verdict=verdict.encode(), may_lead=False)
    assert "ctl-2" in edge.desired.hosts and edge.desired.hosts_with_role("control") == ["ctl-2", "lux"]
    assert "ctl-2" not in load_for_pass(desired, "x86-spill", commit="c1", verdict=verdict.encode(), may_lead=False).desired.hosts


def test_the_port_maps_targets_and_the_plans_hosts_are_read(desired: Path) -> None:
    """racknerd's port maps reach qfox-1 and lux; a plan placing a service
    on a1-arm64 makes x86-spill read a1-arm64's file (render checks every placement)."""
    verdict = verdict_at(desired, "c1")
    fleet = (desired / "fabric.toml").read_text()
    (desired / "fabric.toml").write_text(fleet.replace('host = "racknerd"', 'host = "x86-spill"'))
    loaded = load_for_pass(desired, "x86-spill", commit="c1", verdict=verdict, may_lead=False)
    assert sorted(loaded.desired.hosts) == ["lux", "qfox-1", "x86-spill"]
    plan = plan_from_file(GOLDEN / "fleet-plan.json")
    assert sorted(with_plan_hosts(loaded, plan).hosts) == ["a1-arm64", "lux", "qfox-1", "x86-spill"]
    # A host the plan names must be valid where it is read.
    break_file(desired / "a1-arm64.toml")
    with pytest.raises(DesiredStateError) as caught:
        with_plan_hosts(loaded, plan)
    assert [p.file for p in caught.value.problems] == [str(desired / "a1-arm64.toml")]


@pytest.mark.parametrize("host", ["a1-arm64", "x86-spill", "qfox-1", "lux"])
def test_what_a_host_reads_renders_what_the_whole_tree_renders(desired: Path, host: str) -> None:
    facts = facts_from_capture(load_capture(host), host=host)
    plan = plan_from_file(GOLDEN / "fleet-plan.json")
    whole = load_desired(desired)
    loaded = load_for_pass(desired, host, commit="c1", verdict=verdict_at(desired, "c1"), may_lead=False)
    assert loaded.partial
    assert render(with_plan_hosts(loaded, plan), host, facts, plan) == render(whole, host, facts, plan)


def test_a_whole_load_is_not_completed_again(desired: Path) -> None:
    whole = load_desired(desired)
    loaded = LoadedDesired(whole, desired, partial=False, validated="c1")
    assert with_plan_hosts(loaded, plan_from_file(GOLDEN / "fleet-plan.json")) is whole


@pytest.mark.parametrize("host", ["racknerd", "a1-arm64", "x86-spill", "qfox-1", "lux"])
def test_what_the_watcher_reads_gives_the_part_the_whole_tree_gives(desired: Path, host: str) -> None:
    """`fabric watch` computes a host's part of each plan from a few files
    (load_for_part): the same part as under the whole tree, including on the
    edge a placement on a host that is not declared, left out of both."""
    plan = plan_from_file(GOLDEN / "fleet-plan.json")
    raw = plan.model_dump()
    raw["placements"].append({"service": "braid", "replica": 1, "node": "intruder", "tier": "relay"})
    plan = plan.model_validate(raw)
    few = load_for_part(desired, host, plan)
    assert plan_part(few, plan, host) == plan_part(load_desired(desired), plan, host)
    assert set(few.hosts) == ({host} if host != "racknerd" else {"racknerd", "a1-arm64", "qfox-1", "x86-spill"})
