"""A pass sets the k3s Node's labels when its drop-in changes, through the NodeLabels port.

k3s applies the drop-in only at its start and never removes a label
(k3s-io/k3s pkg/agent/run.go configureNode), so the pass does both itself:
the first pass sets every label, a label that leaves the host file leaves the
Node, an unchanged drop-in asks nothing, and a k3s that cannot be reached
never fails the pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from reconciler.engine.reconcile import run_pass
from reconciler.ports import NodeLabelsUnavailable
from tests.support.fleet import Fleet

ROLE = "topology.researchstack.io/role"


class FakeNode:
    """One k3s Node as the API holds it; the calls made to it."""

    def __init__(self, labels: Mapping[str, str] | None = None, argv: list[str] | None = None) -> None:
        self.node_labels = dict(labels or {})
        self.calls: list[tuple[str, str, dict[str, str | None] | None]] = []
        self.down: str | None = None
        self.argv = argv or []

    def labels(self, node: str) -> dict[str, str]:
        self.calls.append(("get", node, None))
        if self.down:
            raise NodeLabelsUnavailable(self.down)
        return dict(self.node_labels)

    def patch(self, node: str, changes: Mapping[str, str | None]) -> None:
        self.calls.append(("patch", node, dict(changes)))
        for key, value in changes.items():
            if value is None:
                self.node_labels.pop(key, None)
            else:
                self.node_labels[key] = value

    def command_line(self) -> list[str]:
        return self.argv


def reconcile(fleet: Fleet, node: FakeNode):
    ports = fleet.ports()
    assert ports.activators is not None
    return run_pass(fleet.options(), dataclasses.replace(ports, activators=dataclasses.replace(ports.activators, node_labels=node)))


def edit_host(fleet: Fleet, old: str, new: str) -> None:
    path: Path = fleet.desired / f"{fleet.host}.toml"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


def test_the_first_pass_sets_the_drop_ins_labels_and_leaves_others(tmp_path):
    fleet = Fleet(tmp_path)
    node = FakeNode({"kubernetes.io/hostname": "racknerd"})
    report = reconcile(fleet, node)
    assert report.outcome == "applied", report.stderr
    assert node.node_labels[ROLE] == "edge" and node.node_labels["kubernetes.io/hostname"] == "racknerd"
    (get, patch) = node.calls
    assert get[0] == "get" and patch[0] == "patch" and get[1] == patch[1]
    assert patch[2] is not None and all(value is not None for value in patch[2].values())
    assert any(r["action"] == "k3s-labels" and r["outcome"] == "ok" for r in fleet.audit.records)
    # Nothing changed: the Node is not asked again.
    node.calls.clear()
    assert reconcile(fleet, node).outcome == "noop"
    assert node.calls == []


def test_a_label_that_leaves_the_host_file_leaves_the_node(tmp_path):
    fleet = Fleet(tmp_path)
    node = FakeNode()
    edit_host(fleet, f'"{ROLE}" = "edge"\n', f'"{ROLE}" = "edge"\n"site" = "vps"\n')
    assert reconcile(fleet, node).ok
    assert node.node_labels["site"] == "vps"
    # The operator drops the label; the probe never set it.
    edit_host(fleet, '"site" = "vps"\n', "")
    node.calls.clear()
    report = reconcile(fleet, node)
    assert report.outcome == "applied", report.stderr
    patch = next(changes for verb, _, changes in node.calls if verb == "patch")
    assert patch == {"site": None}
    assert "site" not in node.node_labels and node.node_labels[ROLE] == "edge"
    assert any("removed 1 (site)" in line for line in report.stderr), report.stderr


def test_a_k3s_that_cannot_be_reached_fails_nothing_and_says_so(tmp_path):
    fleet = Fleet(tmp_path)
    node = FakeNode()
    node.down = "https://127.0.0.1:6444: ConnectionRefusedError: [Errno 111] Connection refused"
    report = reconcile(fleet, node)
    assert report.outcome == "applied"
    assert fleet.store.good() == fleet.store.current() == 1
    assert any("labels not set now" in line and "removes none" in line for line in report.stderr), report.stderr
    assert any(r["action"] == "k3s-labels" and r["outcome"] == "failed" for r in fleet.audit.records)


def test_a_command_line_node_label_that_beats_the_drop_in_is_reported(tmp_path):
    fleet = Fleet(tmp_path)
    node = FakeNode(argv=["/usr/local/bin/k3s", "agent", f"--node-label={ROLE}=compute"])
    report = reconcile(fleet, node)
    assert report.outcome == "applied"
    assert any(f"{ROLE}=compute (drop-in: edge)" in line for line in report.stderr), report.stderr
