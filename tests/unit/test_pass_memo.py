"""The pass memo: an unchanged pass does nothing but heartbeat and audit; any change of an input, or drift, makes a full pass.

Whole `fabric reconcile --no-activate` passes through the command line, into
a sandbox root, with the embedded (sqlite) registry under it or a plan file.
A memoized pass writes its audit line with `memo: hit`; a full pass does not.
The drift of units and of the nftables table, which needs real systemd and
nft, is in tests/integration/test_reconcile_memo.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from reconciler.engine.pass_memo import MAX_AGE_S, MEMO_FILE, NFT_DRIFT, MemoSeed, PassMemo, drift, sha256, usable
from tests.conftest import REPO
from tests.support.cli import fabric
from tests.support.memo_sandbox import (
    GOLDEN,
    STATE,
    MemoFilesInMemory,
    Sandbox,
    audit_on_stderr,
    memoized,
    new_registry_epoch,
    open_registry,
)

__all__ = ["audit_on_stderr"]  # its autouse fixture applies here


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)


def test_an_unchanged_pass_is_memoized_and_still_heartbeats_and_audits(sandbox: Sandbox, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and "generation 1 written" in out and not memoized(err)
    code, out, err = fabric(capsys, *sandbox.argv())
    assert (code, out) == (0, "nothing to do (generation 1)\n")
    assert memoized(err), err
    assert f"note: heartbeat: {sandbox.host} tier" in err
    # The heartbeat really reaches the registry: a registry that lost the
    # record (here: a new one) has it again after a memoized pass.
    sandbox.registry_file.unlink()
    code, out, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and memoized(err), err
    registry = open_registry(sandbox)
    try:
        assert [state.record.node_id for state in registry.node_states()] == [sandbox.host]
    finally:
        registry.close()


def two_passes_noting_imports(argv: list[str], heavy: tuple[str, ...]) -> tuple[str, str]:
    """Two `fabric reconcile` processes in a row (the first full, the second
    memoized); each prints `HEAVY` and which of `heavy` it imported."""
    script = (
        "import sys\n"
        "from reconciler.cli import main\n"
        f"code = main({argv!r})\n"
        f"heavy = sorted(m for m in {heavy!r} if m in sys.modules)\n"
        "print('HEAVY', ','.join(heavy))\n"
        "sys.exit(code)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    first = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO)
    assert first.returncode == 0, first.stderr
    second = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO)
    assert second.returncode == 0, second.stderr
    assert second.stdout == "nothing to do (generation 1)\nHEAVY \n", second.stdout
    assert memoized(second.stderr)
    return first.stdout, second.stderr


def test_a_memoized_pass_with_a_plan_file_imports_no_model(sandbox: Sandbox) -> None:
    """No pydantic, no template on the memoized path: it is what makes it cheap."""
    argv = sandbox.argv("--plan-file", str(GOLDEN / "fleet-plan.json"))
    first, _ = two_passes_noting_imports(argv, ("pydantic", "jinja2", "reconciler.core.desired.model", "reconciler.engine.reconcile"))
    assert "HEAVY jinja2,pydantic" in first  # the full pass renders


def test_only_the_full_pass_imports_prometheus_client(sandbox: Sandbox) -> None:
    """The full pass writes the metrics textfile with prometheus_client; the
    memoized pass rewrites this host's pass series in it as text and does not
    pay for the library's import (docs/pass.md gives the figure)."""
    argv = sandbox.argv("--plan-file", str(GOLDEN / "fleet-plan.json"))
    first, _ = two_passes_noting_imports(argv, ("prometheus_client",))
    assert "HEAVY prometheus_client" in first


def test_a_memoized_pass_that_probes_live_imports_no_model(sandbox: Sandbox) -> None:
    """The live probe's key is made of the parsed raw outputs, not of HostFacts:
    a hit that probes this machine live imports no model either. With a plan
    file: the registry's heartbeat (NodeRecord) still needs the models."""
    argv = [a for a in sandbox.argv("--plan-file", str(GOLDEN / "fleet-plan.json")) if a not in ("--replay", str(sandbox.capture))]
    assert "--replay" not in argv
    heavy = (
        "pydantic",
        "jinja2",
        "reconciler.core.desired.model",
        "reconciler.core.probe.tiering",
        "reconciler.ports",
        "reconciler.engine.reconcile",
    )
    first, _ = two_passes_noting_imports(argv, heavy)
    assert "pydantic" in first and "reconciler.core.desired.model" in first  # the full pass builds HostFacts


def test_a_memoized_pass_that_heartbeats_to_the_registry_imports_no_model(tmp_path: Path) -> None:
    """The memo's heartbeat is the JSON the last full pass validated, re-sent
    through the sqlite file's standard-library base: no NodeRecord, no
    FleetConfig, no pydantic. racknerd is the edge and runs no lane's jobs (a
    host that does reads fabric.toml for its lanes' queues)."""
    host = "racknerd"
    s = Sandbox(tmp_path, host=host)
    heavy = (
        "pydantic",
        "jinja2",
        "reconciler.core.desired",
        "reconciler.core.desired.model",
        "reconciler.core.live.records",
        "reconciler.adapters.registry_sqlite",
        "reconciler.engine.reconcile",
    )
    first, second_err = two_passes_noting_imports(s.argv(), heavy)
    assert "pydantic" in first and "reconciler.core.desired.model" in first  # the full pass validates
    assert f"note: heartbeat: {host} tier" in second_err, second_err
    registry = open_registry(s)
    try:
        (state,) = [state for state in registry.node_states() if state.record.node_id == host]
    finally:
        registry.close()
    # What the registry keeps from the memoized beat is a valid record, as the full pass measured it.
    memo = PassMemo.from_json(s.memo_file.read_bytes())
    assert memo.seed.node_record is not None
    kept = json.loads(memo.seed.node_record)
    assert state.record.model_dump(mode="json", exclude={"beat_at", "timeout_s"}) == {
        k: v for k, v in kept.items() if k not in ("beat_at", "timeout_s")
    }
    assert state.record.timeout_s == memo.seed.beat_ttl_s == 90.0


def test_a_memoized_pass_of_a_lane_host_imports_no_model(tmp_path: Path) -> None:
    """a1-arm64 runs a compute lane's jobs: its memoized heartbeat counts them
    afresh on the lanes' queues, which the memo names with the broker
    (fabric.toml's, part of the memo's key): no fabric.toml is validated for
    them. With a real broker: tests/integration/test_pass_memo_lanes.py."""
    s = Sandbox(tmp_path, host="a1-arm64")
    heavy = ("pydantic", "jinja2", "reconciler.core.desired", "reconciler.core.desired.model", "reconciler.engine.reconcile")
    first, second_err = two_passes_noting_imports(s.argv(), heavy)
    assert "reconciler.core.desired.model" in first
    assert "note: heartbeat: a1-arm64 tier" in second_err, second_err
    memo = PassMemo.from_json(s.memo_file.read_bytes())
    assert memo.seed.lanes_here == ("a1-arm64",) and memo.seed.lane_queues == {"a1-arm64": "phaze-agent-a1-arm64-analyze"}
    assert memo.seed.lane_broker == {"queue_url_file": None, "job_function": "process_file"}


def edit_desired(s: Sandbox) -> None:
    host_file = s.desired / "racknerd.toml"
    host_file.write_text(host_file.read_text() + "\n# an operator's comment\n")


def edit_other_host(s: Sandbox) -> None:
    other = s.desired / "qfox-1.toml"
    other.write_text(other.read_text() + "\n# a comment\n")


def change_probe(s: Sandbox) -> None:
    meminfo = s.capture / "meminfo"
    meminfo.write_text(meminfo.read_text().replace("MemTotal:", "MemTotal:  ", 1))


def options_changed(s: Sandbox) -> None:
    pass  # the pass below adds --unit-dir


@pytest.mark.parametrize(
    ("change", "extra"),
    [
        (edit_desired, ()),
        (edit_other_host, ()),
        (change_probe, ()),
        (new_registry_epoch, ()),
        (options_changed, ("--unit-dir", "/run/systemd/system")),
    ],
    ids=["host-file-edited", "another-host-edited", "probe-changed", "new-plan-epoch", "options-changed"],
)
def test_a_change_of_any_input_makes_a_full_pass(sandbox: Sandbox, capsys: pytest.CaptureFixture[str], change, extra) -> None:  # type: ignore[no-untyped-def]
    fabric(capsys, *sandbox.argv())
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and memoized(err)
    change(sandbox)
    code, out, err = fabric(capsys, *sandbox.argv(*extra))
    assert code == 0, err
    assert not memoized(err), err
    # ...and the full pass leaves a memo again when it converged.
    if sandbox.memo_file.exists():
        code, out, err = fabric(capsys, *sandbox.argv(*extra))
        assert code == 0 and memoized(err), err


def test_a_new_plan_epoch_makes_a_full_pass_that_beats_once(sandbox: Sandbox, capsys: pytest.CaptureFixture[str]) -> None:
    """The memo's side reads the epoch before it would beat: the full pass a
    new plan needs sends the pass's heartbeat, not a second one after the memo's."""
    fabric(capsys, *sandbox.argv())
    assert memoized(fabric(capsys, *sandbox.argv())[2])
    new_registry_epoch(sandbox)
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and not memoized(err), err
    assert "full pass" in err and err.count("note: heartbeat:") == 1, err


def git(directory: Path, *argv: str) -> None:
    subprocess.run(["git", "-C", str(directory), "-c", "user.name=t", "-c", "user.email=t@localhost", *argv], check=True, capture_output=True)


def test_in_a_git_checkout_a_new_commit_or_an_edit_of_the_own_files_makes_a_full_pass(sandbox: Sandbox, capsys: pytest.CaptureFixture[str]) -> None:
    """The desired state as `fabric pull` keeps it: the commit stands for the tree."""
    git(sandbox.desired, "init", "-q")
    git(sandbox.desired, "add", "-A")
    git(sandbox.desired, "commit", "-q", "-m", "fleet")
    fabric(capsys, *sandbox.argv())
    assert memoized(fabric(capsys, *sandbox.argv())[2])
    edit_other_host(sandbox)
    git(sandbox.desired, "commit", "-q", "-am", "qfox-1: a comment")
    assert not memoized(fabric(capsys, *sandbox.argv())[2])
    assert memoized(fabric(capsys, *sandbox.argv())[2])
    edit_desired(sandbox)  # not committed: this host's own file is watched by itself
    assert not memoized(fabric(capsys, *sandbox.argv())[2])
    fleet_file = sandbox.desired / "fabric.toml"
    fleet_file.write_text(fleet_file.read_text() + "\n# uncommitted\n")
    assert not memoized(fabric(capsys, *sandbox.argv())[2])


def test_a_new_plan_file_makes_a_full_pass(sandbox: Sandbox, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text((GOLDEN / "fleet-plan.json").read_text())
    argv = sandbox.argv("--plan-file", str(plan))
    fabric(capsys, *argv)
    assert memoized(fabric(capsys, *argv)[2])
    data = json.loads(plan.read_text())
    data["epoch"] += 1
    plan.write_text(json.dumps(data))
    code, _, err = fabric(capsys, *argv)
    assert code == 0 and not memoized(err), err


@pytest.mark.parametrize(
    ("path", "how"),
    [("etc/caddy/fabric.caddy", "edit"), ("etc/systemd/system/fabric-nftables.service", "edit"), ("etc/fabric/fabric.nft", "remove")],
)
def test_a_rendered_file_edited_or_removed_is_repaired_by_the_next_pass(
    sandbox: Sandbox, capsys: pytest.CaptureFixture[str], path: str, how: str
) -> None:
    fabric(capsys, *sandbox.argv())
    assert memoized(fabric(capsys, *sandbox.argv())[2])
    rendered = sandbox.root / path
    good = rendered.read_bytes()
    if how == "edit":
        rendered.write_bytes(good + b"# edited by hand\n")
    else:
        rendered.unlink()
    code, out, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and not memoized(err), err
    assert f"drift since the last pass: {path} {'was changed' if how == 'edit' else 'is missing'}" in err
    assert f"  {path}\n" in out
    assert rendered.read_bytes() == good
    code, out, err = fabric(capsys, *sandbox.argv())
    assert (code, out) == (0, "nothing to do (generation 1)\n") and memoized(err)


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"version": 999, "key": "x"}', b'{"version": 1, "key": 3}'])
def test_a_corrupt_or_missing_memo_means_a_full_pass(sandbox: Sandbox, capsys: pytest.CaptureFixture[str], content: bytes) -> None:
    fabric(capsys, *sandbox.argv())
    sandbox.memo_file.write_bytes(content)
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and not memoized(err), err
    assert PassMemo.from_json(sandbox.memo_file.read_bytes()).seed.generation == 1
    sandbox.memo_file.unlink()
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and not memoized(err)
    assert memoized(fabric(capsys, *sandbox.argv())[2])


@pytest.mark.parametrize("where", ["fabric.toml", "qfox-1.toml"])
def test_bad_input_after_a_memoized_pass_is_refused_and_changes_nothing(sandbox: Sandbox, capsys: pytest.CaptureFixture[str], where: str) -> None:
    fabric(capsys, *sandbox.argv())
    assert memoized(fabric(capsys, *sandbox.argv())[2])
    before = tree(sandbox.root)
    broken = sandbox.desired / where
    broken.write_text(broken.read_text() + "\n[this is not = valid\n")
    code, out, err = fabric(capsys, *sandbox.argv())
    assert (code, out) == (2, "") and str(broken) in err
    assert tree(sandbox.root) == before


def test_a_leader_candidate_is_never_memoized(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its pass may have to lead (nobody leads): it always runs whole."""
    lux = Sandbox(tmp_path, host="lux")
    fabric(capsys, *lux.argv())
    code, _, err = fabric(capsys, *lux.argv())
    assert code == 0 and not memoized(err), err
    assert not lux.memo_file.exists()


def seed(**fields: Any) -> MemoSeed:
    """A converged pass's seed for a memo: generation 1, no files or units unless given."""
    return MemoSeed(**{"generation": 1, "files": (), "units": (), "node_record": None, "registry_epoch": None, "may_lead": False, **fields})


def test_the_memo_is_too_old_after_max_age() -> None:
    memo = PassMemo(key="k", written_at=1000.0, seed=seed())
    assert usable(memo, "k", 1000.0 + MAX_AGE_S) is None
    assert usable(memo, "k", 1000.0 + MAX_AGE_S + 1) == "the memo is too old"
    assert usable(memo, "k", 999.0) == "the memo is too old"  # a clock set back
    assert usable(memo, "other", 1000.0) == "the inputs changed"
    assert usable(None, "k", 1000.0) == "no memo"


def test_drift_sees_a_stopped_unit_and_a_changed_table() -> None:

    memo = PassMemo(key="k", written_at=0.0, seed=seed(), file_digests={"a": sha256(b"A")}, unit_states={"u.service": "active"}, nft="n1")
    assert drift(memo, lambda p: b"A", lambda u: "active", lambda: "n1") is None
    assert drift(memo, lambda p: b"B", lambda u: "active", lambda: "n1") == "a was changed"
    assert drift(memo, lambda p: None, lambda u: "active", lambda: "n1") == "a is missing"
    assert drift(memo, lambda p: b"A", lambda u: "inactive", lambda: "n1") == "u.service is inactive, was active"
    assert drift(memo, lambda p: b"A", lambda u: "active", lambda: "n2") == NFT_DRIFT
    assert drift(memo, lambda p: b"A", lambda u: "active", lambda: None) == NFT_DRIFT
    # Without activation neither systemd nor nft is asked.
    assert drift(memo, lambda p: b"A", None, None) is None


def test_the_light_defaults_of_the_options_agree_with_their_homes() -> None:
    """engine.pass_options, engine.memoized_pass and cli.common spell defaults out so that parsing and a memoized pass import nothing heavy."""
    from reconciler.cli import common
    from reconciler.core.install.nodeconfig import NODE_CONFIG_PATH
    from reconciler.core.render.artifacts import Layout
    from reconciler.engine import apply, pass_options, reconcile

    assert pass_options.STATE_DIR == apply.STATE_DIR
    assert pass_options.UNIT_DIR == Layout().unit_dir
    assert pass_options.CADDY_MAIN_CANDIDATES == reconcile.CADDY_MAIN_CANDIDATES
    assert common.NODE_CONFIG_PATH == NODE_CONFIG_PATH


def test_a_memoized_pass_refreshes_this_hosts_pass_series_and_keeps_the_fleets(sandbox: Sandbox, capsys: pytest.CaptureFixture[str]) -> None:
    fabric(capsys, *sandbox.argv())
    textfile = sandbox.root / "var/lib/node_exporter/textfile/fabric.prom"
    counters = sandbox.root / STATE / "pass-counters.json"
    textfile.write_text(textfile.read_text().replace("fabric_reconcile_success 1.0\n", "fabric_reconcile_success 0.0\n"))
    stale = textfile.read_text()
    counters.write_text(json.dumps({"rollbacks_total": 2, "last_success": "2000-01-01T00:00:00+00:00"}))
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and memoized(err), err
    fresh = textfile.read_text()
    changed = {a.split(" ")[0] for a, b in zip(stale.splitlines(), fresh.splitlines(), strict=True) if a != b}
    assert changed == {"fabric_reconcile_duration_seconds", "fabric_reconcile_success", "fabric_reconcile_last_success_timestamp_seconds"}
    assert "fabric_reconcile_success 1\n" in fresh
    last = float(next(line for line in fresh.splitlines() if line.startswith("fabric_reconcile_last_success_timestamp_seconds ")).split()[1])
    assert last > 1_700_000_000
    kept = json.loads(counters.read_text())
    assert kept["rollbacks_total"] == 2 and kept["last_success"] > "2000-01-01T00:00:00+00:00"
    # racknerd, the edge, shows the fleet: its memo lasts no longer than the node timeout.
    assert PassMemo.from_json(sandbox.memo_file.read_bytes()).seed.max_age_s == 90.0


def test_a_pass_that_changes_something_drops_the_memo_before_its_first_change(
    sandbox: Sandbox, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass killed half-way must leave no memo that vouches for the half-done world."""
    fabric(capsys, *sandbox.argv())
    assert sandbox.memo_file.exists()
    edit_desired(sandbox)
    edit = sandbox.desired / "fabric.toml"
    edit.write_text(edit.read_text().replace("listen_port = 2222", "listen_port = 2223"))
    from reconciler import wiring

    seen: list[bool] = []
    real = wiring.real_pass_ports

    def killed_at_the_first_change(options, **wired):  # type: ignore[no-untyped-def]
        with real(options, **wired) as ports:

            def kill(step: str) -> None:
                seen.append(sandbox.memo_file.exists())
                raise KeyboardInterrupt

            ports.checkpoint = kill
            yield ports

    from contextlib import contextmanager

    monkeypatch.setattr(wiring, "real_pass_ports", contextmanager(killed_at_the_first_change))
    with pytest.raises(KeyboardInterrupt):
        from reconciler.cli import build_parser
        from reconciler.cli.reconcile import run as reconcile_run

        reconcile_run(build_parser("reconcile").parse_args(sandbox.argv()))
    assert seen == [False]


def test_a_new_plan_epoch_makes_a_full_pass_before_the_drift_check(sandbox: Sandbox, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan published since the last pass makes the pass whole at once: the
    memo's side does not hash the files (nor, with activation, read the units
    and the table) first; the full pass compares them itself and repairs what drifted."""
    fabric(capsys, *sandbox.argv())
    assert memoized(fabric(capsys, *sandbox.argv())[2])
    rendered = sandbox.root / "etc/caddy/fabric.caddy"
    good = rendered.read_bytes()
    rendered.write_bytes(good + b"# edited by hand\n")
    new_registry_epoch(sandbox)
    code, out, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and not memoized(err), err
    assert "note: registry epoch" in err and "drift since the last pass" not in err, err
    assert err.count("note: heartbeat:") == 1, err


class MemoWorldSeen:
    """The MemoReader port, noting every look at the world the drift check takes (the key's inputs are constants)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def read(self, path: str) -> bytes | None:
        self.calls.append(f"read {path}")
        return b"as installed"

    def unit_state(self):  # type: ignore[no-untyped-def]
        def state(unit: str) -> str:
            self.calls.append(f"unit {unit}")
            return "active"

        return state

    def nft_digest(self):  # type: ignore[no-untyped-def]
        def digest() -> str:
            self.calls.append("nft list")
            return "table"

        return digest

    def fingerprint(self, paths: object) -> str:
        return "stat"

    def git_commit(self, directory: Path) -> str | None:
        return None

    def tree_stamp(self, directory: Path, files: object, since: float | None = None) -> str | None:
        return "stat"

    def which(self, program: str) -> str | None:
        return None


class BeatsSeen:
    """The BeatRegistry port at epoch `epoch`, noting its calls in the same list."""

    def __init__(self, calls: list[str], epoch: int) -> None:
        self.calls, self._epoch = calls, epoch

    def epoch(self) -> int:
        self.calls.append("epoch")
        return self._epoch

    def heartbeat_json(self, record: dict, ttl_s: float) -> dict:  # type: ignore[type-arg]
        self.calls.append("beat")
        return {**record, "timeout_s": ttl_s}

    def close(self) -> None:
        self.calls.append("close")


class FullPassStarted(Exception):
    pass


def memo_side(tmp_path: Path, registry_epoch: int, unit_state: str = "active") -> list[str]:
    """The memo's side of one pass with activation, on ports that note what it
    looks at, in order; the memo saw epoch 4. The full pass is not run: its
    ports raise FullPassStarted (noted as "full pass")."""
    from contextlib import contextmanager

    from reconciler.engine.memoized_pass import MemoPorts, pass_inputs, run_memoized_pass
    from reconciler.engine.pass_memo import inputs_key
    from reconciler.engine.pass_options import PassOptions
    from tests.support.audit import RecordingAudit
    from tests.support.clock import FakeClock

    calls: list[str] = []
    world = MemoWorldSeen(calls)
    options = PassOptions(desired=tmp_path / "desired", host="racknerd", root=tmp_path / "root", replay=str(tmp_path / "capture"))
    memo = PassMemo(
        key=inputs_key(pass_inputs(options, None, world)),
        written_at=1000.0,
        seed=seed(
            node_record=json.dumps({"node_id": "racknerd", "tier": "relay", "in_flight": 0}),
            registry={"registry": {"backend": "sqlite", "path": "/unused"}},
            beat_ttl_s=90.0,
            registry_epoch=4,
        ),
        file_digests={"etc/caddy/fabric.caddy": sha256(b"as installed")},
        unit_states={"fabric-nftables.service": unit_state},
        nft="table",
    )
    store = MemoFilesInMemory({options.root / STATE / MEMO_FILE: memo.to_json().encode()})

    ports = MemoPorts(
        store=store,
        world=world,  # type: ignore[arg-type]
        audit=RecordingAudit(),
        clock=FakeClock(1010.0),
        probe=lambda: None,  # type: ignore[arg-type,return-value]
        open_registry=lambda reach: BeatsSeen(calls, registry_epoch),
    )

    @contextmanager
    def full_pass_ports(options: PassOptions):  # type: ignore[no-untyped-def]
        calls.append("full pass")
        raise FullPassStarted
        yield

    try:
        run_memoized_pass(options, ports, full_pass_ports)
    except FullPassStarted:
        pass
    return calls


def test_the_memo_reads_the_registrys_epoch_before_it_checks_the_world_and_beats_only_after_both(tmp_path: Path) -> None:
    """A new epoch: no unit read, no `nft list`, no file hashed, no beat; the
    full pass at once. The same epoch: the world is checked, then the beat
    sent on the same connection. Drift: no beat (the full pass sends it)."""
    assert memo_side(tmp_path, registry_epoch=5) == ["epoch", "close", "full pass"]
    checks = ["read etc/caddy/fabric.caddy", "unit fabric-nftables.service", "nft list"]
    assert memo_side(tmp_path, registry_epoch=4) == ["epoch", *checks, "beat", "close"]
    assert memo_side(tmp_path, registry_epoch=4, unit_state="failed") == ["epoch", *checks[:2], "close", "full pass"]


def test_the_memos_sha256_is_hashlibs() -> None:
    """reconciler.digests spares a memo hit OpenSSL's start-up; its digests are hashlib's."""
    import hashlib

    from reconciler.digests import sha256 as light

    for data in (b"", b"abc", bytes(range(256)) * 1000):
        assert light(data).hexdigest() == hashlib.sha256(data).hexdigest()
    h = light()
    h.update(b"ab")
    h.update(b"c")
    assert h.hexdigest() == hashlib.sha256(b"abc").hexdigest()
