"""The first-boot bootstrap (`fabric bootstrap --first-boot`, fabric-bootstrap.service).

The same planner as the operator's `fabric bootstrap`, with the stamp last
(so a failed step leaves none and the next boot tries again), the k3s labels
the pass renders written before the join, the first pass queued, and on a
machine without a host file only what a pending machine may have.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.cli import main
from reconciler.core.desired.load import load_desired
from reconciler.core.install.bootstrap import (
    BOOTSTRAP_ASKED,
    BOOTSTRAP_STAMP,
    K3S_JOIN_DROPIN,
    K3S_LABELS_FILE,
    NFT_FIX_DROPIN,
    NFT_FIX_FILE,
    Observed,
    Step,
    after_admission,
    bootstrap_files,
    pending_boot_steps,
    plan_bootstrap,
    socat_units,
    stamp_state,
)
from reconciler.core.install.nodeconfig import parse_node_config
from reconciler.core.render.artifacts import Layout
from reconciler.ports import BootstrapError
from tests.conftest import EXAMPLE_FLEET, REPO
from tests.support.fleet import Fleet
from tests.support.render import facts as example_facts
from tests.support.render import files as rendered_files

STATE = load_desired(EXAMPLE_FLEET)
NODE = parse_node_config(
    """
[node]
host = "qfox-1"
[bootstrap]
tailscale_auth_key_file = "/run/secrets/tailscale-auth-key"
k3s_server = "https://100.101.7.10:6443"
k3s_token_file = "/run/secrets/k3s-token"
"""
)
JOIN = f"etc/rancher/k3s/config.yaml.d/{K3S_JOIN_DROPIN}"
PROBE = REPO / "tests" / "golden" / "probe" / "x86_64"


def new_machine(host: str = "qfox-1", **changes: object) -> Observed:
    values: dict[str, object] = {
        "tailscale_running": False,
        "registered": False,
        "files": dict.fromkeys(bootstrap_files(NODE)),
        "distro_table_present": False,
        "nft_fix_loaded": False,
        "timer_active": False,
        "socat_active": dict.fromkeys(socat_units(STATE, host), False),
        "k3s_agent_installed": True,
    }
    return Observed(**{**values, **changes})  # type: ignore[arg-type]


def test_first_boot_runs_the_seeds_steps_in_order_and_stamps_last() -> None:
    facts = example_facts("qfox-1", labels={"topology.researchstack.io/tier": "gpu_vaapi"})
    plan = plan_bootstrap(node=NODE, desired=STATE, host="qfox-1", facts=facts, observed=new_machine(), first_boot=True)
    assert [(s.kind, s.path) for s in plan.steps] == [
        ("tailscale_up", None),
        ("register", None),
        ("write_file", K3S_LABELS_FILE),
        ("write_file", JOIN),
        ("restart_k3s_agent", None),
        ("wait_k3s_node", None),
        # qfox-1's host file asks for the CachyOS/Arch fix.
        ("write_file", NFT_FIX_FILE),
        ("write_file", NFT_FIX_DROPIN),
        ("daemon_reload", None),
        ("enable_timer", None),
        ("queue_pass", None),
        ("write_stamp", BOOTSTRAP_STAMP),
    ]
    assert plan.problems == ()
    # The labels are the pass's own drop-in, byte for byte: one owner, one content.
    assert K3S_LABELS_FILE == Layout().k3s_dropin
    assert plan.steps[2].content == rendered_files(STATE, "qfox-1", node_facts=facts)[K3S_LABELS_FILE]
    assert '"topology.researchstack.io/tier=gpu_vaapi"' in (plan.steps[2].content or "")


def test_the_operators_bootstrap_waits_for_its_pass_and_writes_no_stamp() -> None:
    plan = plan_bootstrap(node=NODE, desired=STATE, host="qfox-1", facts=example_facts("qfox-1"), observed=new_machine())
    kinds = [s.kind for s in plan.steps]
    assert "write_stamp" not in kinds and "queue_pass" not in kinds and kinds[-1] == "run_pass"
    assert K3S_LABELS_FILE not in {s.path for s in plan.steps}


def test_a_ready_machine_at_first_boot_only_writes_the_stamp() -> None:
    done = new_machine(
        tailscale_running=True,
        registered=True,
        timer_active=True,
        socat_active={u: True for u in socat_units(STATE, "lux")},
        k3s_agent_installed=False,
    )
    node = NODE.model_copy(update={"bootstrap": NODE.bootstrap.model_copy(update={"k3s_server": None, "k3s_token_file": None})})
    plan = plan_bootstrap(node=node, desired=STATE, host="lux", facts=example_facts("lux"), observed=done, first_boot=True)
    assert [s.kind for s in plan.steps] == ["write_stamp"]


def test_a_pending_machine_gets_no_k3s_join_no_port_maps_and_no_fix() -> None:
    plan = pending_boot_steps(NODE, "mystery", new_machine("mystery"))
    assert [s.kind for s in plan.steps] == ["tailscale_up", "report_pending", "enable_timer", "write_stamp"]
    assert plan.steps[0].argv == ("tailscale", "up", "--auth-key=file:/run/secrets/tailscale-auth-key", "--hostname=mystery")
    assert plan.steps[-1].path == BOOTSTRAP_STAMP
    (note,) = plan.notes
    assert "k3s join skipped: mystery is pending" in note and "fabric admit mystery" in note


def test_a_pending_machine_without_tailscale_but_with_an_auth_key_is_a_problem() -> None:
    plan = pending_boot_steps(NODE, "mystery", new_machine("mystery", tailscale_running=None))
    assert plan.problems == ("tailscale is not installed, but [bootstrap] tailscale_auth_key_file is set",)


# --------------------------------------------------------------------------
# The command line: a failed step leaves no stamp.


class RecordingIO:
    def __init__(self, fail: str | None = None) -> None:
        self.done: list[str] = []
        self.fail = fail

    def observe(self, host, files, ports, k3s_node=None) -> Observed:
        return Observed(
            tailscale_running=None,
            registered=False,
            files=dict.fromkeys(files),
            distro_table_present=False,
            nft_fix_loaded=False,
            timer_active=False,
            socat_active=dict.fromkeys(ports, False),
        )

    def execute(self, step: Step) -> None:
        if step.kind == self.fail:
            raise BootstrapError(f"{step.kind}: refused by the test")
        self.done.append(step.kind)


def _argv(tmp_path: Path, host: str) -> list[str]:
    return [
        "bootstrap",
        "--config",
        str(tmp_path / "absent.toml"),
        "--desired",
        str(EXAMPLE_FLEET),
        "--host",
        host,
        "--first-boot",
        "--replay",
        str(PROBE),
        "--registry-path",
        str(tmp_path / "r.sqlite"),
    ]


@pytest.mark.parametrize("fail", [None, "enable_timer"])
def test_cli_first_boot_of_a_pending_machine(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch, fail: str | None) -> None:
    import reconciler.cli.bootstrap as bootstrap_cli

    io = RecordingIO(fail)
    monkeypatch.setattr(bootstrap_cli, "bootstrap_io", lambda registry, root: io)
    status = main(_argv(tmp_path, "mystery"))
    out, err = capsys.readouterr()
    if fail is None:
        assert status == 0, err
        assert io.done == ["enable_timer", "write_stamp"]
        assert "report_pending: it has no host file" in out and "done: report_pending" in out
        assert "pending: mystery has no host file" in out
    else:
        assert status == 1
        assert "bootstrap: enable_timer failed" in err
        assert "write_stamp" not in io.done


@pytest.mark.parametrize("fail", [None, "register"])
def test_cli_first_boot_of_a_declared_host(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch, fail: str | None) -> None:
    import reconciler.cli.bootstrap as bootstrap_cli

    io = RecordingIO(fail)
    monkeypatch.setattr(bootstrap_cli, "bootstrap_io", lambda registry, root: io)
    status = main(_argv(tmp_path, "racknerd"))
    out, err = capsys.readouterr()
    if fail is None:
        assert status == 0, err
        assert io.done == ["register", "enable_timer", "queue_pass", "write_stamp"]
        assert "ready: racknerd" in out and "its first pass is queued" in out
    else:
        assert status == 1 and "bootstrap: register failed" in err
        assert io.done == []


# --------------------------------------------------------------------------
# After admission: the first pass of a now-declared host starts the
# bootstrap its first boot left pending (core: after_admission; engine:
# reconciler.engine.bootstrap_start).


def test_the_stamp_says_what_the_bootstrap_did() -> None:
    pending = pending_boot_steps(NODE, "mystery", new_machine("mystery")).steps[-1]
    done = plan_bootstrap(node=NODE, desired=STATE, host="lux", facts=example_facts("lux"), observed=new_machine("lux"), first_boot=True).steps[-1]
    assert stamp_state(pending.content) == "pending" and (pending.content or "").startswith("pending: mystery reported pending")
    assert stamp_state(done.content) == "complete"
    # Stamps written before they named their state read by their words.
    assert stamp_state("mystery reported pending\n") == "pending"
    assert stamp_state("the first-boot bootstrap is done\n") == "complete"
    assert stamp_state(None) is None


PENDING_STAMP = "pending: newbox reported pending\n"
COMPLETE_STAMP = "complete: the first-boot bootstrap is done\n"


@pytest.mark.parametrize(
    ("stamp", "declared", "asked", "failed", "expected"),
    [
        # incomplete + declared: start it, once
        (PENDING_STAMP, True, False, False, "start"),
        # complete, or never finished (the unit runs by itself at the next boot): nothing
        (COMPLETE_STAMP, True, False, False, None),
        (None, True, False, False, None),
        # still pending (no host file, or a group's member): nothing
        (PENDING_STAMP, False, False, False, None),
        # started after admission already and left pending again: only said
        (PENDING_STAMP, True, True, False, "note"),
        # started after admission and failed (no stamp): only said, the next boot retries
        (None, True, True, True, "note"),
        (None, True, True, False, None),
    ],
)
def test_after_admission_decides_once(stamp: str | None, declared: bool, asked: bool, failed: bool, expected: str | None) -> None:
    decision = after_admission(stamp=stamp, declared=declared, asked=asked, unit_failed=failed)
    kind = None if decision is None else ("start" if decision.start else "note")
    assert kind == expected, decision
    if kind == "start":
        assert decision is not None and decision.line == "start fabric-bootstrap.service (bootstrap left pending at first boot)"
    if kind == "note" and failed:
        assert decision is not None and "runs again at the next boot" in decision.line


def _admitted(tmp_path: Path) -> Fleet:
    fleet = Fleet(tmp_path)
    assert fleet.reconcile().ok
    (fleet.root / BOOTSTRAP_STAMP).write_text(PENDING_STAMP)
    fleet.machine.forget_calls()
    return fleet


def test_the_first_pass_after_admission_starts_the_bootstrap_once_without_waiting(tmp_path: Path) -> None:
    fleet = _admitted(tmp_path)
    assert "would start fabric-bootstrap.service (bootstrap left pending at first boot)" in fleet.preview().stdout
    assert (fleet.root / BOOTSTRAP_STAMP).exists(), "fabric plan changes nothing"

    report = fleet.reconcile()
    assert report.outcome == "noop" and report.ok
    assert report.stdout.endswith("started fabric-bootstrap.service (bootstrap left pending at first boot; not waited for)\n"), report.stdout
    assert fleet.machine.calls == [("enqueue-start", "fabric-bootstrap.service")]
    # The unit's condition would skip it while the stamp is there.
    assert not (fleet.root / BOOTSTRAP_STAMP).exists()
    assert (fleet.root / "var/lib/fabric" / BOOTSTRAP_ASKED).exists()
    assert [r["outcome"] for r in fleet.audit.records if r.get("unit") == "fabric-bootstrap.service"] == ["ok"]

    # The bootstrap wrote its complete stamp: the next passes do nothing about it.
    (fleet.root / BOOTSTRAP_STAMP).write_text(COMPLETE_STAMP)
    fleet.machine.forget_calls()
    assert fleet.reconcile().stdout == "nothing to do (generation 1)\n"
    assert fleet.machine.calls == []


def test_a_bootstrap_left_pending_again_is_not_started_again(tmp_path: Path) -> None:
    fleet = _admitted(tmp_path)
    assert "started fabric-bootstrap.service" in fleet.reconcile().stdout
    (fleet.root / BOOTSTRAP_STAMP).write_text(PENDING_STAMP)  # it ran and said pending again
    fleet.machine.forget_calls()
    for _ in range(3):
        assert fleet.reconcile().stdout == "nothing to do (generation 1)\n"
    assert fleet.machine.calls == []
    assert any("left the bootstrap pending again: not started again" in note for note in fleet.notes), fleet.notes


def test_a_bootstrap_that_failed_after_admission_is_left_to_the_next_boot(tmp_path: Path) -> None:
    fleet = _admitted(tmp_path)
    assert "started fabric-bootstrap.service" in fleet.reconcile().stdout
    # It failed: no stamp (its unit is "failed").
    fleet.machine.state["failed"] = ["fabric-bootstrap.service"]
    fleet.machine.forget_calls()
    for _ in range(3):
        assert "started" not in fleet.reconcile().stdout
    assert ("enqueue-start", "fabric-bootstrap.service") not in fleet.machine.calls
    assert any("failed after admission" in note and "runs again at the next boot" in note for note in fleet.notes), fleet.notes


def test_a_start_systemd_refuses_puts_the_stamp_back_for_the_next_pass(tmp_path: Path) -> None:
    fleet = _admitted(tmp_path)
    fleet.machine.fail["enqueue-start"] = "systemd is not reachable"
    report = fleet.reconcile()
    assert "started" not in report.stdout and report.memo_seed is None
    assert (fleet.root / BOOTSTRAP_STAMP).read_text() == PENDING_STAMP
    assert not (fleet.root / "var/lib/fabric" / BOOTSTRAP_ASKED).exists()
    assert any("could not be started" in note and "the next pass tries again" in note for note in fleet.notes), fleet.notes
    assert "started fabric-bootstrap.service" in fleet.reconcile().stdout
