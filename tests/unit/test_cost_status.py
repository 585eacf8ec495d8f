"""Cost on every surface (issue 32): `fabric status` text and JSON, the status
page and the metrics show each host's cost class and the paid capacity in use."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from reconciler.cli import main
from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import Snapshot, SnapshotNode
from reconciler.core.views.cards import fleet_status, render_text, status_document
from reconciler.core.views.metrics import PassMetrics, render_metrics
from reconciler.core.views.page import render_status_html
from tests.conftest import EXAMPLE_FLEET

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def desired():
    return load_desired(EXAMPLE_FLEET)


def snapshot(x86_status: str = "active") -> Snapshot:
    """The example fleet's nodes with the costs their host files give (qfox-1 not reporting)."""
    return Snapshot(
        now=NOW,
        nodes=[
            SnapshotNode(node_id="a1-arm64", tier="cpu_ffmpeg", in_flight=1, max_concurrent_tasks=1, cost="free", last_seen=NOW),
            SnapshotNode(node_id="lux", tier="cpu_ffmpeg", in_flight=2, max_concurrent_tasks=2, cost="owned", last_seen=NOW),
            SnapshotNode(node_id="racknerd", tier="relay", in_flight=0, max_concurrent_tasks=1, last_seen=NOW),
            SnapshotNode(node_id="x86-spill", tier="cpu_ffmpeg", status=x86_status, in_flight=3, max_concurrent_tasks=4, cost="paid", last_seen=NOW),
        ],
    )


def test_status_text_shows_each_hosts_cost_and_the_paid_slots_in_use(desired):
    lines = render_text(fleet_status(desired, snapshot(), None, NOW)).splitlines()
    table = lines[lines.index("NODES") + 1 :]
    assert table[0].split() == ["NODE", "TIER", "COST", "STATUS", "LOAD", "LAST", "SEEN", "NOTE", "SERVICES"]
    costs = {row.split()[0]: row.split()[2] for row in table[1:6]}
    assert costs == {"a1-arm64": "free", "lux": "owned", "qfox-1": "owned", "racknerd": "owned", "x86-spill": "paid"}
    assert table[6] == "  paid capacity: 3/4 slots in use (x86-spill 3/4)"


def test_an_offline_paid_node_is_no_paid_capacity_in_use(desired):
    status = fleet_status(desired, snapshot(x86_status="offline"), None, NOW)
    assert (status.paid_slots_in_use, status.paid_slots) == (0, 0)
    assert "  paid capacity: no paid node up" in render_text(status).splitlines()


def test_status_json_and_page_carry_the_cost(desired):
    status = fleet_status(desired, snapshot(), None, NOW)
    doc = json.loads(json.dumps(status_document(status)))
    assert {n["node"]: n["cost"] for n in doc["nodes"]}["x86-spill"] == "paid"
    assert doc["paid_slots"] == {"in_use": 3, "total": 4}
    page = render_status_html(status)
    assert '<td data-label="Cost" class="cost">paid</td>' in page
    assert '<p id="paid" data-in-use="3" data-total="4">paid capacity: 3/4 slots in use (x86-spill 3/4)</p>' in page


def test_metrics_export_cost_classes_and_paid_slots_in_use(desired):
    text = render_metrics(PassMetrics(), desired, snapshot())
    assert 'fabric_node_cost_info{cost="paid",node="x86-spill"} 1.0' in text
    assert 'fabric_node_cost_info{cost="free",node="a1-arm64"} 1.0' in text
    assert 'fabric_node_cost_info{cost="owned",node="qfox-1"} 1.0' in text
    assert "\nfabric_paid_slots_in_use 3.0\n" in text
    assert "\nfabric_paid_slots 4.0\n" in text


def test_fabric_status_command_shows_the_costs_of_a_saved_snapshot(tmp_path, capsys):
    path = tmp_path / "snapshot.json"
    path.write_text(snapshot().model_dump_json())
    assert main(["status", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["paid_slots"]["total"] == 4
    assert {n["node"]: n["cost"] for n in doc["nodes"]}["a1-arm64"] == "free"
