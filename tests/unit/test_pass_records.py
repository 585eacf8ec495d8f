"""Per-pass records: probe damping across passes, metrics counters, the edge's status page."""

from __future__ import annotations

import re
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from reconciler.adapters.files import LocalTree
from reconciler.adapters.probe_io import CaptureDirectory
from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import Snapshot, SnapshotNode
from reconciler.core.live.records import NodeRecord
from reconciler.core.probe import RawCapture, facts_from_capture
from reconciler.core.views.metrics import format_value
from reconciler.engine.fleet_view import FleetView
from reconciler.engine.pass_records import PassFigures, damped_facts, save_probe_history, write_pass_records
from reconciler.engine.plan_fence import PassPlan, empty_plan
from tests.conftest import EXAMPLE_FLEET, REPO
from tests.support.harness.waiting import wait_until
from tests.support.registry_store import status_of

STATE_DIR = "var/lib/fabric"
T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
STATE = load_desired(EXAMPLE_FLEET)


def facts(host: str):
    outputs, errors = CaptureDirectory().load(str(REPO / "tests" / "fixtures" / "probe" / host))
    return facts_from_capture(RawCapture(outputs, errors), host=host)


def test_a_gpu_missed_on_one_probe_does_not_demote_the_node(tmp_path: Path) -> None:
    tree = LocalTree(tmp_path)
    cuda = facts("qfox-1")
    blip = cuda.model_copy(update={"tier": "gpu_apu"})
    tiers = []
    for n, observed in enumerate([cuda, blip, cuda, blip, blip, blip]):
        effective, history = damped_facts(tree, STATE_DIR, STATE, observed, T0 + timedelta(seconds=30 * n))
        save_probe_history(tree, STATE_DIR, history)
        tiers.append(effective.tier)
    # missed_beats = 3: the lower tier is taken on its third pass in a row.
    assert tiers == ["gpu_cuda", "gpu_cuda", "gpu_cuda", "gpu_cuda", "gpu_cuda", "gpu_apu"]


def test_a_torn_history_file_starts_afresh(tmp_path: Path) -> None:
    (tmp_path / STATE_DIR).mkdir(parents=True)
    (tmp_path / STATE_DIR / "probe-history.json").write_text("{not json")
    effective, _ = damped_facts(LocalTree(tmp_path), STATE_DIR, STATE, facts("lux"), T0)
    assert effective.tier == facts("lux").tier


def outcome(ok: bool = True, rolled_back: bool = False) -> PassFigures:
    return PassFigures(succeeded=ok, rolled_back=rolled_back, generation=3, duration_s=0.25)


def metrics(root: Path) -> str:
    return (root / "var/lib/node_exporter/textfile/fabric.prom").read_text()


def test_rollbacks_are_counted_across_passes_and_last_success_is_kept(tmp_path: Path) -> None:
    tree = LocalTree(tmp_path)
    source = PassPlan(empty_plan(STATE, T0))
    write_pass_records(tree, STATE_DIR, STATE, "lux", source, outcome(), T0)
    write_pass_records(tree, STATE_DIR, STATE, "lux", source, outcome(ok=False, rolled_back=True), T0 + timedelta(seconds=30))
    write_pass_records(tree, STATE_DIR, STATE, "lux", source, outcome(ok=False, rolled_back=True), T0 + timedelta(seconds=60))
    text = metrics(tmp_path)
    assert "\nfabric_rollbacks_total 2.0\n" in text
    assert "\nfabric_reconcile_success 0.0\n" in text
    assert f"\nfabric_reconcile_last_success_timestamp_seconds {format_value(T0.timestamp())}\n" in text
    assert not (tmp_path / "var/lib/fabric/status").exists(), "only the edge writes the status page"


def test_the_edge_writes_the_status_page_from_the_registry_view(tmp_path: Path) -> None:
    snapshot = Snapshot(now=T0, nodes=[SnapshotNode(node_id="qfox-1", tier="gpu_cuda", max_concurrent_tasks=4)], leader="lux", epoch=7)
    source = PassPlan(empty_plan(STATE, T0))
    write_pass_records(LocalTree(tmp_path), STATE_DIR, STATE, "racknerd", source, outcome(), T0, view=FleetView(snapshot))
    page = (tmp_path / "var/lib/fabric/status/index.html").read_text()
    assert "a1-arm64" in page and "RANK 10" in page and "qfox-1" in page
    assert '\nfabric_node_max_concurrent_tasks{node="qfox-1"} 4.0\n' in metrics(tmp_path)


def test_the_edges_page_lists_the_registrys_nodes_and_the_hosts_the_fleet_names_not_every_declared_host(tmp_path: Path) -> None:
    """A declared host nobody names (no lane, no placement, not control nor a
    candidate) is listed once it reports, not before: the page, and the pass
    that writes it, cost the same at five or ten thousand declared hosts."""
    desired = tmp_path / "desired"
    shutil.copytree(EXAMPLE_FLEET, desired)
    for n in range(2):
        (desired / f"extra-{n}.toml").write_text(f'[host]\nname = "extra-{n}"\nroles = ["compute"]\naddress = "100.64.9.{n + 1}"\n')
    state = load_desired(desired)
    snapshot = Snapshot(now=T0, nodes=[SnapshotNode(node_id="extra-1", tier="relay", max_concurrent_tasks=1)], leader="lux", epoch=7)
    write_pass_records(LocalTree(tmp_path), STATE_DIR, state, "racknerd", PassPlan(empty_plan(state, T0)), outcome(), T0, view=FleetView(snapshot))
    page = (tmp_path / "var/lib/fabric/status/index.html").read_text()
    shown = set(re.findall(r'fabric_node_status\{node="([a-z0-9-]+)",status="active"\}', metrics(tmp_path)))
    assert shown == {"a1-arm64", "extra-1", "lux", "qfox-1", "racknerd", "x86-spill"}
    assert "extra-1" in page and "extra-0" not in page


def test_the_edges_page_says_when_the_registrys_plan_was_refused(tmp_path: Path) -> None:
    snapshot = Snapshot(now=T0, leader="lux", epoch=9)
    reason = "refused: plan epoch 9 is not signed, and fabric.toml lists plan keys"
    source = PassPlan(empty_plan(STATE, T0), static=f"{reason}: running static", refused=reason)
    write_pass_records(LocalTree(tmp_path), STATE_DIR, STATE, "racknerd", source, outcome(), T0, view=FleetView(snapshot))
    page = (tmp_path / "var/lib/fabric/status/index.html").read_text()
    assert 'id="plan-refused"' in page and "PLAN REFUSED" in page and "plan epoch 9 is not signed" in page
    write_pass_records(LocalTree(tmp_path), STATE_DIR, STATE, "racknerd", PassPlan(empty_plan(STATE, T0)), outcome(), T0, view=FleetView(snapshot))
    assert "PLAN REFUSED" not in (tmp_path / "var/lib/fabric/status/index.html").read_text()


def test_records_that_cannot_be_written_are_a_note_not_a_failure(tmp_path: Path) -> None:
    (tmp_path / "var/lib").mkdir(parents=True)
    (tmp_path / "var/lib/node_exporter").write_text("a file where the textfile directory goes\n")
    note = write_pass_records(LocalTree(tmp_path), STATE_DIR, STATE, "lux", PassPlan(empty_plan(STATE, T0)), outcome(), T0)
    assert note is not None and note.startswith("could not write metrics or the status page: ")
    assert write_pass_records(LocalTree(tmp_path / "elsewhere"), STATE_DIR, STATE, "lux", PassPlan(empty_plan(STATE, T0)), outcome(), T0) is None


class CallsSeen:
    """A registry whose calls are noted by name, one list per connection."""

    def __init__(self, registry: Any, calls: list[str]) -> None:
        self._registry, self._calls = registry, calls

    def __getattr__(self, name: str) -> Any:
        self._calls.append(name)
        return getattr(self._registry, name)


def test_the_edges_pass_puts_the_registrys_history_on_its_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole `fabric reconcile` of racknerd (the edge): its page's timeline is
    what the registry remembers, read by the pass, the node loss on top; read
    on the connection that read the fleet's snapshot, not on one of its own."""
    from reconciler import wiring
    from reconciler.cli import main
    from reconciler.wiring import open_registry

    desired = tmp_path / "desired"
    shutil.copytree(REPO / "hosts", desired)
    root = tmp_path / "root"
    registry_file = tmp_path / "registry.sqlite"
    registry = open_registry(STATE.fleet, sqlite_path=registry_file)
    try:
        for host in ("lux", "racknerd"):
            registry.heartbeat(NodeRecord(node_id=host, tier="cpu_ffmpeg", max_concurrent_tasks=2, in_flight=1))
        # a1-arm64's beat lapses within a second.
        registry.heartbeat(NodeRecord(node_id="a1-arm64", tier="cpu_ffmpeg", max_concurrent_tasks=2), ttl_s=1.0)
        # The leader (lux) stores the joins, then, once the beat has lapsed, the loss.
        leadership = registry.campaign("lux", ttl_s=600)
        assert leadership is not None
        joined = registry.advance_lifecycle(leadership)
        assert {(e.node_id, e.transition.status) for e in joined} == {("lux", "active"), ("racknerd", "active"), ("a1-arm64", "active")}
        wait_until(lambda: status_of(registry, "a1-arm64") == "offline", what="a1-arm64 offline")
        registry.advance_lifecycle(leadership)
    finally:
        registry.close()
    argv = ["reconcile", "--desired", str(desired), "--host", "racknerd", "--root", str(root)]
    argv += ["--replay", str(REPO / "tests/golden/probe/x86_64"), "--no-activate", "--registry-path", str(registry_file)]

    connections: list[list[str]] = []

    def noted(*args: Any, **kwargs: Any) -> Any:
        connections.append([])
        return CallsSeen(open_registry(*args, **kwargs), connections[-1])

    monkeypatch.setattr(wiring, "open_registry", noted)
    code = main(argv)
    capsys.readouterr()

    assert code == 0
    history_reads = [calls for calls in connections if {"node_states", "leader", "scaling_record"} & set(calls)]
    assert len(history_reads) == 1 and "snapshot" in history_reads[0], connections
    page = (root / "var/lib/fabric/status/index.html").read_text()
    kinds = re.findall(r'<li class="[a-z_]+" data-kind="([a-z_]+)"><time [^>]*>[^<]*</time> <span class="what">([^<]+)</span>', page)
    assert kinds[0] == ("node_lost", "a1-arm64 lost")
    assert ("node_joined", "lux joined") in kinds
    assert "no registry history" not in page
